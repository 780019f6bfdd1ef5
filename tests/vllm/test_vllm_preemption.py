"""A pool too small for every request: vLLM preempts running requests, evicting ones included, after they
have evicted; each is recomputed, its whole sequence compressed again as a prompt. Every request finishes
with all its tokens, every block comes back to the pool, and the worker keeps no state of a finished one."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.vllm.engines import engine, worker_state

POOL_BLOCKS, BLOCK = 40, 32  # 1,280 slots
BUDGET, WINDOW, NEW = 320, 32, 600  # an evicting request holds up to 11 blocks: 5 of them need 55


@pytest.mark.timeout(900)
def test_preempted_requests_start_over_and_every_block_comes_back(smollm2_path):
    prompts = [[1 + (5 * i + 3 * j) % 500 for j in range(64)] for i in range(6)]
    evicting = {"vasepatch_budget": BUDGET, "vasepatch_window": WINDOW, "vasepatch_policy": "vase"}
    params = [
        SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=None if i == 5 else evicting)
        for i in range(6)
    ]
    with engine(smollm2_path, num_gpu_blocks_override=POOL_BLOCKS, max_model_len=1024, disable_log_stats=False) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        state = llm.collective_rpc(worker_state)[0]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [NEW] * 6
    assert metrics["vllm:num_preemptions"] > 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    assert state["evictions"] >= 5 * ((64 + NEW - BUDGET) // WINDOW)  # every evicting request evicted, again and again
    assert state["requests"] == 0  # nothing kept of finished requests
