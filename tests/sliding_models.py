"""Tiny random models with sliding-window layers, soft-capping or attention sinks, and a patch
helper that checks detection's layer plans against the model's attention modules."""

from __future__ import annotations

import torch
import transformers

import vasepatch
from tests import tiny_models

VOCAB = tiny_models.VOCAB
COMMON = {**tiny_models.COMMON, "num_key_value_heads": 2}
INTERLEAVED = ["sliding_attention", "full_attention"]


def sliding_config(family: str, window: int, **overrides) -> transformers.PretrainedConfig:
    """A 2-layer config of `family` whose sliding layers have window `window`:
    `mistral` (every layer), `qwen2` (`use_sliding_window`: layers from `max_window_layers = 1` on),
    `gemma3` / `gemma2` / `gpt_oss` (layer 0 sliding, layer 1 global)."""
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=window, **overrides)
    if family == "qwen2":
        return transformers.Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=window, max_window_layers=1, **overrides
        )
    gemma = dict(head_dim=16, sliding_window=window, layer_types=INTERLEAVED)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**COMMON, **gemma, query_pre_attn_scalar=16, **overrides)
    if family == "gemma2":
        return transformers.Gemma2Config(**COMMON, **gemma, query_pre_attn_scalar=16, **overrides)
    if family == "gpt_oss":
        common = {**COMMON, "intermediate_size": 32}
        return transformers.GptOssConfig(**common, **gemma, num_local_experts=4, num_experts_per_tok=2, **overrides)
    raise ValueError(family)


def tiny(config: transformers.PretrainedConfig, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.eval()


def module_windows(model: torch.nn.Module) -> list[int | None]:
    """The sliding window each decoder layer's attention module applies (None: global)."""
    default = getattr(model.config, "sliding_window", None)
    return [getattr(layer.self_attn, "sliding_window", default) for layer in model.model.layers]


def patch(model: torch.nn.Module, **settings) -> vasepatch.PatchHandle:
    """`vasepatch.patch`, with the plans detection built checked against the windows the
    model's attention modules apply."""
    handle = vasepatch.patch(model, **settings)
    assert [p.sliding_window for p in handle.layout.layer_plans()] == module_windows(model)
    return handle
