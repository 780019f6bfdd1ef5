"""`VaSECache`: one `VaSELayer` per decoder layer, as a transformers `Cache`."""

from __future__ import annotations

from transformers.cache_utils import Cache

from vasepatch.cache.counters import CacheMonitor, LayerCounters, SeededGenerator
from vasepatch.cache.layer import VaSELayer
from vasepatch.config import VaSEConfig
from vasepatch.policies.base import Policy


class VaSECache(Cache):
    """A transformers `Cache` of `VaSELayer`s: what a patched model's `generate` uses.

    `policy=None` makes the never-evicting reference (`VaSEConfig(policy="full")`),
    whose buffers grow with the sequence, `window` slots past the need at a time."""

    def __init__(
        self,
        config: VaSEConfig,
        policy: Policy | None,
        num_layers: int,
        monitor: CacheMonitor | None = None,
    ) -> None:
        rng = SeededGenerator(config.seed)
        counters = [LayerCounters() for _ in range(num_layers)]
        if monitor is not None:
            monitor.layers = counters
            monitor.generations += 1
        layers = [VaSELayer(config, policy, rng, c) for c in counters]
        super().__init__(layers=layers)
        self.config = config

    def complete_step(self) -> int:
        """Host-side bookkeeping of a compiled forward, run eagerly after it (the patched
        model does this itself); returns how many layers evicted."""
        return sum(layer.complete_step() for layer in self.layers)

    def tokens_until_eviction(self) -> int:
        """Tokens that one step can append so that it ends exactly where the next eviction
        runs (see `VaSELayer.tokens_until_eviction`)."""
        return min(layer.tokens_until_eviction() for layer in self.layers)

    def stats(self) -> dict[str, int]:
        return CacheMonitor([layer.counters for layer in self.layers]).snapshot(self.config.budget, self.config.window)
