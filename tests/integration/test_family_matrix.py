"""Every family of the matrix (`tests/family_matrix.py`): detection reports its attention features, a patched
model computes what the unpatched one computes while nothing is evicted, and an eviction run stays within
capacity; every rejected family is refused with its reason, untouched."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import vasepatch
from tests.attention_features import attention_features
from tests.conftest import greedy_with_logits, max_logit_diff, ragged_batch
from tests.family_matrix import FAMILIES, FEATURES, REJECTED, WINDOW
from tests.tiny_models import VOCAB

TOL = 1e-5
LENGTHS = (12, 7, 3)  # the ragged, left-padded prompts: the longest is longer than the sliding window
PARITY_STEPS = 8
EVICTION_STEPS = 12
EVICTION_BUDGET, EVICTION_WINDOW = 16, 4


def _ids(family) -> str:
    return family.name


def _build(family) -> torch.nn.Module:
    reason = family.missing()
    if reason:
        pytest.skip(reason)
    return family.model()


def test_the_matrix_is_wide_and_well_formed():
    names = [f.name for f in FAMILIES]
    assert len(names) >= 25
    assert len(set(names) | {r.name for r in REJECTED}) == len(names) + len(REJECTED)
    assert max(LENGTHS) > WINDOW
    assert all(f.features <= set(FEATURES) for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES, ids=_ids)
def test_detection_reports_the_expected_attention_features(family):
    model = _build(family)
    assert model.config.model_type == family.name
    detected = attention_features(model)
    assert set(detected) == set(FEATURES)
    assert {name for name, present in detected.items() if present} == set(family.features)


def _layers(handle: vasepatch.PatchHandle) -> list[tuple[bool, object]]:
    """(is a global layer, its counters) for every layer of the patch's most recent cache."""
    plans = handle.layout.layer_plans()
    counters = handle.monitor.layers
    assert len(counters) == len(plans)
    return [(plan.sliding_window is None, c) for plan, c in zip(plans, counters, strict=True)]


@pytest.mark.parametrize("family", FAMILIES, ids=_ids)
def test_parity_with_nothing_evicted(family):
    """Prefill logits at every real position, then greedy decode logits, on a ragged batch. Sliding layers
    drop what left their window (that is exact); global layers evict nothing."""
    model = _build(family)
    ids, mask = ragged_batch(VOCAB, LENGTHS)
    real = mask.bool()
    with torch.no_grad():
        ref_prefill = model(input_ids=ids, attention_mask=mask).logits
        ref = greedy_with_logits(model, ids, mask, PARITY_STEPS)
        with vasepatch.patched(model, budget=64, window=8) as handle:
            cache = {handle.cache_keyword: handle.new_cache()}
            prefill = model(input_ids=ids, attention_mask=mask, **cache).logits
            out = greedy_with_logits(model, ids, mask, PARITY_STEPS)
            layers = _layers(handle)
    assert [c.evictions for is_global, c in layers if is_global] == [0] * sum(g for g, _ in layers)
    assert layers[0][1].tokens_seen == max(LENGTHS) + PARITY_STEPS - 1
    prefill_diff = (ref_prefill[real] - prefill[real]).abs().max().item()
    assert prefill_diff <= TOL, f"{family.name}: prefill max |logit diff| {prefill_diff:.3g}"
    diff = max_logit_diff(ref, out)
    assert diff <= TOL, f"{family.name}: decode max |logit diff| {diff:.3g}"
    assert torch.equal(ref.sequences, out.sequences)


class _Snapshots(LogitsProcessor):
    """Records every layer's (occupancy, capacity) at every decode step (`generate` calls it after each
    forward)."""

    def __init__(self, handle: vasepatch.PatchHandle) -> None:
        self.handle, self.seen = handle, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.seen.append([(c.tokens_seen, c.occupancy, c.capacity) for _, c in _layers(self.handle)])
        return scores


@pytest.mark.parametrize("family", FAMILIES, ids=_ids)
def test_eviction_run_stays_within_capacity(family):
    """Evictions happen (in the global layers where there are any), every layer's occupancy stays within its
    capacity, which never changes, and no logit is NaN."""
    model = _build(family)
    ids, mask = ragged_batch(VOCAB, LENGTHS)
    with torch.no_grad(), vasepatch.patched(model, budget=EVICTION_BUDGET, window=EVICTION_WINDOW) as handle:
        snapshots = _Snapshots(handle)
        out = greedy_with_logits(model, ids, mask, EVICTION_STEPS, logits_processor=LogitsProcessorList([snapshots]))
        layers = _layers(handle)
    seen = snapshots.seen
    assert [step[0][0] for step in seen] == list(range(max(LENGTHS), max(LENGTHS) + EVICTION_STEPS))
    for i in range(len(layers)):
        assert all(step[i][1] <= step[i][2] for step in seen), f"layer {i}: {[step[i] for step in seen]}"
        assert len({step[i][2] for step in seen}) == 1, f"layer {i}'s capacity changed: {[s[i] for s in seen]}"
    evicting = [c for is_global, c in layers if is_global] or [c for _, c in layers]
    assert all(c.evictions > 0 and c.evicted > 0 for c in evicting)
    assert not any(step.isnan().any() for step in out.logits)


@pytest.mark.parametrize("family", REJECTED, ids=[f.name for f in REJECTED])
def test_rejected_family_is_refused_with_its_reason(family):
    model = _build(family)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(vasepatch.UnsupportedModelError) as err:
        vasepatch.patch(model, budget=256, window=16)
    assert family.name in str(err.value)
    assert re.search(family.reason, str(err.value)), str(err.value)
    assert not vasepatch.is_patched(model)
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
