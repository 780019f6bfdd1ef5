"""VaSE-AttnV: protect sinks and large-range values, sample the rest by attention.

Source: Chang et al., "Value-Aware Stochastic KV Cache Eviction for Reasoning
Models" (arXiv 2606.03928), the "sample attn + V" recipe, and its ablations
(top-k instead of sampling, l2/var instead of range, random protection, evicting
the large values on purpose).
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from vasepatch.policies import scoring
from vasepatch.policies.keyed import draws_keyed_noise
from vasepatch.policies.options import OneOf, Protect, Sinks, Smooth, Temperature

PROTECTIONS = ("largest", "random", "evict-largest")


def _ranked(r: Tensor, positions: Tensor, valid: Tensor, sinks: int, n: int) -> Tensor:
    """Mask of the `n` valid candidates with the largest `r`, sinks first."""
    r = torch.where(positions < sinks, torch.full_like(r, float("inf")), r)
    r = r.masked_fill(~valid, float("-inf"))
    top = torch.topk(r, n, dim=-1, sorted=False).indices
    return scoring.mask_of(top, r.shape[-1]) & valid


def protected_mask(
    values: Tensor,
    positions: Tensor,
    valid: Tensor,
    n_keep: int,
    generator: scoring.Randomness,
    *,
    protect: int,
    sinks: int,
    score: str,
    protection: str,
) -> Tensor:
    """`[B, H, N]` bool: the valid candidates that take the `min(protect, n_keep)` protected slots."""
    n_protect = min(protect, n_keep)
    if protection == "largest":
        return _ranked(scoring.value_scores(values, score), positions, valid, sinks, n_protect)
    if protection == "random":
        u = scoring.uniform_noise(valid.shape, valid.device, generator)
        return _ranked(u, positions, valid, sinks, n_protect)
    return scoring.sink_mask(positions, valid, sinks)  # evict-largest: only the sinks


def banned_mask(values: Tensor, positions: Tensor, valid: Tensor, *, protect: int, sinks: int, score: str) -> Tensor:
    """`[B, H, N]` bool: the `protect` valid non-sink candidates with the largest `score`
    (evicted on purpose by `protection="evict-largest"`)."""
    n = values.shape[2]
    sink = scoring.sink_mask(positions, valid, sinks)
    r = scoring.value_scores(values, score).masked_fill(~valid | sink, float("-inf"))
    top = torch.topk(r, min(protect, n), dim=-1, sorted=False).indices
    return scoring.mask_of(top, n) & valid & ~sink


@draws_keyed_noise
def vase(
    keys: Tensor,
    values: Tensor,
    queries: Tensor,
    positions: Tensor,
    valid: Tensor,
    n_keep: int,
    generator: scoring.Randomness,
    *,
    protect: Protect = 0,
    sinks: Sinks = 4,
    temperature: Temperature = 1.0,
    smooth: Smooth = 5,
    score: Annotated[str, OneOf(scoring.VALUE_SCORES)] = "range",
    sample: bool = True,
    protection: Annotated[str, OneOf(PROTECTIONS)] = "largest",
) -> Tensor:
    """VaSE-AttnV.

    1. `protect` slots go first to the sinks (candidates with `position < sinks`),
       then to the candidates whose value vectors have the largest `score`
       (`"range"` = max - min over the head dimension, `"l2"`, `"var"`).
    2. The other `n_keep - protect` are drawn without replacement with probability
       proportional to the window attention (`scoring.window_attention` at
       `temperature`, smoothed over `smooth` positions), by Gumbel-top-k. With
       `sample=False` they are the deterministic top-k instead (the paper's ablation).

    `protection` selects the ablations of step 1: `"largest"` (VaSE), `"random"`
    (the non-sink protected slots go to uniformly random candidates), or
    `"evict-largest"` (only the sinks are protected, and the `protect` non-sink
    candidates with the largest `score` rank below every other valid candidate:
    they are kept only when nothing else is left).
    """
    protected = protected_mask(
        values, positions, valid, n_keep, generator, protect=protect, sinks=sinks, score=score, protection=protection
    )
    key = scoring.log_weights(scoring.window_attention(keys, queries, valid, temperature, smooth))
    if sample:
        key = key + scoring.gumbel_noise(key.shape, key.device, generator)
    if protection == "evict-largest":
        banned = banned_mask(values, positions, valid, protect=protect, sinks=sinks, score=score)
        key = torch.where(banned, torch.finfo(torch.float32).min, key)
    return torch.where(protected, float("inf"), key)
