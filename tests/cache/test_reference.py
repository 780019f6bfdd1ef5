"""The library's cache and every registered policy agree exactly with the loop reference
(`tests/reference.py`): ragged batches, prompts shorter and longer than the budget, GQA and
MHA, deterministic and seeded policies (the same draws from the same generator)."""

from __future__ import annotations

import pytest
import torch

from tests.drive import step
from tests.query_stats_files import options_for
from tests.reference import POLICIES, ReferenceCache
from vasepatch import policies
from vasepatch.cache import VaSELayer
from vasepatch.config import VaSEConfig

BUDGET, WINDOW, PROTECT, SINKS, D, BATCH = 16, 4, 5, 2, 8, 3
# evict-large gives its `protect` banned candidates one equal priority, so when some of them
# must be kept, which ones is torch.topk's tie order, which the reference cannot know: with
# protect=1 there is never a tie.
OVERRIDES = {"evict-large": {"protect": 1, "sinks": 1}}
# triattention's float32 angles `(t - p + d) * w` are off by up to d * 6e-8 rad: by 4e-3 at its default farthest
# offset 65536, which moved its z-scores by 5e-4 from the float64 reference's, and two candidates' fewer than that
# apart swapped places at the keep boundary. Offsets up to 64 keep the difference near 1e-6.
POLICY_OPTIONS = {"triattention": {"max_offset": 64}}


def _compare(layer: VaSELayer, ref: ReferenceCache) -> None:
    occ = layer.counters.occupancy
    assert layer.counters.evicted == ref.evicted
    for b, heads in enumerate(ref.entries):
        for h, entries in enumerate(heads):
            assert len(entries) == occ
            valid = layer.valid[b, h, :occ].tolist()
            assert valid == [e.valid for e in entries]
            for s, e in enumerate(entries):
                if e.valid:
                    assert layer.positions[b, h, s].item() == e.pos
                    assert torch.equal(layer.keys[b, h, s], e.k) and torch.equal(layer.values[b, h, s], e.v)


def _ragged(lengths: tuple[int, ...]) -> torch.Tensor:
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return mask


def test_the_reference_covers_every_registered_policy():
    assert set(policies.available()) <= set(POLICIES)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("lengths", "kv_heads", "q_heads", "prefill"),
    [
        ((10, 6, 2), 2, 4, "compress"),
        ((37, 30, 5), 2, 4, "compress"),
        ((23, 23, 19), 2, 2, "compress"),
        ((37, 30, 5), 2, 4, "pin"),
    ],
    ids=["short-gqa", "long-gqa", "long-mha", "long-gqa-pinned"],
)
def test_library_matches_reference(policy, lengths, kv_heads, q_heads, prefill):
    """Prompts of up to 37 tokens against a budget of 16: a prompt over the budget is compressed
    at once (scored by its last `window` queries), then one eviction every `window` tokens. Pinned
    (`prefill="pin"`): the prompt stays whole and the same schedule runs on the tokens after it."""
    seed = 11
    sizes = {"protect": PROTECT, "sinks": SINKS, **OVERRIDES.get(policy, {})}
    common = dict(**sizes, temperature=2.0, smooth=3, seed=seed, policy=policy, prefill=prefill)
    options = options_for(policy, layers=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=D)
    options.update(POLICY_OPTIONS.get(policy, {}))
    cfg = VaSEConfig(budget=BUDGET, window=WINDOW, **common, policy_options=options)
    layer = VaSELayer(cfg, policies.for_config(cfg))
    ref = ReferenceCache(BATCH, kv_heads, BUDGET, WINDOW, **common, **options)
    g = torch.Generator().manual_seed(3)
    mask = _ragged(lengths)
    prompt = mask.shape[1]

    def rand(heads, n):
        return torch.randn(BATCH, heads, n, D, generator=g)

    k, v, q = rand(kv_heads, prompt), rand(kv_heads, prompt) * 3, rand(q_heads, prompt)
    _, evicted = step(layer, k, v, q, padding=mask)
    assert ref.step(k, v, q, padding=mask) == evicted == (prompt > BUDGET and prefill == "compress")
    _compare(layer, ref)
    evictions = int(evicted)
    for i in range(40 + layer.counters.pinned):
        k, v, q = rand(kv_heads, 1), rand(kv_heads, 1) * 3, rand(q_heads, 1)
        padding = torch.ones(BATCH, prompt + i + 1)
        _, evicted = step(layer, k, v, q, padding=padding)
        assert ref.step(k, v, q, padding=padding) == evicted
        evictions += evicted
        _compare(layer, ref)
    assert evictions >= 8
