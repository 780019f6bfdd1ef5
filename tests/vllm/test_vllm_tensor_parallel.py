"""Tensor parallelism inside vLLM: SmolLM2 (3 KV heads) on 3 ranks gives the tokens of 1 rank, with the full
cache and with VaSE evicting. Each rank evicts its own KV head, with the randomness of its global head.

vLLM's CPU build binds each rank's OpenMP threads to cores; this machine has 2 cores on one NUMA node, so
the ranks are bound by hand (`VLLM_CPU_OMP_THREADS_BIND="0|1|0"`), and each rank gets its own KV pool.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from tests.vllm.engines import greedy_in_subprocess

NEW = 40


def greedy(model: str, prompt: list[int], ranks: int) -> list[list[int]]:
    extra = [None, {"vasepatch_budget": 128, "vasepatch_window": 32, "vasepatch_policy": "vase", "vasepatch_seed": 1}]
    spec = {"model": model, "prompts": [prompt, prompt], "max_tokens": NEW, "extra_args": extra}
    spec["engine"] = {"tensor_parallel_size": ranks, "max_model_len": 1024}
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r % 2) for r in range(ranks))} if ranks > 1 else {}
    return greedy_in_subprocess(spec, bind, timeout=600)


@pytest.mark.timeout(1300)
def test_three_ranks_give_the_tokens_of_one(smollm2_path):
    from transformers import AutoTokenizer

    text = "The bakery opens at seven. Mara bakes rye, Tomas bakes croissants, and the oven runs hot by eight. " * 10
    prompt = AutoTokenizer.from_pretrained(smollm2_path)(text + "\nWho bakes rye? Answer:").input_ids
    one = greedy(smollm2_path, prompt, 1)
    three = greedy(smollm2_path, prompt, 3)
    assert one[0] != one[1]  # eviction changed the text: the second comparison is not vacuous
    assert three == one
