"""The `"vasepatch"` attention implementation, registered with transformers.

Patched attention modules look their kernel up under this name (through a
private config copy), and the model builds its mask with the matching mask
function, which hands the plain 2-D padding mask through untouched: the
vasepatch cache knows positions and validity per slot and builds the real mask
itself.

Calls without a vasepatch cache (`use_cache=False`, a `DynamicCache`, a `StaticCache`,
`cache_implementation="static"`) run transformers' own path: the mask function builds the
mask of the model's own attention implementation and the kernel dispatches to that
implementation, so they compute exactly what the unpatched model computes (dropout and
attention weights included). The patch's wrappers (`vasepatch.integration.wrappers`) know which call
is running, build the mask (`wrappers.padding_mask_passthrough`) and tell this kernel (`OWN_PATH_KWARG`);
under `torch.compile`, which cannot trace that, the mask is passed through and a call without a vasepatch
cache gets a causal + padding mask over a growing cache (with the layer's sliding window, if the module
passes one).

What a model's attention module passes beside the tensors is honoured, never ignored:
`softcap=` (Gemma2's logit soft-capping) and `s_aux=` (gpt-oss's learned attention sinks)
send the step to the eager math path (`kernels.grouped_probs`), whatever the backend,
since neither SDPA nor the varlen kernels take them here; `sliding_window=` must match the
layer's `LayerPlan` (the cache applies the window itself, `vasepatch.cache.sliding`).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vasepatch.cache import Step, VaSELayer
from vasepatch.kernels import backends
from vasepatch.kernels.grouped import (
    causal_attention,
    causal_padding_mask,
    eager_attention_with_weights,
    grouped_attention,
)

ATTN_IMPLEMENTATION = "vasepatch"
LAYER_KWARG = "vasepatch_layer"
OWN_PATH_KWARG = "vasepatch_own_path"  # set by the patch's wrappers: a call for the model's own attention
BACKEND_ATTR = "_vasepatch_backend"  # on the private config copy: the backend chosen at patch time
ORIGINAL_ATTR = "_vasepatch_original"  # on the private config copy: the model's own attention implementation
PAGED_ATTR = "_vasepatch_eviction"  # on a continuous-batching paged cache that evicts: its `PagedEviction`
PAGED_KWARG = "vasepatch_paged"  # set by the attention wrapper on such a cache's calls: the layer records its queries


def vasepatch_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered kernel: `attention_step` over the module's `VaSELayer` when the
    call carries a vasepatch cache, else transformers' own attention over the given K/V."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    backend = getattr(module.config, BACKEND_ATTR, "sdpa")
    layer, own_path = kwargs.pop(LAYER_KWARG, None), kwargs.pop(OWN_PATH_KWARG, False)
    paged = kwargs.pop(PAGED_KWARG, None)
    if paged is not None:  # continuous batching: the evicting requests' last queries, after RoPE
        paged.record(module.layer_idx, query)
    if layer is None:
        return _without_vase_cache(
            module, query, key, value, attention_mask, scaling, dropout, backend, own_path, **kwargs
        )
    window, plan = kwargs.get("sliding_window"), layer.plan
    if window is not None and window != plan.sliding_window:  # a module that passes its window
        fix = "the model's layout plans do not match its attention modules (build the cache with handle.new_cache())"
        raise window_error(plan.index, window, plan.sliding_window, fix)
    extras = _extras(kwargs)
    if dropout:
        raise RuntimeError(
            f"attention dropout ({dropout:g}) in training mode is not applied by the vasepatch cache; "
            "call model.eval() before generating"
        )
    if not kwargs.get("output_attentions"):
        return attention_step(layer, query, key, value, attention_mask, scaling, backend, **extras)[0], None
    if backend != "eager":
        warnings.warn(
            f"output_attentions=True: the vasepatch {backend!r} backend computes no attention weights, so none "
            "are returned; load the model with attn_implementation='eager' to get weights over the cache slots",
            UserWarning,
            stacklevel=2,
        )
        return attention_step(layer, query, key, value, attention_mask, scaling, backend, **extras)[0], None
    out, _, probs = attention_step(layer, query, key, value, attention_mask, scaling, **extras, weights=True)
    return out, probs


def window_error(index: int, model_window: int | None, plan_window: int | None, fix: str) -> ValueError:
    """A decoder layer whose sliding window (`model_window`: what its module passes, or the model's layout
    plan) is not its vasepatch layer plan's (`plan_window`): the cache would attend over a different window
    than the model means. `fix` says what to do. Raised by the kernel and by the patch's cache check."""
    return ValueError(
        f"decoder layer {index} attends with sliding_window={model_window}, but its vasepatch layer plan has "
        f"sliding_window={plan_window}: {fix}"
    )


def _extras(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a model's attention module passes beside the tensors and the kernels honour: `softcap=`
    (logit soft-capping) and `s_aux=` (gpt-oss's learned attention sinks, as `sink_logits`)."""
    return {"softcap": kwargs.get("softcap"), "sink_logits": kwargs.get("s_aux")}


def _without_vase_cache(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
    backend: str,
    own_path: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A call without a vasepatch cache: the model's own attention implementation, with the mask
    transformers built for it, in a patched model's eager call (`own_path`) or with a prepared 4-D mask;
    else a causal + padding mask (see the module docstring)."""
    original = getattr(module.config, ORIGINAL_ATTR, None)
    prepared = attention_mask is not None and attention_mask.dim() != 2
    if original is not None and (prepared or own_path):
        kernel = ALL_ATTENTION_FUNCTIONS.get(original)
        if kernel is None:  # "eager": the modeling file's own function, as transformers uses
            kernel = sys.modules[type(module).__module__].eager_attention_forward
        return kernel(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        raise ValueError(
            f"a call without a vasepatch cache, compiled or outside the patched model's forward, got a 2-D mask "
            f"over {attention_mask.shape[-1]} tokens for {key.shape[-2]} cached keys (a static cache?); call the "
            "patched model eagerly, or pass a 4-D mask"
        )
    window = kwargs.get("sliding_window")
    mask = causal_padding_mask(attention_mask, query.shape[-2], key.shape[-2], query.device, window)
    extras = _extras(kwargs)
    return grouped_attention(query, key, value, mask, scaling, _masked_backend(backend), dropout, **extras), None


def attention_step(
    layer: VaSELayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scaling: float,
    backend: str = "sdpa",
    *,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    weights: bool = False,
) -> tuple[torch.Tensor, bool] | tuple[torch.Tensor, bool, torch.Tensor]:
    """One attention step of one layer: `VaSELayer.step` (append the step's K/V, attend, record the
    queries, evict if due) with the kernel that `backend` and the step choose (`attend`). Returns
    the output `[B, Q, Hq, D]` and whether the step ended with an eviction (always False under
    compilation, where the eviction runs after the graph, in `VaSECache.complete_step`).

    `query` `[B, Hq, Q, D]`, `key`/`value` `[B, Hkv, Q, D]` (after RoPE), `padding` the
    2-D mask (`[B, >= Q]`, 1 = real token) or None; `softcap` (logit soft-capping) and
    `sink_logits` (`[Hq]` learned attention-sink logits, gpt-oss's `s_aux`) as the model's
    attention module passes them. `weights=True` (for `output_attentions=True`) attends with the
    eager kernel and also returns the weights `[B, Hq, Q, S]` over the step's cache slots: before
    the first eviction slot `s` holds sequence position `s`, so they equal transformers' eager
    weights; after it, column `s` is whatever token slot `s` holds."""

    def kernel(step: Step) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if weights:
            return _with_weights(query, step, scaling, softcap, sink_logits)
        return attend(backend, query, key, value, step, scaling, softcap=softcap, sink_logits=sink_logits)

    out, evicted = layer.step(query, key, value, padding, kernel)
    return (out[0], evicted, out[1]) if weights else (out, evicted)


def _with_weights(
    query: torch.Tensor, step: Step, scaling: float, softcap: float | None, sink_logits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager kernel over the step's slots, with its attention weights."""
    n = step.length
    keys, values = step.keys[:, :, :n], step.values[:, :, :n]
    return eager_attention_with_weights(
        query, keys, values, step.mask(), scaling, softcap=softcap, sink_logits=sink_logits
    )


def attend(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step: Step,
    scaling: float,
    *,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's queries over what `step` holds, with `backend`.

    Varlen backends (`flash_attn`, `torch_varlen`): a decode step attends to each row's
    contiguous range of slots (in a sliding-window layer, the part inside the window), and
    the first step (the prompt, eagerly) runs causal attention on the unpadded new tokens,
    unless the prompt is longer than the layer's sliding window. With `sdpa`, a first step
    within any sliding window is causal attention over its own tokens (unpadded: no mask in
    memory; padded: one `[B, 1, Q, Q]` mask for every head). Everything else, and any step
    with `softcap` or `sink_logits` (the eager math path), uses the masked grouped kernel over the
    step's first `length` slots, without a mask for a decode step whose slots are all visible
    (`step.dense`: eagerly, a global layer that never took padding)."""
    math = softcap is not None or sink_logits is not None
    w = step.sliding_window
    within = w is None or step.q_len <= w  # causal over the step's own tokens is exact
    if backend in backends.VARLEN_BACKENDS and not math:
        if step.q_len == 1:
            return backends.decode_attention(backend, query, step.keys, step.values, step.start(), step.end, scaling)
        if step.first and within:
            return backends.prefill_attention(backend, query, key, value, step.new_valid, scaling)
    if step.first and step.q_len > 1 and backend == "sdpa" and within and not math:
        # the prompt attends over its own tokens: `is_causal` if unpadded (one host sync per generation),
        # else one causal + padding mask for all heads
        padded = not bool(step.new_valid.all())
        return causal_attention(query, key, value, scaling, step.new_valid if padded else None)
    n = step.length
    masked = "eager" if math else _masked_backend(backend)
    keys, values = step.keys[:, :, :n], step.values[:, :, :n]
    mask = None if step.dense and step.q_len == 1 else step.mask()  # a decode step that sees every slot: no mask
    return grouped_attention(query, keys, values, mask, scaling, masked, softcap=softcap, sink_logits=sink_logits)


def _masked_backend(backend: str) -> str:
    """The masked kernel (`kernels.MASKED_BACKENDS`) that stands in for `backend` where it has none."""
    return "eager" if backend == "eager" else "sdpa"
