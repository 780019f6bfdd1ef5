"""A prompt longer than `budget + window`, prefilled in chunks (vLLM's chunked prefill, 64 tokens a step), is
compressed as its chunks come: between two chunks it holds at most `budget + window` slots. It keeps what
vasepatch's transformers cache keeps when transformers prefills the prompt in the same chunks
(`prefill_chunk_size`), including a last chunk shorter than the window.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams

from tests.vllm.engines import block_steps, engine, record_blocks, worker_state
from tests.vllm.test_vllm_eviction import BLOCK, BUDGET, NEW, WINDOW, evicting, transformers_tokens, vllm_tokens

CHUNK = 64  # vLLM's max_num_batched_tokens: one request alone is prefilled 64 tokens a step


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("policy", "window"), [("vase", WINDOW), ("snapkv", WINDOW), ("vase", 64)], ids=["vase", "snapkv", "vase-window-64"]
)
def test_a_chunked_prompt_is_compressed_as_its_chunks_come(smollm2_path, prompt, policy, window):
    """Window 64: the prompt's last chunk (626 - 9 x 64 = 50 tokens) is shorter than the window, so the queries
    that score the eviction after it come from two chunks."""
    want = transformers_tokens(
        smollm2_path, prompt, prefill_chunk_size=CHUNK, budget=BUDGET, window=window, policy=policy, seed=0
    )
    asks = {**evicting(policy), "vasepatch_window": window}
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=asks)
    with engine(smollm2_path, max_num_batched_tokens=CHUNK, max_num_seqs=4, max_model_len=1024) as llm:
        llm.collective_rpc(record_blocks)
        got = vllm_tokens(llm, [prompt], params)[0]
        held = [len(blocks) for step in llm.collective_rpc(block_steps)[0] for blocks in step.values()]
        evictions = llm.collective_rpc(worker_state)[0]["evictions"]
    chunks = -(-len(prompt) // CHUNK)
    assert chunks > 4 and len(prompt) > BUDGET + window  # several chunks, more than a request holds
    if window == 64:
        assert len(prompt) % CHUNK < window  # the last chunk is shorter than the window
    assert evictions >= chunks - 2  # the prompt's chunks after the first two, then the decode
    assert max(held) <= -(-(BUDGET + window + CHUNK) // BLOCK) < -(-len(prompt) // BLOCK)
    assert got == want
