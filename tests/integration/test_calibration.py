"""The triattention calibration on tiny random models: the rotary frequencies it reads, the RoPEs it refuses,
the statistics checked against an independent computation, the model key, and the file it writes."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tests.tiny_models import COMMON, VOCAB, tiny_model
from vasepatch.integration import calibration
from vasepatch.policies import rope
from vasepatch.policies.query_stats import load_stats, read_metadata

T = 24


def _ids(n: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _family(name: str, **settings) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIG_MAPPING[name](**{**COMMON, **settings})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def test_rotary_of_reads_the_scaled_frequencies_per_layer():
    inv_freq, scaling = calibration.rotary_of(tiny_model("llama"))
    assert inv_freq.shape == (2, 8) and inv_freq.dtype == torch.float32
    assert torch.allclose(inv_freq, _default_inv_freq(10000.0, 16).expand(2, 8)) and scaling.tolist() == [1.0, 1.0]
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    inv_linear, _ = calibration.rotary_of(tiny_model("llama", rope_parameters=linear))
    assert torch.allclose(inv_linear, inv_freq / 4)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256}
    inv_yarn, scale_yarn = calibration.rotary_of(tiny_model("llama", rope_parameters=yarn))
    assert torch.allclose(scale_yarn, torch.full((2,), 0.1 * math.log(4.0) + 1.0))
    assert not torch.allclose(inv_yarn, inv_freq) and torch.allclose(inv_yarn[:, 0], inv_freq[:, 0])
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    model = tiny_model("llama", rope_parameters=llama3)
    assert torch.equal(calibration.rotary_of(model)[0][1], model.model.rotary_emb.inv_freq)


def test_gemma3_takes_each_layer_types_rotary():
    model = _family("gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    inv_freq, scaling = calibration.rotary_of(model)
    assert torch.allclose(inv_freq[0], _default_inv_freq(10000.0, 16))  # local
    assert torch.allclose(inv_freq[1], _default_inv_freq(1_000_000.0, 16))  # global
    assert scaling.tolist() == [1.0, 1.0]


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 5000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}  # fmt: skip


@pytest.mark.parametrize("kind", ROPES)
def test_the_config_alone_gives_the_rotary_the_model_rotates_by(kind):
    """`rope.config_rotary` (what the vLLM plugin checks a statistics file against, with no transformers model)
    equals the frequencies and scaling read from the model's own rotary module, for every rope type it inverts,
    and Gemma 3's per-layer-type rotaries."""
    model = tiny_model("llama", rope_parameters=ROPES[kind])
    inv_freq, scaling = rope.config_rotary(model.config)
    want_freq, want_scaling = calibration.rotary_of(model)
    assert torch.equal(inv_freq, want_freq) and torch.equal(scaling, want_scaling)
    gemma = _family("gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    pairs = zip(rope.config_rotary(gemma.config), calibration.rotary_of(gemma), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


REFUSED = [
    ("gpt2", {}, "no rotary position embedding"),
    ("bloom", {}, "no rotary position embedding"),
    ("gptj", {"n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 8}, "interleaved"),
    ("codegen", {"n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 8}, "interleaved"),
    ("cohere", {}, "interleaved"),
    ("phi", {}, "partial"),
    ("stablelm", {}, "partial"),
    ("glm", {"head_dim": 16}, "partial"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "'dynamic'"),
    ("smollm3", {"use_sliding_window": False, "no_rope_layers": [1, 0]}, r"layers \[1\] have no RoPE"),
]


@pytest.mark.parametrize(("name", "settings", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_an_rope_it_cannot_invert_is_refused_by_name(name, settings, reason):
    model = _family(name, **settings)
    with pytest.raises(ValueError, match=f"triattention cannot calibrate .*{reason}"):
        calibration.rotary_of(model)
    with pytest.raises(ValueError, match="triattention"):
        calibration.collect(model, _ids())
    if reason != "interleaved" or name != "cohere":  # Cohere's pairing shows only in its modeling code
        with pytest.raises(ValueError, match=reason):
            calibration.check_rope(model.config)  # from the config alone, before any weight loads


def _reference(model: torch.nn.Module, ids: torch.Tensor, chunk: int, query) -> dict[str, torch.Tensor]:
    """The statistics computed another way: each attention's input captured, its query recomputed by
    `query(attn, hidden)` `[T, Hq, D]`, paired as complex numbers `q[:F] + i q[F:]`, averaged over all tokens."""
    inputs: dict[int, list[torch.Tensor]] = {}
    layers = model.model.layers
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: inputs.setdefault(i, []).append(kw["hidden_states"][0]), with_kwargs=True
        )
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            model(ids[:, start : start + chunk], use_cache=False)
    for h in hooks:
        h.remove()
    means, magnitudes = [], []
    for i, layer in enumerate(layers):
        with torch.no_grad():
            q = query(layer.self_attn, torch.cat(inputs[i]))  # [T, Hq, D]
        pairs = torch.complex(*q.unflatten(-1, (2, -1)).unbind(-2))  # [T, Hq, F]
        means.append(torch.view_as_real(pairs.mean(0)))
        magnitudes.append(pairs.abs().mean(0))
    return {"q_mean": torch.stack(means), "q_abs": torch.stack(magnitudes)}


def _q_proj(attn, hidden):
    return attn.q_proj(hidden).unflatten(-1, (-1, attn.head_dim))


@pytest.mark.parametrize("chunk", [T, 7])
def test_statistics_match_an_independent_computation(chunk):
    model = tiny_model("qwen2")  # q_proj has a bias
    seen = []
    stats = calibration.collect(model, _ids(), chunk=chunk, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(min(t + chunk, T), T) for t in range(0, T, chunk)]  # one report per window read
    expected = _reference(model, _ids(), chunk, _q_proj)
    assert stats["q_mean"].shape == (2, 4, 8, 2) and stats["q_abs"].shape == (2, 4, 8)
    for name in ("q_mean", "q_abs"):
        assert stats[name].dtype == torch.float32
        torch.testing.assert_close(stats[name], expected[name], rtol=1e-5, atol=1e-6)
    whole = calibration.collect(model, _ids(), chunk=T)
    assert chunk == T or not torch.allclose(whole["q_mean"], stats["q_mean"])  # windows change the context


def test_the_query_is_read_after_q_norm_where_there_is_one():
    model = tiny_model("qwen3")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
    stats = calibration.collect(model, _ids())
    after_norm = _reference(model, _ids(), T, lambda attn, h: attn.q_norm(_q_proj(attn, h)))
    torch.testing.assert_close(stats["q_abs"], after_norm["q_abs"], rtol=1e-5, atol=1e-6)
    before_norm = _reference(model, _ids(), T, _q_proj)
    assert not torch.allclose(stats["q_abs"], before_norm["q_abs"], rtol=1e-3)


def test_a_fused_qkv_projection_gives_its_query_rows():
    model = _family("phi3")
    stats = calibration.collect(model, _ids())
    rows = model.config.num_attention_heads * model.model.layers[0].self_attn.head_dim

    def query(attn, hidden):
        return attn.qkv_proj(hidden)[..., :rows].unflatten(-1, (-1, attn.head_dim))

    torch.testing.assert_close(stats["q_mean"], _reference(model, _ids(), T, query)["q_mean"], rtol=1e-5, atol=1e-6)


def test_hooks_are_removed_even_when_the_forward_fails(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(model.model.layers[1].mlp, "forward", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        calibration.collect(model, _ids())
    assert all(not layer.self_attn.q_proj._forward_hooks for layer in model.model.layers)


@pytest.mark.parametrize(
    ("ids", "chunk", "message"),
    [
        (torch.zeros(1, 4), 8, "input_ids must be an integer torch.Tensor"),
        ([[1, 2]], 8, "input_ids must be an integer torch.Tensor"),
        (torch.zeros(2, 4, dtype=torch.long), 8, r"input_ids must have shape \[1, T\]"),
        (torch.zeros(1, 0, dtype=torch.long), 8, r"input_ids must have shape \[1, T\]"),
        (torch.full((1, 4), VOCAB), 8, r"input_ids must lie in \[0, 128\)"),
        (torch.zeros(1, 4, dtype=torch.long), 0, "chunk must be an int >= 1"),
        (torch.zeros(1, 4, dtype=torch.long), True, "chunk must be an int >= 1"),
    ],
)
def test_bad_input_is_refused_by_name(ids, chunk, message):
    with pytest.raises(ValueError, match=message):
        calibration.collect(tiny_model("llama"), ids, chunk=chunk)


KEY_IN_A_FRESH_PROCESS = """
import torch
torch.set_num_threads(1)
from tests.tiny_models import tiny_model
from vasepatch.integration.calibration import model_key
print(model_key(tiny_model("llama", attn="eager")))
"""


def test_model_key_is_stable_across_processes_and_follows_the_query_weights(tmp_path):
    model = tiny_model("llama")
    key = calibration.model_key(model)
    assert len(key) == 32 and int(key, 16) >= 0
    model.save_pretrained(tmp_path)  # fills in config.architectures
    assert calibration.model_key(transformers.AutoModelForCausalLM.from_pretrained(tmp_path)) == key
    assert calibration.model_key(model) == key
    assert calibration.model_key(model.to(torch.bfloat16)) == key  # the same weights, served in bfloat16
    done = subprocess.run([sys.executable, "-c", KEY_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == key  # another process, another attention implementation
    assert calibration.model_key(tiny_model("llama", seed=1)) != key
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] += 1e-2  # above bfloat16's step
    assert calibration.model_key(model) != key


def test_stats_path_is_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama")
    assert calibration.stats_path(model) == tmp_path / "triattention" / f"{calibration.model_key(model)}.safetensors"


def test_calibrate_writes_a_file_the_policy_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path))
    model = tiny_model("qwen3")
    path = calibration.calibrate(model, _ids(), metadata={"text_source": "random ids"})
    assert path == calibration.stats_path(model) and path.is_file()
    tensors = calibration.collect(model, _ids())
    stats = load_stats(path)
    assert stats.q_mean.shape == (2 * 2, 2, 8, 2)  # rows (layer, KV head), each with its 2 query heads
    torch.testing.assert_close(stats.q_mean[2:4], tensors["q_mean"][1].reshape(2, 2, 8, 2), rtol=0, atol=0)
    meta = read_metadata(path)
    assert meta["kv_heads"] == "2" and meta["model_key"] == calibration.model_key(model)
    assert meta["tokens"] == str(T) and meta["q_norm_applied"] == "true" and meta["text_source"] == "random ids"
    assert meta["transformers_version"] == transformers.__version__ and len(meta["text_sha256"]) == 64
    other = calibration.calibrate(tiny_model("llama"), _ids(), path=tmp_path / "x" / "llama.safetensors")
    assert other == tmp_path / "x" / "llama.safetensors" and read_metadata(other)["q_norm_applied"] == "false"
    with pytest.raises(ValueError, match="metadata must not set kv_heads"):
        calibration.calibrate(model, _ids(), metadata={"kv_heads": "3"})
    assert json.dumps(meta)  # every value a string
