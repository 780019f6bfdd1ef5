"""`attention_features`: what a patchable model's attention does, for the supported-models table."""

from __future__ import annotations

import torch

from vasepatch.integration.families import inspect_model

FEATURES = ("gqa", "sliding", "hybrid", "sinks", "softcap")


def _softcap(module: torch.nn.Module, config: object) -> bool:
    value = getattr(module, "attn_logit_softcapping", None)
    if value is None:
        value = getattr(config, "attn_logit_softcapping", None)
    return value is not None and float(value) > 0


def attention_features(model: torch.nn.Module) -> dict[str, bool]:
    """The attention features of a model that `vasepatch.patch` accepts (`UnsupportedModelError` otherwise).

    - `gqa`: some layer has fewer KV heads than query heads (grouped-query or multi-query);
    - `sliding`: some layer attends within a sliding window;
    - `hybrid`: sliding-window and global layers are interleaved;
    - `sinks`: the attention modules hold learned attention sinks (a `sinks` parameter, as in gpt-oss);
    - `softcap`: attention logits are soft-capped (`attn_logit_softcapping`, as in Gemma 2).
    """
    layout = inspect_model(model)
    windows = [plan.sliding_window for plan in layout.layer_plans()]
    config = layout.base_model.config
    groups = [getattr(m, "num_key_value_groups", 1) for m in layout.attention_modules]
    sliding = any(w is not None for w in windows)
    return {
        "gqa": layout.num_kv_heads < layout.num_query_heads or any(isinstance(g, int) and g > 1 for g in groups),
        "sliding": sliding,
        "hybrid": sliding and any(w is None for w in windows),
        "sinks": any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in layout.attention_modules),
        "softcap": any(_softcap(m, config) for m in layout.attention_modules),
    }
