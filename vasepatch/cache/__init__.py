"""The cache: static buffers, true positions, host-side eviction triggers.

- `schedule`: when to evict (pure functions of host ints);
- `query_ring.QueryRing`: the last `window` queries, which score the candidates;
- `slots.SlotBuffer`: one layer's slots and their writes; `slots.Step`: what one
  attention step reads;
- `layer.VaSELayer`: one layer's cache and its `step` (append, attend, record the
  queries, evict);
- `cache.VaSECache`: the transformers `Cache` of those layers.

Which slots survive an eviction is decided by a `Policy`; the cache only moves data.
"""

from vasepatch.cache.cache import VaSECache
from vasepatch.cache.counters import CacheMonitor, LayerCounters
from vasepatch.cache.layer import VaSELayer
from vasepatch.cache.slots import Step
from vasepatch.policies.keyed import EvictionRandomness

__all__ = ["CacheMonitor", "EvictionRandomness", "LayerCounters", "Step", "VaSECache", "VaSELayer"]
