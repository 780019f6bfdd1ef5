"""`EvictionRandomness`: the eviction randomness of one cache, keyed so that sharding does not matter.

Every eviction of a layer gets its own `KeyedGenerator`, a pure function of
`(seed, layer index, eviction round)` plus the layer's global head offset, made
where the eviction runs (eagerly, on the host: building it reads plain ints and
moves no data). The draws a policy takes from it are keyed by row, global KV
head and slot (`vasepatch.policies.keyed`), so one process holding all heads and
tensor-parallel ranks holding slices of them draw the same numbers for the same
head; nothing is carried from one eviction to the next, so the order in which
layers evict does not matter either.

`seed=None` draws the key's seed from torch's global CPU generator at the first
eviction of each generation (so it follows `torch.manual_seed`); `reset` (a new
generation on the same cache) starts over: a seeded cache repeats a fresh one.
"""

from __future__ import annotations

import torch

from vasepatch.cache.plan import LayerPlan
from vasepatch.policies.keyed import KeyedGenerator

_SEED_DRAW = 2**62  # a drawn seed: uniform in [0, 2**62)


class EvictionRandomness:
    """The `generator` factory of one cache's layers (shared by all of them)."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._drawn: int | None = None

    def reset(self) -> None:
        """A new generation: a seeded cache repeats its draws; `seed=None` draws a new seed."""
        self._drawn = None

    def generation_seed(self) -> int:
        """The seed of this generation's keys (`seed`, or one drawn from torch's global generator)."""
        if self.seed is not None:
            return self.seed
        if self._drawn is None:  # a CPU draw: no device sync
            self._drawn = int(torch.randint(0, _SEED_DRAW, (), dtype=torch.int64))
        return self._drawn

    def for_eviction(self, plan: LayerPlan, eviction: int, device: torch.device) -> KeyedGenerator:
        """The generator of eviction round `eviction` (0-based) of the layer `plan` describes."""
        return KeyedGenerator(self.generation_seed(), plan.index, eviction, plan.head_offset, device)
