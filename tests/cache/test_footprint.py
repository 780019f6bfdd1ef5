"""The serving arithmetic (`vasepatch.cache.footprint`): KV bytes per token, blocks, pools, held slots."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from vasepatch.cache import footprint
from vasepatch.config import VaSEConfig

# SmolLM2-135M's attention: 30 layers, 9 query heads of 64 (hidden 576), 3 KV heads
SMOLLM2 = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}


def test_bytes_per_token_from_a_config_object_or_its_json_dict():
    assert footprint.kv_bytes_per_token(30, 3, 64, 4) == 2 * 30 * 3 * 64 * 4 == 46080
    assert footprint.model_kv_shape(SMOLLM2) == (30, 3, 64)
    assert footprint.model_kv_shape(LlamaConfig(**SMOLLM2)) == (30, 3, 64)
    assert footprint.model_bytes_per_token({"text_config": SMOLLM2}, 2) == 23040
    mha = {**SMOLLM2, "head_dim": 80}
    del mha["num_key_value_heads"]
    assert footprint.model_kv_shape(mha) == (30, 9, 80)  # no KV heads: one per query head; head_dim wins


def test_dtype_bytes_names_the_parameter_and_the_choices():
    assert [footprint.dtype_bytes(d) for d in ("float32", "float", "bfloat16", "float16")] == [4, 4, 2, 2]
    with pytest.raises(ValueError, match=r"dtype must be one of .*got 'auto'"):
        footprint.dtype_bytes("auto")


def test_blocks_and_pools_round_up_and_count_the_null_block():
    assert [footprint.blocks(n, 32) for n in (0, 1, 32, 33, 64)] == [0, 1, 1, 2, 2]
    assert footprint.block_bytes(160, 32, 10) == 160 * 10 and footprint.block_bytes(161, 32, 10) == 192 * 10
    assert footprint.pool_blocks(4, 12 + 100, 32) == 4 * 4 + 1  # 112 tokens: 4 blocks of 32, and the null block
    assert footprint.pool_blocks(2, 128 + 256, 32) == 2 * 12 + 1


def test_held_slots_bound_between_steps():
    config = VaSEConfig(budget=128, window=32, seed=0)
    assert footprint.held_slots(config.replace(policy="full"), 100, 400) == 500
    assert footprint.held_slots(config, 100, 400) == 160 and footprint.held_slots(config, 20, 30) == 50
    assert footprint.held_slots(config.replace(prefill="pin"), 100, 400) == 260
    assert footprint.held_at_most(100, config) == 260 and footprint.held_at_most(0, config, chunk=64) == 224


def test_held_at_end_of_a_short_answer():
    config = VaSEConfig(budget=128, window=32, seed=0)
    assert footprint.held_at_end(None, 1000, 10) == 1009  # the full cache: every token but the last sampled
    assert footprint.held_at_end(config, 1000, 10) == 128 + 9  # the prompt compressed to the budget
    assert footprint.held_at_end(config, 50, 1) == 50 and footprint.held_at_end(config, 50, 0) == 50
    assert footprint.held_at_end(config.replace(prefill="pin"), 1000, 10) == 1009
