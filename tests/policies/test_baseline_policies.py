"""Every non-VaSE policy and the VaSE ablations on hand-computed cases.

A test whose docstring names a mutant was written for one that survived the mutation check
(`benchmarks/mutation/run.sh`, recorded in `docs/results/mutation/`)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.policies.test_policies import _case, _kept
from vasepatch import policies
from vasepatch.policies import scoring
from vasepatch.policies.vase import protected_mask


def test_every_registered_name_builds_with_the_common_options():
    for name in policies.available():
        policy = policies.get(name, protect=2, sinks=1, temperature=1.0, smooth=1)
        assert isinstance(policy, policies.Policy)


def test_unknown_options_are_named():
    with pytest.raises(
        ValueError, match=r"policy 'snapkv' has no option\(s\) lam; its options are: temperature, smooth"
    ):
        policies.get("snapkv", lam=0.5)
    assert policies.get("rkv", lam=0.25).options["lam"] == 0.25


def test_snapkv_keeps_the_most_attended():
    # attention to candidate i is softmax(i): the last ones win, no sinks or values involved
    assert _kept(policies.get("snapkv", smooth=1), 2) == [4, 5]
    assert _kept(policies.get("snapkv", smooth=1), 3, valid=[True] * 5 + [False]) == [2, 3, 4]


def test_key_redundancy_hand_computed():
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]]).view(1, 1, 3, 2)
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    # cosine similarity to the others: k0 (1, 0) -> 0.5, k1 (1, 0) -> 0.5, k2 (0, 0) -> 0
    expected = torch.softmax(torch.tensor([0.5, 0.5, 0.0]), 0)
    assert torch.allclose(scoring.key_redundancy(keys, valid).flatten(), expected, atol=1e-6)
    # an invalid candidate neither counts as an "other" nor gets any mass
    valid = torch.tensor([True, False, True]).view(1, 1, 3)
    assert torch.allclose(scoring.key_redundancy(keys, valid).flatten(), torch.tensor([0.5, 0.0, 0.5]), atol=1e-6)


def test_rkv_trades_attention_for_diversity():
    keys = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]]).view(1, 1, 3, 2)
    queries = torch.tensor([3.0, 0.0]).view(1, 1, 1, 2)  # attends to k1 most, then k0, k2 least
    values = torch.ones(1, 1, 3, 2)
    positions = torch.arange(3).view(1, 1, 3)
    valid = torch.ones(1, 1, 3, dtype=torch.bool)
    args = (keys, values, queries, positions, valid)
    assert policies.get("rkv", lam=1.0, smooth=1).select(*args, 1).item() == 1  # pure attention
    assert policies.get("rkv", lam=0.0, smooth=1).select(*args, 1).item() == 2  # pure diversity
    attn = scoring.window_attention(keys, queries, valid, smooth=1)
    red = scoring.key_redundancy(keys, valid)
    expected = (0.5 * attn - 0.5 * red).topk(2).indices.sort().values
    assert torch.equal(policies.get("rkv", smooth=1).select(*args, 2).sort().values, expected)


def test_cur_scores_hand_computed():
    keys = torch.tensor([[1.0, 0.0], [0.0, 2.0]]).view(1, 1, 2, 2)
    values = torch.tensor([[3.0, 0.0], [0.0, 1.0]]).view(1, 1, 2, 2)
    g = torch.eye(2)
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    # ||K G||^2 * ||V G||^2 = [1 * 9, 4 * 1] = [9, 4], normalised to sum 1
    expected = torch.tensor([9.0, 4.0]) / 13
    assert torch.allclose(scoring.cur_scores(keys, values, g, valid).flatten(), expected)


def test_cur_scores_are_zero_for_invalid_candidates_and_sum_to_one():
    """`scoring.cur_scores` mutant `masked_fill(~valid, 1.0)`: invalid candidates scored, and
    the valid ones no longer summing to 1 (top-k over them is unchanged, the scores are not)."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, 7, 8, generator=g), torch.randn(2, 1, 7, 8, generator=g)
    valid = torch.ones(2, 1, 7, dtype=torch.bool)
    valid[0, 0, :3] = False
    s = scoring.cur_scores(keys, values, scoring.gaussian_projection(8, 4, keys.device, g), valid)
    assert torch.equal(s[~valid], torch.zeros_like(s[~valid]))
    torch.testing.assert_close(s.sum(-1), torch.ones(2, 1))


def _dkv_case(n=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)
    positions = torch.arange(n).expand(1, 2, n)
    return keys, values, None, positions, torch.ones(1, 2, n, dtype=torch.bool)


def test_vase_dkv_redraws_g_and_cur_keeps_it():
    case = _dkv_case()
    dkv = policies.get("vase-dkv", sinks=2)
    cur = policies.get("cur", sinks=2)
    dkv_draws = {tuple(dkv.select(*case, 6, torch.Generator().manual_seed(s)).sort().values.flatten().tolist())
                 for s in range(20)}  # fmt: skip
    cur_draws = {tuple(cur.select(*case, 6, torch.Generator().manual_seed(s)).sort().values.flatten().tolist())
                 for s in range(20)}  # fmt: skip
    assert len(dkv_draws) > 1 and len(cur_draws) == 1
    for draw in dkv_draws | cur_draws:  # sinks are always in
        assert {0, 1} <= set(draw[:6]) and {0, 1} <= set(draw[6:])


def test_dkv_is_top_k_of_the_cur_score():
    keys, values, _, positions, valid = _dkv_case()
    policy = policies.get("vase-dkv", sinks=0, rank=20)
    gen = torch.Generator().manual_seed(3)
    idx = policy.select(keys, values, None, positions, valid, 5, gen)
    g = scoring.gaussian_projection(8, 20, torch.device("cpu"), torch.Generator().manual_seed(3))
    expected = scoring.cur_scores(keys, values, g, valid).topk(5).indices
    assert torch.equal(idx.sort().values, expected.sort().values)


def test_dkv_head_dim_mismatch_names_the_problem():
    """`dkv` mutant upper-casing its message: the error text users see."""
    keys, values = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 4)
    positions, valid = torch.arange(6).expand(1, 1, 6), torch.ones(1, 1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="dkv projects keys and values with one G: head dims must match"):
        policies.dkv(keys, values, positions, valid, None)


def test_streaming_keeps_sinks_and_the_most_recent():
    keys, values, queries, positions, valid = _case()
    policy = policies.get("streaming", sinks=1)
    assert sorted(policy.select(keys, values, queries, positions, valid, 3).flatten().tolist()) == [0, 4, 5]


def test_random_is_uniform_and_skips_padding():
    keys, values, queries, positions, _ = _case()
    valid = torch.tensor([True, True, False, True, True, True]).view(1, 1, 6)
    policy = policies.get("random")
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(3000):
        counts.scatter_add_(0, policy.select(keys, values, queries, positions, valid, 2, g).flatten(), torch.ones(2))
    assert counts[2] == 0
    freq = counts[valid.flatten()] / counts.sum()
    assert torch.allclose(freq, torch.full_like(freq, 0.2), atol=0.02)


def test_knorm_keeps_the_sinks_then_the_smallest_key_norms():
    # key norms 5, 1, 4, 0.5, 3, 2 (candidate 0 is the sink)
    keys = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, -4.0], [0.3, 0.4], [3.0, 0.0], [0.0, 2.0]]).view(1, 1, 6, 2)
    _, values, queries, positions, valid = _case()
    policy = policies.get("knorm", sinks=1)
    assert sorted(policy.select(keys, values, queries, positions, valid, 3).flatten().tolist()) == [0, 1, 3]
    assert sorted(policy.select(keys, values, None, positions, valid, 4).flatten().tolist()) == [0, 1, 3, 5]
    # without sinks candidate 0 (the largest norm) goes; the invalid smallest-norm key is never kept
    valid = torch.tensor([True, True, True, False, True, True]).view(1, 1, 6)
    no_sinks = policies.get("knorm", sinks=0)
    assert sorted(no_sinks.select(keys, values, None, positions, valid, 3).flatten().tolist()) == [1, 4, 5]


def test_evict_large_drops_the_largest_ranges():
    # ranges r = [0.1, 5.0, 0.2, 0.3, 0.4, 0.5]; protect=3 with 1 sink: the 3 largest non-sink
    # ranges (indices 1, 5, 4) are evicted on purpose, the rest is the top attention (3, 2)
    policy = policies.get("evict-large", protect=3, sinks=1, smooth=1, sample=False)
    assert _kept(policy, 3) == [0, 2, 3]
    vase = policies.get("vase", protect=3, sinks=1, smooth=1, sample=False)
    assert _kept(vase, 3) == [0, 1, 5]
    # when nothing else is left, banned candidates fill the quota
    assert _kept(policy, 6) == [0, 1, 2, 3, 4, 5]


def test_protect_random_protects_random_candidates():
    # protect 2 (1 sink): with top-k attention the protected random slot is the only variable
    policy = policies.get("protect-random", protect=2, sinks=1, smooth=1, sample=False)
    draws = [tuple(_kept(policy, 3, generator=torch.Generator().manual_seed(s))) for s in range(40)]
    assert all(d[0] == 0 and 5 in d for d in draws)  # the sink and the most attended
    assert len(set(draws)) >= 3


def test_random_protection_draws_on_the_candidates_device():
    """`vase.protected_mask` mutant `torch.rand(..., device=None)`: the `protect-random` draw
    landed on the default device (the CPU) whatever the cache's device; on a GPU that fails. The
    `meta` device stands in for one here."""
    valid = torch.ones(1, 2, 6, dtype=torch.bool, device="meta")
    positions = torch.arange(6, device="meta").expand(1, 2, 6)
    values = torch.empty(1, 2, 6, 4, device="meta")
    mask = protected_mask(values, positions, valid, 3, None, protect=3, sinks=1, score="range", protection="random")
    assert mask.device.type == "meta" and mask.shape == (1, 2, 6)


def test_vase_topk_is_deterministic():
    policy = policies.get("vase-topk", protect=2, sinks=1, smooth=1)
    assert {tuple(_kept(policy, 4, generator=torch.Generator().manual_seed(s))) for s in range(10)} == {(0, 1, 4, 5)}


def test_vase_variants_use_their_value_score():
    assert policies.get("vase-l2").options["score"] == "l2" and policies.get("vase-var").options["score"] == "var"
    assert math.isclose(policies.get("vase-l2", temperature=2.0).options["temperature"], 2.0)
