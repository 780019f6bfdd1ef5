"""`VaSECache`: one `VaSELayer` per decoder layer, as a transformers `Cache`."""

from __future__ import annotations

from transformers.cache_utils import Cache

from vasepatch.cache.counters import CacheMonitor, LayerCounters
from vasepatch.cache.layer import VaSELayer
from vasepatch.cache.plan import LayerPlan, default_plans
from vasepatch.config import VaSEConfig
from vasepatch.policies.base import Policy
from vasepatch.policies.keyed import EvictionRandomness


class VaSECache(Cache):
    """A transformers `Cache` of `VaSELayer`s: what a patched model's `generate` uses.

    `policy=None` makes the never-evicting reference (`VaSEConfig(policy="full")`),
    whose buffers grow with the sequence, `window` slots past the need at a time.
    `plans` (one `LayerPlan` per layer; default: global layers on one device) carry the
    per-layer facts: the layer index, a sliding window, the tensor-parallel head offset."""

    def __init__(
        self,
        config: VaSEConfig,
        policy: Policy | None,
        num_layers: int,
        monitor: CacheMonitor | None = None,
        plans: tuple[LayerPlan, ...] | None = None,
    ) -> None:
        rng = EvictionRandomness(config.seed)
        counters = [LayerCounters() for _ in range(num_layers)]
        if monitor is not None:
            monitor.layers = counters
            monitor.generations += 1
        plans = default_plans(num_layers) if plans is None else tuple(plans)
        if len(plans) != num_layers:
            raise ValueError(f"got {len(plans)} layer plans for {num_layers} layers")
        layers = [VaSELayer(config, policy, rng, c, plan) for c, plan in zip(counters, plans, strict=True)]
        super().__init__(layers=layers)
        self.config = config
        self.owner: str | None = None
        """The patch that made this cache (`PatchHandle.new_cache` sets it; None: made by hand)."""
        self.broken: str | None = None
        """Set when a step failed after some layers had completed it: the layers then hold
        different tokens, and the cache refuses to run until `reset`."""

    def reset(self) -> None:
        """A new generation on the same cache: every count starts over; the buffers are kept, and
        re-allocated at the next step if its batch, dtype or device differs."""
        super().reset()
        self.broken = None

    def complete_step(self) -> int:
        """Host-side bookkeeping of a compiled forward, run eagerly after it (the patched
        model does this itself); returns how many layers evicted."""
        return sum(layer.complete_step() for layer in self.layers)

    def tokens_until_eviction(self) -> int:
        """Tokens that one step can append so that it ends exactly where the next eviction
        runs (see `VaSELayer.tokens_until_eviction`)."""
        return min(layer.tokens_until_eviction() for layer in self.layers)

    def tokens_seen(self) -> int:
        """Tokens this cache has taken since it was made or `reset` (0: unused)."""
        return max((layer.counters.tokens_seen for layer in self.layers), default=0)

    def stats(self) -> dict[str, int]:
        return CacheMonitor([layer.counters for layer in self.layers]).snapshot(self.config.budget, self.config.window)
