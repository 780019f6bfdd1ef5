"""The callables a patch installs on the model instance, as objects rather than closures.

Each holds references to the modules it wraps (so a deep copy of the model maps them to
the copy's modules, and pickling stores them with the model) and finds the method it
replaced at call time (`original_method`).

- `PATCHED_CALL`, `padding_mask_passthrough`, `register`: which call is running, the mask function of the
  `"vasepatch"` attention implementation, and its registration with transformers.
- `settle_compiled_steps`: the model's forward hook; runs the host part of a compiled step.
- `PatchState`: what `patch` leaves on the model (its handle, the undo records) and the calls
  in flight, which the wrappers count.

- `AttentionForward`: an attention module's forward; hands its `VaSELayer` to the kernel.
- `BaseForward`: the decoder stack's forward; checks a vasepatch call before any work
  (training-mode dropout), tells the mask function and the cache which call is running
  (`PATCHED_CALL`), counts the call in flight, and warns once (`warn_not_evicting`) when a call
  ran with another cache, which evicts nothing.
- `GenerateCall`: `generate`, counted in flight, so that `unpatch` cannot pull the patch
  from under a running generation.
- `PrepareCache`: `_prepare_cache_for_generation`; gives `generate()` a fresh `VaSECache`,
  refuses a used one.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from vasepatch.cache import VaSECache
from vasepatch.errors import ModelInUseError, NoEvictionWarning
from vasepatch.integration import attention
from vasepatch.integration.compat import CACHE_NAMES, output_cache
from vasepatch.integration.handle import MISSING, PatchHandle

OUTSIDE = object()
"""`PATCHED_CALL` outside any patched model's forward."""
PATCHED_CALL: ContextVar[Any] = ContextVar("vasepatch_patched_call", default=OUTSIDE)
"""The cache given to the patched model's forward now running in this thread (a `VaSECache`,
another `Cache`, or None), set by the patch around its decoder stack's forward
(`BaseForward`); `OUTSIDE` elsewhere."""


def transformers_path() -> bool:
    """Whether the running call goes through transformers' own attention (no vasepatch cache)."""
    if torch.compiler.is_compiling():
        return False
    current = PATCHED_CALL.get()
    return current is not OUTSIDE and not isinstance(current, VaSECache)


def padding_mask_passthrough(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """Mask function: for a vasepatch call, the 2-D padding mask (`[B, S]` bool) unchanged, or
    `None` when there is none or, eagerly, it has no padding (`_all_real`); sizes and offsets,
    whose names vary across releases, are ignored. For any other call, the mask of the model's
    own attention implementation."""
    config = kwargs.get("config")
    original = getattr(config, attention.ORIGINAL_ATTR, None)
    if original is None or not transformers_path():
        return None if _all_real(attention_mask, kwargs.get("q_length")) else attention_mask
    if original not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None  # what transformers does for an implementation without a mask function
    return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, attention_mask=attention_mask, **kwargs)


def _all_real(attention_mask: torch.Tensor | None, q_length: int | None) -> bool:
    """Whether an eager vasepatch call's 2-D mask marks every token real: it is then dropped (the
    layers' mask-free fast path), one reduction per forward, as transformers' own SDPA mask does.
    Never under compilation (the compiled step keeps one graph whatever the mask holds)."""
    if attention_mask is None or attention_mask.dim() != 2 or torch.compiler.is_compiling():
        return False
    if not isinstance(PATCHED_CALL.get(), VaSECache):
        return False
    if q_length is not None and attention_mask.shape[-1] < q_length:
        return False  # too short: the layer names the problem
    return bool(attention_mask.all())


def register() -> None:
    """Register the `"vasepatch"` attention implementation (`attention.vasepatch_attention`) and its mask
    function with transformers (idempotent)."""
    AttentionInterface.register(attention.ATTN_IMPLEMENTATION, attention.vasepatch_attention)
    AttentionMaskInterface.register(attention.ATTN_IMPLEMENTATION, padding_mask_passthrough)


def original_method(obj: Any, name: str, previous: Any) -> Callable[..., Any]:
    """What `obj.name` was before the patch: the instance attribute it replaced, or the class's."""
    if previous is not MISSING:
        return previous
    return getattr(type(obj), name).__get__(obj, type(obj))


class PatchState:
    """What `patch` leaves on the model: its handle, the undo records, the calls in flight."""

    def __init__(self, handle: PatchHandle) -> None:
        self.handle = handle
        self.undo: list[Callable[[], None]] = []
        self.removed = False
        self.in_flight = 0
        self.warned_not_evicting = False  # `warn_not_evicting` has spoken for this patch
        self._lock = threading.Lock()

    @contextmanager
    def call(self) -> Iterator[bool]:
        """Count one call in flight while it runs; yields False if the patch is already gone
        (a call that looked the wrapper up before `unpatch` then runs the original)."""
        with self._lock:
            live = not self.removed
            self.in_flight += live
        try:
            yield live
        finally:
            if live:
                with self._lock:
                    self.in_flight -= 1

    def hold(self) -> Callable[[], None]:
        """Count a long-lived user of the patch (a running continuous-batching manager) as a call in flight until
        the returned function is called (once)."""
        with self._lock:
            live = not self.removed
            self.in_flight += live
        released = [not live]

        def release() -> None:
            with self._lock:
                if not released[0]:
                    released[0] = True
                    self.in_flight -= 1

        return release

    def remove(self) -> None:
        """Run the undo records, unless a call is in flight (`ModelInUseError`, nothing changed)."""
        with self._lock:
            if self.in_flight:
                raise ModelInUseError(
                    f"cannot unpatch: {self.in_flight} generate/forward call(s) or continuous-batching manager(s) are "
                    "running on this model (in another thread, or the caller is inside one, e.g. a streamer or hook; "
                    "a manager runs from its start() to its stop()); "
                    "wait for them to finish, then unpatch"
                )
            self.removed = True
            for restore in reversed(self.undo):
                restore()

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles carry the patch, not the calls in flight nor the lock."""
        state = self.__dict__.copy()
        del state["_lock"]
        state["in_flight"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        register()  # a model unpickled in a fresh process needs the kernel registered


def find_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a call was given (any type), or None."""
    return next((kwargs[name] for name in CACHE_NAMES if name in kwargs), None)


def settle_compiled_steps(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook of the patched model: the host part of a compiled step (`VaSECache.complete_step`),
    after the compiled forward; nothing after an eager one (no layer has a step pending)."""
    cache = find_cache(kwargs)
    if isinstance(cache, VaSECache) and any(layer.pending for layer in cache.layers):
        cache.complete_step()


def by_name(function: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Bind everything besides the first positional argument by name, so the cache is found."""
    if not args[1:]:
        return args, kwargs
    bound = inspect.signature(function).bind_partial(*args, **kwargs)
    return (), {**bound.arguments.pop("kwargs", {}), **bound.arguments}


class AttentionForward:
    """An attention module's forward: with a `VaSECache`, hands the module's `VaSELayer` to
    the vasepatch kernel; with anything else, runs the module as it is."""

    def __init__(self, module: torch.nn.Module, previous: Any) -> None:
        self.module, self.previous = module, previous

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(original_method(self.module, "forward", self.previous))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = original_method(self.module, "forward", self.previous)
        args, kwargs = by_name(original, args, kwargs)
        cache = find_cache(kwargs)
        if not isinstance(cache, VaSECache):
            if not torch.compiler.is_compiling() and transformers_path():
                kwargs[attention.OWN_PATH_KWARG] = True  # the kernel runs the model's own attention
            paged = getattr(cache, attention.PAGED_ATTR, None)
            if paged is not None:  # an evicting continuous batching (`integration.continuous`)
                kwargs[attention.PAGED_KWARG] = paged
            return original(*args, **kwargs)
        layer = cache.layers[self.module.layer_idx]
        kwargs[attention.LAYER_KWARG] = layer
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        called_alone, layer.in_step = not layer.in_step, True  # the layer's guard: a patched call
        try:
            return original(*args, **kwargs)
        finally:
            layer.in_step = not called_alone


class BaseForward:
    """The decoder stack's forward (see the module docstring)."""

    def __init__(self, state: PatchState, previous: Any) -> None:
        self.state, self.previous = state, previous

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._original())

    def _original(self) -> Any:
        return original_method(self.state.handle.layout.base_model, "forward", self.previous)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self._original()
        if torch.compiler.is_compiling():  # dynamo traces no context variable; the graph runs a vasepatch step
            return original(*args, **kwargs)
        args, kwargs = by_name(original, args, kwargs)
        cache = find_cache(kwargs)
        with self.state.call() as live:
            if not live:  # unpatched since this wrapper was looked up
                return original(*args, **kwargs)
            if isinstance(cache, VaSECache):
                check_cache(self.state.handle, cache)
                check_vase_call(self.state.handle)
            token = PATCHED_CALL.set(cache)
            seen = _tokens_seen(cache)
            _in_step(cache, True)  # the layers' guard: a patched call (`VaSELayer.check_patched`)
            try:
                output = original(*args, **kwargs)
            except BaseException as err:
                if _tokens_seen(cache) != seen:  # some layers completed the step, others did not
                    cache.broken = f"{type(err).__name__}: {err}"
                raise
            finally:
                _in_step(cache, False)
                PATCHED_CALL.reset(token)
        if not isinstance(cache, VaSECache):  # the patch's own cache (every decode step) has nothing to warn of
            warn_not_evicting(self.state, output_cache(output, cache))
        return output


NOT_EVICTING = (
    "this call of the patched model ran with transformers' {name}, not a vasepatch cache, so it evicts nothing "
    "and its KV cache grows with every token (transformers' own path: the unpatched model's outputs). To evict, "
    "pass the patch's cache: model(ids, {keyword}=handle.new_cache()), and feed back out.{keyword}; "
    "generate() makes one itself unless it is given a cache or a cache_implementation. use_cache=False needs "
    "none. (Shown once per patch.)"
)


def warn_not_evicting(state: PatchState, used: Any) -> None:
    """Warn once per patch (`NoEvictionWarning`) when a call of the patched model ran with a cache that
    is not vasepatch's, `used`: the one it was given, or the `DynamicCache` transformers built for a
    plain `model(ids)`. A call without a cache (`use_cache=False`) has nothing to evict: silent."""
    if state.warned_not_evicting or used is None or isinstance(used, VaSECache) or not state.handle.config.evicts:
        return  # `policy="full"` evicts nothing by its own choice
    if getattr(used, attention.PAGED_ATTR, None) is not None:  # continuous batching that evicts
        return
    state.warned_not_evicting = True
    message = NOT_EVICTING.format(name=type(used).__name__, keyword=state.handle.cache_keyword)
    warnings.warn(message, NoEvictionWarning, stacklevel=_callers_level())


def _callers_level() -> int:
    """The `stacklevel` of the first frame outside vasepatch, torch and transformers: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in INTERNAL:
        frame, level = frame.f_back, level + 1
    return level


INTERNAL = frozenset({"vasepatch", "torch", "transformers"})


def _in_step(cache: Any, flag: bool) -> None:
    """Mark a `VaSECache`'s layers as in (or out of) a patched model's call."""
    if isinstance(cache, VaSECache):
        for layer in cache.layers:
            layer.in_step = flag


def _tokens_seen(cache: Any) -> list[int] | None:
    """Each layer's token count of a `VaSECache` (None for any other cache)."""
    return [layer.counters.tokens_seen for layer in cache.layers] if isinstance(cache, VaSECache) else None


def check_cache(handle: PatchHandle, cache: VaSECache) -> None:
    """Refuse, before any work, a `VaSECache` this patched model cannot run: one left broken by a
    failed step, or one made for another model (its layers, their plans, KV heads or head size
    differ) or by another patch (another model's, or an earlier patch of this model)."""
    if cache.broken is not None:
        raise RuntimeError(
            f"this VaSECache was left part-way through a step by an error ({cache.broken[:200]}): its layers hold "
            "different tokens; call cache.reset() or make a new cache with handle.new_cache()"
        )
    if cache.owner is not None and cache.owner == handle.cache_owner:
        return
    fix = "make the cache with this model's handle.new_cache()"
    layout, n = handle.layout, len(cache.layers)
    if n != len(layout.attention_modules):
        raise ValueError(f"this VaSECache has {n} layers and this model {len(layout.attention_modules)}: {fix}")
    for ours, theirs in zip(layout.layer_plans(), (layer.plan for layer in cache.layers), strict=True):
        if ours.sliding_window != theirs.sliding_window:
            raise attention.window_error(
                ours.index, ours.sliding_window, theirs.sliding_window, f"this VaSECache's; {fix}"
            )
        if ours != theirs:
            raise ValueError(f"this VaSECache's layer plan {theirs} differs from this model's {ours}: {fix}")
    if cache.owner is not None:
        raise ValueError(
            f"this VaSECache was made by another patch (of another model, or an earlier patch of this one; "
            f"{_settings_diff(cache.config, handle.config)}): {fix}"
        )
    shapes = {(layer.num_heads, layer.keys.shape[-1]) for layer in cache.layers if layer.is_initialized}
    if shapes - {(handle.shard.kv_heads, layout.head_dim)}:
        raise ValueError(
            f"this VaSECache holds (KV heads, head size) {sorted(shapes)}, and this model has "
            f"{(handle.shard.kv_heads, layout.head_dim)}: {fix}"
        )


def _settings_diff(cache: Any, ours: Any) -> str:
    changed = [
        f"{f.name}={getattr(cache, f.name)!r} there, {getattr(ours, f.name)!r} here"
        for f in dataclasses.fields(ours)
        if getattr(cache, f.name) != getattr(ours, f.name)
    ]
    return "settings " + ", ".join(changed) if changed else "the same settings"


def check_vase_call(handle: PatchHandle) -> None:
    """Refuse, before any work, a vasepatch step that would differ from the unpatched model."""
    layout = handle.layout
    if not layout.base_model.training:
        return
    rates = sorted({float(getattr(m, "attention_dropout", 0.0) or 0.0) for m in layout.attention_modules})
    if rates[-1] > 0:
        raise RuntimeError(
            f"the model is in training mode with attention_dropout={rates[-1]:g}, and the vasepatch cache does "
            "not apply attention dropout, so its outputs would differ from the unpatched model's. Call "
            "model.eval() before generating; to train, run without a vasepatch cache (use_cache=False runs "
            "transformers' own attention, dropout included)"
        )


class GenerateCall:
    """`generate`, counted as a call in flight for its whole length."""

    def __init__(self, model: torch.nn.Module, state: PatchState, previous: Any) -> None:
        self.model, self.state, self.previous = model, state, previous

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(original_method(self.model, "generate", self.previous))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.state.call():
            return original_method(self.model, "generate", self.previous)(*args, **kwargs)


class PrepareCache:
    """`_prepare_cache_for_generation`: a fresh `VaSECache` when generate would build its
    default cache; a user's cache or `cache_implementation` goes to transformers."""

    def __init__(self, model: torch.nn.Module, handle: PatchHandle, previous: Any) -> None:
        self.model, self.handle, self.previous = model, handle, previous

    def __call__(self, generation_config: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        handle = self.handle
        user_cache = find_cache(model_kwargs)
        config = user_cache.config if isinstance(user_cache, VaSECache) else handle.config
        if getattr(generation_config, "prefill_chunk_size", None) and config.prefill in ("keep", "pin"):
            raise ValueError(
                f"prefill_chunk_size cannot be used with prefill={config.prefill!r}: that buffer is sized by the "
                "first step, so a chunked prompt would not be kept whole; use prefill='compress' (the default)"
            )
        if isinstance(user_cache, VaSECache):
            check_cache(handle, user_cache)
            check_unused(user_cache, model_kwargs, generation_config)
        wants_default = generation_config.cache_implementation in (None, "dynamic")
        if user_cache is None and generation_config.use_cache is not False and wants_default:
            model_kwargs[handle.cache_keyword] = handle.new_cache()
            return None
        original = original_method(self.model, "_prepare_cache_for_generation", self.previous)
        return original(generation_config, model_kwargs, *args, **kwargs)


class SetAttnImplementation:
    """`set_attn_implementation` on a patched model. Transformers sets the new implementation on every config of
    the model, the patch's private copy included, which would turn the patch's kernel off with nothing said:
    continuous batching (`generate_batch`) does it for an `eager` model, and sets the old one back on `stop()`,
    after which `generate` would attend over a vasepatch cache with transformers' own kernel and give wrong
    tokens. The new implementation becomes what the patched model runs where it does not evict (its own path,
    `attention.ORIGINAL_ATTR`), and the private config keeps `"vasepatch"`."""

    def __init__(self, model: torch.nn.Module, private: Any, previous: Any) -> None:
        self.model, self.private, self.previous = model, private, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = original_method(self.model, "set_attn_implementation", self.previous)(*args, **kwargs)
        chosen = self.private.__dict__.get("_attn_implementation_internal")
        own = self.model.__dict__.get("config")
        if chosen == attention.ATTN_IMPLEMENTATION and own is not None and own is not self.private:
            # older transformers (5.0) skips a submodel whose config has the called model's config class, so only
            # the called model's own config holds the new implementation
            chosen = own.__dict__.get("_attn_implementation_internal", chosen)
        if chosen != attention.ATTN_IMPLEMENTATION:
            self.private.__dict__[attention.ORIGINAL_ATTR] = chosen
            self.private.__dict__["_attn_implementation_internal"] = attention.ATTN_IMPLEMENTATION
        return result


def input_length(model_kwargs: dict[str, Any], generation_config: Any) -> int | None:
    """The length of generate's input: its 2-D mask, or, where transformers dropped an all-ones mask
    (5.24 and later), the length it recorded (`_mask_length`), or the input embeddings'."""
    mask, embeds = model_kwargs.get("attention_mask"), model_kwargs.get("inputs_embeds")
    if mask is not None:
        return mask.shape[-1]
    recorded = getattr(generation_config, "_mask_length", None)
    if isinstance(recorded, int):
        return recorded
    return embeds.shape[1] if embeds is not None else None


def check_unused(cache: VaSECache, model_kwargs: dict[str, Any], generation_config: Any = None) -> None:
    """A used cache may only continue its own sequence: the input must hold more tokens than
    the cache has seen (transformers then feeds only the new ones)."""
    seen = cache.tokens_seen()
    if not seen:
        return
    length = input_length(model_kwargs, generation_config)
    if length is None or length <= seen:
        raise ValueError(
            f"this VaSECache already holds {seen} tokens (a previous generation), and the input has "
            f"{'unknown' if length is None else length}: generate would continue from the cache and drop the "
            "prompt. Pass a fresh cache (handle.new_cache()) or call cache.reset() first; to continue that "
            "generation, pass its whole sequence followed by the new tokens"
        )
