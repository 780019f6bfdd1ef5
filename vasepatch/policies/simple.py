"""Reference policies that look at no scores: StreamingLLM and uniform random.

Sources: Xiao et al., "Efficient Streaming Language Models with Attention
Sinks" (arXiv 2309.17453) for `streaming`; `random` is the usual lower reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vasepatch.policies import scoring
from vasepatch.policies.keyed import draws_keyed_noise
from vasepatch.policies.options import Sinks


def streaming(positions: Tensor, valid: Tensor, *, sinks: Sinks = 4) -> Tensor:
    """Keep the sinks (`position < sinks`) and the most recent candidates."""
    return torch.where(scoring.sink_mask(positions, valid, sinks), float("inf"), positions.float())


@draws_keyed_noise
def uniform(valid: Tensor, generator: scoring.Randomness) -> Tensor:
    """Keep candidates drawn uniformly without replacement among the valid ones."""
    return scoring.uniform_noise(valid.shape, valid.device, generator)
