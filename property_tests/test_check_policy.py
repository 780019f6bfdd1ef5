"""`check_policy` passes a correct user policy and catches broken ones."""

from __future__ import annotations

import pytest
import torch

from property_tests.check_policy import CACHE, EVERY_POLICY, SINK_KEEPERS, check_policy
from vasepatch import policies
from vasepatch.policies import query_stats
from vasepatch.policies.options import Sinks


@pytest.fixture
def register():
    """`register(name, fn)` for one test: the registry is restored afterwards, so that no other test
    (the reference's coverage check, the properties that read `policies.available()`) sees the policy."""
    before = dict(policies._REGISTRY)
    yield policies.register
    policies._REGISTRY.clear()
    policies._REGISTRY.update(before)


def newest(positions, valid):
    return positions.float()


def newest_and_sinks(positions, valid, *, sinks: Sinks = 4):
    return torch.where(valid & (positions < sinks), float("inf"), positions.float())


def newest_but_says_sinks(positions, valid, *, sinks: Sinks = 4):
    return positions.float()  # declares `sinks` and forgets them


def one_row_only(positions, valid):
    return positions[:1].float()  # [1, H, N]: broadcastable, not the [B, H, N] asked for


def test_a_correct_policy_passes_and_the_sink_properties_go_with_a_sinks_option(register):
    register("user-newest", newest)
    register("user-streaming", newest_and_sinks)
    every = [p.__name__ for p in (*EVERY_POLICY, *CACHE)]
    assert check_policy("user-newest", max_examples=5) == every
    assert set(check_policy("user-streaming", max_examples=5)) == {*every, *(p.__name__ for p in SINK_KEEPERS)}


def reads_stats(keys, valid, head_ids, *, stats: str = ""):
    """A user's policy that reads a statistics file: its rows must fit the candidates' heads and head size."""
    rows = query_stats.load_stats(stats).rows(head_ids)  # ValueError without a file, IndexError past its rows
    assert rows.q_abs.shape[:2] == keys.shape[:2] and rows.q_abs.shape[-1] == keys.shape[-1] // 2
    return keys.float().sum(-1) * rows.scaling.unsqueeze(-1)


def test_a_policy_with_a_stats_option_gets_a_statistics_file_of_each_case_s_shapes(register):
    register("user-stats", reads_stats)
    assert check_policy("user-stats", max_examples=10) == [p.__name__ for p in (*EVERY_POLICY, *CACHE)]


def test_a_policy_that_drops_its_sinks_fails(register):
    register("user-no-sinks", newest_but_says_sinks)
    with pytest.raises(AssertionError) as err:
        check_policy("user-no-sinks", max_examples=100)
    assert "keeps_the_sinks" in "\n".join(getattr(err.value, "__notes__", []))


def test_a_priority_of_the_wrong_shape_fails(register):
    register("user-one-row", one_row_only)
    with pytest.raises(policies.PolicyOutputError, match="user-one-row"):
        check_policy("user-one-row", max_examples=100)


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        check_policy("nope")
