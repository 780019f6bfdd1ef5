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
- a forward hook finishes each step on the host (counters, eviction) when the
  forward ran compiled, and `get_compiled_call` / `create_masks_for_generate`
  are overridden so that generate's own compilation of the decode step compiles
  `forward` (keeping that hook eager) and feeds it a static-shape padding mask.

`unpatch` undoes each change in reverse order; weights are never touched.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vasepatch import policies
from vasepatch.cache import CacheMonitor, VaSECache
from vasepatch.config import VaSEConfig
from vasepatch.errors import AlreadyPatchedError, NotPatchedError
from vasepatch.integration import attention, backends
from vasepatch.integration.compat import check_transformers
from vasepatch.integration.families import ModelLayout, inspect_model

STATE_ATTR = "_vasepatch_state"
_MISSING = object()


class PatchHandle:
    """What `patch` returns: statistics, a cache factory, and `remove()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: VaSEConfig,
        policy: policies.Policy | None,
        layout: ModelLayout,
        attn_backend: str = "sdpa",
    ):
        self.model = model
        self.config = config
        self.policy = policy
        self.layout = layout
        self.attn_backend = attn_backend
        """The attention backend chosen at patch time (see `VaSEConfig.attn_backend`)."""
        self.monitor = CacheMonitor()
        self.cache_keyword = _cache_keyword(model)
        """The keyword under which the model takes a cache: `"cache"` (recent transformers)
        or `"past_key_values"` (older 5.x releases)."""

    def new_cache(self, config: VaSEConfig | None = None) -> VaSECache:
        """A fresh cache for one generation (what `generate()` gets automatically).

        Pass it to the model under `handle.cache_keyword` to drive it by hand:
        `model(input_ids, **{handle.cache_keyword: handle.new_cache()})`. With
        `config`, the cache follows those settings instead of the patch's (another
        policy or budget on the same patched model); `stats()` does not track it.
        """
        n_layers = len(self.layout.attention_modules)
        if config is None:
            return VaSECache(self.config, self.policy, n_layers, self.monitor)
        if not isinstance(config, VaSEConfig):
            raise ValueError(f"config must be a vasepatch.VaSEConfig, got {type(config).__name__}")
        return VaSECache(config, policy_for(config), n_layers)

    def stats(self) -> dict[str, int]:
        """Counters of the most recent generation.

        `evictions` (eviction rounds), `evicted_tokens` (slots dropped per row and
        KV head), `tokens_seen` (sequence length incl. padding), `occupancy` (max
        over layers of slots in use), `budget`, `window`, `capacity` (slots
        allocated per layer, row and KV head), `kv_bytes` (K+V buffer bytes, all
        layers), `layers`, `generations` (caches created by this patch).
        """
        return self.monitor.snapshot(self.config.budget, self.config.window)

    @property
    def active(self) -> bool:
        state = getattr(self.model, STATE_ATTR, None)
        return state is not None and state.handle is self

    def remove(self) -> None:
        """Same as `vasepatch.unpatch(model)`."""
        unpatch(self.model)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self.remove()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PatchHandle(policy={c.policy!r}, budget={c.budget}, window={c.window}, "
            f"attn_backend={self.attn_backend!r}, active={self.active})"
        )


class _PatchState:
    def __init__(self, handle: PatchHandle) -> None:
        self.handle = handle
        self.undo: list[Callable[[], None]] = []


def _set_instance_attr(obj: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    previous = obj.__dict__.get(name, _MISSING)

    def restore() -> None:
        if previous is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = previous

    obj.__dict__[name] = value
    undo.append(restore)


def _cache_keyword(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _wrap_attention(module: torch.nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if args[1:]:  # anything besides hidden_states given positionally: bind by name
            bound = signature.bind_partial(*args, **kwargs)
            args, kwargs = (), {**bound.arguments.pop("kwargs", {}), **bound.arguments}
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, VaSECache):
            return original(*args, **kwargs)
        layer = cache.layers[module.layer_idx]
        kwargs[attention.LAYER_KWARG] = layer
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        layer.in_step = True  # lets the layer's `update` tell a patched call from a stray one
        try:
            return original(*args, **kwargs)
        finally:
            layer.in_step = False

    return forward


def _config_from_arguments(config: VaSEConfig | None, budget: int | None, **settings: Any) -> VaSEConfig:
    if config is None:
        if budget is None:
            raise ValueError("budget is required (a positive int: KV pairs kept per layer and head)")
        return VaSEConfig(budget=budget, **settings)
    if not isinstance(config, VaSEConfig):
        raise ValueError(f"config must be a vasepatch.VaSEConfig, got {type(config).__name__}")
    defaults = VaSEConfig.__dataclass_fields__
    changed = [k for k, v in settings.items() if v != defaults[k].default]
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
    config: VaSEConfig | None = None,
) -> PatchHandle:
    """Give `model` a fixed-size KV cache with VaSE eviction; returns a `PatchHandle`.

    After this, a plain `model.generate(...)` keeps at most `budget` KV pairs per
    layer and head after each eviction (evicting once every `window` decode
    steps), in buffers of `budget + window` slots per layer, row and KV head
    whatever the prompt (`prefill="keep"`: `max(prompt, budget) + window`).
    Everything is validated before the model is touched; on any error the model is
    left exactly as it was. See `VaSEConfig` for the settings.
    """
    check_transformers()
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
    )
    chosen = policy_for(cfg)
    backend = _choose_backend(model, cfg)
    attention.register()

    handle = PatchHandle(model, cfg, chosen, layout, backend)
    state = _PatchState(handle)
    try:
        _apply(model, layout, handle, state.undo)
        _set_instance_attr(model, STATE_ATTR, state, state.undo)
    except BaseException:
        for restore in reversed(state.undo):
            restore()
        raise
    return handle


def policy_for(config: VaSEConfig) -> policies.Policy | None:
    """The policy a config asks for (ValueError naming an unknown one), or None for the
    never-evicting `"full"` mode."""
    return policies.for_config(config) if config.evicts else None


def _choose_backend(model: torch.nn.Module, config: VaSEConfig) -> str:
    """The attention backend for `model` (ValueError naming `attn_backend` if unavailable)."""
    if config.attn_backend in (None, "auto") and model.config._attn_implementation == "eager":
        return "eager"  # the user asked the model for eager attention: keep it
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else None
    return backends.resolve_backend(config.attn_backend, device, dtype)


def _apply(model: torch.nn.Module, layout: ModelLayout, handle: PatchHandle, undo: list[Callable[[], None]]) -> None:
    original_config = layout.base_model.config
    private = copy.copy(original_config)
    private.__dict__["_attn_implementation_internal"] = attention.ATTN_IMPLEMENTATION
    private.__dict__[attention.BACKEND_ATTR] = handle.attn_backend
    for module in layout.base_model.modules():
        if module.__dict__.get("config") is original_config:
            _set_instance_attr(module, "config", private, undo)

    for module in layout.attention_modules:
        _set_instance_attr(module, "forward", _wrap_attention(module, module.forward), undo)

    cache_kw = handle.cache_keyword
    original_prepare = model._prepare_cache_for_generation

    def _prepare_cache_for_generation(generation_config, model_kwargs, *args: Any, **kwargs: Any):
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        wants_default = generation_config.cache_implementation in (None, "dynamic")
        if getattr(generation_config, "prefill_chunk_size", None) and handle.config.prefill == "keep":
            raise ValueError(
                "prefill_chunk_size cannot be used with prefill='keep': that buffer is sized by the first "
                "step, so a chunked prompt would not be kept whole; use prefill='compress' (the default)"
            )
        if user_cache is None and generation_config.use_cache is not False and wants_default:
            model_kwargs[cache_kw] = handle.new_cache()
            return None
        return original_prepare(generation_config, model_kwargs, *args, **kwargs)

    _set_instance_attr(model, "_prepare_cache_for_generation", _prepare_cache_for_generation, undo)
    _install_compile_support(model, undo)


def _find_cache(kwargs: dict[str, Any]) -> VaSECache | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, VaSECache) else None


def _complete_step(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook: host-side bookkeeping of a compiled step (a no-op after an eager one)."""
    cache = _find_cache(kwargs)
    if cache is not None:
        cache.complete_step()


def _install_compile_support(model: torch.nn.Module, undo: list[Callable[[], None]]) -> None:
    """Make both of transformers' compile routes work with the vasepatch cache.

    1. `model.forward = torch.compile(model.forward, fullgraph=True)`: the forward
       hook runs in `nn.Module.__call__`, outside the compiled forward.
    2. `generate()` compiling the decode step itself (the cache is compileable):
       it would compile `__call__`, hooks included; we compile `forward` and run
       the hook after it instead.
    In both, generate builds the decode step's mask with `create_masks_for_generate`;
    the vasepatch cache needs only the padding flags of the new tokens, a
    `[batch, new tokens]` slice whose shape does not grow with the sequence.
    """
    hook = model.register_forward_hook(_complete_step, with_kwargs=True)
    undo.append(hook.remove)

    compiled: dict[str, Any] = {}

    def get_compiled_call(compile_config: Any = None) -> Callable[..., Any]:
        if compile_config is None:
            default = getattr(model, "_default_compile_config", None)
            compile_config = default() if default is not None else _compile_config_class()()
        if compiled.get("config") != compile_config:
            compiled["config"] = compile_config
            compiled["forward"] = torch.compile(model.forward, **compile_config.to_dict())
        forward = compiled["forward"]

        def call(*args: Any, **kwargs: Any) -> Any:
            if _multi_token(args, kwargs):  # prefill chunks may need the eager overflow path
                return model(*args, **kwargs)
            out = forward(*args, **kwargs)
            _complete_step(model, args, kwargs, out)
            return out

        return call

    _set_instance_attr(model, "get_compiled_call", get_compiled_call, undo)

    original_masks = getattr(model, "create_masks_for_generate", None)

    def create_masks_for_generate(*args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask")
        cache = _find_cache(kwargs)
        if cache is not None and (mask is None or mask.dim() == 2):
            embeds = kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
            # a fresh tensor: a view would carry the growing row stride into the graph's guards
            return None if mask is None else mask[:, -embeds.shape[1] :].clone(memory_format=torch.contiguous_format)
        if original_masks is not None:
            return original_masks(*args, **kwargs)
        from transformers.masking_utils import create_masks_for_generate as default_masks

        return default_masks(*args, **kwargs)

    _set_instance_attr(model, "create_masks_for_generate", create_masks_for_generate, undo)


def _multi_token(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a forward's inputs hold more than one token per row."""
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
        return x is not None and x.shape[1] > 1
    return x.shape[-1] > 1


def _compile_config_class() -> type:
    from transformers.generation.configuration_utils import CompileConfig

    return CompileConfig


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `model` is currently patched by vasepatch."""
    return getattr(model, STATE_ATTR, None) is not None


def unpatch(model: torch.nn.Module) -> None:
    """Restore `model` exactly as it was before `patch` (forwards, configs, generation)."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise NotPatchedError("this model is not patched by vasepatch")
    for restore in reversed(state.undo):
        restore()


@contextmanager
def patched(model: torch.nn.Module, budget: int | None = None, **settings: Any) -> Iterator[PatchHandle]:
    """`with vasepatch.patched(model, budget=...) as handle:` — unpatched on exit, even on error."""
    handle = patch(model, budget, **settings)
    try:
        yield handle
    finally:
        if handle.active:
            unpatch(model)
