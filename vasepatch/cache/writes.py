"""How a step's tokens get into a layer's static buffers.

Two ways, same result: `write_at_fill` writes at the device-side fill pointer (the
compiled step, whose graph reads no host counter, and any step of a batch with
padding); `write_real` writes at the host-known occupancy, with positions from the
host-known token count, for an eager step of real tokens into a layer that never
held padding (then every row's next position is that count): fewer ops per layer
and step, and no index arithmetic on the device.
"""

from __future__ import annotations

import torch


def new_positions(next_position: torch.Tensor, new_valid: torch.Tensor, all_real: bool) -> torch.Tensor:
    """`[B, Q]` positions of a step's tokens (-1 for padding) from each row's `next_position`
    `[B]`, which it advances in place; `all_real`: no padding among them (no count needed)."""
    q_len = new_valid.shape[-1]
    if all_real:
        new_pos = next_position.unsqueeze(-1) + torch.arange(q_len, device=next_position.device)
        next_position += q_len
        return new_pos
    counts = new_valid.long().cumsum(-1) if q_len > 1 else new_valid.long()
    new_pos = (next_position.unsqueeze(-1) + counts - 1).masked_fill_(~new_valid, -1)
    next_position += counts[:, -1]
    return new_pos


def write_at_fill(
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    fill: torch.Tensor,
    slot_index: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    new_pos: torch.Tensor,
    new_valid: torch.Tensor,
) -> torch.Tensor:
    """Write `k`, `v` (`[B, H, Q, D]`), `new_pos` and `new_valid` (`[B, Q]`) into `buffers`
    (keys, values, positions, valid) at the 0-d `fill` pointer, which it advances. Returns the
    `[Q]` slots written."""
    keys, values, positions, valid = buffers
    q_len, h = k.shape[-2], keys.shape[1]
    slots = fill + slot_index[:q_len]
    keys.index_copy_(2, slots, k)
    values.index_copy_(2, slots, v)
    positions.index_copy_(2, slots, new_pos.unsqueeze(1).expand(-1, h, -1))
    valid.index_copy_(2, slots, new_valid.unsqueeze(1).expand(-1, h, -1))
    fill += q_len
    return slots


def write_real(
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    occupancy: int,
    first_position: int,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write `Q` real tokens (`k`, `v` `[B, H, Q, D]`) into `buffers` (keys, values, positions,
    valid) at slots `occupancy ...`, at positions `first_position ...` in every row."""
    keys, values, positions, valid = buffers
    q_len = k.shape[-2]
    keys.narrow(2, occupancy, q_len).copy_(k)
    values.narrow(2, occupancy, q_len).copy_(v)
    pos = positions.narrow(2, occupancy, q_len)
    if q_len == 1:
        pos.fill_(first_position)
    else:
        pos.copy_(torch.arange(first_position, first_position + q_len, device=pos.device))
    valid.narrow(2, occupancy, q_len).fill_(True)
