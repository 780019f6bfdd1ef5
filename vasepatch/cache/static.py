"""Allocating static buffers, for `torch.compile` and CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def allocating(compiling: bool) -> Iterator[Callable[..., None]]:
    """Around an allocation: eagerly, with inference mode off, so that the buffers are normal tensors
    (a prefill under `torch.inference_mode()` followed by decode steps under `torch.no_grad()` must
    still write them in place, which an inference tensor refuses outside the mode, and
    `copy.deepcopy` copies them). Yields `mark(*tensors)`, which tells dynamo that the buffers keep
    their address (CUDA graphs may then read and write them in place); while `compiling` it does
    nothing, since marking is not allowed while tracing (nor can dynamo ask for the mode)."""

    def mark(*tensors: torch.Tensor) -> None:
        if not compiling:
            for t in tensors:
                torch._dynamo.mark_static_address(t)

    if compiling or not torch.is_inference_mode_enabled():
        yield mark
        return
    with torch.inference_mode(False):
        yield mark
