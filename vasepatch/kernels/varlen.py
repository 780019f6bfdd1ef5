"""Packing helpers for variable-length ("varlen") attention kernels, pure tensor code.

Varlen kernels (FlashAttention-2's `flash_attn_varlen_func`, torch's
`torch.nn.attention.varlen.varlen_attn`) take the tokens of all sequences
packed along one axis, `[T, H, D]`, plus `cu_seqlens`: int32 offsets
`[N + 1]`, sequence `i` being rows `cu[i] : cu[i + 1]` (Dao, "FlashAttention-2",
arXiv 2307.08691; flash-attn's `flash_attn_interface.py` docstrings). Two
layouts are built here:

* **decode over the static cache**: the head-major buffer `[B, Hkv, C, D]`
  flattens for free to `[B*Hkv*C, 1, D]`, and each `(b, h)` pair is one
  sequence whose valid keys are the contiguous slots `[start[b, h], end)`.
  With `seqused_k` (keys of sequence `i` = rows `cu_k[i] : cu_k[i] + seqused_k[i]`)
  the offsets are `cu_k[i] = i*C + start` and gaps between sequences are allowed
  (`decode_seqused`). Without it, every gap becomes a sequence of its own that
  has no queries, so the kernel skips it (`decode_gaps`).
* **prefill without padding**: the real tokens of a left-padded prompt batch are
  gathered into `[T, H, D]` (`pack_prompt`, `unpad`) and the output scattered
  back with zeros at the padding (`repad`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """Cumulative offsets `[n + 1]` (int32, starting at 0) of sequences of the given lengths."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths.reshape(-1), 0)
    return out


def end_per_row(end: int | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """`end` (an int, a 0-d tensor or a `[B]` tensor: slots in use) as an int32 `[B]` tensor."""
    if isinstance(end, torch.Tensor):
        return end.to(device=device, dtype=torch.int32).reshape(-1).expand(batch)
    return torch.full((batch,), int(end), dtype=torch.int32, device=device)


def decode_seqused(start: torch.Tensor, end: int | torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cu_seq_k [N+1], seqused_k [N])`, int32, for the `N = B*Hkv` sequences of a `[B, Hkv, C, D]` buffer.

    Sequence `i = b*Hkv + h` reads slots `[start[b, h], end)` of its own `C` rows:
    `cu_seq_k[i] = i*C + start[b, h]`, `seqused_k[i] = end - start[b, h]`, and
    `cu_seq_k[N] = N*C` (the end of the flattened buffer).
    """
    b, h = start.shape
    n = b * h
    ends = end_per_row(end, b, start.device)
    first = torch.arange(n, dtype=torch.int32, device=start.device) * capacity + start.reshape(-1).to(torch.int32)
    cu_k = torch.cat([first, torch.full((1,), n * capacity, dtype=torch.int32, device=start.device)])
    used = (ends[:, None] - start.to(torch.int32)).reshape(-1)
    return cu_k, used


def decode_gaps(
    start: torch.Tensor, end: int | torch.Tensor, capacity: int, queries_per_seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cu_seq_q, cu_seq_k)` `[2N + 1]`, int32, for kernels without `seqused_k`.

    Sequences alternate gap, real: gap `2i` covers keys `[prev_end, i*C + start)`
    with no queries, real `2i + 1` covers `[i*C + start, i*C + end)` with the
    `queries_per_seq` queries of pair `i`. A sequence with no queries does no work
    in FlashAttention-2 (its row blocks return at once), so the gaps cost nothing.
    A gap spans at most `C` keys when `end` is the same for every row, `2C` otherwise
    (the `max_k` to pass).
    """
    b, h = start.shape
    n = b * h
    dev = start.device
    base = torch.arange(n, dtype=torch.int32, device=dev) * capacity
    ends = end_per_row(end, b, dev)[:, None].expand(b, h).reshape(-1)
    bounds = torch.stack([base + start.reshape(-1).to(torch.int32), base + ends], dim=1).reshape(-1)  # a_0 b_0 a_1 ...
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    cu_k = torch.cat([zero, bounds])
    q_ends = torch.arange(1, n + 1, dtype=torch.int32, device=dev) * queries_per_seq
    cu_q = torch.cat([zero, torch.stack([q_ends - queries_per_seq, q_ends], dim=1).reshape(-1)])
    return cu_q, cu_k


class PackedPrompt(NamedTuple):
    """Where the real tokens of a `[B, Q]` padding mask go when packed.

    `indices`: flat positions `b*Q + t` of the real tokens (int64 `[T]`, row-major);
    `cu_seqlens`: int32 `[B + 1]`; `max_len`: longest row (a Python int);
    `batch`, `length`: `B` and `Q`.
    """

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    batch: int
    length: int


def pack_prompt(
    padding: torch.Tensor | None,
    batch: int | None = None,
    length: int | None = None,
    device: torch.device | str | None = None,
) -> PackedPrompt:
    """Packing for a `[B, Q]` mask (True/1 = real token); `None` means no padding (then pass `batch`, `length`).

    Reads the mask on the host (two syncs); compute it once per forward and reuse
    it for every layer. Any mask works: each row's real tokens keep their order.
    """
    if padding is None:
        if batch is None or length is None:
            raise ValueError("pack_prompt(None) needs batch and length")
        lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
        indices = torch.arange(batch * length, device=device)
        return PackedPrompt(indices, cu_seqlens(lengths), length, batch, length)
    mask = padding.to(torch.bool)
    lengths = mask.sum(1, dtype=torch.int32)
    indices = mask.reshape(-1).nonzero().reshape(-1)
    max_len = int(lengths.max().item()) if lengths.numel() else 0
    return PackedPrompt(indices, cu_seqlens(lengths), max_len, mask.shape[0], mask.shape[1])


def unpad(x: torch.Tensor, packing: PackedPrompt) -> torch.Tensor:
    """`[B, Q, ...]` -> `[T, ...]`: the real tokens, row after row."""
    flat = x.reshape(packing.batch * packing.length, *x.shape[2:])
    if packing.indices.numel() == flat.shape[0]:  # nothing to drop: a view, no copy
        return flat
    return flat.index_select(0, packing.indices.to(flat.device))


def repad(x: torch.Tensor, packing: PackedPrompt) -> torch.Tensor:
    """`[T, ...]` -> `[B, Q, ...]`, zeros at the padding positions."""
    shape = (packing.batch, packing.length, *x.shape[1:])
    if packing.indices.numel() == packing.batch * packing.length:
        return x.reshape(shape)
    out = x.new_zeros(packing.batch * packing.length, *x.shape[1:])
    return out.index_copy(0, packing.indices.to(x.device), x).reshape(shape)
