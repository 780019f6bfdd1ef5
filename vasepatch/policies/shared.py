"""Head-shared selection: one set of kept positions for all the KV heads of a layer.

A paged serving engine (vLLM's blocks hold every KV head of a token together) can
only drop a token for all heads at once. Per candidate slot the heads' priorities
`[B, H, N]` are combined into one ranking, and the same `n_keep` slots are kept
for every head:

1. **Protected by any head first.** A candidate that some head protects (`+inf`:
   its sinks, its largest-range values) ranks above every unprotected one; among
   the protected, those protected by more heads come first (the sinks, protected
   by every head, before a value that is large in one head only), so when the
   union of the heads' protections does not fit in `n_keep` the sinks are kept.
2. **Then the largest priority over the heads** (max). A token that one head
   needs is kept even if the others ignore it; a mean would let the heads that do
   not look at a token outvote the one that does, and a mean of log-weights
   (a geometric mean) would drop any token that one head scores near zero. The
   max is also scale-free: it is the same for attention probabilities (snapkv),
   R-KV's signed scores and VaSE's log-weights.
3. **Noise is shared per slot.** With the cache's `KeyedGenerator` a sampling
   policy draws one noise per (row, slot), equal across heads, so for VaSE
   `max_h(log w_h + g) = log(max_h w_h) + g`: Gumbel-top-k draws the tokens without
   replacement with probability proportional to the largest attention any head
   pays them. (From a plain `torch.Generator` each head's noise is its own and the
   max is over noisy priorities: still a valid choice, not that distribution.)

The candidates' layout (`valid`) is the same in every head of a head-shared cache,
since every eviction keeps the same slots for all heads; a slot is ranked as real
only where it is real in every head.
"""

from __future__ import annotations

import torch


def shared_ranking(priority: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(protected_by, best)`, both `[B, N]`: how many heads protect each slot (`+inf`), and the
    largest priority over the heads that do not (`-inf` when every head does). `priority` is
    `[B, H, N]` as `base.ranked` returns it (invalid `-inf`, no NaN)."""
    protected = priority == float("inf")
    return protected.sum(1), priority.masked_fill(protected, float("-inf")).amax(1)


def shared_top_k(priority: torch.Tensor, valid: torch.Tensor, n_keep: int) -> torch.Tensor:
    """`[B, H, n_keep]` int64, the same indices for every head: the real slots (real in every
    head) first, ordered by the number of heads protecting them, then by their best priority.
    Shape-static: two stable sorts, no host sync."""
    b, h, _ = priority.shape
    real = valid.all(1)
    protected_by, best = shared_ranking(priority.masked_fill(~valid, float("-inf")))
    best = best.masked_fill(~real, float("-inf"))
    protected_by = torch.where(real, protected_by, -1)  # padding below every real slot
    order = torch.argsort(best, dim=-1, descending=True, stable=True)
    order = order.gather(-1, torch.argsort(protected_by.gather(-1, order), dim=-1, descending=True, stable=True))
    return order[:, None, :n_keep].expand(b, h, n_keep).contiguous()
