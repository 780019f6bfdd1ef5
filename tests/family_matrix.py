"""The family matrix: one tiny random config per decoder family that vasepatch patches, and the families
detection rejects.

Every config is built with the family's own transformers config class (`CONFIG_MAPPING[model_type]`) from the
shared tiny settings (`tests.tiny_models.COMMON`, which is `vasepatch.bench.shapes.TINY_CONFIG`: 2 layers,
hidden 64, 4 query heads, 2 KV heads where the family has grouped-query attention, vocab 128) plus the
family's own settings: a small `head_dim` where the family's default is large, 4 experts / top-2 for
mixture-of-experts, and a sliding window of `WINDOW` tokens (shorter than the test sequences) where the
family slides.

`tests/integration/test_family_matrix.py` runs parity and eviction over `FAMILIES`; `docs/gen_models.py`
renders the supported-models page from it, with the attention features that detection reports (`features`
below is what a family is expected to have: the tests check detection against it).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import transformers
from packaging.version import Version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from tests.attention_features import FEATURES  # gqa, sliding, hybrid, sinks, softcap
from tests.tiny_models import COMMON

WINDOW = 8  # sliding window of the sliding families' tiny configs: shorter than every test sequence

_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_LOCAL_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
_HYBRID = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}


def _declares(config_class: type, name: str) -> bool:
    """Whether a config class has the setting `name` (a dataclass field in recent transformers, an
    `__init__` parameter in older ones)."""
    fields = getattr(config_class, "__dataclass_fields__", None) or {}
    return name in fields or name in inspect.signature(config_class.__init__).parameters


def _frozen(settings: Mapping) -> Mapping:
    return MappingProxyType(dict(settings))


@dataclass(frozen=True)
class Family:
    """One decoder family of the matrix."""

    name: str  # `config.model_type`
    settings: Mapping = field(default_factory=dict)  # config settings on top of `COMMON`
    features: frozenset[str] = frozenset({"gqa"})  # expected attention features (a subset of `FEATURES`)
    attn: str = "sdpa"  # the attention implementation the unpatched family runs (some have no SDPA path)
    real_model: str = ""  # `vasepatch.models` name of a real checkpoint of this family tested in the slow tests
    limits: str = ""  # what does not work, or works differently, for this family
    since: str = ""  # the oldest transformers the family is tested with, when not every supported one

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", _frozen(self.settings))
        object.__setattr__(self, "features", frozenset(self.features))
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"{self.name}: unknown features {sorted(unknown)}; allowed: {FEATURES}")

    def missing(self) -> str:
        """Why this transformers cannot build the family ("" when it can)."""
        if self.name not in CONFIG_MAPPING_NAMES:
            return f"transformers {transformers.__version__} has no model type {self.name!r}"
        here = transformers.__version__
        if getattr(self, "since", "") and Version(here) < Version(self.since):
            return f"{self.name} is tested with transformers >= {self.since} ({here} here): {self.limits}"
        return ""

    def config(self, attn: str | None = None) -> transformers.PretrainedConfig:
        attn = attn or self.attn
        config_class = CONFIG_MAPPING[self.name]
        gqa = {"num_key_value_heads": 2} if _declares(config_class, "num_key_value_heads") else {}
        cfg = config_class(**{**COMMON, **gqa, **self.settings})
        cfg._attn_implementation = attn
        return cfg

    def model(self, attn: str | None = None, seed: int = 0) -> torch.nn.Module:
        """A tiny random-weight fp32 causal LM of this family, in eval mode."""
        torch.manual_seed(seed)
        cfg = self.config(attn)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation).eval()


@dataclass(frozen=True)
class Rejected:
    """A family detection refuses, with the words its reason must contain."""

    name: str
    settings: Mapping = field(default_factory=dict)
    attn: str = "sdpa"
    reason: str = ""  # a regex the `UnsupportedModelError` message must match

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", _frozen(self.settings))

    missing = Family.missing
    config = Family.config
    model = Family.model


_NEWEST = "5.24"  # the transformers release the matrix was written against


def _old(why: str) -> str:
    return f"with transformers 5.0 detection refuses it ({why}); tested with {_NEWEST}"


_OLD_MASKS = _old("its model builds masks outside `masking_utils`")

_DEEPSEEK_MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 32,
}

FAMILIES: tuple[Family, ...] = (
    Family("llama", real_model="smollm2-135m"),
    Family("mistral", {"sliding_window": WINDOW}, {"gqa", "sliding"}),
    Family("qwen2", {"use_sliding_window": False}, real_model="qwen2.5-coder-0.5b"),
    Family("qwen3", {"head_dim": 16, "use_sliding_window": False}),
    Family("phi3"),
    Family("gemma", {"head_dim": 16}),
    Family(
        "gemma2",
        {"head_dim": 16, "query_pre_attn_scalar": 16, **_HYBRID},
        {"gqa", "sliding", "hybrid", "softcap"},
        attn="eager",
    ),
    Family(
        "gemma3_text",
        {"head_dim": 16, "query_pre_attn_scalar": 16, **_HYBRID},
        {"gqa", "sliding", "hybrid"},
        real_model="gemma3-270m",
    ),
    Family(
        "vaultgemma",
        {"head_dim": 16, "query_pre_attn_scalar": 16, **_HYBRID},
        {"gqa", "sliding", "hybrid", "softcap"},
        attn="eager",
    ),
    Family("olmo"),
    Family("olmo2"),
    Family("olmo3", _HYBRID, {"gqa", "sliding", "hybrid"}),
    Family("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    Family("flex_olmo", {"num_experts": 4, "num_experts_per_tok": 2}),
    Family("mixtral", {"sliding_window": None, **_LOCAL_MOE}),
    Family("phimoe", {"sliding_window": None, **_LOCAL_MOE}),
    Family("minimax_m2", {"head_dim": 16, **_LOCAL_MOE}),
    Family("qwen2_moe", {"use_sliding_window": False, "shared_expert_intermediate_size": 32, **_MOE}),
    Family("qwen3_moe", {"head_dim": 16, "use_sliding_window": False, **_MOE}),
    Family("granite"),
    Family("granitemoe", _LOCAL_MOE),
    Family("granitemoeshared", {"shared_intermediate_size": 32, **_LOCAL_MOE}),
    Family("glm", {"head_dim": 16}),
    Family("glm4", {"head_dim": 16}),
    Family("glm4_moe", {"first_k_dense_replace": 1, **_DEEPSEEK_MOE}),
    Family("dots1", {"first_k_dense_replace": 1, **_DEEPSEEK_MOE}),
    Family("smollm3", {"use_sliding_window": False}),
    Family("cohere"),
    Family("cohere2", _HYBRID, {"gqa", "sliding", "hybrid"}),
    Family("ministral", {"head_dim": 16, **_HYBRID}, {"gqa", "sliding", "hybrid"}),
    Family("exaone4", _HYBRID, {"gqa", "sliding", "hybrid"}),
    Family("cwm", {"head_dim": 16, "bos_token_id": 1, "eos_token_id": 2, **_HYBRID}, {"gqa", "sliding", "hybrid"}),
    Family("starcoder2", {"sliding_window": WINDOW}, {"gqa", "sliding"}),
    Family("stablelm", limits=_OLD_MASKS, since=_NEWEST),
    Family("phi"),
    Family("helium", {"head_dim": 16}),
    Family("arcee"),
    Family("apertus"),
    Family("seed_oss", {"head_dim": 16}),
    Family("ernie4_5", {"head_dim": 16}),
    Family("ernie4_5_moe", {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32, "moe_layer_start_index": 1}),
    Family("hunyuan_v1_dense", {"head_dim": 16}),
    Family("hunyuan_v1_moe", {"head_dim": 16, "num_experts": 4, "moe_topk": 2}),
    Family("bitnet"),
    Family("nemotron", {"head_dim": 16}, limits=_old("its attention computes attention itself"), since=_NEWEST),
    Family("jais2", {"head_dim": 16}),
    Family("nanochat"),
    Family("internlm3", {"head_dim": 16}),
    Family("iquestcoder", {"head_dim": 16}),
    Family("hyperclovax", {"head_dim": 16}),
    Family(
        "afmoe",
        {"head_dim": 16, "num_dense_layers": 1, **_MOE, **_HYBRID},
        {"gqa", "sliding", "hybrid"},
        limits=_old("its attention takes its cache as `past_key_value`"),
        since=_NEWEST,
    ),
    Family("solar_open", {"head_dim": 16, **_DEEPSEEK_MOE}),
    Family("exaone_moe", {"first_k_dense_replace": 1, **_MOE, **_HYBRID}, {"gqa", "sliding", "hybrid"}),
    Family("mellum", {"head_dim": 16, **_MOE}),
    Family("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 96}, frozenset()),
    Family(
        "codegen",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 96, "rotary_dim": 8},
        frozenset(),
        limits="transformers 5.0 has no SDPA path for it; tested with 5.24",
        since=_NEWEST,
    ),
    Family(
        "gptj",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 96, "rotary_dim": 8},
        frozenset(),
        limits="transformers 5.0 has no SDPA path for it; tested with 5.24",
        since=_NEWEST,
    ),
    Family("opt", {"ffn_dim": 96, "word_embed_proj_dim": 64}, frozenset(), limits=_OLD_MASKS, since=_NEWEST),
    Family("persimmon", {}, frozenset(), limits=_OLD_MASKS, since=_NEWEST),
    Family(
        "gpt_oss",
        {"head_dim": 16, **_LOCAL_MOE, **_HYBRID},
        {"gqa", "sliding", "hybrid", "sinks"},
        attn="eager",
    ),
)

_MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}

REJECTED: tuple[Rejected, ...] = (
    Rejected("deepseek_v3", {"num_key_value_heads": 4, **_MLA, **_DEEPSEEK_MOE}, reason="latent attention"),
    Rejected("deepseek_v2", {"num_key_value_heads": 4, **_MLA, **_DEEPSEEK_MOE}, reason="latent attention"),
    Rejected(
        "qwen3_next",
        {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], **_MOE},
        reason="linear-attention",
    ),
    Rejected(
        "minimax",
        {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], **_LOCAL_MOE},
        reason="linear-attention",
    ),
    Rejected("falcon_h1", reason="linear-attention"),
    Rejected("jamba", {"num_experts": 4, "attn_layer_offset": 1, "attn_layer_period": 2}, reason="linear-attention"),
    Rejected("lfm2", {"layer_types": ["conv", "full_attention"]}, reason="linear-attention"),
    Rejected("mamba", attn="eager", reason="linear-attention"),
    Rejected("llama4_text", {"head_dim": 16, "num_local_experts": 4, "attention_chunk_size": 8}, reason="chunked"),
    Rejected(
        "bart",
        {"d_model": 64, "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 96},
        reason="cross-attention",
    ),
    Rejected("gpt_neox", reason="no KV cache|keep no KV cache"),
    Rejected("gpt_bigcode", {"n_embd": 64, "n_layer": 2, "n_head": 4}, reason="keep no KV cache"),
    Rejected("falcon", {"num_kv_heads": 2, "new_decoder_architecture": True}, reason="ALiBi"),
    Rejected("bloom", {"n_layer": 2, "n_head": 4}, attn="eager", reason="ALiBi"),
    Rejected("mpt", {"d_model": 64, "n_heads": 4, "n_layers": 2}, attn="eager", reason="interface"),
    Rejected(
        "diffllama",
        {"head_dim": 16},
        reason="calls the attention function 2 times|computes attention itself",  # 5.0: its own SDPA class
    ),
    Rejected(
        "doge",
        reason="uses the `value_states` returned by the cache beyond the attention call",
    ),
)


def by_name(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(name)
