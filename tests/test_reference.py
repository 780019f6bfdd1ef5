"""The library's cache + VaSE policy agree exactly with the loop reference."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ragged_batch
from tests.drive import step
from tests.reference import ReferenceCache
from vasepatch import policies
from vasepatch.cache import VaSELayer
from vasepatch.config import VaSEConfig


def _compare(layer: VaSELayer, ref: ReferenceCache) -> None:
    occ = layer.counters.occupancy
    for b, heads in enumerate(ref.entries):
        for h, entries in enumerate(heads):
            assert len(entries) == occ
            valid = layer.valid[b, h, :occ].tolist()
            assert valid == [e.valid for e in entries]
            for s, e in enumerate(entries):
                if e.valid:
                    assert layer.positions[b, h, s].item() == e.pos
                    assert torch.equal(layer.keys[b, h, s], e.k) and torch.equal(layer.values[b, h, s], e.v)


@pytest.mark.parametrize("sample", [False, True], ids=["topk", "sampled"])
@pytest.mark.parametrize(("kv_heads", "q_heads"), [(2, 4), (2, 2)])
def test_library_matches_reference(sample, kv_heads, q_heads):
    budget, window, protect, sinks, d, batch = 16, 4, 5, 2, 8, 3
    cfg = VaSEConfig(budget=budget, window=window, protect=protect, sinks=sinks, seed=11 if sample else None)
    policy = policies.get("vase", protect=protect, sinks=sinks, smooth=5, sample=sample)
    layer = VaSELayer(cfg, policy)
    ref = ReferenceCache(batch, kv_heads, budget, window, protect, sinks, smooth=5, seed=11 if sample else None)
    g = torch.Generator().manual_seed(3)
    _, mask = ragged_batch(lengths=(10, 6, 2))
    prompt = mask.shape[1]

    def rand(heads, n):
        return torch.randn(batch, heads, n, d, generator=g)

    k, v, q = rand(kv_heads, prompt), rand(kv_heads, prompt) * 3, rand(q_heads, prompt)
    step(layer, k, v, q, padding=mask)
    ref.step(k, v, q, padding=mask)
    _compare(layer, ref)
    evictions = 0
    for i in range(70):
        k, v, q = rand(kv_heads, 1), rand(kv_heads, 1) * 3, rand(q_heads, 1)
        padding = torch.ones(batch, prompt + i + 1)
        _, evicted = step(layer, k, v, q, padding=padding)
        assert ref.step(k, v, q, padding=padding) == evicted
        evictions += evicted
        _compare(layer, ref)
    assert evictions >= 10
