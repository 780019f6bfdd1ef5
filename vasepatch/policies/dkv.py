"""VaSE-DKV and CUR: query-free scores from a random projection of keys and values.

Source: Chang et al. (arXiv 2606.03928), "CUR resample" (VaSE-DKV) and its
"CUR fixed" baseline.
"""

from __future__ import annotations

import functools
from typing import Annotated

import torch
from torch import Tensor

from vasepatch.policies import scoring
from vasepatch.policies.keyed import draws_keyed_noise
from vasepatch.policies.options import Between, Seed, Sinks

# The width of the sketch `G`. A sketch is narrower than what it sketches: from rank = head_dim on, the exact
# norms cost less than their estimate. 256 is the largest head_dim of the supported families (and of the
# varlen kernels); the paper uses 20. Unbounded, rank = 10**30 overflowed torch.randn and 2**40 asked for 70 TB,
# at the first eviction.
MAX_RANK = 256


@functools.lru_cache(maxsize=64)
def fixed_projection(dim: int, rank: int, seed: int, device: str) -> Tensor:
    """The one `G` of `resample=False`: drawn on the CPU from `seed`, then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    return scoring.gaussian_projection(dim, rank, torch.device("cpu"), g).to(device)


@draws_keyed_noise
def dkv(
    keys: Tensor,
    values: Tensor,
    positions: Tensor,
    valid: Tensor,
    generator: scoring.Randomness,
    *,
    sinks: Sinks = 4,
    rank: Annotated[int, Between(1, MAX_RANK)] = 20,
    resample: bool = True,
    seed: Seed = 0,
) -> Tensor:
    """Keep the sinks, then the candidates with the largest `||K G||^2 * ||V G||^2`.

    `G` is a `[head_dim, rank]` Gaussian matrix scaled by `1/sqrt(rank)`. With
    `resample=True` (VaSE-DKV) it is drawn from the cache's generator at every
    eviction, which makes the choice stochastic; with `resample=False` (the "CUR
    fixed" baseline) one `G`, drawn from `seed`, serves the whole generation. The
    value factor lets large-magnitude values win without an explicit protection.
    Needs no queries.
    """
    dim = keys.shape[-1]
    if values.shape[-1] != dim:
        raise ValueError("dkv projects keys and values with one G: head dims must match")
    if resample:
        g = scoring.gaussian_projection(dim, rank, keys.device, generator)
    else:
        g = fixed_projection(dim, rank, seed, str(keys.device))
    s = scoring.cur_scores(keys, values, g, valid)
    return torch.where(scoring.sink_mask(positions, valid, sinks), float("inf"), s)
