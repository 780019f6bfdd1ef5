"""VaSE-AttnV: protect sinks and large-range values, sample the rest by attention.

Source: Chang et al., "Value-Aware Stochastic KV Cache Eviction for Reasoning
Models" (arXiv 2606.03928), the "sample attn + V" recipe, and its ablations
(top-k instead of sampling, l2/var instead of range, random protection, evicting
the large values on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vasepatch.policies import scoring

PROTECTIONS = ("largest", "random", "evict-largest")


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

    `protection` selects the ablations of step 1: `"largest"` (VaSE), `"random"`
    (the non-sink protected slots go to uniformly random candidates), or
    `"evict-largest"` (only the sinks are protected, and the `protect` non-sink
    candidates with the largest `score` are evicted on purpose; they are kept
    only when nothing else is left to keep).

    Options: `protect` (default 0: no protection beyond what the caller asks),
    `sinks`, `temperature`, `smooth`, `score`, `sample`, `protection`.
    """

    protect: int = 0
    sinks: int = 4
    temperature: float = 1.0
    smooth: int = 5
    score: str = "range"
    sample: bool = True
    protection: str = "largest"

    def __post_init__(self) -> None:
        if self.score not in scoring.VALUE_SCORES:
            raise ValueError(f"score must be one of {scoring.VALUE_SCORES}, got {self.score!r}")
        if self.protection not in PROTECTIONS:
            raise ValueError(f"protection must be one of {PROTECTIONS}, got {self.protection!r}")
        if self.protect < 0 or self.sinks < 0 or self.smooth < 1 or not self.temperature > 0:
            raise ValueError(
                "VaSEPolicy needs protect >= 0, sinks >= 0, smooth >= 1 and temperature > 0, got "
                f"protect={self.protect}, sinks={self.sinks}, smooth={self.smooth}, temperature={self.temperature}"
            )

    def _ranked(self, r: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
        """Mask of the `n` valid candidates with the largest `r`, sinks first."""
        r = torch.where(positions < self.sinks, torch.full_like(r, float("inf")), r)
        r = r.masked_fill(~valid, float("-inf"))
        top = torch.topk(r, n, dim=-1, sorted=False).indices
        return scoring.mask_of(top, r.shape[-1]) & valid

    def protected_mask(
        self,
        values: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        n_keep: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """`[B, H, N]` bool: the valid candidates that take the protected slots."""
        n_protect = min(self.protect, n_keep)
        if self.protection == "largest":
            return self._ranked(scoring.value_scores(values, self.score), positions, valid, n_protect)
        if self.protection == "random":
            u = torch.rand(valid.shape, device=valid.device, generator=generator)
            return self._ranked(u, positions, valid, n_protect)
        return scoring.sink_mask(positions, valid, self.sinks)  # evict-largest: only the sinks

    def banned_mask(self, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`[B, H, N]` bool: candidates evicted on purpose (`protection="evict-largest"` only)."""
        n = values.shape[2]
        if self.protection != "evict-largest":
            return torch.zeros(valid.shape, dtype=torch.bool, device=valid.device)
        sink = scoring.sink_mask(positions, valid, self.sinks)
        r = scoring.value_scores(values, self.score).masked_fill(~valid | sink, float("-inf"))
        n_ban = min(self.protect, n)
        top = torch.topk(r, n_ban, dim=-1, sorted=False).indices
        return scoring.mask_of(top, n) & valid & ~sink

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
        protected = self.protected_mask(values, positions, valid, n_keep, generator)
        attn = scoring.window_attention(keys, queries, valid, self.temperature, self.smooth)
        key = scoring.log_weights(attn)
        if self.sample:
            key = key + scoring.gumbel_noise(key.shape, key.device, generator)
        # banned candidates rank below every other valid one, above the invalid ones
        key = torch.where(self.banned_mask(values, positions, valid), torch.finfo(torch.float32).min, key)
        priority = scoring.compose_priority(protected, key, valid)
        return scoring.top_k_by_priority(priority, n_keep)
