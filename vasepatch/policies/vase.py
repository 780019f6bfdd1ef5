"""VaSE-AttnV: protect sinks and large-range values, sample the rest by attention.

Source: Chang et al., "Value-Aware Stochastic KV Cache Eviction for Reasoning
Models" (arXiv 2606.03928), the "sample attn + V" recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vasepatch.policies import scoring


@dataclass(frozen=True)
class VaSEPolicy:
    """VaSE-AttnV selection.

    1. `protect` slots go first to the sinks (candidates with `position < sinks`),
       then to the candidates whose value vectors have the largest `score`
       (`"range"` = max - min over the head dimension, `"l2"`, `"var"`).
    2. The other `n_keep - protect` are drawn without replacement with probability
       proportional to the window attention scores (softmax at `temperature`,
       averaged over the window and the GQA group, smoothed by an average pool of
       width `smooth`), by Gumbel-top-k. With `sample=False` they are the
       deterministic top-k instead (the paper's "top-k" ablation).

    Options: `protect` (default 0: no protection beyond what the caller asks),
    `sinks`, `temperature`, `smooth`, `score`, `sample`.
    """

    protect: int = 0
    sinks: int = 4
    temperature: float = 1.0
    smooth: int = 5
    score: str = "range"
    sample: bool = True

    def __post_init__(self) -> None:
        if self.score not in scoring.VALUE_SCORES:
            raise ValueError(f"score must be one of {scoring.VALUE_SCORES}, got {self.score!r}")
        if self.protect < 0 or self.sinks < 0 or self.smooth < 1 or not self.temperature > 0:
            raise ValueError(
                "VaSEPolicy needs protect >= 0, sinks >= 0, smooth >= 1 and temperature > 0, got "
                f"protect={self.protect}, sinks={self.sinks}, smooth={self.smooth}, temperature={self.temperature}"
            )

    def protected_mask(self, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, n_keep: int):
        """`[B, H, N]` bool: the valid candidates that take the protected slots."""
        r = scoring.value_scores(values, self.score)
        r = torch.where(positions < self.sinks, torch.full_like(r, float("inf")), r)
        r = r.masked_fill(~valid, float("-inf"))
        n_protect = min(self.protect, n_keep)
        top = torch.topk(r, n_protect, dim=-1, sorted=False).indices
        return scoring.mask_of(top, r.shape[-1]) & valid

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        scoring.check_inputs(keys, values, queries, positions, valid, n_keep)
        protected = self.protected_mask(values, positions, valid, n_keep)
        attn = scoring.window_attention(keys, queries, valid, self.temperature, self.smooth)
        key = scoring.log_weights(attn)
        if self.sample:
            key = key + scoring.gumbel_noise(key.shape, key.device, generator)
        priority = scoring.compose_priority(protected, key, valid)
        return scoring.top_k_by_priority(priority, n_keep)
