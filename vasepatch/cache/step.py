"""`Step`: what one attention step reads, as returned by `VaSELayer.append`."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Step(NamedTuple):
    """The slots a step's queries attend over, and where its own tokens are.

    `keys`/`values` (`[B, Hkv, S, D]`), `positions` (`[B, Hkv, S]` int64, -1 for
    padding) and `valid` (`[B, Hkv, S]` bool) are the layer's static buffers, or,
    for a step too long for them (a prompt over the budget, a prefill chunk), the
    buffer's occupied slots followed by the step's tokens in temporaries that live
    only until the step's eviction. Only the first `length` slots hold anything.
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

    @property
    def q_len(self) -> int:
        return self.new_valid.shape[-1]

    def start(self) -> torch.Tensor:
        """`[B, Hkv]`: the first attendable slot; the attendable slots of each row and
        KV head are the contiguous range `[start, end)` (padding, if any, sits before)."""
        return self.end - self.valid.sum(-1)

    def mask(self) -> torch.Tensor:
        """`[B, Hkv, Q, length]` bool: which slots each query may attend to.

        A slot is visible if it holds a real token at a position not after the
        query's. A padding query sees only its own slot, so no row is empty. A
        decode step (one token) sees every valid slot, its own among them: the
        mask is then a view of `valid`, with no copy.
        """
        valid = self.valid.narrow(2, 0, self.length)
        if self.q_len == 1:
            return valid.unsqueeze(-2)
        positions = self.positions.narrow(2, 0, self.length)
        qpos = self.positions[:, 0].index_select(-1, self.new_slots)[:, None, :, None]  # [B, 1, Q, 1]
        mask = valid.unsqueeze(-2) & (positions.unsqueeze(-2) <= qpos)
        mask[:, :, torch.arange(self.q_len, device=mask.device), self.new_slots] = True
        return mask
