"""Where the slots of a paged request (vLLM's, transformers' continuous batching) are in its sequence.

An evicting request of a paged engine holds its slots in its own blocks: after an eviction the kept ones, gathered
to the front in sequence order, then the tokens appended since, in order. Its eviction state is host ints (the
tokens `dropped` so far) and the kept positions of its last eviction, from which the positions of all its slots
follow, for the policies that read them (`positions`, `now`).
"""

from __future__ import annotations

import torch


def candidate_positions(
    kept: torch.Tensor | None, layers: int, heads: int, n: int, dropped: int, pinned: int = 0
) -> torch.Tensor:
    """`[layers, heads, n - pinned]` int64: the sequence position of each candidate slot `pinned..n-1`. Slots
    past the last eviction's kept ones (or all, before the first) hold position `dropped + slot`; the
    `budget` slots after the pinned ones hold `kept`."""
    positions = torch.arange(pinned + dropped, dropped + n, dtype=torch.int64).expand(layers, heads, n - pinned)
    positions = positions.clone()
    if kept is not None and dropped > 0:
        positions[:, :, : kept.shape[-1]] = kept
    return positions
