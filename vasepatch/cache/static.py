"""Static buffers for `torch.compile` and CUDA graphs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these buffers keep their address (CUDA graphs may then read and write
    them in place). Only eagerly: marking is not allowed while tracing."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def outside_inference_mode(fn: F) -> F:
    """Run `fn` (an allocation) with inference mode off, so that its buffers are normal tensors:
    a prefill under `torch.inference_mode()` followed by decode steps under `torch.no_grad()`
    must still write them in place (an inference tensor refuses that outside the mode), and
    `copy.deepcopy` copies them."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():  # dynamo cannot ask
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
