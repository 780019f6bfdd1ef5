"""Make both of transformers' compile routes work with the vasepatch cache.

1. `model.forward = torch.compile(model.forward, fullgraph=True)`: a forward hook
   (`wrappers.settle_compiled_steps`) runs in `nn.Module.__call__`, outside the compiled forward, and does
   the step's host-side bookkeeping.
2. `generate()` compiling the decode step itself (the cache is compileable): it would
   compile `__call__`, hooks included; `CompiledCall` compiles `forward` and runs the hook
   after it instead.

In both, generate builds the decode step's mask with `create_masks_for_generate`; the
vasepatch cache needs only the padding flags of the new tokens, a `[batch, new tokens]`
slice whose shape does not grow with the sequence (`CreateMasks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vasepatch.cache import VaSECache
from vasepatch.integration.handle import MISSING, set_instance_attr
from vasepatch.integration.wrappers import find_cache, settle_compiled_steps


class RemoveHook:
    """Undo record of the forward hook (a picklable object, like the rest of the patch)."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def __call__(self) -> None:
        self.hook.remove()


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


class CompiledCall:
    """`get_compiled_call`: generate's compiled decode step, with the hook run after it.
    The compiled function is neither copied nor pickled (a copy compiles its own)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._compiled: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model, "_compiled": {}}

    def __call__(self, compile_config: Any = None) -> Callable[..., Any]:
        model, compiled = self.model, self._compiled
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
            settle_compiled_steps(model, args, kwargs, out)
            return out

        return call


class CreateMasks:
    """`create_masks_for_generate`: the static-shape padding slice for a vasepatch cache,
    transformers' own masks (from the model's own config) for any other cache."""

    def __init__(self, model: torch.nn.Module, previous: Any) -> None:
        self.model, self.previous = model, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask")
        if isinstance(find_cache(kwargs), VaSECache) and (mask is None or mask.dim() == 2):
            embeds = kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
            # a fresh tensor: a view would carry the growing row stride into the graph's guards
            return None if mask is None else mask[:, -embeds.shape[1] :].clone(memory_format=torch.contiguous_format)
        if self.previous is not MISSING:
            return self.previous(*args, **kwargs)
        own = getattr(type(self.model), "create_masks_for_generate", None)
        if own is not None:
            return own.__get__(self.model, type(self.model))(*args, **kwargs)
        from transformers.masking_utils import create_masks_for_generate as default_masks

        return default_masks(*args, **kwargs)


def install_compile_support(model: torch.nn.Module, undo: list[Callable[[], None]]) -> None:
    """Install the hook, `get_compiled_call` and `create_masks_for_generate` (see the module docstring)."""
    hook = model.register_forward_hook(settle_compiled_steps, with_kwargs=True)
    undo.append(RemoveHook(hook))
    set_instance_attr(model, "get_compiled_call", CompiledCall(model), undo)
    previous = model.__dict__.get("create_masks_for_generate", MISSING)
    set_instance_attr(model, "create_masks_for_generate", CreateMasks(model, previous), undo)
