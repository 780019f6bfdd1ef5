"""`patch` / `unpatch` / `patched`: instance-level surgery with guaranteed teardown.

A patch changes only the given model *instance*:

- every module of the decoder stack that shares the model's config gets a private
  copy of it whose attention implementation is `"vasepatch"` (so the model's own
  projections, norms and RoPE run unchanged, and only the kernel and mask
  function are ours);
- each attention module's `forward` is wrapped to hand its `VaSELayer` to the
  kernel;
- `_prepare_cache_for_generation` is overridden so that `generate()` builds a
  `VaSECache` on its own, with no extra arguments;
- the decoder stack's `forward` and `generate` are wrapped to check a vasepatch
  call before any work and to count the calls in flight (`unpatch` refuses while
  one runs in another thread);
- `set_attn_implementation` is wrapped so that the private config keeps `"vasepatch"` (transformers
  would set the new implementation on it too, as continuous batching does): the implementation set
  becomes the one the patch's own path runs;
- a forward hook finishes each step on the host (counters, eviction) when the
  forward ran compiled, and `get_compiled_call` / `create_masks_for_generate`
  are overridden so that generate's own compilation of the decode step compiles
  `forward` (keeping that hook eager) and feeds it a static-shape padding mask
  (`compile_support`).

Calls without a vasepatch cache (`use_cache=False`, a `DynamicCache` or `StaticCache`,
`cache_implementation="static"`) run transformers' own attention and masks.

A tensor-parallel model (`from_pretrained(..., tp_plan="auto")`) is patched on every rank:
each rank caches and evicts its own KV heads (they must split evenly over the ranks), with no
communication. A model dispatched by accelerate (`device_map`, CPU or disk offload) keeps each
layer's buffers on the device that layer runs on (`distributed`).

`unpatch` undoes each change in reverse order; weights are never touched. Every
installed piece is an object, not a closure (`wrappers`, `handle`), so a deep copy or a
pickle of a patched model carries a working patch of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from vasepatch.cache import footprint
from vasepatch.config import VaSEConfig
from vasepatch.errors import AlreadyPatchedError, NotPatchedError, UnsupportedModelError
from vasepatch.integration import attention, distributed, policy_stats
from vasepatch.integration.compat import check_transformers, evicts_in_continuous_batching
from vasepatch.integration.compile_support import install_compile_support
from vasepatch.integration.continuous.hooks import InitContinuousBatching
from vasepatch.integration.families import ModelLayout, inspect_model
from vasepatch.integration.handle import MISSING, STATE_ATTR, PatchHandle, policy_for, set_instance_attr
from vasepatch.integration.wrappers import (
    AttentionForward,
    BaseForward,
    GenerateCall,
    PatchState,
    PrepareCache,
    SetAttnImplementation,
    register,
)
from vasepatch.kernels import backends

__all__ = ["STATE_ATTR", "PatchHandle", "is_patched", "patch", "patched", "policy_for", "unpatch"]


def _compiled_inner(model: Any) -> torch.nn.Module | None:
    """The model inside a `torch.compile(model)` wrapper (an `OptimizedModule`), else None."""
    inner = getattr(model, "__dict__", {}).get("_modules", {}).get("_orig_mod")
    return inner if type(model).__name__ == "OptimizedModule" and inner is not None else None


def _refuse_compiled(model: Any) -> None:
    inner = _compiled_inner(model)
    if inner is not None:
        raise UnsupportedModelError(
            f"vasepatch.patch got a torch.compile wrapper (OptimizedModule around {type(inner).__name__}): its "
            "generate() runs the inner model's own methods, so a patch through the wrapper would change the "
            "inner model's modules while generation kept the unbounded default cache. Patch the model first, "
            "then compile its forward: `vasepatch.patch(model, ...); model.forward = torch.compile(model.forward)`; "
            "or patch the inner model: `vasepatch.patch(compiled._orig_mod, ...)`"
        )


def _default(name: str) -> Any:
    """A `VaSEConfig` field's default (default factories included)."""
    field = VaSEConfig.__dataclass_fields__[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _config_from_arguments(config: VaSEConfig | None, budget: int | None, **settings: Any) -> VaSEConfig:
    if config is None:
        if budget is None:
            raise ValueError("budget is required (a positive int: KV pairs kept per layer and head)")
        return VaSEConfig(budget=budget, **settings)
    if not isinstance(config, VaSEConfig):
        raise ValueError(f"config must be a vasepatch.VaSEConfig, got {type(config).__name__}")
    changed = [k for k, v in settings.items() if v != _default(k)]
    if budget is not None and budget != config.budget:
        changed.insert(0, "budget")
    if changed:
        raise ValueError(f"pass settings either in config or as keywords, not both (got config and {changed})")
    return config


def patch(
    model: torch.nn.Module,
    budget: int | None = None,
    *,
    window: int = 64,
    protect: int | None = None,
    sinks: int = 4,
    policy: str = "vase",
    temperature: float = 1.0,
    smooth: int = 5,
    seed: int | None = None,
    attn_backend: str | None = None,
    prefill: str = "compress",
    policy_options: Mapping[str, Any] | None = None,
    check_policy_output: bool = True,
    shared_heads: bool = False,
    config: VaSEConfig | None = None,
) -> PatchHandle:
    """Give `model` a fixed-size KV cache with VaSE eviction; returns a `PatchHandle`.

    After this, a plain `model.generate(...)` keeps at most `budget` KV pairs per layer and
    head after each eviction (one every `window` decode steps), in buffers of `budget + window`
    slots per layer, row and KV head whatever the prompt (`prefill="keep"`: `max(prompt,
    budget) + window`; `"pin"`: `prompt + budget + window`, the prompt never evicted).
    Everything is validated first (one sequence's buffers must fit the device's memory); on
    any error the model is left as it was. Settings: `VaSEConfig`.
    Tensor-parallel and accelerate-dispatched models: see the module docstring.
    """
    check_transformers()
    _refuse_compiled(model)
    layout = inspect_model(model)
    if getattr(model, STATE_ATTR, None) is not None:
        raise AlreadyPatchedError("this model is already patched by vasepatch; call vasepatch.unpatch(model) first")
    cfg = _config_from_arguments(
        config,
        budget,
        window=window,
        protect=protect,
        sinks=sinks,
        policy=policy,
        temperature=temperature,
        smooth=smooth,
        seed=seed,
        attn_backend=attn_backend,
        prefill=prefill,
        policy_options={} if policy_options is None else policy_options,  # VaSEConfig checks and copies it
        check_policy_output=check_policy_output,
        shared_heads=shared_heads,
    )
    cfg = policy_stats.with_stats(model, cfg)  # a policy that reads calibrated statistics: its file, checked
    chosen = policy_for(cfg)
    layout, shard, backend = _placement(model, layout, cfg)
    register()
    return _install(model, PatchHandle(model, cfg, chosen, layout, backend, shard))


def _install(model: torch.nn.Module, handle: PatchHandle) -> PatchHandle:
    """Make every change of the patch, each recording its own undo; any failure undoes them all."""
    state = PatchState(handle)
    try:
        _apply(model, handle.layout, state)
        set_instance_attr(model, STATE_ATTR, state, state.undo)
    except BaseException:
        for restore in reversed(state.undo):
            restore()
        raise
    return handle


def _placement(
    model: torch.nn.Module, layout: ModelLayout, config: VaSEConfig
) -> tuple[ModelLayout, distributed.Sharding, str]:
    """This process's KV heads (tensor parallelism: their global offset goes into the layer
    plans), the memory check on the devices the layers run on, and the attention backend."""
    shard = distributed.sharding(model, layout)
    layout = distributed.with_head_offsets(layout, shard)
    devices = distributed.execution_devices(model, layout)
    _check_fits(model, layout, config, shard, devices)
    return layout, shard, _choose_backend(model, config, devices, layout.head_dim)


def _check_fits(
    model: torch.nn.Module,
    layout: ModelLayout,
    config: VaSEConfig,
    shard: distributed.Sharding,
    devices: list[torch.device],
) -> None:
    """Refuse (naming `budget`) a buffer that one sequence could never allocate: per device the
    layers run on (accelerate's execution devices; offloaded weights do not count), this
    process's KV heads only (a tensor-parallel rank holds its shard)."""
    dtype = distributed.compute_dtype(model)
    if dtype is None:
        return
    for device, layers in Counter(devices).items():
        if device.type == "cuda":
            available, where = torch.cuda.get_device_properties(device).total_memory, f"GPU memory ({device})"
        else:
            available, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
        need = footprint.kv_bytes_per_token(layers, shard.kv_heads, layout.head_dim, dtype.itemsize)
        config.check_fits(need, available, where)


def _choose_backend(model: torch.nn.Module, config: VaSEConfig, devices: list[torch.device], head_dim: int) -> str:
    """The attention backend for `model` (ValueError naming `attn_backend` if unavailable): one
    that runs on every device its attention layers execute on, with heads of `head_dim`."""
    if config.attn_backend in (None, "auto") and model.config._attn_implementation == "eager":
        return "eager"  # the user asked the model for eager attention: keep it
    return backends.choose_backend(config.attn_backend, devices, distributed.compute_dtype(model), head_dim)


def _apply(model: torch.nn.Module, layout: ModelLayout, state: PatchState) -> None:
    handle, undo = state.handle, state.undo
    original_config = layout.base_model.config
    private = copy.copy(original_config)
    private.__dict__["_attn_implementation_internal"] = attention.ATTN_IMPLEMENTATION
    private.__dict__[attention.BACKEND_ATTR] = handle.attn_backend
    private.__dict__[attention.ORIGINAL_ATTR] = original_config._attn_implementation
    for module in layout.base_model.modules():
        if module.__dict__.get("config") is original_config:
            set_instance_attr(module, "config", private, undo)

    for module in layout.attention_modules:
        previous = module.__dict__.get("forward", MISSING)
        set_instance_attr(module, "forward", AttentionForward(module, previous), undo)
    base = layout.base_model
    set_instance_attr(base, "forward", BaseForward(state, base.__dict__.get("forward", MISSING)), undo)
    set_instance_attr(model, "generate", GenerateCall(model, state, model.__dict__.get("generate", MISSING)), undo)
    previous = model.__dict__.get("_prepare_cache_for_generation", MISSING)
    set_instance_attr(model, "_prepare_cache_for_generation", PrepareCache(model, handle, previous), undo)
    for owner in {id(m): m for m in (model, base)}.values():  # the model and its decoder stack, where they differ
        previous = owner.__dict__.get("set_attn_implementation", MISSING)
        set_instance_attr(owner, "set_attn_implementation", SetAttnImplementation(owner, private, previous), undo)
    batching = callable(getattr(model, "init_continuous_batching", None))
    if handle.config.evicts and batching and evicts_in_continuous_batching():
        previous = model.__dict__.get("init_continuous_batching", MISSING)
        set_instance_attr(model, "init_continuous_batching", InitContinuousBatching(model, state, previous), undo)
    install_compile_support(model, undo)


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `model` is currently patched by vasepatch (for a `torch.compile(model)`
    wrapper: whether the model inside it is)."""
    model = _compiled_inner(model) or model
    return model.__dict__.get(STATE_ATTR) is not None


def unpatch(model: torch.nn.Module) -> None:
    """Restore `model` exactly as it was before `patch` (forwards, configs, generation).

    A `torch.compile(model)` wrapper unpatches the model inside it. Raises
    `NotPatchedError` if it is not patched, and `ModelInUseError` (changing nothing) while
    a `generate` or forward call runs on it in another thread."""
    model = _compiled_inner(model) or model
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise NotPatchedError("this model is not patched by vasepatch")
    state.remove()


@contextmanager
def patched(model: torch.nn.Module, budget: int | None = None, **settings: Any) -> Iterator[PatchHandle]:
    """`with vasepatch.patched(model, budget=...) as handle:` — unpatched on exit, even on error."""
    handle = patch(model, budget, **settings)
    try:
        yield handle
    finally:
        if handle.active:
            unpatch(model)
