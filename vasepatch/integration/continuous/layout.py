"""The slots of one request in transformers' paged cache (continuous batching), read and written by rows.

transformers' `FullAttentionCacheAllocator` keeps one flat tensor per group of full-attention layers; each layer
has a view `[rows, kv_heads, head_dim]` of its keys and one of its values (`_kv_token_views`). A request owns blocks
(`block_table[request_id]`), each of `page` tokens per layer, and token slot `s` of the request is row
`blocks[s // page] * stride + s % page` of every layer's views (`stride`: the allocator's
`block_physical_stride`). Pure tensor code: a request's rows, and its slots read and written through them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_rows(
    blocks: Sequence[int], start: int, stop: int, page: int, stride: int, device: torch.device
) -> torch.Tensor:
    """`[stop - start]` int64: the rows of slots `start .. stop - 1` of a request whose blocks are `blocks`."""
    slots = torch.arange(start, stop, dtype=torch.int64)
    table = torch.tensor(list(blocks), dtype=torch.int64)
    return (table[slots // page] * stride + slots % page).to(device)


def read_slots(
    views: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of `rows` in each layer's `(keys, values)` views, each `[layers, kv_heads, rows, D]`."""
    keys = torch.stack([k.index_select(0, rows).transpose(0, 1) for k, _ in views])
    values = torch.stack([v.index_select(0, rows).transpose(0, 1) for _, v in views])
    return keys, values


def write_slots(
    views: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Write `keys` and `values` (`[layers, kv_heads, len(rows), head_dim]`) to `rows` of each layer's views."""
    for (k_view, v_view), k, v in zip(views, keys, values, strict=True):
        k_view.index_copy_(0, rows, k.transpose(0, 1).to(k_view.dtype))
        v_view.index_copy_(0, rows, v.transpose(0, 1).to(v_view.dtype))
