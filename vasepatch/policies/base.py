"""The `Policy` protocol: the pure selection step of an eviction."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Policy(Protocol):
    """Chooses which eviction candidates to keep.

    A policy is a pure function of its inputs (plus the random generator): it
    owns no buffers and never touches the cache. Shapes:

    - `keys`, `values`: `[B, Hkv, N, D]` candidates (keys after RoPE).
    - `queries`: `[B, Hq, W, D]` queries (after RoPE) of the last `W` steps,
      `Hq` a multiple of `Hkv` (query heads `h*G .. h*G+G-1` share KV head `h`).
    - `positions`: `[B, Hkv, N]` int64 absolute positions (first real token = 0).
    - `valid`: `[B, Hkv, N]` bool, False for padding and empty slots.

    `select` returns `[B, Hkv, n_keep]` int64: distinct indices into `N` per
    `(b, h)`. Valid candidates come before invalid ones: a row with fewer than
    `n_keep` valid candidates keeps all of them.
    """

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor: ...
