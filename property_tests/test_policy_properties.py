"""Invariants of every registered policy, and VaSE's protection guarantees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from property_tests.strategies import PolicyCase, policy_cases, policy_options
from vasepatch import VaSEConfig, policies
from vasepatch.policies import base, scoring


def _build(name: str, case: PolicyCase, **extra):
    """Policy `name` with the case's common options, and a statistics file of its shapes if it reads one."""
    extra = {**policy_options(name, case), **extra}
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
    """The generator's seed alone decides: the global RNG is in a different state for each call."""
    policy = _build(name, case)
    torch.manual_seed(case.seed)
    first = _select(policy, case, seed=1)
    torch.manual_seed(case.seed + 1)
    assert torch.equal(first, _select(policy, case, seed=1))


def _corruptions(idx: torch.Tensor, valid: torch.Tensor, n_keep: int):
    """(what, corrupted picks) for every kind of bad output this case allows."""
    n = valid.shape[-1]
    if n_keep >= 1:
        for bad in (n, -1):
            out = idx.clone()
            out[0, 0, 0] = bad
            yield f"index {bad}", out
    if n_keep >= 2:
        out = idx.clone()
        out[-1, -1, 1] = out[-1, -1, 0]
        yield "duplicate", out
    kept = torch.zeros_like(valid).scatter(-1, idx, True)
    for b, h in (valid.sum(-1) > 0).nonzero().tolist():
        real_kept = (valid[b, h] & kept[b, h]).nonzero().flatten()
        pad_left = (~valid[b, h] & ~kept[b, h]).nonzero().flatten()
        if len(real_kept) and len(pad_left):
            out = idx.clone()
            out[b, h][idx[b, h] == real_kept[0]] = pad_left[0]
            yield "padding over a real token", out
            return


@pytest.mark.parametrize("name", policies.available())
@given(case=policy_cases())
def test_the_output_check_accepts_every_policy_and_rejects_each_corruption(name, case):
    """`check_picks` (run at every eviction) never refuses what a registered policy picks, and
    refuses every corruption of it: out of range, duplicated, padding kept over a real token."""
    idx = _select(_build(name, case), case)
    policies.check_picks(name, idx, case.valid, case.n_keep)
    for _what, bad in _corruptions(idx, case.valid, case.n_keep):
        with pytest.raises(policies.PolicyOutputError, match=f"policy '{name}'"):
            policies.check_picks(name, bad, case.valid, case.n_keep)
        policies.check_picks(name, bad, case.valid, case.n_keep, data=False)  # switched off: not looked at
    with pytest.raises(policies.PolicyOutputError, match=r"shape"):
        policies.check_picks(name, idx.flatten(), case.valid, case.n_keep)


PRIORITY_VALUES = (float("nan"), float("-inf"), float("inf"), -1e30, 0.0, 1.0)


@given(case=policy_cases(), data=st.data())
def test_valid_candidates_rank_first_whatever_the_priority(case, data):
    """However a priority function scores the candidates (NaN, -inf, +inf included), the valid
    ones are kept first, and +inf ones before every other."""
    shape = case.valid.shape
    codes = data.draw(
        st.lists(st.integers(0, len(PRIORITY_VALUES) - 1), min_size=shape.numel(), max_size=shape.numel())
    )
    priority = torch.tensor([PRIORITY_VALUES[c] for c in codes]).view(shape)
    idx = torch.topk(base.ranked(priority, case.valid), case.n_keep, dim=-1).indices
    kept = _kept_mask(idx, shape[-1])
    assert torch.equal((kept & case.valid).sum(-1), case.valid.sum(-1).clamp(max=case.n_keep))
    protected = case.valid & (priority == float("inf"))
    fits = protected.sum(-1) <= case.n_keep
    assert (kept | ~protected)[fits].all()


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


@given(n=st.integers(1, 40), data=st.data())
def test_smoothing_is_centred_on_each_candidate(n, data):
    """All the attention on one candidate `i` (a one-hot softmax): the pool of width `smooth` spreads it
    evenly over `i - smooth // 2 .. i + smooth // 2` (cut at the ends), never further on one side."""
    i = data.draw(st.integers(0, n - 1))
    smooth = data.draw(st.integers(0, 2 * n + 2).map(lambda k: 2 * k + 1))
    keys = torch.zeros(1, 1, n, 2)
    keys[0, 0, i, 0] = 1.0
    queries = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    valid = torch.ones(1, 1, n, dtype=torch.bool)
    scores = scoring.window_attention(keys, queries, valid, temperature=1e-6, smooth=smooth).flatten()
    half = smooth // 2
    spread = (torch.arange(n) - i).abs() <= half
    expected = torch.where(spread, 1.0 / smooth, 0.0)
    assert torch.allclose(scores, expected, rtol=1e-6, atol=0), (i, smooth, scores)


@given(k=st.integers(1, 2**20))
def test_an_even_smoothing_width_is_refused_everywhere(k):
    """An even pool has no centre slot (width 4 spread a spike at slot 4 over slots 3..6): the config, every
    policy that declares `smooth`, and the scoring function itself refuse it."""
    smooth = 2 * k
    with pytest.raises(ValueError, match=r"smooth must be an odd int in \[1, "):
        VaSEConfig(budget=max(smooth, 128), smooth=smooth)
    for name in policies.available():
        if "smooth" in policies.get(name).options:
            with pytest.raises(ValueError, match=rf"option smooth must be an odd int .*got {smooth}"):
                policies.get(name, smooth=smooth)
    keys = torch.zeros(1, 1, 3, 2)
    with pytest.raises(ValueError, match=rf"smooth must be odd .*got {smooth}"):
        scoring.window_attention(keys, keys[:, :, :1], torch.ones(1, 1, 3, dtype=torch.bool), smooth=smooth)
