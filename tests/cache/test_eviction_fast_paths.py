"""The eviction's fast paths keep bit for bit what the plain formulation keeps.

The eviction (1) hashes the keyed noise with the key-free halves of the hash cached
(`keyed.mixed_indices`), (2) moves the kept slots with one `index_select` of whole rows
(`slots.gather_slots`) instead of a `gather` with the slot index expanded over the head
dimension, and (3) computes the window attention a few (row, KV head) pairs at a time, masking
the invalid candidates by adding a 0 / -inf bias in the pass that scales the logits
(`scoring.window_attention`, `scoring.attention_chunks`) instead of one batched product and a
broadcast `masked_fill`. None may change a bit. The reference below is the plain formulation,
written out here: the chained `absorb_tensor` hash of (key, row, global KV head, slot), the
expanded-index `gather` and the one-product window attention. Every registered policy is driven
through the production step (`attention_step`) twice, once with the library's eviction and once
with the reference, over ragged batches, tensor-parallel head offsets, a sliding-window layer with
its own budget, and an overflowing (chunked) step, and the buffers are compared bit for bit.

Stacking the eviction of all layers along the batch axis was measured
(`benchmarks/eviction_batching.py`, docs/performance.md#eviction-share): with the chunked window
attention it saves the per-op overhead (x0.68 at batch 1, x0.91 by 5 layers and x1.17 by 30 at
batch 8, where the copies of the layers' buffers eat the saving), not enough to reach 2% at batch 8;
the library evicts layer by layer. The last test checks that the stacking the benchmark times keeps
the same slots, so its timings compare like with like.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.drive import step
from tests.query_stats_files import options_for
from vasepatch import VaSEConfig, policies
from vasepatch.cache import VaSELayer, slots
from vasepatch.cache.plan import LayerPlan
from vasepatch.cache.slots import gather_slots
from vasepatch.policies import keyed, scoring
from vasepatch.policies.base import kept_slots
from vasepatch.policies.keyed import (
    MASK32,
    SHARED_HEAD,
    KeyedGenerator,
    StackedKeyedGenerator,
    absorb_tensor,
    to_uniform,
)

CPU = torch.device("cpu")


class ReferenceGenerator(KeyedGenerator):
    """The keyed noise as it was computed before the key-free halves were cached."""

    def uniform_candidates(self, shape, device):
        b, h, n = shape
        key = self._next_key(device)
        rows = torch.arange(b, device=device, dtype=torch.int64).view(b, 1, 1)
        if self.shared:
            heads = torch.full((1, h, 1), SHARED_HEAD, device=device, dtype=torch.int64)
        else:
            heads = torch.arange(self.head_offset, self.head_offset + h, device=device, dtype=torch.int64)
            heads = heads.view(1, h, 1) & MASK32
        slots = torch.arange(n, device=device, dtype=torch.int64).view(1, 1, n)
        return to_uniform(absorb_tensor(absorb_tensor(absorb_tensor(key, rows), heads), slots))

    def normal(self, shape, device):
        key = self._next_key(device)
        flat = torch.arange(2 * math.prod(shape), device=device, dtype=torch.int64).view(*shape, 2)
        u = to_uniform(absorb_tensor(key, flat))
        return torch.sqrt(-2.0 * torch.log(u[..., 0])) * torch.cos((2.0 * math.pi) * u[..., 1])

    def shared_heads(self):
        return ReferenceGenerator(self.seed, self.layer, self.eviction, self.head_offset, self.device, shared=True)


def reference_gather(src: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    return src.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, src.shape[-1]))


def reference_window_attention(keys, queries, valid, temperature=1.0, smooth=1):
    """The window attention as one batched product, scaled, then a broadcast `masked_fill`."""
    h_kv, d = keys.shape[1], keys.shape[-1]
    b, hq, w, _ = queries.shape
    q = queries.float().reshape(b, h_kv, hq // h_kv * w, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)).mul_(1.0 / (math.sqrt(d) * temperature))
    logits.masked_fill_(~valid.unsqueeze(-2), float("-inf"))
    scores = torch.softmax(logits, dim=-1).mean(-2).nan_to_num_(0.0)
    if smooth > 1:
        n = scores.shape[-1]
        pooled = F.avg_pool1d(scores.reshape(-1, 1, n), kernel_size=smooth, padding=smooth // 2, stride=1)
        scores = pooled[..., :n].reshape(scores.shape)
    return scores.masked_fill(~valid, 0.0)


WINDOW_SHAPES = [  # (batch, KV heads, GQA group, window, candidates, head dim, dtype)
    (1, 3, 3, 64, 512, 64, torch.float32),
    (8, 3, 3, 64, 512, 64, torch.float32),
    (3, 2, 4, 7, 33, 128, torch.float32),
    (2, 4, 1, 5, 19, 96, torch.bfloat16),
    (1, 1, 2, 1, 1, 16, torch.float32),
]


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
@pytest.mark.parametrize("chunk_bytes", [1, 2**16, 2 * 2**20, 2**40])
def test_the_chunked_window_attention_is_the_one_product(shape, chunk_bytes, monkeypatch):
    """Any chunk size (1 byte: one pair a chunk; 1 TiB: one chunk) gives the previous numbers bit
    for bit, with padding, a row and head with no valid candidate, temperatures and smoothing."""
    b, h, group, w, n, d, dtype = shape
    g = torch.Generator().manual_seed(sum(shape[:6]))
    keys = (torch.randn(b, h, n, d, generator=g) * 2).to(dtype)
    queries = (torch.randn(b, h * group, w, d, generator=g) * 2).to(dtype)
    valid = torch.rand(b, h, n, generator=g) > 0.25
    valid[0, 0] = False  # no valid candidate: scores 0
    monkeypatch.setitem(scoring.CHUNK_BYTES, "cpu", chunk_bytes)
    for temperature, smooth in ((1.0, 1), (0.7, 5), (1.3, 3)):
        got = scoring.window_attention(keys, queries, valid, temperature, smooth)
        assert torch.equal(got, reference_window_attention(keys, queries, valid, temperature, smooth))


@pytest.mark.parametrize(
    ("pairs", "per_pair", "limit"), [(24, 192 * 512, 2 * 2**20), (3, 10, 2**40), (7, 5, 1), (0, 9, 64)]
)
def test_attention_chunks_cover_every_pair_within_the_limit(pairs, per_pair, limit, monkeypatch):
    monkeypatch.setitem(scoring.CHUNK_BYTES, "cpu", limit)
    chunks = scoring.attention_chunks(pairs, per_pair, CPU)
    assert [i for c in chunks for i in range(pairs)[c]] == list(range(pairs))
    assert all(c.stop - c.start == 1 or 4 * per_pair * (c.stop - c.start) <= limit for c in chunks)
    assert all(4 * per_pair * (c.stop - c.start + 1) > limit for c in chunks[:-1])  # as full as the limit allows


def test_other_devices_chunk_by_the_device_limit():
    chunks = scoring.attention_chunks(1000, 2**20, torch.device("meta"))
    assert {c.stop - c.start for c in chunks} == {scoring.DEVICE_CHUNK_BYTES // 2**22, 1000 % 64 or 64}


def test_the_window_attention_runs_with_gradients_on():
    """A forward with autograd on may evict: no `out=` into tensors that require grad."""
    keys = torch.randn(2, 2, 9, 8, requires_grad=True)
    queries = torch.randn(2, 4, 3, 8, requires_grad=True)
    valid = torch.ones(2, 2, 9, dtype=torch.bool)
    scores = scoring.window_attention(keys, queries, valid, smooth=3)
    with torch.no_grad():
        assert torch.equal(scores, scoring.window_attention(keys, queries, valid, smooth=3))


@pytest.mark.parametrize(
    ("seed", "layer", "round_", "offset", "shared", "shape"),
    [
        (0, 0, 0, 0, False, (1, 3, 512)),
        (2**64 - 1, 29, 7, 5, False, (8, 3, 700)),
        (-5, 3, 1, 3, True, (3, 4, 9)),
        (7, 3, 1, 2**33 + 1, False, (2, 2, 5)),
    ],
)
def test_the_cached_hash_draws_the_previous_noise(seed, layer, round_, offset, shared, shape):
    ours = KeyedGenerator(seed, layer, round_, offset, shared=shared)
    ref = ReferenceGenerator(seed, layer, round_, offset, shared=shared)
    for _ in range(3):  # successive draws of one eviction
        assert torch.equal(ours.uniform_candidates(shape, CPU), ref.uniform_candidates(shape, CPU))
    assert torch.equal(ours.normal((64, 20), CPU), ref.normal((64, 20), CPU))


def test_the_cached_halves_serve_inside_and_outside_inference_mode():
    keyed._cached_index_mix.cache_clear()
    with torch.inference_mode():
        inside = KeyedGenerator(1, 2, 3, 4).uniform_candidates((2, 3, 11), CPU)
    cached = keyed.mixed_indices(0, 11, CPU)
    assert not cached.is_inference()  # made outside inference mode, usable by any later eviction
    outside = KeyedGenerator(1, 2, 3, 4).uniform_candidates((2, 3, 11), CPU)
    assert torch.equal(inside, outside)
    assert keyed.mixed_indices(0, 11, CPU) is cached


@pytest.mark.parametrize("shape", [(1, 1, 5, 1), (2, 3, 17, 4), (8, 3, 576, 64)])
def test_gather_slots_is_the_expanded_gather(shape):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(shape, generator=g)
    b, h, s, _ = shape
    kept = torch.stack([torch.randperm(s, generator=g)[: max(1, s - 3)] for _ in range(b * h)]).view(b, h, -1)
    assert torch.equal(gather_slots(src, kept), reference_gather(src, kept))
    assert torch.equal(
        gather_slots(src.transpose(0, 1).contiguous().transpose(0, 1), kept),
        src.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, shape[-1])),
    )  # a non-contiguous source is copied, not misread


class _Reference:
    """Within the block, layers evict with the reference noise and the expanded-index gather."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def __enter__(self):
        def for_eviction(rng, plan, round_, device):
            return ReferenceGenerator(rng.generation_seed(), plan.index, round_, plan.head_offset, device)

        from vasepatch.cache import EvictionRandomness

        self.monkeypatch.setattr(EvictionRandomness, "for_eviction", for_eviction)
        self.monkeypatch.setattr(slots, "gather_slots", reference_gather)
        self.monkeypatch.setattr(scoring, "window_attention", reference_window_attention)

    def __exit__(self, *exc):
        self.monkeypatch.undo()


def _drive(layer: VaSELayer, batch: int, kv_heads: int, steps: list[int], padded: bool, seed: int) -> int:
    """Feed `steps` (tokens per step) of random K/V/Q; the first step left-pads rows 1.. when
    `padded`. Returns the number of steps that evicted."""
    g = torch.Generator().manual_seed(seed)
    d, group, evictions = 8, 2, 0
    for i, q_len in enumerate(steps):
        k, v = (torch.randn(batch, kv_heads, q_len, d, generator=g) for _ in range(2))
        q = torch.randn(batch, kv_heads * group, q_len, d, generator=g)
        padding = None
        if padded and i == 0:
            padding = torch.ones(batch, q_len, dtype=torch.long)
            for row in range(1, batch):
                padding[row, : 3 * row] = 0
        elif padded:
            padding = torch.ones(batch, q_len, dtype=torch.long)
        evictions += step(layer, k, v, q, padding)[1]
    return evictions


def _state(layer: VaSELayer) -> tuple[torch.Tensor, ...]:
    return layer.keys.clone(), layer.values.clone(), layer.positions.clone(), layer.valid.clone()


CASES = {
    "global": dict(plan=LayerPlan(3), batch=1, heads=2, padded=False, steps=[40] + [1] * 30),
    "ragged": dict(plan=LayerPlan(5), batch=3, heads=2, padded=True, steps=[37] + [1] * 30),
    "tensor-parallel": dict(
        plan=LayerPlan(2, head_offset=6, kv_heads=12), batch=2, heads=3, padded=True, steps=[30] + [1] * 25
    ),  # the third of four ranks of 3 KV heads
    "sliding": dict(plan=LayerPlan(1, sliding_window=24), batch=2, heads=2, padded=True, steps=[33] + [1] * 30),
    "chunked": dict(plan=LayerPlan(4), batch=2, heads=2, padded=False, steps=[9, 9, 9, 9, 9, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", policies.available())
def test_every_policy_keeps_exactly_what_the_previous_eviction_kept(name, case, monkeypatch):
    c = CASES[case]
    kv_heads = c["plan"].kv_heads or c["heads"]  # the layer's over all ranks: the statistics' rows
    stats = options_for(name, layers=c["plan"].index + 1, q_heads=2 * kv_heads, kv_heads=kv_heads, head_dim=8)
    config = VaSEConfig(budget=16, window=4, policy=name, seed=11, protect=6, policy_options=stats)
    monkeypatch.setitem(scoring.CHUNK_BYTES, "cpu", 1)  # ours: one (row, KV head) pair a chunk
    runs = []
    for reference in (False, True):
        layer = VaSELayer(config, policies.for_config(config), plan=c["plan"])
        if reference:
            with _Reference(monkeypatch):
                n = _drive(layer, c["batch"], c["heads"], c["steps"], c["padded"], seed=3)
        else:
            n = _drive(layer, c["batch"], c["heads"], c["steps"], c["padded"], seed=3)
        runs.append((n, layer.counters.evictions, _state(layer)))
    (n_ours, rounds, ours), (n_ref, ref_rounds, ref) = runs
    assert n_ours == n_ref and rounds == ref_rounds and rounds >= 2
    for got, want in zip(ours, ref, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", policies.available())
def test_stacking_the_layers_keeps_the_same_slots(name):
    """The stacked eviction the benchmark times (`keyed.StackedKeyedGenerator`, `rows=B`: layer `l`'s rows
    `l*B .. l*B + B - 1`, their `head_ids` those of layer `l`) keeps what each layer keeps on its own, for every
    registered policy."""
    g = torch.Generator().manual_seed(1)
    b, h, n, d, budget, window, layers = 2, 3, 40, 16, 24, 8, 4
    policy = policies.get(name, protect=8, **options_for(name, layers=layers, q_heads=2 * h, kv_heads=h, head_dim=d))
    inputs = []
    for _ in range(layers):
        k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
        pos = torch.arange(n).expand(b, h, n).clone()
        valid = torch.ones(b, h, n, dtype=torch.bool)
        valid[1, :, :5], pos[1, :, :5] = False, -1
        inputs.append((k, v, pos, valid, torch.randn(b, 2 * h, window, d, generator=g)))
    gens = [KeyedGenerator(5, i, 2, 3) for i in range(layers)]
    ids = [LayerPlan(i).head_ids(h, b, CPU) for i in range(layers)]  # each layer's rows of statistics
    one = [kept_slots(policy, *x, n, budget, window, *more) for x, *more in zip(inputs, gens, ids, strict=True)]
    stacked = [torch.cat([x[i] for x in inputs]) for i in range(5)]
    keys = [(5, i, 2) for i in range(layers)]
    generator = StackedKeyedGenerator(keys, 3, rows=b)
    together = kept_slots(policy, *stacked, n, budget, window, generator, torch.cat(ids))
    assert torch.equal(together, torch.cat(one))
