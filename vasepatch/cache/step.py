"""`Step`: what one attention step reads, as returned by `VaSELayer.append`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from vasepatch.cache.sliding import window_mask


class Step(NamedTuple):
    """The slots a step's queries attend over, and where its own tokens are.

    `keys`/`values` (`[B, Hkv, S, D]`), `positions` (`[B, Hkv, S]` int64, -1 for
    padding) and `valid` (`[B, Hkv, S]` bool) are the layer's static buffers, or,
    for a step too long for them (a prompt over the budget, a prefill chunk), the
    buffer's occupied slots followed by the step's tokens in temporaries that live
    only until the step's eviction. Only the first `length` slots hold anything.
    A sliding-window layer's step (`sliding_window` set) also hides the keys outside each
    query's window (`vasepatch.cache.sliding`).
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

        A slot is visible if it holds a real token at a position not after the
        query's (and, in a sliding-window layer, inside its window). A padding query
        sees only its own slot, so no row is empty. A decode step (one token) of a
        global layer sees every valid slot, its own among them: the mask is then a
        view of `valid`, with no copy.
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


def overflow_step(
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    occupancy: int,
    k: torch.Tensor,
    v: torch.Tensor,
    new_pos: torch.Tensor,
    new_valid: torch.Tensor,
    first: bool,
    sliding_window: int | None,
) -> Step:
    """A step longer than the free slots (a long prompt, a prefill chunk): the first `occupancy`
    slots of the layer's `buffers` (keys, values, positions, valid) followed by the step's tokens,
    in temporaries that live until the step's eviction writes the kept ones into the buffer."""
    keys, values, positions, valid = buffers
    occ, q_len, h = occupancy, k.shape[-2], keys.shape[1]
    pos = new_pos.unsqueeze(1).expand(-1, h, -1)
    val = new_valid.unsqueeze(1).expand(-1, h, -1)
    if occ:
        k, v = torch.cat([keys[:, :, :occ], k], 2), torch.cat([values[:, :, :occ], v], 2)
        pos, val = torch.cat([positions[:, :, :occ], pos], 2), torch.cat([valid[:, :, :occ], val], 2)
    slots = torch.arange(occ, occ + q_len, device=k.device)
    end = torch.full((), occ + q_len, dtype=torch.long, device=k.device)
    return Step(k, v, pos, val, occ + q_len, slots, new_valid, end, first, True, sliding_window)
