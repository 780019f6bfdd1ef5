"""R-KV: attention importance minus key redundancy.

Source: Cai et al., "R-KV: Redundancy-aware KV Cache Compression for
Reasoning Models" (arXiv 2505.24133), as used as a baseline in the VaSE paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vasepatch.policies import scoring


@dataclass(frozen=True)
class RKVPolicy:
    """Keep the top `n_keep` by `lam * attention - (1 - lam) * redundancy`.

    `attention` is the window attention of SnapKV (`temperature`, `smooth`);
    `redundancy` is a softmax over the candidates of each key's mean cosine
    similarity to the other candidates' keys (`scoring.key_redundancy`).
    Deterministic. Options: `lam` (default 0.5), `temperature`, `smooth`.
    """

    lam: float = 0.5
    temperature: float = 1.0
    smooth: int = 5

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam <= 1.0 or self.smooth < 1 or not self.temperature > 0:
            raise ValueError(
                "RKVPolicy needs 0 <= lam <= 1, smooth >= 1 and temperature > 0, got "
                f"lam={self.lam}, smooth={self.smooth}, temperature={self.temperature}"
            )

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
        attn = scoring.window_attention(keys, queries, valid, self.temperature, self.smooth)
        score = self.lam * attn - (1.0 - self.lam) * scoring.key_redundancy(keys, valid)
        return scoring.top_k_by_priority(score.masked_fill(~valid, float("-inf")), n_keep)
