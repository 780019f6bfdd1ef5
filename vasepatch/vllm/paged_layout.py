"""Reading and writing one request's slots in vLLM's paged KV cache (pure tensor functions).

vLLM's CPU attention backend (`CPU_ATTN`, ISAs `vec` and `vec16`) stores one layer's cache as
`[num_blocks, kv_heads, block_size, 2 * head_size]`, and inside each (block, head) region of
`block_size * 2 * head_size` elements **K is stored transposed, `[head_size, block_size]`**, followed by
V as `[block_size, head_size]` (vLLM 0.32, `csrc/cpu/cpu_attn_vec*.hpp`; checked by the plugin's tests
against vLLM's own attention output). Slot `s` of a request is offset `s % block_size` of its block
`blocks[s // block_size]`.

`read_slots` returns the request's first `n` slots as `[kv_heads, n, head_size]` keys and values;
`write_slots` writes `[kv_heads, m, head_size]` keys and values into its first `m` slots. Both take several
requests at once: block ids `[R, nb]` and a leading `R` on the keys and values.
"""

from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec", "vec16")


def _regions(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The cache as `[num_blocks, kv_heads, 2 * block_size * head_size]`, with block_size and head_size."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    return kv_cache.view(num_blocks, heads, block_size * two_d), block_size, two_d // 2


def read_slots(kv_cache: torch.Tensor, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[kv_heads, n, head_size]` of slots `0..n-1` of the request holding `blocks` (int64);
    with `blocks` `[R, nb]` (R requests), `[R, kv_heads, n, head_size]`, in one `index_select`."""
    flat, bs, d = _regions(kv_cache)
    nb = -(-n // bs)
    used = blocks[..., :nb]
    region = flat.index_select(0, used.reshape(-1)).view(*used.shape, *flat.shape[1:])  # [(R,) nb, H, 2*bs*d]
    heads = region.shape[-2]
    keys = region[..., : bs * d].unflatten(-1, (d, bs)).movedim(-3, -4).transpose(-1, -2)
    values = region[..., bs * d :].unflatten(-1, (bs, d)).movedim(-3, -4)
    keys, values = (t.reshape(*t.shape[:-4], heads, nb * bs, d)[..., :n, :] for t in (keys, values))
    return keys, values


def write_slots(kv_cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write `keys`, `values` `[kv_heads, m, head_size]` into slots `0..m-1` of the request holding `blocks`
    (or `[R, kv_heads, m, head_size]` into R requests' `blocks` `[R, nb]`, in one `index_copy_`). The slots
    past `m` in the last block written are zeroed (nothing attends to them before they are written again:
    the request's length is `m`)."""
    flat, bs, d = _regions(kv_cache)
    heads, m = keys.shape[-3], keys.shape[-2]
    nb = -(-m // bs)
    pad = nb * bs - m
    lead = keys.shape[:-3]
    k = torch.nn.functional.pad(keys, (0, 0, 0, pad)).unflatten(-2, (nb, bs)).movedim(-3, -4).transpose(-1, -2)
    v = torch.nn.functional.pad(values, (0, 0, 0, pad)).unflatten(-2, (nb, bs)).movedim(-3, -4)
    region = torch.cat([k.reshape(*lead, nb, heads, bs * d), v.reshape(*lead, nb, heads, bs * d)], dim=-1)
    flat.index_copy_(0, blocks[..., :nb].reshape(-1), region.reshape(-1, heads, 2 * bs * d).to(flat.dtype))
