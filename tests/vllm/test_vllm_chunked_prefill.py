"""A prompt longer than the budget, prefilled in chunks (vLLM's chunked prefill, 64 tokens a step), is kept
whole until its last chunk, then compressed: the same tokens as vasepatch's transformers cache, which
prefills it in one step, including with a last chunk shorter than the window."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams

from tests.vllm.engines import engine, worker_state
from tests.vllm.test_vllm_eviction import BUDGET, NEW, WINDOW, evicting, transformers_tokens, vllm_tokens


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("policy", "window"), [("vase", WINDOW), ("snapkv", WINDOW), ("vase", 64)], ids=["vase", "snapkv", "vase-window-64"]
)
def test_chunked_prompts_evict_as_one_prefill_does(smollm2_path, prompt, policy, window):
    """Window 64: the prompt's last chunk (626 - 9 x 64 = 50 tokens) is shorter than the window, so the queries
    that score its compression come from two chunks."""
    want = transformers_tokens(smollm2_path, prompt, budget=BUDGET, window=window, policy=policy, seed=0)
    asks = {**evicting(policy), "vasepatch_window": window}
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=asks)
    with engine(smollm2_path, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024) as llm:
        got = vllm_tokens(llm, [prompt], params)[0]
        assert llm.collective_rpc(worker_state)[0]["evictions"] >= 1 + (window < NEW)  # compression, decode
    assert len(prompt) > 4 * 64  # several chunks
    if window == 64:
        assert len(prompt) % 64 < window  # the last chunk is shorter than the window
    assert got == want
