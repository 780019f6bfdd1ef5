"""Sliding-window layers: which tokens such a layer may attend to, and which it keeps.

A layer whose `LayerPlan.sliding_window` is `w` attends as transformers does: a query at
position `p` sees the keys at positions `> p - w` (itself and the `w - 1` tokens before it).
Positions count real tokens (left padding has none), so with left padding this is the same
window transformers builds over padded cache indices.

What such a layer keeps (`sliding_only`):

- `w <= budget`, or no policy at all (`policy="full"`): the layer keeps exactly its window.
  It needs no policy and no scores: its buffer has `w + window` slots, and every `window`
  tokens (or whenever a step overflows it, e.g. a prompt longer than `w`) an eviction keeps
  the `w` most recent slots (`recent_slots`). Nothing it drops could ever be attended again,
  so such a layer is exact, in `"full"` mode too (the reference then stays exact while the
  sliding layers' memory stays bounded). Sinks and `prefill="keep"`/`"pin"` do not apply to
  it: a prompt longer than its buffer is attended whole, then cut to its last `w` tokens.
- `w > budget` with a policy: the layer is a normal VaSE layer (budget, schedule,
  `prefill` mode and capacity of a global layer, but `"pin"` acts as `"keep"`:
  `prefill_mode`) with the sliding mask on top, and the tokens
  already out of the window are no eviction candidates (`in_window`): the policy ranks them
  as padding, last, so they are dropped first, and any it still keeps (fewer real candidates
  than slots) are stored as padding, never attended.
"""

from __future__ import annotations

import torch


def check_window(sliding_window: int | None) -> None:
    """Refuse a sliding window that is not a positive int (`None`: a global layer)."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"LayerPlan.sliding_window must be None or an int >= 1, got {sliding_window!r}")


def sliding_only(sliding_window: int | None, budget: int, has_policy: bool) -> bool:
    """Whether a layer keeps exactly its sliding window (the last `w` tokens, no policy):
    a sliding layer whose window fits the budget, or any sliding layer without a policy."""
    check_window(sliding_window)
    return sliding_window is not None and (sliding_window <= budget or not has_policy)


def prefill_mode(prefill: str, sliding_window: int | None, sliding_only: bool) -> str:
    """A layer's prefill mode: the model's, except that a `sliding_only` layer keeps exactly its window
    (`"compress"`), and that a sliding layer with a policy keeps its prompt whole at prefill but does not
    pin it (`"pin"` becomes `"keep"`): its later evictions may take prompt tokens, out-of-window ones first,
    since pinned slots that fall out of the window would break the one contiguous attendable range."""
    if sliding_only:
        return "compress"
    if prefill == "pin" and sliding_window is not None:
        return "keep"
    return prefill


def recent_slots(n: int, keep: int, valid: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, keep]`: the last `keep` of the first `n` slots of `valid` `[B, Hkv, S]`, in order.

    Slots hold tokens in sequence order with left padding first, so these are the `keep` most
    recent tokens of every row and KV head (padding included where a row has fewer real
    tokens), and once gathered to the front the attendable slots stay one contiguous range."""
    if not 0 < keep <= n:
        raise ValueError(f"cannot keep the last {keep} of {n} slots")
    b, h = valid.shape[:2]
    return torch.arange(n - keep, n, device=valid.device).expand(b, h, keep)


def in_window(
    positions: torch.Tensor, valid: torch.Tensor, next_position: torch.Tensor, sliding_window: int
) -> torch.Tensor:
    """`valid` (`[B, Hkv, S]`) restricted to the tokens the next query of each row can still
    see: positions `> next_position - w` (`next_position` `[B]`: that query's position)."""
    return valid & (positions > (next_position - sliding_window)[:, None, None])


def window_mask(positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Whether a key at `positions` is inside the window of a query at `query_positions`
    (broadcast against each other): `key > query - w`."""
    return positions > query_positions - sliding_window
