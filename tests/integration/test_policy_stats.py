"""`patch(model, policy="triattention")`: the statistics file it reads (the model's own from `vasepatch
calibrate`, or `policy_options["stats"]`), checked against the model before anything is patched. The vLLM
plugin's side: `tests/vllm/test_plugin_stats.py`."""

from __future__ import annotations

import warnings

import pytest
import torch

import vasepatch
from tests.tiny_models import VOCAB, tiny_model
from vasepatch.integration import calibration
from vasepatch.policies import query_stats

GEN = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _ids(n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids):
    return model.generate(ids, attention_mask=torch.ones_like(ids), **GEN)


def test_a_model_without_statistics_is_refused_with_the_command_and_left_as_it_was(cache_dir):
    model = tiny_model("llama")
    forward = model.model.layers[0].self_attn.forward
    with pytest.raises(ValueError, match=r"run `vasepatch calibrate .*` first, or pass policy_options"):
        vasepatch.patch(model, budget=16, window=4, policy="triattention")
    assert not vasepatch.is_patched(model) and model.model.layers[0].self_attn.forward == forward


def test_the_models_own_statistics_are_found_and_evict_as_the_same_file_given_by_hand(cache_dir):
    model = tiny_model("llama")
    path = calibration.calibrate(model, _ids())
    assert path == calibration.stats_path(model) and path.parent.parent == cache_dir
    prompt = _ids(12, seed=1)
    with vasepatch.patched(model, budget=16, window=4, policy="triattention") as handle:
        assert handle.config.policy_options == {"stats": str(path), "rotary_dtype": "float32"}
        found = _generate(model, prompt)
        assert handle.stats()["evictions"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is this model's: no warning
        with vasepatch.patched(model, budget=16, window=4, policy="triattention", policy_options={"stats": str(path)}):
            assert torch.equal(_generate(model, prompt), found)


def test_other_statistics_change_what_is_kept(cache_dir, tmp_path):
    """The scores follow the file: statistics of other query weights (a warning says so) keep other tokens."""
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    own, foreign = calibration.calibrate(model, _ids()), calibration.calibrate(other, _ids(), path=tmp_path / "o")
    prompt = _ids(12, seed=1)
    kept = []
    for path in (own, foreign):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with vasepatch.patched(
                model, budget=16, window=4, policy="triattention", policy_options={"stats": str(path)}
            ):
                cache = model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), return_dict_in_generate=True, **GEN
                ).past_key_values
                kept.append(cache.layers[1].positions.clone())
        assert any("other query weights" in str(w.message) for w in seen) == (path == foreign)
    assert not torch.equal(kept[0], kept[1])


def test_statistics_of_another_shape_or_rotary_are_refused_by_name(cache_dir, tmp_path):
    model = tiny_model("llama", kv_heads=2)
    path = calibration.calibrate(tiny_model("llama", kv_heads=1), _ids(), path=tmp_path / "one-kv-head")
    with pytest.raises(
        ValueError, match=r"policy_options\['stats'\]: .* has 2 rows \(layers x KV heads\), this model 4"
    ):
        vasepatch.patch(model, budget=16, window=4, policy="triattention", policy_options={"stats": str(path)})
    tensors = calibration.collect(model, _ids())
    tensors["inv_freq"] = tensors["inv_freq"] * 2
    moved = query_stats.save_stats(tmp_path / "moved", tensors, 2, {})
    with pytest.raises(ValueError, match="another rotary"):
        vasepatch.patch(model, budget=16, window=4, policy="triattention", policy_options={"stats": str(moved)})
    with pytest.raises(ValueError, match=r"policy_options\['stats'\]: no query statistics file at .*absent"):
        vasepatch.patch(model, budget=16, window=4, policy="triattention", policy_options={"stats": "absent"})
    assert not vasepatch.is_patched(model)


def test_a_rope_the_policy_cannot_invert_is_refused_at_patch(cache_dir):
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"triattention cannot calibrate .*dynamic"):
        vasepatch.patch(model, budget=16, window=4, policy="triattention")
    assert not vasepatch.is_patched(model)


def test_other_policies_read_no_statistics(cache_dir):
    model = tiny_model("llama")
    with vasepatch.patched(model, budget=16, window=4, policy="vase") as handle:
        assert handle.config.policy_options == {}
    assert not cache_dir.exists()


def test_a_cache_of_other_settings_on_a_patched_model_gets_the_models_statistics(cache_dir):
    """`handle.new_cache(config)` (what `vasepatch eval` runs each policy with) resolves the file as `patch`."""
    model = tiny_model("llama")
    path = calibration.calibrate(model, _ids())
    with vasepatch.patched(model, budget=16, window=4) as handle:
        cache = handle.new_cache(vasepatch.VaSEConfig(budget=16, window=4, policy="triattention"))
        assert cache.config.policy_options == {"stats": str(path), "rotary_dtype": "float32"}
        model(_ids(24, seed=2), **{handle.cache_keyword: cache})
        model(_ids(1, seed=3), **{handle.cache_keyword: cache})
        assert cache.layers[0].counters.evictions > 0


def test_a_model_cast_to_bfloat16_finds_its_float32_calibration_and_its_rounded_rotary(cache_dir, tmp_path):
    """`model.to(torch.bfloat16)` rounds the rotary's frequencies, and RoPE rotates by the rounded ones: the key is
    the same, and the policy un-rotates by the file's frequencies rounded alike. A file whose frequencies do not
    round to the model's is refused."""
    model = tiny_model("llama")
    path = calibration.calibrate(model, _ids())
    model = model.to(torch.bfloat16)
    assert calibration.rotary_dtype(model) == torch.bfloat16
    with vasepatch.patched(model, budget=16, window=4, policy="triattention") as handle:
        assert handle.config.policy_options == {"stats": str(path), "rotary_dtype": "bfloat16"}
        _generate(model, _ids(12, seed=1))
        assert handle.stats()["evictions"] > 0
    tensors = calibration.collect(tiny_model("llama"), _ids())
    tensors["inv_freq"] = tensors["inv_freq"] * (1 + 2**-6)
    off = query_stats.save_stats(tmp_path / "off", tensors, 2, {})
    with pytest.raises(ValueError, match="another rotary"):
        vasepatch.patch(model, budget=16, window=4, policy="triattention", policy_options={"stats": str(off)})
