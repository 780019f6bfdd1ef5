"""With nothing evicted, vLLM with the plugin gives vLLM's own greedy tokens, on two model families.

Each side runs in a fresh process (`run_greedy.py`): vLLM without the plugin (`VLLM_PLUGINS=none`) and
vLLM with it, the engine's settings asking for eviction (`additional_config["vasepatch"]`) with a
budget larger than every sequence, so that every patched function runs (query rings, physical
lengths, the scheduler's plan) and none evicts.

Both run the engine core in the test's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so that every prompt is
queued before the first step and the steps batch the same rows on both sides. With a separate engine-core
process the first step takes the requests that have arrived by then, and in bfloat16 on a CPU with AMX vLLM's
own logits depend on the rows batched together: measured on SmolLM2 at 48 tokens, two runs of vLLM without
the plugin gave different tokens in 2 of 4 tries (a logprob 0.04 apart at step 14), and none of 5 in-process.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from tests.vllm.engines import greedy_in_subprocess

PROMPTS = [[1 + (7 * i + 3 * j) % 400 for j in range(n)] for i, n in enumerate((37, 5, 120, 64))]
NEW_TOKENS = 48


def greedy(model: str, plugin: bool, engine: dict) -> list[list[int]]:
    spec = {"model": model, "prompts": PROMPTS, "max_tokens": NEW_TOKENS, "engine": engine}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **({} if plugin else {"VLLM_PLUGINS": "none"})}
    return greedy_in_subprocess(spec, env, timeout=420)


def check_parity(model: str, engine: dict) -> None:
    budget = {"vasepatch": {"budget": 4000, "window": 64, "policy": "vase"}}  # > 120 + 48 tokens
    reference = greedy(model, plugin=False, engine=engine)
    patched = greedy(model, plugin=True, engine={**engine, "additional_config": budget})
    assert [len(t) for t in reference] == [NEW_TOKENS] * len(PROMPTS)
    assert patched == reference


@pytest.mark.timeout(900)
def test_smollm2_greedy_tokens_equal_vllm_without_the_plugin(smollm2_path):
    check_parity(smollm2_path, {})


@pytest.mark.timeout(900)
def test_smollm2_in_bfloat16_greedy_tokens_equal_vllm_without_the_plugin(smollm2_path):
    """bfloat16 caches: the `amx` layout on a CPU with AMX tiles, `vec` elsewhere (test_vllm_layout.py)."""
    check_parity(smollm2_path, {"dtype": "bfloat16"})


@pytest.mark.timeout(900)
def test_a_qwen3_model_greedy_tokens_equal_vllm_without_the_plugin(tmp_path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    for p in model.parameters():  # larger weights than the default init: logits far from uniform, few argmax ties
        p.data.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    check_parity(str(tmp_path), {"skip_tokenizer_init": True})
