"""SnapKV-style selection: the window's attention, deterministic top-k.

Source: Li et al., "SnapKV: LLM Knows What You Are Looking for Before
Generation" (arXiv 2404.14469), applied at every eviction as in the VaSE paper's
"Attn" baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vasepatch.policies import scoring


@dataclass(frozen=True)
class SnapKVPolicy:
    """Keep the `n_keep` candidates with the largest window attention (softmax at
    `temperature`, averaged over the window and GQA group, average-pooled over
    `smooth` positions). No sinks or value protection: attention alone decides.
    Options: `temperature`, `smooth`."""

    temperature: float = 1.0
    smooth: int = 5

    def __post_init__(self) -> None:
        if self.smooth < 1 or not self.temperature > 0:
            raise ValueError(
                f"SnapKVPolicy needs smooth >= 1 and temperature > 0, got {self.smooth}, {self.temperature}"
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
        return scoring.top_k_by_priority(attn.masked_fill(~valid, float("-inf")), n_keep)
