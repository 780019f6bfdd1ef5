"""Tiny random-weight models of every supported family (and a few unsupported ones)."""

from __future__ import annotations

import torch
import transformers

from vasepatch.bench.shapes import TINY_CONFIG

COMMON = TINY_CONFIG  # the tiny settings every family's tiny model is built from (KV heads: `tiny_config`)
VOCAB = COMMON["vocab_size"]

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(family: str, kv_heads: int = 2, attn: str = "sdpa", **overrides):
    family_defaults = {
        "llama": {},
        "qwen2": {"use_sliding_window": False},
        "qwen3": {"head_dim": 16, "use_sliding_window": False},
        "mistral": {"sliding_window": None},
    }
    kwargs = {**COMMON, "num_key_value_heads": kv_heads, **family_defaults[family], **overrides}
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[family]
    cfg = config_class(**kwargs)
    cfg._attn_implementation = attn
    return cfg


def tiny_model(family: str = "llama", kv_heads: int = 2, attn: str = "sdpa", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = tiny_config(family, kv_heads, attn, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.eval()
