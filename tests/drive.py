"""Drive a `VaSELayer` by hand, the way the attention integration does, without a model."""

from __future__ import annotations

import torch

from vasepatch.cache import VaSELayer
from vasepatch.integration.kernels import grouped_attention


def step(layer: VaSELayer, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, padding: torch.Tensor | None = None):
    """One forward step of one layer: append, attend, observe queries, maybe evict.

    Returns the attention output `[B, Q, Hq, D]` and whether an eviction ran.
    """
    layer.prepare_step(padding)
    keys, values = layer.update(k, v)
    out = grouped_attention(q, keys, values, layer.step_mask(), q.shape[-1] ** -0.5)
    layer.observe_queries(q)
    return out, layer.maybe_evict()
