"""The parts of transformers' cache-layer API that a fixed-size, fixed-batch layer refuses or fixes."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class FixedBatchLayer(CacheLayerMixin):
    """A cache layer whose batch is fixed at the first step and whose evicted tokens are gone:
    no cropping, no batch expansion or selection, no maximum sequence length."""

    is_croppable = False
    is_sliding = False

    def get_max_length(self) -> int:
        return -1  # the sequence length is unbounded; the buffer is not

    def get_max_cache_shape(self) -> int:  # what older 5.x releases call `get_max_length`
        return self.get_max_length()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("vasepatch caches cannot be cropped (evicted tokens are gone)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("vasepatch caches have a fixed batch size; expand inputs before the prefill")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("vasepatch caches have a fixed batch size")
