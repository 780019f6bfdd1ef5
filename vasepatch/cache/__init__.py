"""The cache: static buffers, true positions, host-side eviction triggers.

- `schedule`: when to evict (pure functions of host ints);
- `footprint`: the serving arithmetic (KV bytes per token, blocks, pools, held slots; pure);
- `query_ring.QueryRing`: the last `window` queries, which score the candidates;
- `slots.SlotBuffer`: one layer's slots and their writes; `slots.Step`: what one
  attention step reads;
- `layer.VaSELayer`: one layer's cache and its `step` (append, attend, record the
  queries, evict);
- `cache.VaSECache`: the transformers `Cache` of those layers.

Which slots survive an eviction is decided by a `Policy`; the cache only moves data. The names below need torch
and are imported on first use (PEP 562), so that the pure modules (`schedule`, `footprint`) import without it.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

if _TYPE_CHECKING:
    from vasepatch.cache.cache import VaSECache
    from vasepatch.cache.counters import CacheMonitor, LayerCounters
    from vasepatch.cache.layer import VaSELayer
    from vasepatch.cache.slots import Step
    from vasepatch.policies.keyed import EvictionRandomness

_LAZY = {
    "CacheMonitor": "vasepatch.cache.counters",
    "EvictionRandomness": "vasepatch.policies.keyed",
    "LayerCounters": "vasepatch.cache.counters",
    "Step": "vasepatch.cache.slots",
    "VaSECache": "vasepatch.cache.cache",
    "VaSELayer": "vasepatch.cache.layer",
}

__all__ = ["CacheMonitor", "EvictionRandomness", "LayerCounters", "Step", "VaSECache", "VaSELayer"]


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'vasepatch.cache' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
