"""`LayerPlan`: what one decoder layer's cache must respect, fixed when the model is patched."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vasepatch.policies.base import head_ids


@dataclass(frozen=True)
class LayerPlan:
    """Per-layer facts a `VaSELayer` needs beyond the `VaSEConfig` shared by all layers.

    - `index`: the decoder layer's index (part of the key of its eviction randomness).
    - `sliding_window`: the layer attends to at most this many latest tokens, itself
      included (a sliding-window layer); `None` for a global layer.
    - `head_offset`: the global index of the first KV head this process holds (tensor
      parallelism shards the heads; 0 on one device).
    - `kv_heads`: the layer's KV heads over all processes (0: those this process holds, all of them on one
      device).
    """

    index: int
    sliding_window: int | None = None
    head_offset: int = 0
    kv_heads: int = 0

    def head_ids(self, local_heads: int, batch: int, device: torch.device) -> torch.Tensor:
        """`[batch, local_heads]` int64: the policies' `head_ids` of this process's heads of the layer
        (`policies.base.head_ids`)."""
        layer = torch.tensor([self.index], device=device)
        return head_ids(layer, local_heads, self.head_offset, self.kv_heads).expand(batch, local_heads)


def default_plans(num_layers: int) -> tuple[LayerPlan, ...]:
    """Plans of `num_layers` global-attention layers on one device."""
    return tuple(LayerPlan(i) for i in range(num_layers))
