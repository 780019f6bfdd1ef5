"""Seeded requests whose prefill vLLM chunks. vLLM 0.32 rewinds the generator of a request whose sampled
token it discards (a prefill chunk that is not the prompt's last) by an offset, which a CPU generator does
not have: without the plugin the engine dies ("CPU Generator does not use offset") as soon as the prompts of
one step pass `max_num_batched_tokens`. The plugin puts such a generator back as it was instead, so a seeded
request samples as if its prompt had been prefilled in one step."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.vllm.engines import engine, worker_state

REQUESTS, PROMPT, NEW = 48, 110, 24  # 48 x 110 = 5,280 prompt tokens: over the default 4,096 per step


@pytest.mark.timeout(600)
def test_48_seeded_requests_at_the_default_batch_size_sample_as_alone(smollm2_path, monkeypatch):
    # the engine core in this process: all 48 requests are queued before its first step, so that step's prompts
    # pass max_num_batched_tokens and one is chunked (from a process of its own, the core may start on fewer)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    prompts = [[1 + (7 * i + 11 * j) % 700 for j in range(PROMPT)] for i in range(REQUESTS)]
    params = [SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.8, seed=100 + i) for i in range(REQUESTS)]
    vase = {"budget": 64, "window": 16, "policy": "vase"}  # every request evicts: its prompt is over the budget
    with engine(smollm2_path, additional_config={"vasepatch": vase}) as llm:
        assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens < REQUESTS * PROMPT
        together = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in together] == [NEW] * REQUESTS
        state = llm.collective_rpc(worker_state)[0]
        assert state["evictions"] >= REQUESTS
        assert state["generators_restored"] >= 1  # a seeded prompt was chunked, its discarded sample undone
        for i in range(REQUESTS):  # alone, no prompt is chunked
            alone = llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], params[i], use_tqdm=False)
            assert list(alone[0].outputs[0].token_ids) == list(together[i].outputs[0].token_ids), i
