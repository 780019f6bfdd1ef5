"""The cache: static buffers, true positions, host-side eviction triggers.

- `schedule`: when to evict (pure functions of host ints);
- `query_ring.QueryRing`: the last `window` queries, which score the candidates;
- `step.Step`: what one attention step reads;
- `layer.VaSELayer`: one layer's buffers and its step API (`append`,
  `record_queries`, `evict_if_due`);
- `cache.VaSECache`: the transformers `Cache` of those layers.

Which slots survive an eviction is decided by a `Policy`; the cache only moves data.
"""

from vasepatch.cache.cache import VaSECache
from vasepatch.cache.counters import CacheMonitor, LayerCounters
from vasepatch.cache.layer import VaSELayer
from vasepatch.cache.randomness import EvictionRandomness
from vasepatch.cache.step import Step

__all__ = ["CacheMonitor", "EvictionRandomness", "LayerCounters", "Step", "VaSECache", "VaSELayer"]
