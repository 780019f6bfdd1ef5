"""Drive a `VaSELayer` by hand, without a model, through the production step function."""

from __future__ import annotations

import torch

from vasepatch.cache import VaSELayer
from vasepatch.integration.attention import attention_step


def step(
    layer: VaSELayer,
    k: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    padding: torch.Tensor | None = None,
    backend: str = "sdpa",
):
    """One forward step of one layer (append, attend, record the queries, evict if due),
    exactly as a patched attention module runs it.

    Returns the attention output `[B, Q, Hq, D]` and whether an eviction ran.
    """
    return attention_step(layer, q, k, v, padding, q.shape[-1] ** -0.5, backend)
