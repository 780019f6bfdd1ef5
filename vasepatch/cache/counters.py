"""Host-side bookkeeping of a cache: plain ints (reading them never syncs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerCounters:
    """Host-side bookkeeping of one layer."""

    occupancy: int = 0  # slots in use (padding slots included)
    tokens_seen: int = 0  # tokens appended since the start (the sequence length HF sees)
    evictions: int = 0  # eviction rounds
    evicted: int = 0  # slots dropped per row and KV head, summed over rounds
    capacity: int = 0  # slots allocated per row and KV head
    kv_bytes: int = 0  # bytes held by the K and V buffers
    pinned: int = 0  # leading slots no eviction touches (the prompt, with prefill="pin")

    def restart(self) -> None:
        """A new generation on the same buffers (`reset`): the counts start over, while
        `capacity` and `kv_bytes` describe the buffers, which are kept."""
        self.occupancy = self.tokens_seen = self.evictions = self.evicted = self.pinned = 0


@dataclass
class CacheMonitor:
    """Counters of the most recent cache of a patch; outlives the cache's tensors."""

    layers: list[LayerCounters] = field(default_factory=list)
    generations: int = 0

    def snapshot(self, budget: int, window: int) -> dict[str, int]:
        ls = self.layers
        return {
            "evictions": max((c.evictions for c in ls), default=0),
            "evicted_tokens": max((c.evicted for c in ls), default=0),
            "tokens_seen": max((c.tokens_seen for c in ls), default=0),
            "occupancy": max((c.occupancy for c in ls), default=0),
            "budget": budget,
            "window": window,
            "capacity": max((c.capacity for c in ls), default=0),
            "pinned": max((c.pinned for c in ls), default=0),
            "kv_bytes": sum(c.kv_bytes for c in ls),
            "layers": len(ls),
            "generations": self.generations,
        }
