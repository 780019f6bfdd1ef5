"""Beam search: the patched model's beams equal the unpatched model's when nothing is evicted,
and `reorder_cache` permutes every per-row buffer of a layer (keys, values, positions, validity,
next positions, the query ring) and nothing else."""

from __future__ import annotations

import pytest
import torch

import vasepatch
from tests.conftest import ragged_batch
from tests.drive import step
from tests.tiny_models import VOCAB
from vasepatch import policies
from vasepatch.cache import VaSELayer
from vasepatch.config import VaSEConfig

B, HKV, HQ, D = 4, 2, 4, 8
PERM = torch.tensor([2, 0, 0, 3])  # beams are copied (row 0 twice) and dropped (row 1), not only permuted


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_beam_search_equals_the_unpatched_model_when_nothing_is_evicted(make_model, family):
    model = make_model(family)
    ids, mask = ragged_batch(VOCAB, lengths=(9, 5))
    kw = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=24,
        num_beams=3,
        num_return_sequences=3,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        ref = model.generate(**kw)
        with vasepatch.patched(model, budget=256, window=16) as handle:
            out = model.generate(**kw)
    assert handle.stats()["evictions"] == 0
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=1e-5)


def _layer(policy: str = "vase-topk", budget: int = 12, window: int = 4) -> VaSELayer:
    cfg = VaSEConfig(budget=budget, window=window, protect=3, sinks=2, policy=policy, seed=0)
    return VaSELayer(cfg, policies.for_config(cfg))


def _inputs(seed: int, prompt: int, decode: int):
    """A ragged prompt (row r has r padding slots) then `decode` one-token steps: (k, v, q, mask) per step."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, prompt, dtype=torch.long)
    for row in range(B):
        mask[row, :row] = 0
    steps = [(prompt, mask)] + [(1, torch.ones(B, prompt + i + 1, dtype=torch.long)) for i in range(decode)]
    return [
        (
            torch.randn(B, HKV, n, D, generator=g),
            torch.randn(B, HKV, n, D, generator=g) * 3,
            torch.randn(B, HQ, n, D, generator=g),
            m,
        )
        for n, m in steps
    ]


def _drive(layer: VaSELayer, steps, rows: torch.Tensor | None = None) -> int:
    """Feed the steps (their rows selected by `rows`); returns how many evicted."""
    evictions = 0
    for k, v, q, m in steps:
        if rows is not None:
            k, v, q, m = k[rows], v[rows], q[rows], m[rows]
        evictions += step(layer, k, v, q, padding=m)[1]
    return evictions


def _per_row(layer: VaSELayer) -> dict[str, torch.Tensor]:
    return {
        "keys": layer.keys,
        "values": layer.values,
        "positions": layer.positions,
        "valid": layer.valid,
        "next_position": layer.slots.next_position,
        "ring.queries": layer.ring.queries,
        "ring.valid": layer.ring.valid,
    }


def test_reorder_cache_permutes_every_per_row_buffer_in_place():
    layer = _layer(window=6)
    _drive(layer, _inputs(0, prompt=5, decode=2))  # occupancy 7 of 18: the ring holds real and padding queries
    before = {name: t.clone() for name, t in _per_row(layer).items()}
    ptrs = {name: t.data_ptr() for name, t in _per_row(layer).items()}
    shared = (int(layer.slots.fill), int(layer.slots.seen), int(layer.ring.pointer), dict(vars(layer.counters)))
    for name, t in before.items():  # the test can fail: every buffer differs between the rows it mixes
        assert not torch.equal(t, t[PERM]), name
    layer.reorder_cache(PERM)
    for name, t in _per_row(layer).items():
        assert torch.equal(t, before[name][PERM]), f"{name} not reordered"
        assert t.data_ptr() == ptrs[name], f"{name} moved"
    assert (int(layer.slots.fill), int(layer.slots.seen), int(layer.ring.pointer), dict(vars(layer.counters))) == shared


@pytest.mark.parametrize("policy", ["vase-topk", "snapkv", "rkv"])
def test_a_beam_reordered_cache_equals_one_built_from_the_reordered_inputs(policy):
    """Reordering mid-generation (after evictions), then decoding on, leaves exactly the
    cache that the reordered rows would have built: kept slots, positions and the queries
    that score the next evictions all follow their row. Deterministic policies only (a
    sampled policy's noise is drawn per row index, not per beam)."""
    steps = _inputs(1, prompt=20, decode=30)
    reordered = _layer(policy)
    assert _drive(reordered, steps[:15]) >= 2
    reordered.reorder_cache(PERM)
    after = _drive(reordered, steps[15:])
    assert after >= 3  # evictions after the reorder use the reordered query ring
    direct = _layer(policy)
    _drive(direct, steps[:15], rows=PERM)
    _drive(direct, steps[15:])
    for name, t in _per_row(reordered).items():
        assert torch.equal(t, _per_row(direct)[name]), name
    assert vars(reordered.counters) == vars(direct.counters)
