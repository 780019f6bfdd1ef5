"""The plugin's reading of vLLM's CPU paged cache (`paged_layout`) against vLLM's own cache-writing kernel, for
both layouts it accepts (`vec`, `vec16`) and both dtypes an engine may use (float32, bfloat16): no engine, the
kernel the CPU attention backend calls to store each step's keys and values."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

import torch
from vllm import _custom_ops as ops

from vasepatch.vllm import paged_layout

HEADS, HEAD_SIZE, BLOCKS = 3, 64, 6


def vllm_cache(block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's cache as the backend allocates it, and its key and value halves as its `forward` views them."""
    cache = torch.zeros(BLOCKS, HEADS, block_size, 2 * HEAD_SIZE, dtype=dtype)
    key_cache, value_cache = cache.view(BLOCKS, HEADS, block_size * 2, HEAD_SIZE).chunk(2, dim=2)
    return cache, key_cache, value_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("isa", "block_size"), [("vec", 32), ("vec16", 16)])
def test_read_slots_reads_what_vllms_kernel_wrote_and_write_slots_writes_as_it_does(isa, block_size, dtype):
    torch.manual_seed(0)
    blocks = torch.tensor([4, 1, 5, 0])  # a request's blocks, out of order
    n = 3 * block_size + 5  # the last block part-filled
    keys, values = (torch.randn(n, HEADS, HEAD_SIZE).to(dtype) for _ in range(2))
    slots = blocks[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    theirs, key_cache, value_cache = vllm_cache(block_size, dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    got_keys, got_values = paged_layout.read_slots(theirs, blocks, n)
    assert torch.equal(got_keys, keys.transpose(0, 1)) and torch.equal(got_values, values.transpose(0, 1))
    ours, _, _ = vllm_cache(block_size, dtype)
    paged_layout.write_slots(ours, blocks, keys.transpose(0, 1), values.transpose(0, 1))
    assert torch.equal(ours[blocks], theirs[blocks])  # every byte of the request's blocks, the unused tail zero
