"""Reading and writing one request's slots in vLLM's paged KV cache (pure tensor functions).

vLLM's CPU attention backend (`CPU_ATTN`) stores one layer's cache as `[num_blocks, kv_heads, block_size,
2 * head_size]`: each (block, head) region of `2 * block_size * head_size` elements holds the block's keys,
then its values, in an order set by the ISA the backend picked for the engine (vLLM 0.32,
`csrc/cpu/cpu_attn_*.hpp`; each checked by the plugin's tests against vLLM's own cache-writing kernel):

- `vec`, `vec16` (float32, and bfloat16 where the CPU has no AMX): keys transposed, `[head_size, block_size]`,
  values `[block_size, head_size]`;
- `amx` (bfloat16 on CPUs with AMX, block_size a multiple of 32): the tiles' pair-interleaved order, keys as
  `[block_size/16, head_size/2, 16, 2]` (slot group, dimension pair, slot, dimension), values as
  `[head_size/16, block_size/2, 16, 2]` (dimension group, slot pair, dimension, slot).

Slot `s` of a request is offset `s % block_size` of its block `blocks[s // block_size]`.

`read_slots` returns the request's first `n` slots as `[kv_heads, n, head_size]` keys and values;
`write_slots` writes `[kv_heads, m, head_size]` keys and values into its first `m` slots. Both take several
requests at once: block ids `[R, nb]` and a leading `R` on the keys and values.
"""

from __future__ import annotations

import re

import torch
from einops import rearrange

# per ISA: (packed, as slots) einops patterns of one block's keys, then of its values; `s` and `d` are slots
# and dimensions (amx: within a tile's groups of 16), `two` the pairs amx interleaves
_LAYOUTS = {
    "vec": (("(d s)", "s d"), ("(s d)", "s d")),
    "vec16": (("(d s)", "s d"), ("(s d)", "s d")),
    "amx": (("(sg dp s two)", "(sg s) (dp two)"), ("(dg sp d two)", "(sp two) (dg d)")),
}

SUPPORTED_ISAS = tuple(_LAYOUTS)


def _patterns(isa: str, which: int, block_size: int) -> tuple[str, str, dict[str, int]]:
    """Keys' (`which` 0) or values' (1) packed and slot patterns in `isa`, with the axis lengths they need."""
    packed, slots = _LAYOUTS[isa][which]
    if isa != "amx":
        return packed, slots, {"s": block_size}
    names = set(re.findall(r"\w+", packed))
    amx = {"s": 16, "d": 16, "two": 2, "sg": block_size // 16, "sp": block_size // 2}  # its tile's shape
    return packed, slots, {name: size for name, size in amx.items() if name in names}


def _unpack(region: torch.Tensor, isa: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' regions `[..., 2 * bs * d]` as their keys and values `[..., bs, d]`."""
    half = region.shape[-1] // 2
    out = []
    for which, part in enumerate((region[..., :half], region[..., half:])):
        packed, slots, lengths = _patterns(isa, which, block_size)
        out.append(rearrange(part, f"... {packed} -> ... {slots}", **lengths))
    return out[0], out[1]


def _pack(keys: torch.Tensor, values: torch.Tensor, isa: str, block_size: int) -> torch.Tensor:
    """Blocks' keys and values `[..., bs, d]` as their regions `[..., 2 * bs * d]`."""
    parts = []
    for which, part in enumerate((keys, values)):
        packed, slots, lengths = _patterns(isa, which, block_size)
        parts.append(rearrange(part, f"... {slots} -> ... {packed}", **lengths))
    return torch.cat(parts, dim=-1)


def _regions(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache as `[num_blocks, kv_heads, 2 * block_size * head_size]`, with its block_size."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    return kv_cache.view(num_blocks, heads, block_size * two_d), block_size


def read_slots(
    kv_cache: torch.Tensor, blocks: torch.Tensor, n: int, isa: str = "vec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[kv_heads, n, head_size]` of slots `0..n-1` of the request holding `blocks` (int64),
    in layout `isa`; with `blocks` `[R, nb]` (R requests), `[R, kv_heads, n, head_size]`, in one
    `index_select`."""
    flat, bs = _regions(kv_cache)
    nb = -(-n // bs)
    used = blocks[..., :nb]
    region = flat.index_select(0, used.reshape(-1)).view(*used.shape, *flat.shape[1:])  # [(R,) nb, H, 2*bs*d]
    keys, values = (t.movedim(-3, -4) for t in _unpack(region, isa, bs))  # [(R,) H, nb, bs, d]
    return keys.flatten(-3, -2)[..., :n, :], values.flatten(-3, -2)[..., :n, :]


def write_slots(
    kv_cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, isa: str = "vec"
) -> None:
    """Write `keys`, `values` `[kv_heads, m, head_size]` into slots `0..m-1` of the request holding `blocks`
    (or `[R, kv_heads, m, head_size]` into R requests' `blocks` `[R, nb]`, in one `index_copy_`), in layout
    `isa`. The slots past `m` in the last block written are zeroed (nothing attends to them before they are
    written again: the request's length is `m`)."""
    flat, bs = _regions(kv_cache)
    heads, m = keys.shape[-3], keys.shape[-2]
    nb = -(-m // bs)
    k, v = (
        torch.nn.functional.pad(t, (0, 0, 0, nb * bs - m)).unflatten(-2, (nb, bs)).movedim(-3, -4)
        for t in (keys, values)
    )
    region = _pack(k, v, isa, bs)  # [(R,) nb, H, 2*bs*d]
    flat.index_copy_(0, blocks[..., :nb].reshape(-1), region.reshape(-1, heads, flat.shape[-1]).to(flat.dtype))
