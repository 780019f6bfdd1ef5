"""A prompt longer than the budget, prefilled in chunks (vLLM's chunked prefill, 64 tokens a step), is kept
whole until its last chunk, then compressed: the same tokens as vasepatch's transformers cache, which
prefills it in one step."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams

from tests.vllm.engines import engine, worker_state
from tests.vllm.test_vllm_eviction import BUDGET, NEW, WINDOW, evicting, transformers_tokens, vllm_tokens


@pytest.mark.timeout(900)
@pytest.mark.parametrize("policy", ["vase", "snapkv"])
def test_chunked_prompts_evict_as_one_prefill_does(smollm2_path, prompt, policy):
    want = transformers_tokens(smollm2_path, prompt, budget=BUDGET, window=WINDOW, policy=policy, seed=0)
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=evicting(policy))
    with engine(smollm2_path, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024) as llm:
        got = vllm_tokens(llm, [prompt], params)[0]
        assert llm.collective_rpc(worker_state)[0]["evictions"] >= 2
    assert len(prompt) > 4 * 64  # several chunks
    assert got == want
