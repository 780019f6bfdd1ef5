"""The callables a patch installs on the model instance, as objects rather than closures.

Each holds references to the modules it wraps (so a deep copy of the model maps them to
the copy's modules, and pickling stores them with the model) and finds the method it
replaced at call time (`handle.original_method`).

- `AttentionForward`: an attention module's forward; hands its `VaSELayer` to the kernel.
- `BaseForward`: the decoder stack's forward; checks a vasepatch call before any work
  (training-mode dropout), tells the mask function and the cache which call is running
  (`PATCHED_CALL`), counts the call in flight.
- `GenerateCall`: `generate`, counted in flight, so that `unpatch` cannot pull the patch
  from under a running generation.
- `PrepareCache`: `_prepare_cache_for_generation`; gives `generate()` a fresh `VaSECache`,
  refuses a used one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vasepatch.cache import VaSECache
from vasepatch.cache.cache import PATCHED_CALL
from vasepatch.integration import attention
from vasepatch.integration.handle import PatchHandle, PatchState, original_method


def find_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a call was given (any type), or None."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


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
            return original(*args, **kwargs)
        layer = cache.layers[self.module.layer_idx]
        kwargs[attention.LAYER_KWARG] = layer
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        layer.in_step = True  # lets the layer's `update` tell a patched call from a stray one
        try:
            return original(*args, **kwargs)
        finally:
            layer.in_step = False


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
                check_vase_call(self.state.handle)
            token = PATCHED_CALL.set(cache)
            try:
                return original(*args, **kwargs)
            finally:
                PATCHED_CALL.reset(token)


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
        if getattr(generation_config, "prefill_chunk_size", None) and handle.config.prefill == "keep":
            raise ValueError(
                "prefill_chunk_size cannot be used with prefill='keep': that buffer is sized by the first "
                "step, so a chunked prompt would not be kept whole; use prefill='compress' (the default)"
            )
        if isinstance(user_cache, VaSECache):
            check_unused(user_cache, model_kwargs)
        wants_default = generation_config.cache_implementation in (None, "dynamic")
        if user_cache is None and generation_config.use_cache is not False and wants_default:
            model_kwargs[handle.cache_keyword] = handle.new_cache()
            return None
        original = original_method(self.model, "_prepare_cache_for_generation", self.previous)
        return original(generation_config, model_kwargs, *args, **kwargs)


def check_unused(cache: VaSECache, model_kwargs: dict[str, Any]) -> None:
    """A used cache may only continue its own sequence: the input must hold more tokens than
    the cache has seen (transformers then feeds only the new ones)."""
    seen = cache.tokens_seen()
    if not seen:
        return
    mask, embeds = model_kwargs.get("attention_mask"), model_kwargs.get("inputs_embeds")
    length = mask.shape[-1] if mask is not None else embeds.shape[1] if embeds is not None else None
    if length is None or length <= seen:
        raise ValueError(
            f"this VaSECache already holds {seen} tokens (a previous generation), and the input has "
            f"{'unknown' if length is None else length}: generate would continue from the cache and drop the "
            "prompt. Pass a fresh cache (handle.new_cache()) or call cache.reset() first; to continue that "
            "generation, pass its whole sequence followed by the new tokens"
        )
