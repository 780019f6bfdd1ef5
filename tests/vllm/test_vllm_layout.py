"""The plugin's reading of vLLM's CPU paged cache (`paged_layout`) against vLLM's own cache-writing kernel, for
every layout it accepts (`vec`, `vec16` in float32 and bfloat16; `amx`, bfloat16 only, as vLLM picks it on
CPUs with AMX): the kernel the CPU attention backend calls to store each step's keys and values, the one it
attends with, and, at the end, one engine in bfloat16."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

import torch
from vllm import SamplingParams
from vllm import _custom_ops as ops

from vasepatch.vllm import paged_layout

HEADS, HEAD_SIZE, BLOCKS = 3, 64, 6


def vllm_cache(block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's cache as the backend allocates it, and its key and value halves as its `forward` views them."""
    cache = torch.zeros(BLOCKS, HEADS, block_size, 2 * HEAD_SIZE, dtype=dtype)
    key_cache, value_cache = cache.view(BLOCKS, HEADS, block_size * 2, HEAD_SIZE).chunk(2, dim=2)
    return cache, key_cache, value_cache


LAYOUTS = [
    *[(isa, bs, dtype) for isa, bs in [("vec", 32), ("vec16", 16)] for dtype in (torch.float32, torch.bfloat16)],
    ("amx", 32, torch.bfloat16),
    ("amx", 64, torch.bfloat16),
]


def skip_amx_without_tiles(isa: str) -> None:
    """vLLM's `amx` kernels need AMX tiles (vLLM picks that layout only where the CPU has them): skip elsewhere.
    `_init_amx` asks for the process's permission to use them (a worker's first bfloat16 matmul does);
    False where there are none."""
    if isa == "amx" and not torch.cpu._init_amx():
        pytest.skip("this CPU has no AMX tiles")


@pytest.mark.parametrize(("isa", "block_size", "dtype"), LAYOUTS, ids=lambda v: str(v).replace("torch.", ""))
def test_read_slots_reads_what_vllms_kernel_wrote_and_write_slots_writes_as_it_does(isa, block_size, dtype):
    skip_amx_without_tiles(isa)
    torch.manual_seed(0)
    blocks = torch.tensor([4, 1, 5, 0])  # a request's blocks, out of order
    n = 3 * block_size + 5  # the last block part-filled
    keys, values = (torch.randn(n, HEADS, HEAD_SIZE).to(dtype) for _ in range(2))
    slots = blocks[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
    theirs, key_cache, value_cache = vllm_cache(block_size, dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    got_keys, got_values = paged_layout.read_slots(theirs, blocks, n, isa)
    assert torch.equal(got_keys, keys.transpose(0, 1)) and torch.equal(got_values, values.transpose(0, 1))
    ours, _, _ = vllm_cache(block_size, dtype)
    paged_layout.write_slots(ours, blocks, keys.transpose(0, 1), values.transpose(0, 1), isa)
    assert torch.equal(ours[blocks], theirs[blocks])  # every byte of the request's blocks, the unused tail zero


@pytest.mark.parametrize(("isa", "block_size", "dtype"), LAYOUTS, ids=lambda v: str(v).replace("torch.", ""))
def test_vllms_attention_reads_the_slots_write_slots_left(isa, block_size, dtype):
    """What compaction does to a request: its kept slots written back in a new order (`write_slots`), then
    vLLM's own decode attention over them gives attention over those keys and values."""
    skip_amx_without_tiles(isa)
    torch.manual_seed(1)
    blocks = torch.tensor([2, 5, 0])
    n, kept = 3 * block_size - 7, 2 * block_size + 3
    keys, values = (torch.randn(HEADS, n, HEAD_SIZE).to(dtype) for _ in range(2))
    order = torch.randperm(n)[:kept]
    cache, key_cache, value_cache = vllm_cache(block_size, dtype)
    paged_layout.write_slots(cache, blocks, keys[:, order], values[:, order], isa)
    query = torch.randn(1, 2 * HEADS, HEAD_SIZE).to(dtype)  # two query heads per KV head
    starts, lengths = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([kept], dtype=torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=2 * HEADS, num_kv_heads=HEADS, head_dim=HEAD_SIZE, seq_lens=lengths, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=lengths, scale=HEAD_SIZE**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=blocks[None].to(torch.int32), softcap=0.0, scheduler_metadata=schedule, s_aux=None,
    )  # fmt: skip
    want = torch.nn.functional.scaled_dot_product_attention(
        query.float().transpose(0, 1), *(t[:, order].float().repeat_interleave(2, 0) for t in (keys, values))
    ).transpose(0, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.timeout(600)
def test_a_bfloat16_engine_evicts_in_its_cpu_layout_with_float32s_tokens(smollm2_path, prompt):
    """bfloat16 KV blocks take the `amx` layout on a CPU with AMX tiles (`vec` elsewhere): the plugin compacts
    them in that layout (byte for byte against vLLM's kernels: test_vllm_layout.py). End to end, a `vase`
    request evicts, repeats its tokens when run again, and gives the tokens of vasepatch's float32 cache
    (measured: the same 60 tokens, a loop of "The answer is:" that the full cache does not fall into)."""
    from tests.vllm.engines import engine, worker_state
    from tests.vllm.test_vllm_eviction import BUDGET, NEW, WINDOW, evicting, transformers_tokens, vllm_tokens

    want = transformers_tokens(smollm2_path, prompt, budget=BUDGET, window=WINDOW, policy="vase", seed=0)
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=evicting("vase"))
    with engine(smollm2_path, dtype="bfloat16", max_num_batched_tokens=8192) as llm:
        before = llm.collective_rpc(worker_state)[0]["evictions"]
        first, again = (vllm_tokens(llm, [prompt], params)[0] for _ in range(2))
        evictions = llm.collective_rpc(worker_state)[0]["evictions"] - before
        full = vllm_tokens(llm, [prompt], SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0))[0]
    assert evictions >= 4  # each run: the prompt compressed, then at least one decode eviction
    assert first == again  # the compaction in this layout is deterministic
    assert full != first  # the evictions changed the text
    if torch.cpu._init_amx():  # the amx layout: measured equal to float32's tokens on a CPU with AMX tiles; the
        assert first == want  # vec layout's bfloat16 tokens part from them at token 9 on an AMD EPYC without AMX
