"""SnapKV-style selection: the window's attention, deterministic top-k.

Source: Li et al., "SnapKV: LLM Knows What You Are Looking for Before
Generation" (arXiv 2404.14469), applied at every eviction as in the VaSE paper's
"Attn" baseline.
"""

from __future__ import annotations

from torch import Tensor

from vasepatch.policies import scoring
from vasepatch.policies.options import Smooth, Temperature


def snapkv(
    keys: Tensor, queries: Tensor, valid: Tensor, *, temperature: Temperature = 1.0, smooth: Smooth = 5
) -> Tensor:
    """Keep the candidates with the largest window attention (softmax at `temperature`,
    averaged over the window and GQA group, average-pooled over `smooth` positions).
    No sinks or value protection: attention alone decides."""
    return scoring.window_attention(keys, queries, valid, temperature, smooth)
