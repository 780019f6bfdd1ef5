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
- `n_keep`: how many candidates will be kept; `generator`: the only source of randomness.

`Policy.select` runs the input checks, calls the function, gives invalid
candidates `-inf` and takes the top `n_keep`, so every policy returns distinct
indices with the valid candidates first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from vasepatch.policies import scoring

INPUTS = ("keys", "values", "queries", "positions", "valid", "n_keep", "generator")
PriorityFn = Callable[..., torch.Tensor]


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
    `vasepatch.policies.get`, which checks the options first.
    """

    def __init__(self, name: str, priority: PriorityFn, options: Mapping[str, Any]) -> None:
        self.name = name
        self.priority = priority
        self.options = MappingProxyType(dict(options))
        self.inputs = inputs_of(priority)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"Policy({self.name!r}{', ' if opts else ''}{opts})"

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`[B, Hkv, n_keep]` int64: distinct indices into `N` per `(b, h)`, valid candidates
        before invalid ones (a row with fewer than `n_keep` valid candidates keeps all of them)."""
        scoring.check_inputs(keys, values, queries, positions, valid, n_keep)
        given = {"keys": keys, "values": values, "queries": queries, "positions": positions}
        given.update(valid=valid, n_keep=n_keep, generator=generator)
        priority = self.priority(*(given[name] for name in self.inputs), **self.options)
        return scoring.top_k_by_priority(priority.masked_fill(~valid, float("-inf")), n_keep)
