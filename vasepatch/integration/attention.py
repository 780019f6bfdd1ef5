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

from vasepatch.integration import backends
from vasepatch.integration.kernels import causal_padding_mask, grouped_attention

ATTN_IMPLEMENTATION = "vasepatch"
LAYER_KWARG = "vasepatch_layer"
BACKEND_ATTR = "_vasepatch_backend"  # on the private config copy: the backend chosen at patch time


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
    """Attention over the static buffer of a `VaSELayer`, then its eviction step.

    With a varlen backend (`flash_attn`, `torch_varlen`), decode steps attend to each
    row's contiguous range of slots and the eager prefill runs on the unpadded
    prompt; other steps (and every step of the `sdpa`/`eager` backends) use the
    masked grouped kernel.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    backend = getattr(module.config, BACKEND_ATTR, "sdpa")
    kernel = "eager" if backend == "eager" else "sdpa"
    layer = kwargs.get(LAYER_KWARG)
    if layer is not None:
        q_len = query.shape[-2]
        if backend in backends.VARLEN_BACKENDS and q_len == 1:
            out = backends.decode_attention(backend, query, key, value, layer.attend_start(), layer.fill, scaling)
        elif backend in backends.VARLEN_BACKENDS and not torch.compiler.is_compiling() and layer.prefilling:
            padding = layer.valid[:, 0, :q_len]  # the prompt sits in slots [0, q_len)
            out = backends.prefill_attention(backend, query, key[:, :, :q_len], value[:, :, :q_len], padding, scaling)
        else:
            n = layer.attended_slots()
            mask = layer.step_mask(n, q_len)
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
