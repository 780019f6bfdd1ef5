"""TriAttention: each key scored by the attention that calibrated future queries would pay it.

Source: Mao et al., "TriAttention" (arXiv 2604.04921), its scoring as the authors' PyTorch reference computes it
(paraphrased in `benchmarks/triattention/NOTES.md`; none of their code is here). RoPE turns the dot product of a
query at position `t + d` and a key at position `p` into a trigonometric series in `(t + d - p)`: with the
pre-RoPE query replaced by its calibrated mean, that series predicts how much attention the key will get `d`
tokens from now, whatever the query turns out to be.

Per RoPE frequency pair `f` (half-split: `z_f(x) = x[f] + i x[f + F]`, `F = D / 2`, as transformers'
`rotate_half` pairs them), with `a` the rotary's attention scaling and `w_f` its (scaled) inverse frequency:

- the key is un-rotated to its pre-RoPE form: `k_f = z_f(key) * exp(-i p w_f) / a`;
- `A_f = |qbar_f| |k_f|`, `phi_f = arg(qbar_f conj(k_f))`, `E_f = (m_f - |qbar_f|) |k_f|`, where `qbar_f` is the
  calibrated mean of the pre-RoPE query's pair and `m_f` the mean of its magnitude;
- `S(d) = sum_f a^2 (A_f cos((t - p + d) w_f + phi_f) + E_f)`, averaged over the offsets `d = 1, 2, 4, ...`
  up to `max_offset`.

Each query head's scores are z-scored over the valid candidates, and a KV head takes the largest over the query
heads of its group (the authors' `per_layer_perhead` mode with its `max` aggregation). Everything is float32 and
computed in the reference's order of operations.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import torch
from torch import Tensor

from vasepatch.policies import query_stats, scoring
from vasepatch.policies.keyed import draws_keyed_noise
from vasepatch.policies.options import AtLeast, Between, OneOf
from vasepatch.policies.query_stats import QueryStats

MAX_OFFSET = 1 << 24  # positions are exact in float32 below 2^24
ROTARY_DTYPES = ("float32", "bfloat16", "float16")


def future_offsets(max_offset: int) -> list[float]:
    """The future offsets the scores average over: 1, 2, 4, ... up to `max_offset` (at least 1)."""
    return [float(2**i) for i in range(max(1, max_offset).bit_length())]


def half_pairs(x: Tensor) -> tuple[Tensor, Tensor]:
    """The real and imaginary parts of `x`'s half-split frequency pairs: `x[..., :F]`, `x[..., F:]`, float32."""
    f = x.shape[-1] // 2
    x = x.float()
    return x[..., :f], x[..., f : 2 * f]  # an odd last element has no pair (RoPE needs an even head size)


def unrotate(keys: Tensor, positions: Tensor, inv_freq: Tensor, scaling: Tensor) -> tuple[Tensor, Tensor]:
    """Pre-RoPE keys as frequency pairs `(real, imag)`, each `[B, H, N, F]` float32: the keys `[B, H, N, D]`
    (after RoPE at `positions` `[B, H, N]`) rotated back by `-positions * inv_freq` (`[B, H, F]`) and divided by
    the attention scaling `[B, H]`."""
    re, im = half_pairs(keys)
    angle = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(-2)  # [B, H, N, F]
    cos, sin = torch.cos(angle), torch.sin(angle)
    a = scaling.view(*scaling.shape, 1, 1)
    return (re * cos + im * sin) / a, (im * cos - re * sin) / a


def future_scores(keys: Tensor, positions: Tensor, now: Tensor, stats: QueryStats, max_offset: int) -> Tensor:
    """`[B, H, G, N]` float32: each candidate's predicted attention logit from each query head of its group,
    averaged over the future offsets. `stats` holds the rows of the candidates' heads (`QueryStats.rows`), `now`
    `[B, H]` the position of the next token (`t`)."""
    k_re, k_im = unrotate(keys, positions, stats.inv_freq, stats.scaling)
    k_re, k_im = k_re.unsqueeze(2), k_im.unsqueeze(2)  # [B, H, 1, N, F]
    q_re, q_im = (stats.q_mean[..., i].unsqueeze(3) for i in (0, 1))  # [B, H, G, 1, F]
    k_abs = torch.sqrt(k_re * k_re + k_im * k_im)
    q_abs_mean = torch.sqrt(q_re * q_re + q_im * q_im)
    amp = q_abs_mean * k_abs  # |qbar conj(k)| = |qbar| |k|
    phase = torch.atan2(q_im * k_re - q_re * k_im, q_re * k_re + q_im * k_im)  # arg(qbar conj(k))
    s2 = (stats.scaling * stats.scaling).view(*stats.scaling.shape, 1, 1, 1)  # a^2, the same for every pair
    extra = ((stats.q_abs.unsqueeze(3) - q_abs_mean) * k_abs * s2).sum(-1)  # [B, H, G, N]
    delta = (now.unsqueeze(-1) - positions).float().view(*positions.shape[:2], 1, -1, 1)  # t - p: [B, H, 1, N, 1]
    omega = stats.inv_freq.view(*stats.inv_freq.shape[:2], 1, 1, -1)  # [B, H, 1, 1, F]
    total = torch.zeros(amp.shape[:-1], dtype=torch.float32, device=keys.device)
    offsets = future_offsets(max_offset)
    for d in offsets:  # host constants: one [B, H, G, N, F] temporary at a time
        total += (amp * s2 * torch.cos((delta + d) * omega + phase)).sum(-1)
    return total / len(offsets) + extra


def zscore(scores: Tensor, valid: Tensor) -> Tensor:
    """`scores` `[B, H, G, N]` standardised per (row, KV head, query head) over the valid candidates
    (`valid` `[B, H, N]`; biased standard deviation, at least 1e-6); invalid candidates score 0."""
    v = valid.unsqueeze(2)
    count = v.sum(-1, keepdim=True).clamp_min(1)
    mean = scores.masked_fill(~v, 0.0).sum(-1, keepdim=True) / count
    centred = (scores - mean).masked_fill(~v, 0.0)
    std = torch.sqrt((centred * centred).sum(-1, keepdim=True) / count).clamp_min(1e-6)
    return centred / std


def triattention_scores(
    keys: Tensor, positions: Tensor, valid: Tensor, now: Tensor, stats: QueryStats, max_offset: int
) -> Tensor:
    """`[B, H, N]` float32: the largest z-scored future score over each KV head's query heads (`stats` the rows of
    the candidates' heads)."""
    return zscore(future_scores(keys, positions, now, stats, max_offset), valid).amax(2)


@draws_keyed_noise
def triattention(
    keys: Tensor,
    positions: Tensor,
    valid: Tensor,
    head_ids: Tensor,
    now: Tensor,
    generator: scoring.Randomness,
    *,
    stats: str = "",
    max_offset: Annotated[int, Between(1, MAX_OFFSET)] = 65536,
    rotary_dtype: Annotated[str, OneOf(ROTARY_DTYPES)] = "float32",
    tie_noise: Annotated[float, AtLeast(0.0, finite=True)] = 1e-6,
) -> Tensor:
    """TriAttention (`per_layer_perhead`, max over each KV head's query heads): keep the candidates whose keys
    the calibrated future queries would attend to most, averaged over the offsets 1, 2, 4, ... `max_offset`.

    `stats`: the file of the model's calibrated query statistics (`vasepatch calibrate`; `patch()` finds the
    model's own when it is not given); `rotary_dtype`: the dtype the model's rotary holds its frequencies in
    (`patch()` sets it: a model cast to bfloat16 rotates by the rounded ones, so the keys are un-rotated by the
    file's frequencies rounded alike); `tie_noise`: uniform noise of this size added to the z-scores, as the
    authors add 1e-6, which breaks exact ties (two candidates z-score to exactly -1 and 1) the same way whatever
    the sharding of the heads (`scoring.uniform_noise`; 0: none). No sinks or value protection; the window is
    kept as by every policy."""
    rows = query_stats.load_stats(stats).rows(head_ids)
    if rotary_dtype != "float32":
        rows = dataclasses.replace(rows, inv_freq=rows.inv_freq.to(getattr(torch, rotary_dtype)).float())
    scores = triattention_scores(keys, positions, valid, now, rows, max_offset)
    return scores + tie_noise * scoring.uniform_noise(scores.shape, scores.device, generator)
