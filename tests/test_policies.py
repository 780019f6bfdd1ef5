"""The VaSE policy on hand-computed cases, and the policy registry."""

from __future__ import annotations

import math

import pytest
import torch

from vasepatch import policies
from vasepatch.policies import scoring


def _case(valid=None):
    """6 candidates; attention to candidate i is softmax(i); value ranges are r."""
    n, d = 6, 2
    a = torch.arange(n, dtype=torch.float32)
    keys = torch.stack([a * math.sqrt(d), torch.zeros(n)], -1).view(1, 1, n, d)
    queries = torch.tensor([1.0, 0.0]).view(1, 1, 1, d)
    r = torch.tensor([0.1, 5.0, 0.2, 0.3, 0.4, 0.5])
    values = torch.stack([torch.zeros(n), r], -1).view(1, 1, n, d)
    positions = torch.arange(n).view(1, 1, n)
    valid = torch.ones(1, 1, n, dtype=torch.bool) if valid is None else torch.tensor(valid).view(1, 1, n)
    return keys, values, queries, positions, valid


def _kept(policy, n_keep, valid=None, generator=None):
    idx = policy.select(*_case(valid), n_keep, generator=generator)
    return sorted(idx.flatten().tolist())


def test_window_attention_is_softmax_of_scaled_dot_product():
    keys, _, queries, _, valid = _case()
    scores = scoring.window_attention(keys, queries, valid, temperature=1.0, smooth=1)
    assert torch.allclose(scores.flatten(), torch.softmax(torch.arange(6.0), 0), atol=1e-6)
    hot = scoring.window_attention(keys, queries, valid, temperature=2.0, smooth=1)
    assert torch.allclose(hot.flatten(), torch.softmax(torch.arange(6.0) / 2, 0), atol=1e-6)


def test_smoothing_is_a_zero_padded_average_pool():
    keys, _, queries, _, valid = _case()
    raw = scoring.window_attention(keys, queries, valid, smooth=1).flatten()
    smooth = scoring.window_attention(keys, queries, valid, smooth=3).flatten()
    padded = torch.cat([torch.zeros(1), raw, torch.zeros(1)])
    expected = torch.stack([padded[i : i + 3].mean() for i in range(6)])
    assert torch.allclose(smooth, expected, atol=1e-7)


def test_value_scores():
    v = torch.tensor([[1.0, -2.0, 4.0]]).view(1, 1, 1, 3)
    assert scoring.value_scores(v, "range").item() == 6.0
    assert scoring.value_scores(v, "l2").item() == pytest.approx(math.sqrt(21))
    assert scoring.value_scores(v, "var").item() == pytest.approx(torch.tensor([1.0, -2.0, 4.0]).var(unbiased=False))
    with pytest.raises(ValueError, match="score"):
        scoring.value_scores(v, "max")


def test_vase_topk_hand_computed():
    policy = policies.get("vase", protect=2, sinks=1, smooth=1, sample=False)
    # sink (position 0), largest range (index 1), then the two most attended: 4 and 5
    assert _kept(policy, 4) == [0, 1, 4, 5]
    # index 5 invalid: the next most attended valid one (3) takes its place
    assert _kept(policy, 4, valid=[True] * 5 + [False]) == [0, 1, 3, 4]


def test_vase_keeps_all_valid_first_when_short():
    policy = policies.get("vase", protect=2, sinks=1, smooth=1, sample=False)
    valid = [True, False, False, False, False, True]
    kept = _kept(policy, 4, valid=valid)
    assert {0, 5} <= set(kept) and len(set(kept)) == 4


def test_l2_and_var_scores_change_the_protected_set():
    keys, values, queries, positions, valid = _case()
    values = values.clone()
    values[0, 0, 2] = torch.tensor([-4.0, -4.0])  # range 0, but norm 5.66 > 5.0
    for score, expected in (("range", [0, 1, 4, 5]), ("l2", [0, 2, 4, 5])):
        policy = policies.get("vase", protect=2, sinks=1, smooth=1, sample=False, score=score)
        assert sorted(policy.select(keys, values, queries, positions, valid, 4).flatten().tolist()) == expected


def test_sampling_uses_the_generator():
    policy = policies.get("vase", protect=0, sinks=0, smooth=1)
    draws = {tuple(_kept(policy, 3, generator=torch.Generator().manual_seed(s))) for s in range(30)}
    assert len(draws) > 1
    a = _kept(policy, 3, generator=torch.Generator().manual_seed(5))
    b = _kept(policy, 3, generator=torch.Generator().manual_seed(5))
    assert a == b


def test_gumbel_top1_frequencies_match_the_weights():
    """Gumbel-max picks item i with probability w_i / sum(w)."""
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g = torch.Generator().manual_seed(0)
    n = 40000
    keys = scoring.log_weights(w).expand(n, 4) + scoring.gumbel_noise(torch.Size((n, 4)), w.device, g)
    freq = torch.bincount(keys.argmax(-1), minlength=4).float() / n
    assert torch.allclose(freq, w, atol=0.01)


def test_bad_calls_are_rejected():
    policy = policies.get("vase")
    keys, values, queries, positions, valid = _case()
    with pytest.raises(ValueError, match="n_keep"):
        policy.select(keys, values, queries, positions, valid, 7)
    with pytest.raises(ValueError, match="multiple"):
        policy.select(keys.expand(1, 2, 6, 2), values.expand(1, 2, 6, 2), queries.expand(1, 3, 1, 2),
                      positions.expand(1, 2, 6), valid.expand(1, 2, 6), 2)  # fmt: skip
    with pytest.raises(ValueError, match="score"):
        policies.get("vase", score="max")


def test_registry():
    assert "vase" in policies.available()
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; registered policies: .*vase"):
        policies.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        policies.register("vase", policies.VaSEPolicy)

    class KeepFirst:
        def __init__(self, **options):
            self.options = options

        def select(self, keys, values, queries, positions, valid, n_keep, generator=None):
            return torch.arange(n_keep).expand(*keys.shape[:2], n_keep)

    policies.register("test-keep-first", KeepFirst)
    try:
        assert isinstance(policies.get("test-keep-first", protect=3), policies.Policy)
        assert "test-keep-first" in policies.available()
    finally:
        policies._REGISTRY.pop("test-keep-first")


def test_valid_candidates_with_zero_attention_still_beat_invalid_ones():
    """Attention underflowing to exactly 0 must not let padding compete with real tokens."""
    d = 2
    keys = torch.tensor([[100.0, 0.0], [-100.0, 0.0], [0.0, 0.0], [0.0, 0.0]]).view(1, 1, 4, d)
    queries = torch.tensor([10.0, 0.0]).view(1, 1, 1, d)
    values = torch.ones(1, 1, 4, d)
    positions = torch.tensor([10, 11, -1, -1]).view(1, 1, 4)
    valid = torch.tensor([True, True, False, False]).view(1, 1, 4)
    assert scoring.window_attention(keys, queries, valid)[0, 0, 1] == 0.0
    policy = policies.get("vase", protect=0, sinks=0, smooth=1)
    for seed in range(50):
        idx = policy.select(keys, values, queries, positions, valid, 2, torch.Generator().manual_seed(seed))
        assert sorted(idx.flatten().tolist()) == [0, 1]
