"""`Policy`: a priority function with its options bound, and the one shared selection step.

A policy's own part is a pure function returning a `[B, Hkv, N]` float priority
(higher is kept first, `+inf` = protected). Its positional parameters name the
inputs it reads, out of `INPUTS`; its keyword-only parameters are its options
(see `vasepatch.policies.options`). Shapes of the inputs:

- `keys`, `values`: `[B, Hkv, N, D]` candidates (keys after RoPE).
- `queries`: `[B, Hq, W, D]` queries (after RoPE) of the last `W` steps,
  `Hq` a multiple of `Hkv` (query heads `h*G .. h*G+G-1` share KV head `h`).
- `positions`: `[B, Hkv, N]` int64 absolute positions (first real token = 0).
- `valid`: `[B, Hkv, N]` bool, False for padding and empty slots.
- `head_ids`: `[B, Hkv]` int64, which (layer, KV head) each row's heads are: `layer * K + h` with `K` the
  model's KV heads per layer and `h` the global KV head (tensor parallelism holds a slice of the heads).
- `now`: `[B, Hkv]` int64, the position of the token after the newest one cached (the newest is in the window,
  never a candidate).
- `n_keep`: how many candidates will be kept; `generator`: the only source of randomness:
  a `torch.Generator`, None (torch's global one), or at an eviction the cache's
  `keyed.KeyedGenerator`, whose noise (`scoring.uniform_noise`, `gumbel_noise`,
  `gaussian_projection`) is keyed by row and global KV head, so that it does not depend
  on how tensor parallelism shards the heads. Only a function marked
  `keyed.draws_keyed_noise` receives it as is; any other receives
  `KeyedGenerator.torch_generator()`, a plain `torch.Generator` (see `keyed`).

`Policy.select` runs the input checks, calls the function, checks the priority's
shape and dtype, ranks invalid candidates last and takes the top `n_keep`, so
every policy returns distinct indices with the valid candidates first. With
`shared_heads` the heads' priorities are combined and every KV head keeps the same
candidates (`vasepatch.policies.shared`).
`check_picks` checks the indices an eviction is about to keep, whatever
produced them (a `Policy` subclass may override `select`); `kept_slots` is the whole
choice of an eviction: the policy's picks among the candidates, checked, then the window.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from vasepatch.policies import scoring, shared
from vasepatch.policies.keyed import KeyedGenerator, marked_keyed

INPUTS = ("keys", "values", "queries", "positions", "valid", "n_keep", "generator", "head_ids", "now")
PriorityFn = Callable[..., torch.Tensor]


class PolicyOutputError(RuntimeError):
    """A policy returned something an eviction cannot use; the message names the policy.
    Raised before the cache is touched."""


def inputs_of(fn: PriorityFn) -> tuple[str, ...]:
    """The names of the inputs a priority function reads (its positional parameters)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in positional)
    unknown = [n for n in names if n not in INPUTS]
    if unknown:
        raise TypeError(f"{fn.__name__} reads unknown input(s) {unknown}; its inputs must be among {INPUTS}")
    return names


class Policy:
    """Chooses which eviction candidates to keep: `priority(inputs..., **options)`, then top-k.

    Pure: it owns no buffers and never touches the cache. Built by
    `vasepatch.policies.get`, which checks the options first. `check_output=False`
    skips the data-dependent checks of its picks at each eviction (`check_picks`).
    `shared_heads=True` keeps one set of candidates for all KV heads (`shared.shared_top_k`).
    """

    def __init__(
        self,
        name: str,
        priority: PriorityFn,
        options: Mapping[str, Any],
        *,
        check_output: bool = True,
        shared_heads: bool = False,
    ) -> None:
        if not isinstance(shared_heads, bool):
            raise ValueError(f"shared_heads must be a bool, got {shared_heads!r}")
        self.name = name
        self.priority = priority
        self.options = MappingProxyType(dict(options))
        self.inputs = inputs_of(priority)
        self.check_output = check_output
        self.shared_heads = shared_heads

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles take the options as a plain dict (a read-only mapping is neither
        copyable nor picklable), so a cache holding a policy can be deep-copied and pickled."""
        return {**self.__dict__, "options": dict(self.options)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, options=MappingProxyType(state["options"]))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        shared = ", shared_heads=True" if self.shared_heads else ""
        return f"Policy({self.name!r}{', ' if opts else ''}{opts}{shared})"

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: scoring.Randomness = None,
        *,
        head_ids: torch.Tensor | None = None,
        now: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[B, Hkv, n_keep]` int64: distinct indices into `N` per `(b, h)`, valid candidates
        before invalid ones (a row with fewer than `n_keep` valid candidates keeps all of them).
        Without `head_ids`, the rows are layer 0's heads `0 .. Hkv - 1`; without `now`, the position after
        each row's last valid candidate (the cache's evictions pass both)."""
        scoring.check_inputs(keys, values, queries, positions, valid, n_keep)
        if isinstance(generator, KeyedGenerator):
            if self.shared_heads:
                generator = generator.shared_heads()  # one noise per slot for all heads
            if "generator" in self.inputs and not marked_keyed(self.priority):  # calls torch.rand(..., generator=)
                generator = generator.torch_generator()
        given = {"keys": keys, "values": values, "queries": queries, "positions": positions}
        given.update(valid=valid, n_keep=n_keep, generator=generator)
        if "head_ids" in self.inputs or "now" in self.inputs:
            given.update(head_inputs(positions, valid, head_ids, now))
        priority = self.priority(*(given[name] for name in self.inputs), **self.options)
        check_priority(self.name, priority, valid)
        if self.shared_heads:
            return shared.shared_top_k(ranked(priority, valid), valid, n_keep)
        return scoring.top_k_by_priority(ranked(priority, valid), n_keep)


def head_ids(layers: torch.Tensor, heads: int, head_offset: int = 0, kv_heads: int = 0) -> torch.Tensor:
    """`[R, heads]` int64 on `layers`' device: the `head_ids` input of rows of the layers `layers` (`[R]`) whose
    heads are the global KV heads `head_offset .. head_offset + heads - 1`: `layer * K + head_offset + h`, with
    `K` = `kv_heads`, the model's KV heads per layer (0: `heads`, a process that holds them all)."""
    total = kv_heads or heads
    return layers.view(-1, 1) * total + head_offset + torch.arange(heads, device=layers.device).view(1, -1)


def head_inputs(
    positions: torch.Tensor, valid: torch.Tensor, head_ids: torch.Tensor | None, now: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """`head_ids` and `now` (`[B, Hkv]` int64) as given, or their defaults (`Policy.select`), shapes checked."""
    b, h = valid.shape[:2]
    if head_ids is None:
        head_ids = torch.arange(h, device=valid.device).expand(b, h)
    if now is None:
        now = positions.masked_fill(~valid, -1).amax(-1) + 1 if positions.shape[-1] else positions.sum(-1)
    for name, t in (("head_ids", head_ids), ("now", now)):
        if tuple(t.shape) != (b, h):
            raise ValueError(f"{name} must be [B, Hkv] = {[b, h]}, got {list(t.shape)}")
    return {"head_ids": head_ids, "now": now}


def ranked(priority: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The priority `top_k` ranks by: invalid candidates `-inf`, and valid ones whose priority
    is `-inf` or NaN (which `topk` would tie with padding, or rank above `+inf`) the lowest
    finite value, so that a valid candidate always beats an invalid one."""
    low = torch.finfo(priority.dtype).min
    clean = priority.nan_to_num(nan=low, posinf=float("inf"), neginf=low)
    return clean.masked_fill(~valid, float("-inf"))


def check_priority(name: str, priority: Any, valid: torch.Tensor) -> None:
    """A priority must be a floating-point `[B, Hkv, N]` tensor on the candidates' device
    (host metadata only: no sync). A broadcastable shape would silently apply one row's
    priorities to every row."""
    if not isinstance(priority, torch.Tensor):
        raise PolicyOutputError(f"policy {name!r} returned {type(priority).__name__} instead of a priority tensor")
    if priority.shape != valid.shape:
        raise PolicyOutputError(
            f"policy {name!r} returned a priority of shape {list(priority.shape)}; expected {list(valid.shape)} "
            "(batch, kv_heads, candidates)"
        )
    if not priority.is_floating_point():
        raise PolicyOutputError(
            f"policy {name!r} returned a priority of dtype {priority.dtype}; expected a floating-point tensor"
        )
    if priority.device != valid.device:
        raise PolicyOutputError(f"policy {name!r} returned a priority on {priority.device}; expected {valid.device}")


def check_picks(name: str, idx: Any, valid: torch.Tensor, n_keep: int, *, data: bool = True) -> None:
    """Check the `[B, Hkv, n_keep]` int64 indices a policy picked out of the candidates `valid`
    (`[B, Hkv, N]`) before an eviction keeps them; `PolicyOutputError` names the policy.

    Shape, dtype and device are host metadata (free). With `data`, one host sync checks the
    values: each in `[0, N)`, distinct per row and KV head, and exactly `min(n_keep, real
    candidates)` of them real tokens (never padding while a real token is left out)."""
    b, h, n = valid.shape
    if not isinstance(idx, torch.Tensor):
        raise PolicyOutputError(f"policy {name!r} returned {type(idx).__name__} instead of a tensor of indices")
    if tuple(idx.shape) != (b, h, n_keep):
        raise PolicyOutputError(
            f"policy {name!r} returned indices of shape {list(idx.shape)}; expected {[b, h, n_keep]} "
            "(batch, kv_heads, keep)"
        )
    if idx.dtype != torch.int64:
        raise PolicyOutputError(f"policy {name!r} returned indices of dtype {idx.dtype}; expected torch.int64")
    if idx.device != valid.device:
        raise PolicyOutputError(f"policy {name!r} returned indices on {idx.device}; expected {valid.device}")
    if not data or n_keep == 0:
        return
    lo, hi = idx.aminmax()
    kept = torch.zeros_like(valid).scatter_(-1, idx.clamp(0, n - 1), True)  # O(keep): no sort
    distinct = kept.sum(-1) == n_keep
    real = (kept & valid).sum(-1) == valid.sum(-1).clamp(max=n_keep)
    if bool((lo >= 0) & (hi < n) & distinct.all() & real.all()):  # the one host sync
        return
    raise PolicyOutputError(_describe(name, idx, valid, n_keep))


def _describe(name: str, idx: torch.Tensor, valid: torch.Tensor, n_keep: int) -> str:
    """The message for the first bad pick (error path only: it may sync freely)."""
    n = valid.shape[-1]
    outside = (idx < 0) | (idx >= n)
    if bool(outside.any()):
        b, h, k = outside.nonzero()[0].tolist()
        return f"policy {name!r} returned index {idx[b, h, k].item()} (row {b}, KV head {h}) outside [0, {n})"
    s = idx.sort(-1).values
    repeated = s[..., 1:] == s[..., :-1]
    if bool(repeated.any()):
        b, h, k = repeated.nonzero()[0].tolist()
        return f"policy {name!r} returned candidate {s[b, h, k].item()} twice (row {b}, KV head {h})"
    real = valid.sum(-1)
    kept = valid.gather(-1, idx).sum(-1)
    b, h = (kept != real.clamp(max=n_keep)).nonzero()[0].tolist()
    return (
        f"policy {name!r} kept {kept[b, h].item()} real tokens (row {b}, KV head {h}, which has "
        f"{real[b, h].item()} real candidates): it must keep min(keep={n_keep}, real candidates) = "
        f"{min(n_keep, real[b, h].item())}, never padding while a real token is left out"
    )


def kept_slots(
    policy: Policy,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    queries: torch.Tensor,
    n: int,
    budget: int,
    window: int,
    generator: torch.Generator | KeyedGenerator | None = None,
    head_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, Hkv, budget]` indices into the first `n` slots: `budget - window` of the older
    `n - window` chosen by `policy` from the `queries` `[B, Hq, W, D]`, then the last
    `window` (always kept). A policy whose inputs include them gets `head_ids` (`[B, Hkv]`, see `INPUTS`) as
    they are, and `now`, the position after the newest slot's (slot `n - 1`, in the window).

    Order: kept padding first, then real tokens in slot (= sequence) order, then the
    window, so that once gathered to the front each row's attendable slots form one
    contiguous range ending at the fill pointer.

    The picks are checked here, where every policy's pass (`check_picks`: shape, dtype, and
    unless `policy.check_output` is False, range, duplicates and padding kept over real tokens),
    before anything is written. Evictions run eagerly (a compiled step's after its graph,
    `VaSELayer.complete_step`), so the check's one host sync never enters a compiled graph.
    """
    n_cand = n - window
    cand_valid = valid[:, :, :n_cand]
    where = {}  # only to a policy that reads them: an object with a `select` of its own may not take them
    if {"head_ids", "now"} & set(getattr(policy, "inputs", ())):
        where = {"head_ids": head_ids, "now": positions[:, :, n - 1] + 1}
    idx = policy.select(
        keys[:, :, :n_cand],
        values[:, :, :n_cand],
        queries,
        positions[:, :, :n_cand],
        cand_valid,
        budget - window,
        generator=generator,
        **where,
    )
    data = getattr(policy, "check_output", True)
    check_picks(getattr(policy, "name", type(policy).__name__), idx, cand_valid, budget - window, data=data)
    kept_valid = cand_valid.gather(-1, idx)
    idx = idx.gather(-1, torch.argsort(idx + n_cand * kept_valid.long(), dim=-1))
    recent = torch.arange(n_cand, n, device=idx.device).expand(*idx.shape[:2], window)
    return torch.cat([idx, recent], dim=-1)
