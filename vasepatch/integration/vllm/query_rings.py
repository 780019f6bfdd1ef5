"""The last `window` queries of every evicting vLLM request, per layer: what an eviction scores with.

vLLM's attention takes no per-request side buffers, so the plugin keeps its own: one pool per window
size, per layer a tensor `[rows, window, q_heads, head_size]`, a row per request (`assign`/`release`,
keyed by request id, so vLLM's reordering of its batch does not matter). Query of position `p` goes to
column `p % window`; the scores average over the window, so the order of the columns does not matter.

Each step the runner states which tokens of the batch to keep (`plan`: the last `window` of each
evicting request); each layer's attention then writes them with one `index_copy_` (`record`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class _Pool:
    window: int
    rows: int = 0
    free: list[int] = field(default_factory=list)
    layers: dict[str, torch.Tensor] = field(default_factory=dict)

    def take(self) -> int:
        if not self.free:
            grown = max(4, 2 * self.rows)
            self.free.extend(range(grown - 1, self.rows - 1, -1))
            for name, ring in self.layers.items():
                bigger = ring.new_zeros((grown, *ring.shape[1:]))
                bigger[: self.rows] = ring
                self.layers[name] = bigger
            self.rows = grown
        return self.free.pop()


class QueryRings:
    """The query rings of one worker (see the module's docstring)."""

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}
        self._rows: dict[str, tuple[int, int]] = {}  # request id -> (window, row)
        self._plan: list[tuple[_Pool, torch.Tensor, torch.Tensor]] = []

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def assign(self, req_id: str, window: int) -> None:
        """Give `req_id` a row of the pool of `window` (once)."""
        if req_id not in self._rows:
            pool = self._pools.setdefault(window, _Pool(window))
            self._rows[req_id] = (window, pool.take())

    def release(self, req_id: str) -> None:
        """The request finished: its row goes back to its pool."""
        entry = self._rows.pop(req_id, None)
        if entry is not None:
            self._pools[entry[0]].free.append(entry[1])

    def plan(self, req_ids: Sequence[str], starts: Sequence[int], counts: Sequence[int], first_positions) -> None:
        """This step's writes: request `req_ids[i]` has `counts[i]` tokens from batch token `starts[i]`, the
        first at sequence position `first_positions[i]`; the last `window` of them are kept."""
        per_pool: dict[int, tuple[list[int], list[int]]] = {}
        for req_id, start, count, first in zip(req_ids, starts, counts, first_positions, strict=True):
            entry = self._rows.get(req_id)
            if entry is None or count <= 0:
                continue
            window, row = entry
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
        window, row = self._rows[req_id]
        pool = self._pools[window]
        return torch.stack([pool.layers[name][row].transpose(0, 1) for name in layers])
