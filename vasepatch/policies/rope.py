"""A model's RoPE as its config states it, for the policies that invert it (`triattention`): whether they can,
and its frequencies, from the config alone (no weights, no model: what the vLLM plugin has at engine start).

- `check_rope(config)`: ValueError naming the policy and why, for a RoPE it cannot invert: no rotary (ALiBi,
  absolute positions), interleaved pairs (GPT-J's `rotate_every_two`), a rope type outside `ROPE_TYPES` (dynamic
  NTK, longrope, mrope), partial rotary, layers without RoPE (`no_rope_layers`).
- `config_rotary(config)`: each layer's inverse frequencies (after the rope type's scaling) and attention
  scaling, computed as transformers' rotary modules compute them (`transformers.modeling_rope_utils`).

`config` is a text config (a multimodal model's `text_config`: `vasepatch.integration.families.text_config`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

POLICY = "triattention"
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The rope types whose rotation is a fixed angle `position * inv_freq` per pair (scaled or not)."""


def refusal(config: Any, why: str) -> ValueError:
    """The error for a model the policy cannot serve: its name, its model type, and why."""
    name = getattr(config, "_name_or_path", "") or "this model"
    kind = getattr(config, "model_type", "") or "unknown"
    return ValueError(f"{POLICY} cannot calibrate {name} (model type {kind}): {why}")


def _layer_count(config: Any) -> int:
    return int(getattr(config, "num_hidden_layers", 0) or 0)


def layer_rope_parameters(config: Any) -> list[dict]:
    """Each layer's `rope_parameters` (a dict with `rope_type`): one dict for all layers, or one per layer type
    (Gemma 3: `config.rope_parameters[config.layer_types[i]]`). ValueError for a model without RoPE."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        if getattr(config, "rotary_dim", None) is not None:  # GPT-J, CodeGen: rotate_every_two, partial
            raise refusal(config, "its RoPE is interleaved (GPT-J's rotate_every_two), not half-split")
        raise refusal(config, "it has no rotary position embedding (ALiBi or absolute positions)")
    layers = _layer_count(config)
    if _per_layer_type(params):
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != layers or any(params.get(t) is None for t in types):
            raise refusal(config, f"its per-layer-type rope_parameters {sorted(params)} do not cover its layers")
        return [dict(params[t]) for t in types]
    return [dict(params)] * layers


def _per_layer_type(params: dict) -> bool:
    return all(isinstance(v, dict) or v is None for v in params.values())


def rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default"))


def check_rope(config: Any) -> None:
    """ValueError naming the reason if the config's RoPE is not one `triattention` can invert (from the config
    alone, before any weight loads): no rotary, a rope type outside `ROPE_TYPES`, partial rotary, NoPE layers."""
    for i, params in enumerate(layer_rope_parameters(config)):
        if rope_type(params) not in ROPE_TYPES:
            raise refusal(
                config,
                f"layer {i} has rope type {rope_type(params)!r}; only {', '.join(ROPE_TYPES)} have fixed frequencies",
            )
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        if factor < 1:
            raise refusal(config, f"its RoPE is partial (partial_rotary_factor {factor}): it rotates part of a head")
    nope = getattr(config, "no_rope_layers", None)
    if nope is not None and not all(nope):
        missing = [i for i, uses_rope in enumerate(nope) if not uses_rope]
        raise refusal(config, f"layers {missing} have no RoPE (no_rope_layers)")


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_rotary(config: Any) -> tuple[Tensor, Tensor]:
    """Each layer's rotary inverse frequencies `[L, F]` float32 and attention scaling `[L]` float32, from the config
    alone: `1 / theta ** (2 i / D)` for the default rope type, transformers' `ROPE_INIT_FUNCTIONS` for the scaled
    ones (linear, llama3, YaRN). ValueError (`check_rope`) for a RoPE the policy cannot invert."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    check_rope(config)
    per_type = _per_layer_type(getattr(config, "rope_parameters", {}))
    types = list(getattr(config, "layer_types", None) or [None] * _layer_count(config))
    dim, freqs, scales = head_dim(config), [], []
    for params, layer_type in zip(layer_rope_parameters(config), types, strict=True):
        if rope_type(params) == "default":
            steps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            inv_freq, scale = 1.0 / (params["rope_theta"] ** steps), 1.0
        else:
            where = {"layer_type": layer_type} if per_type else {}
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type(params)](config, "cpu", **where)
        freqs.append(inv_freq.float())
        scales.append(float(scale))
    return torch.stack(freqs), torch.tensor(scales, dtype=torch.float32)
