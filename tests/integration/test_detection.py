"""Detection by capability: which models `vasepatch.patch` accepts, why it refuses the others,
and each layer's sliding window (`ModelLayout.plans`), on tiny random models of many families.

Families that the installed transformers lacks (the oldest supported release, 5.0, has fewer)
are skipped with the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import vasepatch
from tests.attention_features import attention_features
from vasepatch.bench.shapes import TINY_CONFIG
from vasepatch.integration.families import REASONS, inspect_model

# the shared tiny settings with 4 layers (room for a layer pattern), 2 KV heads of 16, 256 positions and real
# BOS/EOS ids; whether the embeddings are tied is left to each family's config class
COMMON = {k: v for k, v in TINY_CONFIG.items() if k != "tie_word_embeddings"} | dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _config(model_type: str, **overrides):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    return CONFIG_MAPPING[model_type](**{**COMMON, **overrides})


def _causal_lm(model_type: str, attn: str | None = None, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(model_type, **overrides), attn_implementation=attn)
    return model.eval()


def fingerprint(model: torch.nn.Module) -> dict:
    """Everything a patch could change: instance attributes of every module, config identity, weights."""
    modules = {
        name: (sorted(module.__dict__), id(module.__dict__.get("config")), module.__dict__.get("forward"))
        for name, module in model.named_modules()
    }
    weights = {name: p.detach().clone() for name, p in model.state_dict().items()}
    return {"modules": modules, "attn": model.config._attn_implementation, "config": model.config.to_dict()} | {
        "weights": weights
    }


def _same(a: dict, b: dict) -> bool:
    return (
        a["modules"] == b["modules"]
        and a["attn"] == b["attn"]
        and a["config"] == b["config"]
        and a["weights"].keys() == b["weights"].keys()
        and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    )


# (id, model type, config overrides, expected sliding window per layer)
ACCEPTED = [
    ("llama", "llama", {}, [None] * 4),
    ("mistral-sliding", "mistral", dict(sliding_window=16), [16] * 4),
    ("mistral-global", "mistral", dict(sliding_window=None), [None] * 4),
    (
        "qwen2-sliding",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
        [None] * 2 + [16] * 2,
    ),
    ("qwen2-unused-window", "qwen2", dict(use_sliding_window=False, sliding_window=16), [None] * 4),
    ("qwen3", "qwen3", dict(use_sliding_window=False), [None] * 4),
    ("qwen3-sliding", "qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), [None] + [8] * 3),
    ("phi3", "phi3", dict(sliding_window=None), [None] * 4),
    ("phi3-sliding", "phi3", dict(sliding_window=12), [12] * 4),
    ("gemma2", "gemma2", dict(sliding_window=16), [16, None, 16, None]),
    ("gemma3_text", "gemma3_text", dict(sliding_window=16, num_hidden_layers=6), [16] * 5 + [None]),
    ("cohere2", "cohere2", dict(sliding_window=16), [16, 16, 16, None]),
    ("olmo2", "olmo2", {}, [None] * 4),
    ("mixtral", "mixtral", dict(MOE, sliding_window=None), [None] * 4),
    ("mixtral-sliding", "mixtral", dict(MOE, sliding_window=8), [8] * 4),
    ("qwen3_moe", "qwen3_moe", dict(MOE), [None] * 4),
    ("gpt_oss", "gpt_oss", dict(MOE, sliding_window=16), [16, None, 16, None]),
    ("granite", "granite", {}, [None] * 4),
    ("smollm3", "smollm3", {}, [None] * 4),
    (
        "explicit-layer-types",
        "qwen3",
        dict(use_sliding_window=True, sliding_window=32, layer_types=["full_attention", "sliding_attention"] * 2),
        [None, 32, None, 32],
    ),
]


@pytest.mark.parametrize(
    ("model_type", "overrides", "windows"), [a[1:] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED]
)
def test_accepted_families_and_their_layer_plans(model_type, overrides, windows):
    model = _causal_lm(model_type, **overrides)
    layout = inspect_model(model)
    layers = model.model.layers
    assert len(layout.attention_modules) == len(layers) == len(windows)
    assert list(layout.attention_modules) == [layer.self_attn for layer in layers]
    assert [plan.index for plan in layout.layer_plans()] == list(range(len(layers)))
    assert [plan.sliding_window for plan in layout.layer_plans()] == windows
    assert all(plan.head_offset == 0 for plan in layout.layer_plans())
    assert (layout.num_query_heads, layout.num_kv_heads, layout.head_dim) == (4, 2, 16)
    assert layout.model_type == model.config.model_type


def test_the_sliding_window_is_what_the_unpatched_mask_applies():
    """A query at position p sees exactly the keys at positions > p - w, w the plan's window."""
    model = _causal_lm("mistral", attn="eager", sliding_window=5, num_hidden_layers=1)
    window = inspect_model(model).layer_plans()[0].sliding_window
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_hook(
        lambda module, args, output: seen.append(output[1][0, 0] > 0), with_kwargs=False
    )
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(3, 15)[None], output_attentions=True)
    finally:
        hook.remove()
    visible = seen[0]
    for p in range(visible.shape[0]):
        assert visible[p].nonzero().flatten().tolist() == [k for k in range(p + 1) if k > p - window]


def test_head_counts_come_from_the_modules_as_held():
    """A tensor-parallel shard holds fewer heads than the config says; the layout counts what it holds."""
    model = _causal_lm("llama", num_attention_heads=8, num_key_value_heads=4)
    for attn in model.model.layers:
        attn = attn.self_attn
        attn.k_proj = torch.nn.Linear(64, 2 * 16, bias=False)  # half the KV heads, as one of two shards
    layout = inspect_model(model)
    assert (layout.num_query_heads, layout.num_kv_heads, layout.head_dim) == (4, 2, 16)


# (id, builder, model type in the message, reason kind, detail expected in the message)
def _t5():
    if "t5" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no T5")
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_ff=96, d_kv=16, num_layers=2, num_heads=4)
    return transformers.T5ForConditionalGeneration(cfg).eval()


def _gpt2_cross():
    return _causal_lm("gpt2", n_embd=64, n_layer=2, n_head=4, add_cross_attention=True)


def _deepseek_v3():
    return _causal_lm(
        "deepseek_v3",
        **MOE,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


def _qwen3_next():
    return _causal_lm(
        "qwen3_next",
        **MOE,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        shared_expert_intermediate_size=32,
    )


REJECTED = [
    ("deepseek_v3", _deepseek_v3, "deepseek_v3", "mla", "kv_lora_rank=16"),
    ("qwen3_next", _qwen3_next, "qwen3_next", "linear-attention", "'linear_attention'"),
    ("mamba", lambda: _causal_lm("mamba", state_size=8, expand=2), "mamba", "linear-attention", ""),
    ("t5", _t5, "t5", "encoder-decoder", "is_encoder_decoder"),
    (
        "bart",
        lambda: _causal_lm("bart", d_model=64, decoder_layers=2, decoder_attention_heads=4),
        "bart",
        "cross-attention",
        "encoder_attn",
    ),
    ("gpt2-cross-attention", _gpt2_cross, "gpt2", "cross-attention", ""),
    ("bloom", lambda: _causal_lm("bloom", n_layer=2, n_head=4), "bloom", "no-interface", "ALiBi"),
    (
        "mpt",
        lambda: _causal_lm("mpt", d_model=64, n_heads=4, n_layers=2, expansion_ratio=2),
        "mpt",
        "no-interface",
        "ALL_ATTENTION_FUNCTIONS",
    ),
    ("gpt_neox", lambda: _causal_lm("gpt_neox"), "gpt_neox", "no-kv-cache", "layer_past"),
    (
        "llama4-chunked",
        lambda: _causal_lm("llama4_text", **MOE, attention_chunk_size=8, max_position_embeddings=256),
        "llama4_text",
        "chunked",
        "8",
    ),
    (
        "bert",
        lambda: transformers.BertModel(transformers.BertConfig(**COMMON)).eval(),
        "bert",
        "not-generative",
        "BertModel",
    ),
]


@pytest.mark.parametrize(
    ("build", "model_type", "kind", "detail"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED]
)
def test_rejected_families_name_the_model_type_and_the_reason_and_stay_unchanged(build, model_type, kind, detail):
    model = build()
    before = fingerprint(model)
    with pytest.raises(vasepatch.UnsupportedModelError) as info:
        vasepatch.patch(model, budget=64, window=8)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message
    assert repr(model_type) in message
    assert REASONS[kind] in message
    assert detail in message
    assert _same(fingerprint(model), before)


def test_each_reason_has_its_own_message():
    assert len(set(REASONS.values())) == len(REASONS)


@pytest.mark.parametrize(
    ("model_type", "overrides", "expected"),
    [
        (
            "llama",
            dict(num_key_value_heads=4),
            dict(gqa=False, sliding=False, hybrid=False, sinks=False, softcap=False),
        ),
        ("mistral", dict(sliding_window=16), dict(gqa=True, sliding=True, hybrid=False, sinks=False, softcap=False)),
        (
            "gemma2",
            dict(sliding_window=16, attn_logit_softcapping=50.0),
            dict(gqa=True, sliding=True, hybrid=True, sinks=False, softcap=True),
        ),
        (
            "gemma3_text",
            dict(sliding_window=16, num_hidden_layers=6),
            dict(gqa=True, sliding=True, hybrid=True, sinks=False, softcap=False),
        ),
        ("gpt_oss", dict(MOE, sliding_window=16), dict(gqa=True, sliding=True, hybrid=True, sinks=True, softcap=False)),
    ],
    ids=["llama-mha", "mistral", "gemma2", "gemma3_text", "gpt_oss"],
)
def test_attention_features(model_type, overrides, expected):
    assert attention_features(_causal_lm(model_type, **overrides)) == expected


def test_gpt2_is_found_under_transformer_h_and_its_cache_alias_is_followed():
    model = _causal_lm("gpt2", n_embd=64, n_layer=2, n_head=4)
    layout = inspect_model(model)
    assert list(layout.attention_modules) == [block.attn for block in model.transformer.h]
    assert layout.base_model is model.transformer
    assert (layout.num_query_heads, layout.num_kv_heads, layout.head_dim) == (4, 4, 16)


class _OwnKernelAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """A Llama attention that updates the cache but computes attention itself."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2)), None


class _NoCacheAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """A Llama attention that dispatches through the interface but never stores keys and values."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = interface(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        return self.o_proj(out.flatten(2)), None


def _swap_attention(model, cls, layer=1):
    old = model.model.layers[layer].self_attn
    new = cls(model.config, layer_idx=layer)
    new.load_state_dict(old.state_dict())
    model.model.layers[layer].self_attn = new


def _own_config(model, layer=1):
    model.model.layers[layer].self_attn.config = copy.copy(model.config)


@pytest.mark.parametrize(
    ("change", "kind", "detail"),
    [
        (lambda m: _swap_attention(m, _OwnKernelAttention), "no-interface", "_OwnKernelAttention.forward computes"),
        (lambda m: _swap_attention(m, _NoCacheAttention), "no-kv-cache", "never calls past_key_values.update"),
        (_own_config, "layout", "does not share the decoder stack's config"),
        (lambda m: setattr(m.model.layers[1].self_attn, "layer_idx", 0), "layout", "layer_idx=0"),
    ],
    ids=["own-kernel", "no-cache-update", "own-config", "layer-idx"],
)
def test_a_llama_is_judged_by_its_modules_not_by_its_model_type(change, kind, detail):
    model = _causal_lm("llama")
    change(model)
    before = fingerprint(model)
    with pytest.raises(vasepatch.UnsupportedModelError) as info:
        vasepatch.patch(model, budget=64, window=8)
    assert "'llama'" in str(info.value) and REASONS[kind] in str(info.value) and detail in str(info.value)
    assert _same(fingerprint(model), before)
