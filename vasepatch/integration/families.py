"""Which models vasepatch supports, and where their attention modules are."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vasepatch.cache.plan import LayerPlan, default_plans
from vasepatch.errors import UnsupportedModelError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelLayout:
    """The parts of a supported causal LM that a patch touches."""

    model_type: str
    base_model: torch.nn.Module  # the decoder stack (e.g. `LlamaModel`); builds the masks
    attention_modules: tuple[torch.nn.Module, ...]  # one per decoder layer, in order
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    plans: tuple[LayerPlan, ...] = field(default=())  # one per decoder layer; empty: global layers on one device

    def layer_plans(self) -> tuple[LayerPlan, ...]:
        return self.plans or default_plans(len(self.attention_modules))


def _supported() -> str:
    return ", ".join(SUPPORTED_FAMILIES)


def _sliding_layers(config) -> bool:
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return True
    if getattr(config, "use_sliding_window", False):
        return True
    return config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None


def inspect_model(model: torch.nn.Module) -> ModelLayout:
    """Check that `model` is a supported causal LM and locate its attention modules.

    Raises `UnsupportedModelError` (a `ValueError`) naming the model type and the
    supported families; never modifies the model.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"vasepatch does not support model type {model_type!r} ({name}); supported families: {_supported()}"
        )
    if getattr(config, "is_encoder_decoder", False) or not hasattr(model, "generate"):
        raise UnsupportedModelError(
            f"vasepatch patches decoder-only causal LMs with generate(); {name} ({model_type!r}) is not one "
            f"(supported families: {_supported()})"
        )
    if _sliding_layers(config):
        raise UnsupportedModelError(
            f"vasepatch does not support sliding-window attention layers ({name}, model type {model_type!r}); "
            f"supported: full-attention {_supported()} models"
        )
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None:
        raise UnsupportedModelError(
            f"{name} ({model_type!r}) has no `model.layers` decoder stack; supported families: {_supported()}"
        )
    attns = tuple(getattr(layer, "self_attn", None) for layer in layers)
    for i, attn in enumerate(attns):
        if attn is None or getattr(attn, "layer_idx", None) != i:
            raise UnsupportedModelError(f"decoder layer {i} of {name} has no `self_attn` with layer_idx={i}")
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    return ModelLayout(model_type, base, attns, n_q, n_kv, head_dim)
