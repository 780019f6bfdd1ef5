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

from vasepatch.cache import Step, VaSELayer
from vasepatch.integration import backends
from vasepatch.integration.kernels import causal_attention, causal_padding_mask, grouped_attention

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
    """The registered kernel: `attention_step` over the module's `VaSELayer` when the
    call carries a vasepatch cache, else masked attention over the given K/V."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    backend = getattr(module.config, BACKEND_ATTR, "sdpa")
    layer = kwargs.get(LAYER_KWARG)
    if layer is not None:
        return attention_step(layer, query, key, value, attention_mask, scaling, backend)[0], None
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("vasepatch expects a 2-D padding mask; got a prepared 4-D mask")
    mask = causal_padding_mask(attention_mask, query.shape[-2], key.shape[-2], query.device)
    return grouped_attention(query, key, value, mask, scaling, _kernel(backend), dropout), None


def attention_step(
    layer: VaSELayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scaling: float,
    backend: str = "sdpa",
) -> tuple[torch.Tensor, bool]:
    """One attention step of one layer, the whole data path: append the step's K/V,
    attend, record the queries, evict if due. Returns the output `[B, Q, Hq, D]` and
    whether the step ended with an eviction (always False under compilation, where the
    eviction runs after the graph, in `VaSECache.complete_step`).

    `query` `[B, Hq, Q, D]`, `key`/`value` `[B, Hkv, Q, D]` (after RoPE), `padding` the
    2-D mask (`[B, >= Q]`, 1 = real token) or None."""
    step = layer.append(key, value, padding)
    out = attend(backend, query, key, value, step, scaling)
    layer.record_queries(query, step)
    evicted = layer.evict_if_due(step)
    return out, evicted


def attend(
    backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: Step, scaling: float
) -> torch.Tensor:
    """Attention of a step's queries over what `step` holds, with `backend`.

    Varlen backends (`flash_attn`, `torch_varlen`): a decode step attends to each row's
    contiguous range of slots, and the first step (the prompt, eagerly) runs causal
    attention on the unpadded new tokens. With `sdpa`, a first step without padding is
    plain causal attention over its own tokens (no mask in memory). Everything else uses
    the masked grouped kernel over the step's first `length` slots."""
    if backend in backends.VARLEN_BACKENDS:
        if step.q_len == 1:
            return backends.decode_attention(backend, query, step.keys, step.values, step.start(), step.end, scaling)
        if step.first:
            return backends.prefill_attention(backend, query, key, value, step.new_valid, scaling)
    if step.first and step.q_len > 1 and backend == "sdpa" and bool(step.new_valid.all()):
        return causal_attention(query, key, value, scaling)  # an unpadded prompt (one host sync per generation)
    n = step.length
    return grouped_attention(query, step.keys[:, :, :n], step.values[:, :, :n], step.mask(), scaling, _kernel(backend))


def _kernel(backend: str) -> str:
    return "eager" if backend == "eager" else "sdpa"


def register() -> None:
    """Register the implementation and its mask function (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, vasepatch_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_passthrough)
