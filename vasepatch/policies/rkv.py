"""R-KV: attention importance minus key redundancy.

Source: Cai et al., "R-KV: Redundancy-aware KV Cache Compression for
Reasoning Models" (arXiv 2505.24133), as used as a baseline in the VaSE paper.
"""

from __future__ import annotations

from typing import Annotated

from torch import Tensor

from vasepatch.policies import scoring
from vasepatch.policies.options import Between, Smooth, Temperature


def rkv(
    keys: Tensor,
    queries: Tensor,
    valid: Tensor,
    *,
    lam: Annotated[float, Between(0, 1)] = 0.5,
    temperature: Temperature = 1.0,
    smooth: Smooth = 5,
) -> Tensor:
    """Keep the top `n_keep` by `lam * attention - (1 - lam) * redundancy`.

    `attention` is the window attention of SnapKV (`temperature`, `smooth`);
    `redundancy` is a softmax over the candidates of each key's mean cosine
    similarity to the other candidates' keys (`scoring.key_redundancy`).
    Deterministic.
    """
    attn = scoring.window_attention(keys, queries, valid, temperature, smooth)
    return lam * attn - (1.0 - lam) * scoring.key_redundancy(keys, valid)
