"""The `"vasepatch"` attention implementation, registered with transformers.

Patched attention modules look their kernel up under this name (through a
private config copy), and the model builds its mask with the matching mask
function, which hands the plain 2-D padding mask through untouched: the
vasepatch cache knows positions and validity per slot and builds the real mask
itself. Calls without a vasepatch cache (`use_cache=False`, a user-supplied
`DynamicCache`) get an ordinary causal + padding mask.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from vasepatch.integration.kernels import causal_padding_mask, grouped_attention

ATTN_IMPLEMENTATION = "vasepatch"
LAYER_KWARG = "vasepatch_layer"


def padding_mask_passthrough(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """Mask function: return the 2-D padding mask (`[B, S]` bool) or `None`, unchanged.

    Sizes and offsets (whose names vary across transformers releases) are ignored.
    """
    return attention_mask


def vasepatch_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the static buffer of a `VaSELayer`, then its eviction step."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    kernel = getattr(module.config, "_vasepatch_kernel", "sdpa")
    layer = kwargs.get(LAYER_KWARG)
    if layer is not None:
        n = layer.attended_slots()
        mask = layer.step_mask(n, query.shape[-2])
        out = grouped_attention(query, key[:, :, :n], value[:, :, :n], mask, scaling, kernel)
        layer.observe_queries(query)
        layer.end_step()
        return out, None
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("vasepatch expects a 2-D padding mask; got a prepared 4-D mask")
    mask = causal_padding_mask(attention_mask, query.shape[-2], key.shape[-2], query.device)
    return grouped_attention(query, key, value, mask, scaling, kernel, dropout), None


def register() -> None:
    """Register the implementation and its mask function (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, vasepatch_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_passthrough)
