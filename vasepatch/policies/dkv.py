"""VaSE-DKV and CUR: query-free scores from a random projection of keys and values.

Source: Chang et al. (arXiv 2606.03928), "CUR resample" (VaSE-DKV) and its
"CUR fixed" baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vasepatch.policies import scoring


@dataclass(frozen=True)
class DKVPolicy:
    """Keep the sinks, then the top `n_keep` candidates by `||K G||^2 * ||V G||^2`.

    `G` is a `[head_dim, rank]` Gaussian matrix scaled by `1/sqrt(rank)`. With
    `resample=True` (VaSE-DKV) it is drawn from the cache's generator at every
    eviction, which makes the choice stochastic; with `resample=False` (the "CUR
    fixed" baseline) one `G`, drawn from `seed`, serves the whole generation. The
    value factor lets large-magnitude values win without an explicit protection.
    Needs no queries. Options: `sinks`, `rank`, `resample`, `seed` (fixed `G` only).
    """

    sinks: int = 4
    rank: int = 20
    resample: bool = True
    seed: int = 0
    _fixed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.rank < 1:
            raise ValueError(f"DKVPolicy needs sinks >= 0 and rank >= 1, got sinks={self.sinks}, rank={self.rank}")

    def projection(self, dim: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
        """The `G` of this eviction: fresh when resampling, else one per (dim, device)."""
        if self.resample:
            return scoring.gaussian_projection(dim, self.rank, device, generator)
        key = (dim, str(device))
        if key not in self._fixed:
            g = torch.Generator().manual_seed(self.seed)
            self._fixed[key] = scoring.gaussian_projection(dim, self.rank, torch.device("cpu"), g).to(device)
        return self._fixed[key]

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
        if keys.shape[-1] != values.shape[-1]:
            raise ValueError("DKVPolicy projects keys and values with one G: head dims must match")
        g = self.projection(keys.shape[-1], keys.device, generator)
        s = scoring.cur_scores(keys, values, g, valid)
        protected = scoring.sink_mask(positions, valid, self.sinks)
        return scoring.top_k_by_priority(scoring.compose_priority(protected, s, valid), n_keep)
