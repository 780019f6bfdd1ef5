"""Eviction does not depend on the sharding: one process and tensor-parallel ranks keep the same slots.

Tensor parallelism gives each rank a contiguous slice of the KV heads (and of the
query heads that share them). With the cache's keyed randomness (`KeyedGenerator`,
keyed by seed, layer, round, row, *global* KV head and slot) the slots an
eviction keeps for a head are the same whether one process holds all heads or a
rank holds that head at some `head_offset`. Likewise a row's choice does not
depend on the rows after it in the batch (the batch size).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from property_tests.strategies import PolicyCase, policy_cases, policy_options
from vasepatch import policies
from vasepatch.cache import EvictionRandomness
from vasepatch.cache.plan import LayerPlan
from vasepatch.policies.base import kept_slots

LAYERS = 41  # the layers an eviction below may be of (0 to 40): the rows of a statistics file


def _build(name: str, case: PolicyCase, **extra):
    """Policy `name` with the case's common options, and a statistics file of `LAYERS` layers of its shapes (all
    of its KV heads, over every rank) if it reads one."""
    extra = {**policy_options(name, case, layers=LAYERS), **extra}
    return policies.get(
        name, protect=case.protect, sinks=case.sinks, temperature=case.temperature, smooth=case.smooth, **extra
    )


def _keep(policy, case: PolicyCase, heads: slice, rows: slice, window: int, layer: int, round_: int):
    """The kept slots of an eviction that holds KV heads `heads` (and their query heads) of rows `rows` of layer
    `layer`: its noise keyed and its `head_ids` numbered by the global KV head, as the cache's layers do."""
    group = case.queries.shape[1] // case.keys.shape[1]
    q_heads = slice(heads.start * group, heads.stop * group)
    plan = LayerPlan(layer, head_offset=heads.start, kv_heads=case.keys.shape[1])
    generator = EvictionRandomness(case.seed).for_eviction(plan, round_, case.keys.device)
    b, n = case.keys[rows].shape[0], case.keys.shape[2]
    return kept_slots(
        policy,
        case.keys[rows, heads],
        case.values[rows, heads],
        case.positions[rows, heads],
        case.valid[rows, heads],
        case.queries[rows, q_heads],
        n,
        case.n_keep + window,
        window,
        generator,
        plan.head_ids(heads.stop - heads.start, b, case.keys.device),
    )


def _window(case: PolicyCase, data) -> int:
    """Recent slots kept besides the `n_keep` picks; at least one candidate is left, as in a cache."""
    return data.draw(st.integers(0, max(0, case.keys.shape[2] - max(case.n_keep, 1))), label="window")


@pytest.mark.parametrize("name", policies.available())
@given(case=policy_cases(kv_heads=st.sampled_from([2, 4])), data=st.data())
def test_one_process_and_two_ranks_keep_the_same_slots(name, case, data):
    """Ranks holding KV heads [0, H/2) and [H/2, H) keep, for each head, what one process holding
    all H keeps (every registered policy: the stochastic ones draw keyed noise)."""
    window, layer, round_ = _window(case, data), data.draw(st.integers(0, 40)), data.draw(st.integers(0, 10**6))
    policy = _build(name, case)
    h, rows = case.keys.shape[1], slice(None)
    whole = _keep(policy, case, slice(0, h), rows, window, layer, round_)
    ranks = [_keep(policy, case, slice(r * h // 2, (r + 1) * h // 2), rows, window, layer, round_) for r in (0, 1)]
    assert torch.equal(torch.cat(ranks, dim=1), whole)


@pytest.mark.parametrize("name", policies.available())
@given(case=policy_cases(), data=st.data())
def test_a_rows_choice_does_not_depend_on_the_rows_after_it(name, case, data):
    """Evicting rows [0, k) alone keeps for them what evicting the whole batch keeps (the
    noise is keyed by the row's index, not drawn in batch order)."""
    window = _window(case, data)
    b = case.keys.shape[0]
    k = data.draw(st.integers(1, b), label="rows")
    policy = _build(name, case)
    heads = slice(0, case.keys.shape[1])
    whole = _keep(policy, case, heads, slice(None), window, 3, 7)
    assert torch.equal(_keep(policy, case, heads, slice(0, k), window, 3, 7), whole[:k])


@given(case=policy_cases(kv_heads=st.sampled_from([2, 4])), data=st.data())
def test_the_keyed_noise_differs_between_heads_layers_and_rounds(case, data):
    """The key is not degenerate: two heads, layers or rounds draw different noise."""
    n = case.keys.shape[2]
    shape = (case.keys.shape[0], case.keys.shape[1], n)
    rnd = EvictionRandomness(case.seed)
    base = rnd.for_eviction(LayerPlan(1), 2, case.keys.device).uniform_candidates(shape, case.keys.device)
    other_layer = rnd.for_eviction(LayerPlan(2), 2, case.keys.device).uniform_candidates(shape, case.keys.device)
    other_round = rnd.for_eviction(LayerPlan(1), 3, case.keys.device).uniform_candidates(shape, case.keys.device)
    assert not torch.equal(base[:, 0], base[:, 1])
    assert not torch.equal(base, other_layer) and not torch.equal(base, other_round)
