"""Invariants of every registered policy, and VaSE's protection guarantees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from property_tests.strategies import PolicyCase, policy_cases
from vasepatch import policies


def _build(name: str, case: PolicyCase, **extra):
    return policies.get(
        name, protect=case.protect, sinks=case.sinks, temperature=case.temperature, smooth=case.smooth, **extra
    )


def _select(policy, case: PolicyCase, seed: int | None = None):
    gen = torch.Generator().manual_seed(case.seed if seed is None else seed)
    return policy.select(case.keys, case.values, case.queries, case.positions, case.valid, case.n_keep, gen)


@pytest.mark.parametrize("name", policies.available())
@given(case=policy_cases())
def test_every_policy_returns_distinct_valid_first_indices(name, case):
    idx = _select(_build(name, case), case)
    b, h, n = case.valid.shape
    assert idx.shape == (b, h, case.n_keep) and idx.dtype == torch.long
    assert ((idx >= 0) & (idx < n)).all()
    if case.n_keep:
        s = idx.sort(-1).values
        assert (s[..., 1:] != s[..., :-1]).all(), "duplicate indices"
    chosen_valid = case.valid.gather(-1, idx).sum(-1)
    expected = case.valid.sum(-1).clamp(max=case.n_keep)
    assert torch.equal(chosen_valid, expected), "a valid candidate was dropped while an invalid one was kept"


@pytest.mark.parametrize("name", policies.available())
@given(case=policy_cases())
def test_every_policy_is_seeded_reproducible(name, case):
    policy = _build(name, case)
    assert torch.equal(_select(policy, case, seed=1), _select(policy, case, seed=1))


def _kept_mask(idx, n):
    return torch.zeros((*idx.shape[:2], n), dtype=torch.bool).scatter(-1, idx, True)


# a policy with a `sinks` option promises to keep the sinks
SINK_KEEPERS = [name for name in policies.available() if "sinks" in policies.get(name).options]


@pytest.mark.parametrize("name", SINK_KEEPERS)
@given(case=policy_cases())
def test_every_policy_with_a_sinks_option_keeps_the_sinks(name, case):
    """Whenever the sinks fit (in `n_keep`, and in `protect` for a policy that has it), all are kept."""
    policy = _build(name, case)
    kept = _kept_mask(_select(policy, case), case.valid.shape[-1])
    sink = case.valid & (case.positions < case.sinks)
    room = min(policy.options.get("protect", case.n_keep), case.n_keep)
    assert (kept | ~sink)[sink.sum(-1) <= room].all()


@given(case=policy_cases(), sample=st.booleans())
def test_vase_never_evicts_sinks(case, sample):
    kept = _kept_mask(_select(_build("vase", case, sample=sample), case), case.valid.shape[-1])
    sink = case.valid & (case.positions < case.sinks)
    feasible = sink.sum(-1) <= min(case.protect, case.n_keep)
    assert (kept | ~sink)[feasible].all()


@given(case=policy_cases(), sample=st.booleans())
def test_vase_keeps_the_largest_range_values(case, sample):
    """After the sinks, the rest of `protect` goes to the largest value ranges: every valid
    non-sink candidate whose range beats the (k+1)-th largest is kept, k = free protected slots."""
    kept = _kept_mask(_select(_build("vase", case, sample=sample), case), case.valid.shape[-1])
    ranges = case.values.amax(-1) - case.values.amin(-1)
    sink = case.valid & (case.positions < case.sinks)
    free = (min(case.protect, case.n_keep) - sink.sum(-1)).clamp(min=0)  # [B, H]
    others = case.valid & ~sink
    for b, h in torch.cartesian_prod(torch.arange(kept.shape[0]), torch.arange(kept.shape[1])).tolist():
        r = ranges[b, h][others[b, h]].sort(descending=True).values
        k = int(free[b, h])
        threshold = r[k].item() if k < len(r) else float("-inf")
        must = others[b, h] & (ranges[b, h] > threshold)
        assert kept[b, h][must].all(), f"row {b} head {h}: a protected large-range value was evicted"


def test_keep_frequency_rises_with_attention():
    """Sampling keeps candidates proportionally to attention: over many draws the keep
    frequency of unprotected candidates is rank-correlated (>= 0.9) with their score."""
    n, d, n_keep, draws = 24, 8, 8, 2000
    g = torch.Generator().manual_seed(0)
    query = torch.randn(d, generator=g)
    query = query / query.norm()
    # candidate i has key = a_i * query: attention grows with a_i, i.e. with i
    a = torch.linspace(-2.0, 2.0, n)
    keys = (a[:, None] * query[None, :] * d**0.5).view(1, 1, n, d)
    values = torch.ones(1, 1, n, d)  # equal ranges: protection does not interfere
    queries = query.view(1, 1, 1, d)
    positions = torch.arange(10, 10 + n).view(1, 1, n)  # no sinks among candidates
    valid = torch.ones(1, 1, n, dtype=torch.bool)
    policy = policies.get("vase", protect=0, sinks=4, smooth=1)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(n)
    for _ in range(draws):
        counts += _kept_mask(policy.select(keys, values, queries, positions, valid, n_keep, gen), n)[0, 0]
    assert counts.sum() == draws * n_keep
    assert counts.min() > 0 and counts.max() < draws  # stochastic, not top-k
    rank_score = torch.arange(n, dtype=torch.float)
    rank_freq = counts.argsort().argsort().float()
    rho = torch.corrcoef(torch.stack([rank_score, rank_freq]))[0, 1].item()
    assert rho >= 0.9, f"Spearman rho {rho:.3f}"
