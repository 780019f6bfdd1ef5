"""Key norm: keep the keys with the smallest L2 norm.

Source: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV
Cache Compression" (arXiv 2406.11430): a low key norm goes with high attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vasepatch.policies import scoring
from vasepatch.policies.options import Sinks


def knorm(keys: Tensor, positions: Tensor, valid: Tensor, *, sinks: Sinks = 4) -> Tensor:
    """Keep the sinks, then the candidates whose keys have the smallest L2 norm. Needs no queries."""
    norm = torch.linalg.vector_norm(keys.float(), dim=-1)
    return torch.where(scoring.sink_mask(positions, valid, sinks), float("inf"), -norm)
