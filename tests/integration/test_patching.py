"""Patching is instance-level, validated up front, and fully reversible."""

from __future__ import annotations

import pytest
import torch
import transformers

import vasepatch
from tests.conftest import ragged_batch
from tests.tiny_models import VOCAB, tiny_config


def fingerprint(model: torch.nn.Module) -> dict:
    """Everything a patch could change: instance attributes of every module, config identity."""
    return {
        name: (sorted(module.__dict__), id(module.__dict__.get("config")), module.__dict__.get("forward"))
        for name, module in model.named_modules()
    } | {"__model__": sorted(model.__dict__), "attn": model.config._attn_implementation}


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


BAD_SETTINGS = [
    (dict(budget=0), "budget"),
    (dict(budget=-5), "budget"),
    (dict(budget=12.5), "budget"),
    (dict(budget=True), "budget"),
    (dict(budget=None), "budget"),
    (dict(budget=128, window=0), "window"),
    (dict(budget=128, window=2.0), "window"),
    (dict(budget=64, window=64), "window"),
    (dict(budget=64, window=100), "window"),
    (dict(budget=128, sinks=-1), "sinks"),
    (dict(budget=64, window=8, sinks=10, protect=4), "protect"),
    (dict(budget=64, window=8, protect=57), "protect"),
    (dict(budget=64, window=8, protect=-1), "protect"),
    (dict(budget=8, window=4, sinks=4), "protect"),  # budget // 4 = 2 < sinks
    (dict(budget=128, temperature=0), "temperature"),
    (dict(budget=128, temperature=-1.0), "temperature"),
    (dict(budget=128, temperature=float("nan")), "temperature"),
    (dict(budget=128, smooth=0), "smooth"),
    (dict(budget=128, policy="nope"), "policy"),
    (dict(budget=128, seed="x"), "seed"),
    (dict(budget=128, attn_backend="flash"), "attn_backend"),
    (dict(budget=128, attn_backend="flash_attn"), "attn_backend"),  # not available on this machine
]


@pytest.mark.parametrize(("settings", "param"), BAD_SETTINGS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_SETTINGS)])
def test_bad_settings_raise_before_any_change(make_model, settings, param):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    before, out_before = fingerprint(model), logits(model, ids, mask)
    with pytest.raises(ValueError, match=param) as info:
        vasepatch.patch(model, **settings)
    message = str(info.value)
    if settings.get(param) is not None:
        assert repr(settings[param]) in message or str(settings[param]) in message, message
    assert fingerprint(model) == before
    assert not vasepatch.is_patched(model)
    assert torch.equal(logits(model, ids, mask), out_before)


def test_unknown_policy_message_lists_registered(make_model):
    with pytest.raises(ValueError, match=r"registered policies: .*vase"):
        vasepatch.patch(make_model("llama"), budget=128, policy="nope")


def test_range_is_named_in_messages():
    with pytest.raises(ValueError, match=r"allowed range \[4, 56\]"):
        vasepatch.VaSEConfig(budget=64, window=8, protect=60)
    with pytest.raises(ValueError, match=r"1 <= window <= budget - max\(sinks, 1\) = 60"):
        vasepatch.VaSEConfig(budget=64, window=64)
    vasepatch.VaSEConfig(budget=64, window=60, protect=4)  # the bound itself is accepted
    with pytest.raises(ValueError, match=r"budget=8 leaves no room for a window besides sinks=8; raise budget"):
        vasepatch.VaSEConfig(budget=8, sinks=8)


def test_config_object_and_keywords_do_not_mix(make_model):
    model = make_model("llama")
    cfg = vasepatch.VaSEConfig(budget=64, window=8)
    with pytest.raises(ValueError, match="either in config or as keywords"):
        vasepatch.patch(model, config=cfg, window=16)
    handle = vasepatch.patch(model, config=cfg)
    assert handle.config is cfg
    handle.remove()


def test_double_patch_raises_and_says_unpatch(make_model):
    model = make_model("llama")
    vasepatch.patch(model, budget=64, window=8)
    state = fingerprint(model)
    with pytest.raises(vasepatch.AlreadyPatchedError, match="unpatch"):
        vasepatch.patch(model, budget=32, window=8)
    assert fingerprint(model) == state
    vasepatch.unpatch(model)
    with pytest.raises(vasepatch.NotPatchedError):
        vasepatch.unpatch(model)


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    return transformers.BertForMaskedLM(cfg).eval()


def test_unsupported_models_raise_before_any_change():
    """Which architectures are supported is `tests/integration/test_detection.py`'s matter; here: a refusal
    is a `ValueError` naming the model type, raised before the model changes."""
    model = _bert()
    before = fingerprint(model)
    with pytest.raises(vasepatch.UnsupportedModelError) as info:
        vasepatch.patch(model, budget=64, window=8)
    assert isinstance(info.value, ValueError)
    assert "bert" in str(info.value)
    assert fingerprint(model) == before


def test_patch_is_instance_level(make_model):
    patched_model, other = make_model("qwen3"), make_model("qwen3")
    ids, mask = ragged_batch(VOCAB)
    other_before = fingerprint(other)
    ref = logits(other, ids, mask)
    with vasepatch.patched(patched_model, budget=16, window=4):
        assert type(patched_model).forward is type(other).forward
        assert fingerprint(other) == other_before
        assert other.config._attn_implementation == "sdpa"
        assert torch.equal(logits(other, ids, mask), ref)
        out = other.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + 30


def test_shared_config_object_is_not_mutated():
    """Two models built from one config object: patching one leaves the other (and the config) alone."""
    cfg = tiny_config("llama")
    a = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    b = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    b.load_state_dict(a.state_dict())
    ids, mask = ragged_batch(VOCAB)
    ref = logits(b, ids, mask)
    with vasepatch.patched(a, budget=16, window=4):
        assert a.config._attn_implementation == b.config._attn_implementation == "sdpa"
        assert b.model.layers[0].self_attn.config._attn_implementation == "sdpa"
        assert torch.equal(logits(b, ids, mask), ref)


def test_unpatch_restores_bit_identical_outputs(make_model):
    model = make_model("mistral")
    ids, mask = ragged_batch(VOCAB)
    before, ref = fingerprint(model), logits(model, ids, mask)
    ref_gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    handle = vasepatch.patch(model, budget=16, window=4)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert handle.stats()["evictions"] > 0
    handle.remove()
    assert fingerprint(model) == before
    assert torch.equal(logits(model, ids, mask), ref)
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, ref_gen)


def test_context_manager_restores_on_error(make_model):
    model = make_model("qwen2")
    before = fingerprint(model)
    with pytest.raises(KeyError), vasepatch.patched(model, budget=32, window=8) as handle:
        assert vasepatch.is_patched(model) and handle.active
        raise KeyError("boom")
    assert not vasepatch.is_patched(model)
    assert fingerprint(model) == before


def test_handle_is_a_context_manager_too(make_model):
    model = make_model("llama")
    with vasepatch.patch(model, budget=32, window=8) as handle:
        assert handle.active
    assert not handle.active and not vasepatch.is_patched(model)


def test_user_cache_and_cache_implementation_are_respected(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4) as handle:
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
            **{handle.cache_keyword: transformers.DynamicCache(config=model.config)},
        )  # fmt: skip
        assert handle.stats()["generations"] == 0
        own = handle.new_cache()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=30,
            do_sample=False,
            pad_token_id=0,
            **{handle.cache_keyword: own},
        )
        assert own.stats()["evictions"] > 0


def test_new_cache_with_another_config(make_model):
    model = make_model("llama")
    with vasepatch.patched(model, budget=32, window=8) as handle:
        other = handle.new_cache(vasepatch.VaSEConfig(budget=16, window=4, policy="snapkv"))
        assert other.layers[0].policy.name == "snapkv" and other.layers[0].config.policy == "snapkv"
        assert handle.new_cache(vasepatch.VaSEConfig(budget=16, window=4, policy="full")).layers[0].policy is None
        assert other.layers[0].config.budget == 16
        assert handle.stats()["generations"] == 0  # caches of other configs are not tracked
        with pytest.raises(ValueError, match="VaSEConfig"):
            handle.new_cache({"budget": 16})


def test_stats_on_one_process_say_world_size_one(make_model):
    model = make_model("llama", kv_heads=2)
    ids, mask = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4) as handle:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
        stats = handle.stats()
        assert [p.head_offset for p in handle.layout.layer_plans()] == [0, 0]
    # K+V x 2 layers x 3 rows x 2 KV heads x capacity x head_dim 16 x fp32
    assert stats["kv_bytes"] == 2 * 2 * 3 * 2 * stats["capacity"] * 16 * 4
    assert (stats["world_size"], stats["rank"], stats["kv_bytes_total"]) == (1, 0, stats["kv_bytes"])


def test_memory_check_counts_the_heads_this_process_holds(make_model, monkeypatch):
    """A tensor-parallel rank holds `1/world` of the KV heads: a budget whose buffers fit only
    as a shard passes for the shard and is refused (naming budget) for the whole model."""
    from vasepatch.config import VaSEConfig
    from vasepatch.integration import patching
    from vasepatch.integration.distributed import Sharding, sharding
    from vasepatch.integration.families import inspect_model

    model = make_model("llama", kv_heads=2)
    layout = inspect_model(model)
    config = VaSEConfig(budget=1000, window=24)
    whole = 1024 * 2 * 2 * 2 * 16 * 4  # slots x K+V x layers x KV heads x head_dim x fp32
    monkeypatch.setattr(patching.os, "sysconf", lambda name: 1 if name == "SC_PAGE_SIZE" else whole * 3 // 4)
    cpu = [torch.device("cpu")] * 2
    patching._check_fits(model, layout, config, Sharding(2, 1, 1, 2), cpu)  # half of it: fits
    with pytest.raises(ValueError, match="budget=1000"):
        patching._check_fits(model, layout, config, sharding(model, layout), cpu)
