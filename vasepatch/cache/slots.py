"""`SlotBuffer`: the static slots of one layer, everything that writes them, and `Step`, what a step reads.

Per row `b` and KV head `h`, slot `s` holds `keys[b, h, s]`, `values[b, h, s]`, the token's
absolute position `positions[b, h, s]` (-1 for padding) and whether it is a real token
`valid[b, h, s]`. Three 0-d/`[B]` device counters go with them: the fill pointer `fill` (next
free slot), `seen` (tokens appended) and each row's `next_position`. The buffer is allocated once
(grown only where a mode allows it) and never moves.

Its writes, one per way a step's tokens arrive:
- `append_real`: eagerly, real tokens into a buffer that never held padding, written at the
  host-known occupancy with positions from the host-known token count (fewer ops, no index
  arithmetic on the device);
- `append_at_fill`: at the device fill pointer (a compiled step, whose graph reads no host counter,
  and any step of a batch with padding);
- `overflow`: a step longer than the free slots (a long prompt, a prefill chunk): the occupied slots
  followed by the step's tokens, in temporaries that live until the step's eviction;
- `compact`: an eviction's gather of the kept slots to the front, in place;
- `undo`: puts back what a failed eager step wrote.

Layout invariant: in every row and KV head the attendable slots form one contiguous range
`[fill - n_valid, fill)` (left padding first, then real tokens in sequence order), which is what
varlen attention kernels need. (Buffers are normal tensors even under `torch.inference_mode()`:
`static.allocating`.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vasepatch.cache.sliding import window_mask
from vasepatch.cache.static import allocating


class Step(NamedTuple):
    """The slots a step's queries attend over, and where its own tokens are.

    `keys`/`values` (`[B, Hkv, S, D]`), `positions` (`[B, Hkv, S]` int64, -1 for padding) and
    `valid` (`[B, Hkv, S]` bool) are the layer's static buffers, or, for an `overflow` step, the
    buffer's occupied slots followed by the step's tokens in temporaries. Only the first `length`
    slots hold anything. A sliding-window layer's step (`sliding_window` set) also hides the keys
    outside each query's window (`vasepatch.cache.sliding`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    length: int  # slots to read: the occupied ones eagerly, the whole buffer under torch.compile
    new_slots: torch.Tensor  # [Q] slots holding this step's tokens
    new_valid: torch.Tensor  # [B, Q] bool: which of this step's tokens are real (not padding)
    end: torch.Tensor  # 0-d: one past the last occupied slot (the fill pointer)
    first: bool  # the first step of the cache (the prompt, or its first chunk); eager only
    overflow: bool  # the step's tokens are in temporaries; its eviction writes the buffer
    sliding_window: int | None = None  # a query sees the keys at positions > its own - this; None: all
    dense: bool = False  # every one of the first `length` slots holds a real token a query may see (eager only)

    @property
    def q_len(self) -> int:
        return self.new_valid.shape[-1]

    def start(self) -> torch.Tensor:
        """`[B, Hkv]`: the first attendable slot of a decode step; the attendable slots of each
        row and KV head are the contiguous range `[start, end)` (padding, if any, sits before;
        in a sliding-window layer, so do the real tokens already out of the window, since
        slots hold tokens in sequence order)."""
        visible = self.valid
        if self.sliding_window is not None:
            visible = visible & window_mask(self.positions, self._query_positions(), self.sliding_window)
        return self.end - visible.sum(-1)

    def _query_positions(self) -> torch.Tensor:
        """`[B, Hkv, 1]`: the position of the step's last token (a decode step's query)."""
        return self.positions.index_select(-1, self.new_slots[-1:])

    def mask(self) -> torch.Tensor:
        """`[B, Hkv, Q, length]` bool: which slots each query may attend to.

        A slot is visible if it holds a real token at a position not after the query's (and, in
        a sliding-window layer, inside its window). A padding query sees only its own slot, so no
        row is empty. A decode step (one token) of a global layer sees every valid slot, its own
        among them: the mask is then a view of `valid`, with no copy.
        """
        valid = self.valid.narrow(2, 0, self.length)
        w = self.sliding_window
        if self.q_len == 1:
            if w is None:
                return valid.unsqueeze(-2)
            positions = self.positions.narrow(2, 0, self.length)
            return (valid & window_mask(positions, self._query_positions(), w)).unsqueeze(-2)
        positions = self.positions.narrow(2, 0, self.length)
        qpos = self.positions[:, 0].index_select(-1, self.new_slots)[:, None, :, None]  # [B, 1, Q, 1]
        mask = valid.unsqueeze(-2) & (positions.unsqueeze(-2) <= qpos)
        if w is not None:
            mask &= window_mask(positions.unsqueeze(-2), qpos, w)
        mask[:, :, torch.arange(self.q_len, device=mask.device), self.new_slots] = True
        return mask


def new_valid_mask(padding: torch.Tensor | None, q_len: int, batch_size: int, device: torch.device) -> torch.Tensor:
    """`[B, Q]` bool: which of a step's `q_len` tokens are real, from the 2-D `padding` mask."""
    if padding is None:
        return torch.ones((batch_size, q_len), dtype=torch.bool, device=device)
    if padding.dim() != 2:
        raise ValueError(
            "vasepatch needs a 2-D attention mask ([batch, sequence], 1 = real token, 0 = padding); "
            f"got a {padding.dim()}-D mask of shape {tuple(padding.shape)}"
        )
    if padding.shape[-1] < q_len:
        raise ValueError(f"attention mask has {padding.shape[-1]} columns, fewer than the {q_len} new tokens")
    return padding[:, -q_len:].to(device=device, dtype=torch.bool)


def _kind(t: torch.Tensor) -> str:
    return f"batch of {t.shape[0]}, {t.shape[1]} KV heads of size {t.shape[-1]}, {t.dtype} on {t.device}"


class SlotBuffer:
    """The slots of one layer (see the module docstring); `keys is None` until `allocate`."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values = self.positions = self.valid = self.slot_index = None
        self.fill = self.seen = self.next_position = None
        self.capacity = 0
        self.padded = False  # a step came with a padding mask: slots may hold padding (sticky until reset)

    def allocate(
        self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int, keep: int, compiling: bool
    ) -> None:
        """(Re)allocate with `capacity` slots for `key_states`' batch, heads, head size, dtype and device,
        carrying the first `keep` slots over from the buffers held (growing), or starting empty;
        `compiling`: inside a traced step (`static.allocating`)."""
        with allocating(compiling) as mark:
            b, h, _, _ = key_states.shape
            dev = key_states.device
            keys = key_states.new_zeros((b, h, capacity, key_states.shape[-1]))
            values = value_states.new_zeros((b, h, capacity, value_states.shape[-1]))
            positions = torch.full((b, h, capacity), -1, dtype=torch.long, device=dev)
            valid = torch.zeros((b, h, capacity), dtype=torch.bool, device=dev)
            if self.keys is None:  # fresh (or dropped for another input): new device counters
                self.next_position = torch.zeros((b,), dtype=torch.long, device=dev)
                self.fill = torch.zeros((), dtype=torch.long, device=dev)  # next free slot
                self.seen = torch.zeros((), dtype=torch.long, device=dev)  # tokens appended
                self._real_row = torch.ones((b, 1), dtype=torch.bool, device=dev)  # a real token's validity
                mark(self.next_position, self.fill, self.seen)
            elif keep:  # growing: carry the occupied slots over
                for new, old in ((keys, self.keys), (values, self.values), (positions, self.positions)):
                    new[:, :, :keep] = old[:, :, :keep]
                valid[:, :, :keep] = self.valid[:, :, :keep]
            self.keys, self.values, self.positions, self.valid = keys, values, positions, valid
            self.slot_index = torch.arange(capacity, device=dev)
            self.capacity = capacity
            mark(keys, values, positions, valid, self.slot_index)

    def refuses(self, key_states: torch.Tensor, tokens_seen: int, index: int) -> bool:
        """Whether the buffers must be dropped for a step's `key_states` (`[B, Hkv, Q, D]`): False if
        they fit; True if they do not and the layer holds nothing (`tokens_seen == 0`: fresh, or
        `reset`); a ValueError naming both if it is in use."""
        keys = self.keys
        same = keys.shape[:2] == key_states.shape[:2] and keys.shape[-1] == key_states.shape[-1]
        if same and keys.dtype == key_states.dtype and keys.device == key_states.device:
            return False
        if tokens_seen == 0:
            return True
        raise ValueError(
            f"this VaSECache holds {tokens_seen} tokens of a previous generation ({_kind(keys)} in layer {index}), "
            f"and the model now gives a {_kind(key_states)}; call cache.reset() first (it then re-allocates for "
            "the new input) or make a new cache with handle.new_cache()"
        )

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.keys, self.values, self.positions, self.valid

    def _positions(self, new_valid: torch.Tensor, all_real: bool) -> torch.Tensor:
        """`[B, Q]` positions of a step's tokens (-1 for padding) from each row's `next_position`,
        which it advances; `all_real`: no padding among them (no count needed)."""
        q_len = new_valid.shape[-1]
        if all_real:
            new_pos = self.next_position.unsqueeze(-1) + torch.arange(q_len, device=new_valid.device)
            self.next_position += q_len
            return new_pos
        counts = new_valid.long().cumsum(-1) if q_len > 1 else new_valid.long()
        new_pos = (self.next_position.unsqueeze(-1) + counts - 1).masked_fill_(~new_valid, -1)
        self.next_position += counts[:, -1]
        return new_pos

    def append_real(self, k: torch.Tensor, v: torch.Tensor, occupancy: int, tokens_seen: int, **step) -> Step:
        """Eagerly, `Q` real tokens (`[B, H, Q, D]`) at slots `occupancy...`, at positions
        `tokens_seen...` in every row (a buffer that never held padding: every row's next position is
        that count). A global layer's step is `dense` (every slot up to its length visible)."""
        q_len = k.shape[-2]
        self.keys.narrow(2, occupancy, q_len).copy_(k)
        self.values.narrow(2, occupancy, q_len).copy_(v)
        pos = self.positions.narrow(2, occupancy, q_len)
        if q_len == 1:
            pos.fill_(tokens_seen)
        else:
            pos.copy_(torch.arange(tokens_seen, tokens_seen + q_len, device=pos.device))
        self.valid.narrow(2, occupancy, q_len).fill_(True)
        for t in (self.next_position, self.seen, self.fill):
            t.add_(q_len)
        new_valid = self._real_row if q_len == 1 else self._real_row.expand(-1, q_len)
        slots = self.slot_index.narrow(0, occupancy, q_len)
        dense = step["sliding_window"] is None
        return Step(*self.buffers, occupancy + q_len, slots, new_valid, self.fill, **step, overflow=False, dense=dense)

    def append_at_fill(
        self, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None, length: int | None, **step
    ):
        """A step's tokens written at the device fill pointer, which it advances; `padding` is the 2-D
        mask (`[B, >= Q]`, last `Q` columns for these tokens) or None. `length` None: the whole buffer
        (compiled: static shapes, no host counter is read)."""
        q_len, h = k.shape[-2], self.keys.shape[1]
        new_valid = new_valid_mask(padding, q_len, k.shape[0], k.device)
        new_pos = self._positions(new_valid, padding is None)
        self.seen += q_len
        slots = self.fill + self.slot_index[:q_len]
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        self.positions.index_copy_(2, slots, new_pos.unsqueeze(1).expand(-1, h, -1))
        self.valid.index_copy_(2, slots, new_valid.unsqueeze(1).expand(-1, h, -1))
        self.fill += q_len
        length = self.capacity if length is None else length
        return Step(*self.buffers, length, slots, new_valid, self.fill, **step, overflow=False)

    def overflow(self, k: torch.Tensor, v: torch.Tensor, padding: torch.Tensor | None, occupancy: int, **step) -> Step:
        """A step longer than the free slots: the first `occupancy` slots followed by the step's tokens,
        in temporaries that live until the step's eviction writes the kept ones back (`compact`)."""
        occ, q_len, h = occupancy, k.shape[-2], self.keys.shape[1]
        new_valid = new_valid_mask(padding, q_len, k.shape[0], k.device)
        new_pos = self._positions(new_valid, padding is None)
        self.seen += q_len
        pos = new_pos.unsqueeze(1).expand(-1, h, -1)
        val = new_valid.unsqueeze(1).expand(-1, h, -1)
        if occ:
            k, v = torch.cat([self.keys[:, :, :occ], k], 2), torch.cat([self.values[:, :, :occ], v], 2)
            pos, val = torch.cat([self.positions[:, :, :occ], pos], 2), torch.cat([self.valid[:, :, :occ], val], 2)
        slots = torch.arange(occ, occ + q_len, device=k.device)
        end = torch.full((), occ + q_len, dtype=torch.long, device=k.device)
        return Step(k, v, pos, val, occ + q_len, slots, new_valid, end, **step, overflow=True)

    def compact(self, sources: tuple[torch.Tensor, ...], kept: torch.Tensor, start: int, n: int) -> int:
        """Gather the `kept` slots (`[B, H, K]`, indices into `sources`: keys, values, positions, valid,
        this buffer's or an overflow step's) into slots `start..start+K-1`, free slots `start+K..n-1`
        (invalid, position -1), and move the fill pointer there. Returns `start + K`."""
        keys, values, positions, valid = self.buffers
        src_keys, src_values, src_positions, src_valid = sources
        end = start + kept.shape[-1]
        keys[:, :, start:end] = gather_slots(src_keys, kept)
        values[:, :, start:end] = gather_slots(src_values, kept)
        valid[:, :, start:end] = src_valid.gather(2, kept)
        positions[:, :, start:end] = src_positions.gather(2, kept).masked_fill_(~valid[:, :, start:end], -1)
        valid[:, :, end:n] = False
        positions[:, :, end:n] = -1
        self.fill.fill_(end)
        return end

    def undo(self, step: Step, occupancy: int, tokens_seen: int) -> None:
        """Put back what a failed eager `step` wrote, given the host counts from before it."""
        self.seen.fill_(tokens_seen)
        self.fill.fill_(occupancy)
        self.next_position.sub_(step.new_valid.sum(-1))
        if not step.overflow:  # the step's tokens were written after the occupied slots
            self.valid[:, :, occupancy : occupancy + step.q_len] = False
            self.positions[:, :, occupancy : occupancy + step.q_len] = -1

    def reset(self) -> None:
        """Empty, keeping the allocation."""
        if self.keys is not None:
            self.valid.zero_()
            self.positions.fill_(-1)
            for t in (self.next_position, self.fill, self.seen):
                t.zero_()
        self.padded = False

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: permute rows in place (storage unchanged)."""
        if self.keys is not None:
            for t in (*self.buffers, self.next_position):
                t.copy_(t.index_select(0, beam_idx.to(t.device)))


def gather_slots(src: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`[B, H, K, D]`: `src[b, h, kept[b, h, k]]` for `src` `[B, H, S, D]` and `kept` `[B, H, K]`, what
    `src.gather(2, kept[..., None].expand(..., D))` returns, as one `index_select` of whole rows of
    the flattened slots (no index per element: 3-6x faster on CPU)."""
    b, h, s, d = src.shape
    base = torch.arange(0, b * h * s, s, device=kept.device).view(b, h, 1)
    return src.reshape(b * h * s, d).index_select(0, (kept + base).view(-1)).view(b, h, -1, d)
