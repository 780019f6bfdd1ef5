"""The eviction's keyed randomness: the hash, its uniforms, its keys, and a cache driven with it.

A test whose docstring names a mutant was written for one that survived the mutation check
(`benchmarks/mutation/run.sh`, recorded in `docs/results/mutation/`)."""

from __future__ import annotations

import pytest
import torch

from tests import drive
from vasepatch import policies
from vasepatch.cache import EvictionRandomness, VaSECache
from vasepatch.cache.plan import LayerPlan
from vasepatch.config import VaSEConfig
from vasepatch.policies import keyed, scoring
from vasepatch.policies.base import kept_slots
from vasepatch.policies.keyed import KeyedGenerator, StackedKeyedGenerator

EDGES = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFE, 0xFFFFFFFF]


def _fmix32(x: int) -> int:
    """murmur3's finaliser with exact (Python int) products reduced mod 2**32: an independent reference."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) % 2**32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) % 2**32
    return x ^ (x >> 16)


def test_the_int64_mixer_equals_wrapping_uint32_arithmetic():
    """The tensor mixer multiplies in 16-bit halves so nothing overflows int64: it must agree with
    exact 32-bit arithmetic everywhere, the edges of the range included."""
    values = EDGES + torch.randint(0, 2**32, (5000,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = keyed.mix_tensor(torch.tensor(values, dtype=torch.int64))
    assert ours.tolist() == [_fmix32(v) for v in values]
    assert ours.tolist() == [keyed.mix(v) for v in values]  # the host-side (Python int) mixer too
    assert int(ours.min()) >= 0 and int(ours.max()) < 2**32


def test_uniforms_lie_strictly_inside_0_1_even_at_the_extreme_hashes():
    u = keyed.to_uniform(torch.tensor([0, 1, 2**32 - 1], dtype=torch.int64))
    assert u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    gumbel = -torch.log(-torch.log(u))
    assert torch.isfinite(gumbel).all()


def test_keyed_uniforms_look_uniform_and_independent():
    u = KeyedGenerator(0, 3, 5).uniform_candidates((4, 8, 4096), torch.device("cpu")).double()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50, chi2  # 15 degrees of freedom: 50 is far out in the tail
    for a, b in ((u[:, 0], u[:, 1]), (u[0], u[1]), (u[..., :-1], u[..., 1:])):  # heads, rows, slots
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(r) < 0.02, r


def test_a_heads_noise_depends_on_its_global_index_only():
    """A rank holding heads [2, 5) draws for them what one process holding all 8 draws."""
    whole = KeyedGenerator(7, 1, 2).uniform_candidates((3, 8, 50), torch.device("cpu"))
    rank = KeyedGenerator(7, 1, 2, head_offset=2).uniform_candidates((3, 3, 50), torch.device("cpu"))
    assert torch.equal(rank, whole[:, 2:5])
    assert torch.equal(whole[:2], KeyedGenerator(7, 1, 2).uniform_candidates((2, 8, 50), torch.device("cpu")))


@pytest.mark.parametrize("change", ["seed", "layer", "eviction", "draw"])
def test_every_part_of_the_key_changes_the_noise(change):
    shape, cpu = (2, 2, 64), torch.device("cpu")
    parts = {"seed": 1, "layer": 2, "eviction": 3}
    base = KeyedGenerator(**parts)
    first = base.uniform_candidates(shape, cpu)
    if change == "draw":
        other = base.uniform_candidates(shape, cpu)  # the second draw of one eviction
    else:
        other = KeyedGenerator(**{**parts, change: parts[change] + 1}).uniform_candidates(shape, cpu)
    assert not torch.equal(first, other)
    assert torch.equal(first, KeyedGenerator(**parts).uniform_candidates(shape, cpu))  # a pure function of the key


def test_huge_and_negative_seeds_are_keys_too():
    lo, hi = -(2**63), 2**64 - 1
    a = KeyedGenerator(lo, 0, 0).uniform_candidates((1, 1, 32), torch.device("cpu"))
    b = KeyedGenerator(hi, 0, 0).uniform_candidates((1, 1, 32), torch.device("cpu"))
    assert not torch.equal(a, b)


def test_shared_heads_give_every_head_the_same_noise():
    g = KeyedGenerator(5, 0, 1, head_offset=4).shared_heads()
    u = scoring.uniform_noise(torch.Size((2, 3, 40)), torch.device("cpu"), g)
    assert torch.equal(u[:, 0], u[:, 1]) and torch.equal(u[:, 0], u[:, 2])
    assert not torch.equal(u[0, 0], u[1, 0])


def test_its_torch_generator_is_seeded_by_seed_layer_and_round():
    a, b, c = KeyedGenerator(1, 2, 3), KeyedGenerator(1, 2, 3, head_offset=4), KeyedGenerator(1, 2, 4)
    first = torch.rand(5, generator=a.torch_generator())
    assert torch.equal(first, torch.rand(5, generator=b.torch_generator()))  # the head offset is not in it
    assert not torch.equal(first, torch.rand(5, generator=c.torch_generator()))


def _user_policy(valid, generator):
    """A user's policy as CONTRIBUTING describes it: draws with torch.rand from `generator`."""
    return torch.rand(valid.shape, generator=generator)


def test_a_user_policy_calling_torch_rand_gets_a_plain_seeded_generator():
    policy = policies.Policy("user", _user_policy, {})
    valid = torch.ones(2, 3, 20, dtype=torch.bool)
    args = (torch.zeros(2, 3, 20, 4), torch.zeros(2, 3, 20, 4), None, torch.arange(20).expand(2, 3, 20), valid)
    picks = [policy.select(*args, 6, generator=KeyedGenerator(4, 1, e)) for e in (0, 0, 1)]
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])


def test_the_keyed_normal_noise_is_standard_normal():
    z = KeyedGenerator(2, 0, 0).normal((200, 100), torch.device("cpu")).double()
    assert z.shape == (200, 100) and torch.isfinite(z).all()
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.02


def test_the_noise_traces_under_torch_compile_without_graph_breaks():
    """Made outside the compiled region (as the cache does, eagerly), the noise traces in one graph."""

    def noise(x, generator):
        return x + scoring.gumbel_noise(x.shape, x.device, generator)

    x = torch.zeros(2, 3, 17)
    compiled = torch.compile(noise, backend="aot_eager", fullgraph=True)
    got = compiled(x, KeyedGenerator(3, 1, 2, head_offset=1))
    assert torch.equal(got, noise(x, KeyedGenerator(3, 1, 2, head_offset=1)))


def test_eviction_randomness_keys_layer_round_and_head_offset():
    rnd = EvictionRandomness(11)
    g = rnd.for_eviction(LayerPlan(4, head_offset=6), 9, torch.device("cpu"))
    assert (g.seed, g.layer, g.eviction, g.head_offset, g.shared) == (11, 4, 9, 6, False)
    assert g.device == torch.device("cpu")


def test_seed_none_follows_torchs_global_generator_and_reset_draws_anew():
    torch.manual_seed(0)
    a = EvictionRandomness(None)
    first = a.generation_seed()
    assert a.generation_seed() == first  # one seed per generation
    torch.manual_seed(0)
    assert EvictionRandomness(None).generation_seed() == first  # reproducible under torch.manual_seed
    a.reset()
    assert a.generation_seed() != first
    seeded = EvictionRandomness(5)
    seeded.reset()
    assert seeded.generation_seed() == 5


def keyed_cache(config: VaSEConfig, n_layers: int, plans=None) -> VaSECache:
    """A cache of `n_layers` layers; every layer draws its eviction randomness keyed by (seed, layer, round)."""
    return VaSECache(config, policies.for_config(config), n_layers, plans=plans)


def _run(cache: VaSECache, heads: slice, steps: int, seed: int = 0, hq_per_kv: int = 2):
    """Drive every layer of `cache` with the same K/V/queries (KV heads `heads` of 4); returns the
    positions each layer holds at the end, `[layers, B, H, budget]`, and the evictions."""
    g = torch.Generator().manual_seed(seed)
    b, h, d = 2, 4, 8
    k = torch.randn(b, h, steps, d, generator=g)
    v = torch.randn(b, h, steps, d, generator=g)
    q = torch.randn(b, h * hq_per_kv, steps, d, generator=g)
    qh = slice(heads.start * hq_per_kv, heads.stop * hq_per_kv)
    for layer in cache.layers:
        drive.step(layer, k[:, heads, :16], v[:, heads, :16], q[:, qh, :16])
        for t in range(16, steps):
            drive.step(layer, k[:, heads, t : t + 1], v[:, heads, t : t + 1], q[:, qh, t : t + 1])
    budget = cache.config.budget
    return torch.stack([layer.positions[:, :, :budget] for layer in cache.layers]), cache.stats()["evictions"]


@pytest.mark.parametrize("policy", ["vase", "vase-dkv"])
def test_a_cache_on_two_ranks_keeps_what_one_process_keeps(policy):
    """Two "ranks" holding KV heads [0, 2) and [2, 4) (head offsets 0 and 2) of two layers keep,
    eviction after eviction, the positions one process holding all four keeps."""
    config = VaSEConfig(budget=10, window=2, protect=4, sinks=2, policy=policy, seed=3)
    whole, evictions = _run(keyed_cache(config, 2), slice(0, 4), 36)
    ranks = [
        _run(keyed_cache(config, 2, plans=(LayerPlan(0, head_offset=o), LayerPlan(1, head_offset=o))), heads, 36)[0]
        for o, heads in ((0, slice(0, 2)), (2, slice(2, 4)))
    ]
    assert evictions >= 5
    assert torch.equal(torch.cat(ranks, dim=2), whole)
    assert not torch.equal(whole[0], whole[1])  # the layers' draws differ (same inputs)


def test_same_seed_same_positions_and_reset_repeats_a_fresh_cache():
    config = VaSEConfig(budget=10, window=2, protect=4, sinks=2, seed=8)
    cache = keyed_cache(config, 1)
    first, _ = _run(cache, slice(0, 4), 30)
    assert torch.equal(_run(keyed_cache(config, 1), slice(0, 4), 30)[0], first)
    cache.reset()
    assert torch.equal(_run(cache, slice(0, 4), 30)[0], first)
    assert not torch.equal(_run(keyed_cache(config.replace(seed=9), 1), slice(0, 4), 30)[0], first)


def test_the_layers_of_one_cache_draw_from_one_seeded_stream():
    """`VaSECache.__init__` mutant `rng = None`: every layer made its own generator from the same
    seed, so layers fed identical inputs drew identical noise (reproducible, but not the one
    stream per cache that `seed` documents)."""
    cfg = VaSEConfig(budget=16, window=4, seed=5, policy="random", sinks=0, protect=0)
    cache = VaSECache(cfg, policies.for_config(cfg), num_layers=2)
    g = torch.Generator().manual_seed(1)
    for q_len in (14, *[1] * 10):  # the prompt, then decode steps: two evictions
        k, v, q = (torch.randn(2, n, q_len, 8, generator=g) for n in (2, 2, 4))
        for layer in cache.layers:
            drive.step(layer, k, v, q)
    first, second = cache.layers
    assert first.counters.evictions == second.counters.evictions == 2
    assert not torch.equal(first.positions, second.positions)
    again = VaSECache(cfg, policies.for_config(cfg), num_layers=2)
    g = torch.Generator().manual_seed(1)
    for q_len in (14, *[1] * 10):
        k, v, q = (torch.randn(2, n, q_len, 8, generator=g) for n in (2, 2, 4))
        for layer in again.layers:
            drive.step(layer, k, v, q)
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(cache.layers, again.layers, strict=True))


def test_kept_slots_with_a_keyed_generator_on_a_rank():
    """`kept_slots`, the function the layer calls, with the generator of each rank."""
    g = torch.Generator().manual_seed(1)
    b, h, n, d = 2, 4, 30, 8
    keys, values = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    queries = torch.randn(b, h, 3, d, generator=g)
    positions = torch.arange(n).expand(b, h, n)
    valid = torch.ones(b, h, n, dtype=torch.bool)
    policy = policies.get("vase", protect=4, sinks=2)
    rnd = EvictionRandomness(0)

    def keep(lo, hi):
        gen = rnd.for_eviction(LayerPlan(5, head_offset=lo), 2, torch.device("cpu"))
        args = (keys[:, lo:hi], values[:, lo:hi], positions[:, lo:hi], valid[:, lo:hi], queries[:, lo:hi])
        return kept_slots(policy, *args, n, 16, 4, gen)

    assert torch.equal(torch.cat([keep(0, 1), keep(1, 4)], 1), keep(0, 4))


def test_a_stacked_generator_draws_each_rows_own_keys_draws():
    """Row `i` of a `StackedKeyedGenerator` draws what `KeyedGenerator(*keys[i])` draws for row 0 of a batch of
    one, draw after draw: uniforms per KV head (head-shared too) and each row's own Gaussian sketch. So one policy
    call over stacked evictions (`vasepatch.vllm.compaction.compact_stacked`) keeps what one call
    per eviction keeps."""
    cpu = torch.device("cpu")
    keys = [(7, 0, 3), (7, 1, 3), (-5, 0, 0), (2**64 - 1, 29, 11)]
    stacked = StackedKeyedGenerator(keys, head_offset=3)
    alone = [KeyedGenerator(*key, head_offset=3) for key in keys]
    for _ in range(2):
        got = stacked.uniform_candidates((4, 2, 50), cpu)
        for row, g in enumerate(alone):
            assert torch.equal(got[row], g.uniform_candidates((1, 2, 50), cpu)[0])
    sketch = stacked.normal((16, 5), cpu)
    assert sketch.shape == (4, 16, 5)
    for row, g in enumerate(alone):
        assert torch.equal(sketch[row], g.normal((16, 5), cpu))
    shared = stacked.shared_heads().uniform_candidates((4, 3, 9), cpu)
    for row, key in enumerate(keys):
        assert torch.equal(shared[row], KeyedGenerator(*key).shared_heads().uniform_candidates((1, 3, 9), cpu)[0])
    with pytest.raises(ValueError, match="a draw of 3 rows from a StackedKeyedGenerator of 4 rows"):
        stacked.uniform_candidates((3, 2, 50), cpu)
    batches = StackedKeyedGenerator(keys[:2], rows=3).uniform_candidates((6, 2, 20), cpu)  # a batch of 3 per key
    for i, key in enumerate(keys[:2]):
        assert torch.equal(batches[3 * i : 3 * i + 3], KeyedGenerator(*key).uniform_candidates((3, 2, 20), cpu))
    with pytest.raises(TypeError, match="only a priority function marked draws_keyed_noise"):
        stacked.torch_generator()
