"""Fidelity and generation metrics: pure functions of logits and token lists (torch is imported by the
functions that need it, so that the eval commands' `--help` does not wait for it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def next_token_metrics(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position comparison of a policy's next-token distribution with the reference's.

    `reference`, `logits`: `[..., V]` logits; `targets`: `[...]` the tokens actually
    fed next. Returns float tensors of shape `[...]`:
    `kl` = KL(reference || policy) in nats, `top1` = 1 where both argmaxes agree,
    `nll_delta` = -log p_policy(target) + log p_reference(target).
    """
    import torch

    ref = torch.log_softmax(reference.float(), -1)
    pol = torch.log_softmax(logits.float(), -1)
    kl = (ref.exp() * (ref - pol)).sum(-1).clamp_min(0.0)
    top1 = (ref.argmax(-1) == pol.argmax(-1)).float()
    t = targets.unsqueeze(-1)
    nll_delta = ref.gather(-1, t).squeeze(-1) - pol.gather(-1, t).squeeze(-1)
    return {"kl": kl, "top1": top1, "nll_delta": nll_delta}


def loop_period(tokens: Sequence[int], span: int = 256, max_period: int = 64, threshold: float = 0.9) -> int | None:
    """The smallest period `p <= max_period` such that at least `threshold` of the last
    `span` tokens equal the token `p` places before them (periods longer than
    `len(tokens) - span` cannot be checked); `None` if there is none, or if the
    sequence is shorter than `span + 1` tokens."""
    if len(tokens) <= span:
        return None
    import torch

    x = torch.as_tensor(list(tokens[-(span + max_period) :]))
    tail = x[-span:]
    for p in range(1, max_period + 1):
        if len(x) - p < span:
            break
        earlier = x[len(x) - span - p : len(x) - p]
        if (tail == earlier).float().mean().item() >= threshold:
            return p
    return None


def is_looping(tokens: Sequence[int], span: int = 256, max_period: int = 64, threshold: float = 0.9) -> bool:
    """True if the sequence ends in a repetition loop (see `loop_period`)."""
    return loop_period(tokens, span, max_period, threshold) is not None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where `a` and `b` differ (the common length if none)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std / sqrt(n); 0 for n < 2)."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)
