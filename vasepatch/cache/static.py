"""Static buffers for `torch.compile` and CUDA graphs."""

from __future__ import annotations

import torch


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these buffers keep their address (CUDA graphs may then read and write
    them in place). Only eagerly: marking is not allowed while tracing."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)
