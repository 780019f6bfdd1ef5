"""The queries of the last `window` tokens, kept in a ring: what scores the eviction candidates."""

from __future__ import annotations

import torch

from vasepatch.cache.static import allocating


class QueryRing:
    """`[B, Hq, window, D]` queries (after RoPE) and `[B, window]` validity.

    Allocated at the first write; the write position is a 0-d device tensor, so a
    compiled step writes the ring without host syncs or recompiles. Eagerly, the
    same position is also known on the host (`host_pointer`, advanced by eager
    writes and, after a compiled step, by `advance`), and a one-query write is a
    plain copy into that slot. Padding queries are kept but zeroed when read (a
    zero query spreads its attention uniformly, so it favours no candidate).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.queries: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.pointer: torch.Tensor | None = None
        self.slot_index: torch.Tensor | None = None
        self.host_pointer = 0  # = `pointer`, on the host

    def _allocate(self, query: torch.Tensor, compiling: bool) -> None:
        b, hq, _, d = query.shape
        dev, w = query.device, self.window
        with allocating(compiling) as mark:
            self.queries = torch.zeros((b, hq, w, d), dtype=query.dtype, device=dev)
            self.valid = torch.zeros((b, w), dtype=torch.bool, device=dev)
            self.pointer = torch.zeros((), dtype=torch.long, device=dev)
            self.slot_index = torch.arange(w, device=dev)
            mark(self.queries, self.valid, self.pointer, self.slot_index)

    def write(self, query: torch.Tensor, valid: torch.Tensor) -> None:
        """Eagerly, keep the last `min(Q, window)` of a step's queries `[B, Hq, Q, D]`; `valid`
        `[B, Q]` marks the real (non-padding) ones. Written at the host pointer."""
        if self.queries is None:
            self._allocate(query, compiling=False)
        q_len = query.shape[-2]
        if q_len == 1:  # one query: a plain copy at the host pointer
            self.queries.narrow(2, self.host_pointer, 1).copy_(query)
            self.valid.narrow(1, self.host_pointer, 1).copy_(valid)
        else:
            self._write_at(self.host_pointer, query, valid)
        self.advance(q_len)
        self.pointer.fill_(self.host_pointer)

    def write_at_pointer(self, query: torch.Tensor, valid: torch.Tensor) -> None:
        """In a compiled step, `write` at the device pointer, which it advances; the host pointer
        follows after the graph (`advance`)."""
        if self.queries is None:
            self._allocate(query, compiling=True)
        self._write_at(self.pointer, query, valid)
        self.pointer.add_(min(query.shape[-2], self.window)).remainder_(self.window)

    def _write_at(self, start: int | torch.Tensor, query: torch.Tensor, valid: torch.Tensor) -> None:
        q_len = query.shape[-2]
        m = min(q_len, self.window)
        slots = (start + self.slot_index[:m]) % self.window
        self.queries.index_copy_(2, slots, query.narrow(2, q_len - m, m))
        self.valid.index_copy_(1, slots, valid.narrow(1, q_len - m, m))

    def advance(self, q_len: int) -> None:
        """Move the host pointer past a write of `q_len` queries (eagerly: after a compiled step)."""
        self.host_pointer = (self.host_pointer + min(q_len, self.window)) % self.window

    def read(self) -> torch.Tensor:
        """`[B, Hq, window, D]`, padding and never-written queries zeroed."""
        return self.queries * self.valid[:, None, :, None]

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: permute rows in place."""
        if self.queries is not None:
            for t in (self.queries, self.valid):
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def save(self, q_len: int) -> tuple | None:
        """Eagerly, what a write of `q_len` queries will overwrite (None: the ring is not allocated)."""
        if self.queries is None:
            return None
        slots = (self.host_pointer + torch.arange(min(q_len, self.window), device=self.queries.device)) % self.window
        return self.host_pointer, slots, self.queries.index_select(2, slots), self.valid.index_select(1, slots)

    def restore(self, saved: tuple | None) -> None:
        """Undo the writes since `save` returned `saved`."""
        if saved is None:
            self.release()
            return
        self.host_pointer, slots, queries, valid = saved
        self.queries.index_copy_(2, slots, queries)
        self.valid.index_copy_(1, slots, valid)
        self.pointer.fill_(self.host_pointer)

    def release(self) -> None:
        """Drop the buffers (allocated again, for the next write's shape, at that write)."""
        self.queries = self.valid = self.pointer = self.slot_index = None
        self.host_pointer = 0

    def reset(self) -> None:
        if self.queries is not None:
            self.queries.zero_()
            self.valid.zero_()
            self.pointer.zero_()
        self.host_pointer = 0
