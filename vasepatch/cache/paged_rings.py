"""The last `window` queries of every evicting request of a paged engine, per layer: what an eviction scores with.

A paged engine (vLLM; transformers' continuous batching) passes its attention no per-request side buffers, so
eviction keeps its own: one pool per window size, per layer a tensor `[rows, window, q_heads, head_size]`, a row
per request (`assign`/`release`, keyed by request id, so the engine's reordering of its batch does not matter).
Query of position `p` goes to column `p % window`; the scores average over the window, so the order of the
columns does not matter.

Each step the engine's side states which tokens of the batch to keep (`plan`: the last `window` of each
evicting request); each layer's attention then writes them with one `index_copy_` (`record`).

Memory follows the requests in flight: a pool doubles when a request finds no free row, halves (its live
rows moved to the front) when at most a quarter of its rows are live, and is freed when its last request
finishes. So a pool never holds more than `4 x` its live rows (`nbytes` counts them all), and an engine
whose requests have all finished holds no rings. Layers are named by any hashable key (vLLM's layer names,
transformers' layer indices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class _Pool:
    window: int
    rows: int = 0
    members: dict[str, int] = field(default_factory=dict)  # request id -> row
    layers: dict[str, torch.Tensor] = field(default_factory=dict)

    def take(self, req_id: str) -> None:
        used = set(self.members.values())
        if len(used) == self.rows:
            self._resize(max(1, 2 * self.rows))
            used = set(self.members.values())
        self.members[req_id] = min(set(range(self.rows)) - used)

    def give_back(self, req_id: str) -> None:
        del self.members[req_id]
        if 0 < len(self.members) <= self.rows // 4:
            self._resize(self.rows // 2)

    def _resize(self, rows: int) -> None:
        """`rows` rows, the live ones first (their queries moved with them)."""
        order = sorted(self.members, key=self.members.get)
        old = torch.tensor([self.members[r] for r in order], dtype=torch.int64)
        for name, ring in self.layers.items():
            resized = ring.new_zeros((rows, *ring.shape[1:]))
            resized[: len(order)] = ring.index_select(0, old.to(ring.device))
            self.layers[name] = resized
        self.members = {r: i for i, r in enumerate(order)}
        self.rows = rows


class QueryRings:
    """The query rings of one worker or engine (see the module's docstring)."""

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}
        self._windows: dict[str, int] = {}  # request id -> window
        self._plan: list[tuple[_Pool, torch.Tensor, torch.Tensor]] = []

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._windows

    def assign(self, req_id: str, window: int) -> None:
        """Give `req_id` a row of the pool of `window` (once)."""
        if req_id not in self._windows:
            self._pools.setdefault(window, _Pool(window)).take(req_id)
            self._windows[req_id] = window

    def copy(self, source: str, req_id: str) -> None:
        """Give `req_id` a row holding `source`'s queries (a request forked from `source`, whose queries it shares)."""
        window = self._windows[source]
        self.assign(req_id, window)
        pool = self._pools[window]
        for ring in pool.layers.values():
            ring[pool.members[req_id]] = ring[pool.members[source]]

    def release(self, req_id: str) -> None:
        """The request finished: its row goes back to its pool, and a pool left without requests is freed."""
        window = self._windows.pop(req_id, None)
        if window is None:
            return
        pool = self._pools[window]
        pool.give_back(req_id)
        if not pool.members:
            del self._pools[window]

    @property
    def nbytes(self) -> int:
        """Bytes the rings hold now, every pool and layer."""
        return sum(t.numel() * t.element_size() for pool in self._pools.values() for t in pool.layers.values())

    def plan(self, req_ids: Sequence[str], starts: Sequence[int], counts: Sequence[int], first_positions) -> None:
        """This step's writes: request `req_ids[i]` has `counts[i]` tokens from batch token `starts[i]`, the
        first at sequence position `first_positions[i]`; the last `window` of them are kept."""
        per_pool: dict[int, tuple[list[int], list[int]]] = {}
        for req_id, start, count, first in zip(req_ids, starts, counts, first_positions, strict=True):
            window = self._windows.get(req_id)
            if window is None or count <= 0:
                continue
            row = self._pools[window].members[req_id]
            tokens, slots = per_pool.setdefault(window, ([], []))
            for j in range(max(0, count - window), count):
                tokens.append(start + j)
                slots.append(row * window + (first + j) % window)
        self._plan = [
            (self._pools[w], torch.tensor(t, dtype=torch.int64), torch.tensor(s, dtype=torch.int64))
            for w, (t, s) in per_pool.items()
        ]

    def clear_plan(self) -> None:
        self._plan = []

    def record(self, layer: str, query: torch.Tensor) -> None:
        """Write this step's planned queries of one layer (`query`: `[tokens, q_heads, head_size]`)."""
        for pool, tokens, slots in self._plan:
            ring = pool.layers.get(layer)
            if ring is None:
                ring = query.new_zeros((pool.rows, pool.window, *query.shape[1:]))
                pool.layers[layer] = ring
            flat = ring.view(pool.rows * pool.window, *query.shape[1:])
            flat.index_copy_(0, slots.to(query.device), query.index_select(0, tokens.to(query.device)))

    def queries(self, req_id: str, layers: Sequence[str]) -> torch.Tensor:
        """`[layers, q_heads, window, head_size]`: the request's last `window` queries of each layer."""
        pool = self._pools[self._windows[req_id]]
        row = pool.members[req_id]
        return torch.stack([pool.layers[name][row].transpose(0, 1) for name in layers])
