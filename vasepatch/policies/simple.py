"""Reference policies that look at no scores: StreamingLLM, uniform random, and full.

Sources: Xiao et al., "Efficient Streaming Language Models with Attention
Sinks" (arXiv 2309.17453) for `streaming`; `random` and `full` are the usual
lower and upper references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vasepatch.policies import scoring


@dataclass(frozen=True)
class StreamingPolicy:
    """Keep the sinks (`position < sinks`) and the most recent candidates. Option: `sinks`."""

    sinks: int = 4

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        scoring.check_inputs(keys, values, queries, positions, valid, n_keep)
        recency = positions.float()
        protected = scoring.sink_mask(positions, valid, self.sinks)
        return scoring.top_k_by_priority(scoring.compose_priority(protected, recency, valid), n_keep)


@dataclass(frozen=True)
class RandomPolicy:
    """Keep `n_keep` candidates drawn uniformly without replacement among the valid ones."""

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        scoring.check_inputs(keys, values, queries, positions, valid, n_keep)
        u = torch.rand(valid.shape, device=valid.device, generator=generator)
        return scoring.top_k_by_priority(u.masked_fill(~valid, float("-inf")), n_keep)


@dataclass(frozen=True)
class FullPolicy:
    """The uncompressed reference: a cache with this policy never evicts.

    Its buffer is still static, so `budget` must cover the prompt plus every
    generated token (the cache raises a clear error otherwise), like a
    `StaticCache`. `select` is never called by the cache; for completeness it keeps
    the oldest valid candidates.
    """

    evicts: ClassVar[bool] = False

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor | None,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        scoring.check_inputs(keys, values, queries, positions, valid, n_keep)
        oldest = -torch.arange(valid.shape[-1], device=valid.device, dtype=torch.float32).expand(valid.shape)
        return scoring.top_k_by_priority(oldest.masked_fill(~valid, float("-inf")), n_keep)
