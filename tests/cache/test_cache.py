"""The static cache: fixed storage, true positions, eviction schedule, no host syncs."""

from __future__ import annotations

import contextlib

import pytest
import torch

import vasepatch
from tests.conftest import ragged_batch
from tests.drive import step
from tests.tiny_models import VOCAB
from vasepatch import policies
from vasepatch.cache import VaSECache, VaSELayer
from vasepatch.config import VaSEConfig


def _layer(budget=16, window=4, seed=0, **kw):
    cfg = VaSEConfig(budget=budget, window=window, seed=seed, **kw)
    return VaSELayer(cfg, policies.for_config(cfg))


def _rand(b, h, n, d, g=None):
    return torch.randn(b, h, n, d, generator=g)


def test_capacity_and_storage_never_change_and_schedule_matches_spec():
    layer = _layer(budget=16, window=4)
    g = torch.Generator().manual_seed(0)
    b, hkv, hq, d, prompt = 2, 2, 4, 8, 10
    step(layer, _rand(b, hkv, prompt, d, g), _rand(b, hkv, prompt, d, g), _rand(b, hq, prompt, d, g))
    assert layer.capacity == max(prompt, 16) + 4
    ptrs = [t.data_ptr() for t in (layer.keys, layer.values, layer.positions, layer.valid, layer.ring.queries)]
    evict_steps, occupancy = [], []
    for i in range(60):
        _, evicted = step(layer, _rand(b, hkv, 1, d, g), _rand(b, hkv, 1, d, g), _rand(b, hq, 1, d, g))
        occupancy.append(layer.counters.occupancy)
        if evicted:
            evict_steps.append(i)
        assert [
            t.data_ptr() for t in (layer.keys, layer.values, layer.positions, layer.valid, layer.ring.queries)
        ] == ptrs
        assert layer.counters.occupancy <= layer.capacity
    # occupancy 10 + i + 1 reaches 20 = budget + window at decode step 9, then every 4 steps
    assert evict_steps == list(range(9, 60, 4))
    assert max(occupancy) <= 19 and min(occupancy[9:]) == 16
    assert layer.get_seq_length() == prompt + 60
    # positions keep counting the true sequence: the newest slot holds position prompt + 59
    newest = layer.positions[:, :, : layer.counters.occupancy].amax(-1)
    assert torch.equal(newest, torch.full_like(newest, prompt + 59))


def test_long_prompt_is_kept_whole_with_prefill_keep_then_evicted_to_budget():
    layer = _layer(budget=16, window=4, prefill="keep")
    g = torch.Generator().manual_seed(1)
    prompt = 37
    step(layer, _rand(1, 1, prompt, 8, g), _rand(1, 1, prompt, 8, g), _rand(1, 2, prompt, 8, g))
    assert layer.counters.occupancy == prompt and layer.capacity == prompt + 4
    steps = 0
    while True:
        steps += 1
        _, evicted = step(layer, _rand(1, 1, 1, 8, g), _rand(1, 1, 1, 8, g), _rand(1, 2, 1, 8, g))
        if evicted:
            break
    # first multiple of window past the budget: 37 + steps - 16 divisible by 4
    assert (prompt + steps - 16) % 4 == 0 and steps <= 4
    assert layer.counters.occupancy == 16 and int(layer.valid.sum()) == 16


def test_left_padding_positions_follow_hf():
    layer = _layer(budget=32, window=4)
    _, mask = ragged_batch(VOCAB, lengths=(6, 3))
    k = torch.randn(2, 1, 6, 8)
    step(layer, k, k, torch.randn(2, 1, 6, 8), padding=mask)
    assert layer.positions[0, 0, :6].tolist() == [0, 1, 2, 3, 4, 5]
    assert layer.positions[1, 0, :6].tolist() == [-1, -1, -1, 0, 1, 2]
    assert layer.valid[1, 0, :6].tolist() == [False] * 3 + [True] * 3
    full_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    step(layer, k[:, :, :1], k[:, :, :1], torch.randn(2, 1, 1, 8), padding=full_mask)
    assert layer.positions[:, 0, 6].tolist() == [6, 3]


def test_padding_is_never_attended_by_real_queries():
    layer = _layer(budget=32, window=4)
    _, mask = ragged_batch(VOCAB, lengths=(5, 2))
    k = torch.randn(2, 1, 5, 8)
    m = layer.step(k, k, k, mask, lambda st: st)[0].mask()[1, 0]  # row with 3 padding slots
    assert not m[3:, :3].any()  # real queries never see padding
    assert m[3:, 3:5].tolist() == [[True, False], [True, True]]  # causal among real tokens
    assert m[:3, :3].equal(torch.eye(3, dtype=torch.bool))  # padding queries see only themselves


class _HostSyncError(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_sync():
    """Make every tensor -> Python conversion raise while active."""

    def boom(*args, **kwargs):
        raise _HostSyncError("host sync in the decode path")

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, boom)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_forbid_host_sync_catches_a_sync():
    with pytest.raises(_HostSyncError), forbid_host_sync():
        torch.ones(1).item()


@pytest.mark.parametrize("masked", [True, False], ids=["mask-of-ones", "no-mask"])
def test_decode_and_eviction_do_not_sync_with_the_device(masked):
    """With the policy-output check off: that check reads its verdict on the host, once per
    eviction, by design (`VaSEConfig.check_policy_output`). Both write paths (the device fill
    pointer with a mask; the host-known occupancy without one)."""
    layer = _layer(budget=16, window=4, check_policy_output=False)
    g = torch.Generator().manual_seed(0)
    step(layer, _rand(2, 2, 9, 8, g), _rand(2, 2, 9, 8, g), _rand(2, 4, 9, 8, g), torch.ones(2, 9) if masked else None)
    evictions = 0
    with forbid_host_sync():
        for i in range(40):
            padding = torch.ones(2, 10 + i) if masked else None
            _, evicted = step(layer, _rand(2, 2, 1, 8, g), _rand(2, 2, 1, 8, g), _rand(2, 4, 1, 8, g), padding)
            evictions += evicted
    assert evictions >= 5 and layer.slots.padded == masked


def test_memory_does_not_grow_with_generated_length(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    stats = []
    with vasepatch.patched(model, budget=24, window=8) as handle:
        for n in (50, 200):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
            stats.append(handle.stats())
    assert stats[0]["kv_bytes"] == stats[1]["kv_bytes"]
    assert stats[0]["capacity"] == stats[1]["capacity"] == 24 + 8
    assert stats[1]["evictions"] > stats[0]["evictions"] > 0
    assert stats[1]["occupancy"] <= stats[1]["capacity"]
    assert stats[1]["tokens_seen"] == ids.shape[1] + 200 - 1


def _sample(model, ids, mask, seed, steps=60):
    """Sampled generation whose only varying randomness is vasepatch's `seed`: the global
    generator (the token sampler) is reset to the same state before every call."""
    with vasepatch.patched(model, budget=20, window=4, seed=seed) as handle:
        torch.manual_seed(123)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=True, top_k=0, pad_token_id=0
        )
        assert handle.stats()["evictions"] > 0
    return out


def test_generate_sampling_is_reproducible_from_seed_alone(make_model):
    """Holds only if `seed` drives the eviction noise: with the global generator held fixed,
    the same seed repeats the generation and another seed changes it (were `seed` ignored,
    every seed would draw from the same global state and give the same tokens)."""
    model = make_model("qwen3")
    ids, mask = ragged_batch(VOCAB)
    first = _sample(model, ids, mask, seed=7)
    assert torch.equal(first, _sample(model, ids, mask, seed=7))
    assert not torch.equal(first, _sample(model, ids, mask, seed=8))


def test_eos_stops_a_row(make_model):
    model = make_model("qwen3")
    ids, mask = ragged_batch(VOCAB)
    prompt, pad = ids.shape[1], VOCAB - 1
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=pad)
    with vasepatch.patched(model, budget=20, window=4) as handle:
        greedy = model.generate(**kw)
        eos = int(greedy[0, prompt + 5])  # the token row 0 emits at step 5 becomes the EOS
        stopped = model.generate(**kw, eos_token_id=eos)
        assert handle.stats()["evictions"] > 0
    first = int((greedy[0, prompt:] == eos).nonzero()[0, 0])
    end = prompt + first + 1
    assert torch.equal(stopped[0, :end], greedy[0, :end])  # identical up to and including the EOS
    after = greedy[0, end:]
    assert after.numel() > 0 and (after != pad).any()  # without EOS, row 0 goes on emitting tokens
    assert (stopped[0, end:] == pad).all()  # with it, row 0 emits only padding after the EOS


def test_beam_search_reorders_in_place(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(8, 5))
    with vasepatch.patched(model, budget=16, window=4) as handle:
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=30, num_beams=3, do_sample=False, pad_token_id=0
        )
        assert out.shape == (2, ids.shape[1] + 30)
        assert handle.stats()["evictions"] > 0


def test_cache_stats_and_reset():
    cfg = VaSEConfig(budget=16, window=4)
    cache = VaSECache(cfg, policies.get("vase", protect=4), num_layers=2)
    k = torch.randn(1, 1, 5, 8)
    for layer in cache.layers:
        step(layer, k, k, k)
    assert cache.get_seq_length() == 5
    assert cache.stats()["occupancy"] == 5 and cache.stats()["layers"] == 2
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stats()["occupancy"] == 0
    assert not cache.layers[0].valid.any() and int(cache.layers[0].slots.next_position[0]) == 0
    with pytest.raises(NotImplementedError):
        cache.crop(1)


def test_a_cache_used_outside_a_patched_attention_module_is_an_error():
    """A model whose attention is not vasepatch's would attend to the new tokens only."""
    cache = VaSECache(VaSEConfig(budget=16, window=4), policies.get("vase", protect=4), num_layers=1)
    k = torch.randn(1, 1, 5, 8)
    with pytest.raises(RuntimeError, match="not patched"):
        cache.update(k, k, 0)


def _drive_ragged(layer: VaSELayer, seed: int, prompt: int = 22, decode: int = 25) -> list[int]:
    """A ragged prompt (longer than the budget) then one-token steps; returns the occupancy
    before each eviction."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, hq, d = 3, 2, 4, 8
    mask = torch.ones(b, prompt, dtype=torch.long)
    mask[1, :5], mask[2, :13] = 0, 0
    before = []
    for i in range(decode + 1):
        n = prompt if i == 0 else 1
        padding = mask if i == 0 else torch.ones(b, prompt + i)
        occ = layer.counters.occupancy + n
        _, evicted = step(layer, _rand(b, hkv, n, d, g), _rand(b, hkv, n, d, g) * 3, _rand(b, hq, n, d, g), padding)
        if evicted:
            before.append(occ)
    return before


def _state(layer: VaSELayer) -> dict:
    occ = layer.counters.occupancy
    return {
        "keys": layer.keys[:, :, :occ],
        "values": layer.values[:, :, :occ],
        "positions": layer.positions,
        "valid": layer.valid,
        "next_position": layer.slots.next_position,
        "fill": layer.slots.fill,
        "seen": layer.slots.seen,
        "ring.queries": layer.ring.read(),
        "ring.pointer": layer.ring.pointer,
        "counters": vars(layer.counters),
    }


@pytest.mark.parametrize("sample", [False, True], ids=["topk", "sampled"])
def test_reset_starts_over_exactly_like_a_fresh_layer(sample):
    """After `reset()` a layer holds what a new layer would after the same inputs: positions
    count from 0 again (`next_position`), the counters restart, and a seeded generator
    restarts from its seed."""
    used, fresh = _layer(seed=3, policy_options={"sample": sample}), _layer(seed=3, policy_options={"sample": sample})
    _drive_ragged(used, seed=0)
    used.reset()
    assert int(used.slots.next_position.abs().sum()) == 0 and used.counters.tokens_seen == 0
    assert _drive_ragged(used, seed=1) == _drive_ragged(fresh, seed=1)
    want = _state(fresh)
    for name, value in _state(used).items():
        assert (value == want[name]) if isinstance(value, dict) else torch.equal(value, want[name]), name


def test_evicted_tokens_counts_every_dropped_slot():
    """`evicted` sums, over eviction rounds, the slots dropped: occupancy before - budget."""
    layer = _layer(budget=16, window=4)
    before = _drive_ragged(layer, seed=0, prompt=22, decode=25)
    assert before[0] == 22 and len(before) == 1 + 25 // 4  # the prompt is compressed, then every `window` steps
    assert layer.counters.evictions == len(before)
    assert layer.counters.evicted == sum(n - 16 for n in before) == 6 + 6 * 4
    cache = VaSECache(VaSEConfig(budget=16, window=4), policies.get("vase", protect=4), num_layers=2)
    for lay in cache.layers:
        _drive_ragged(lay, seed=0)
    assert cache.stats()["evicted_tokens"] == 30 and cache.stats()["evictions"] == 7


def test_a_long_prompt_is_scored_by_its_last_window_queries():
    """The query ring holds the prompt's last `window` queries (in ring order) after the prefill."""
    layer = _layer(budget=16, window=4)
    g = torch.Generator().manual_seed(0)
    q = _rand(2, 4, 22, 8, g)
    step(layer, _rand(2, 2, 22, 8, g), _rand(2, 2, 22, 8, g), q)
    assert torch.equal(layer.ring.read(), q[:, :, -4:])


def test_prefill_keep_after_reset_leaves_room_for_the_window():
    """A prompt after `reset()` that exactly fills the old buffer gets a buffer sized for it plus
    one window, as a fresh layer would (found by the thorough stateful run: the next decode step
    raised "cache overflow")."""
    layer = _layer(budget=11, window=6, prefill="keep", protect=2, sinks=0)
    g = torch.Generator().manual_seed(0)
    step(layer, _rand(1, 1, 25, 4, g), _rand(1, 1, 25, 4, g), _rand(1, 1, 25, 4, g))
    assert layer.capacity == 31
    layer.reset()
    step(layer, _rand(1, 1, 31, 4, g), _rand(1, 1, 31, 4, g), _rand(1, 1, 31, 4, g))
    assert layer.capacity == 31 + 6
    evictions = sum(step(layer, *(_rand(1, 1, 1, 4, g) for _ in range(3)))[1] for _ in range(12))
    assert evictions >= 1 and layer.counters.occupancy <= layer.capacity


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt", [6, 22], ids=["short-prompt", "prompt-over-budget"])
def test_real_token_fast_path_equals_the_fill_pointer_path(backend, prompt):
    """Steps without a padding mask take the eager fast path (writes at the host-known occupancy,
    a mask-free decode attention, the ring written at its host pointer); the same steps with a
    mask of ones take the device-pointer path. Outputs, buffers and counters must match exactly,
    through chunks, one-token steps and several evictions."""
    fast, masked = _layer(budget=16, window=4), _layer(budget=16, window=4)
    g = torch.Generator().manual_seed(3)
    b, hkv, hq, d = 2, 2, 4, 8
    seen, evictions = 0, 0
    for n in [prompt, 3, *[1] * 30, 2, *[1] * 9]:
        k, v, q = _rand(b, hkv, n, d, g), _rand(b, hkv, n, d, g) * 3, _rand(b, hq, n, d, g)
        out_fast, ev_fast = step(fast, k, v, q, None, backend)
        out_masked, ev_masked = step(masked, k, v, q, torch.ones(b, seen + n), backend)
        seen += n
        torch.testing.assert_close(out_fast, out_masked, rtol=0, atol=1e-6)
        assert ev_fast == ev_masked
        for layer in (fast, masked):  # a compiled step would go on from the device pointer
            assert int(layer.ring.pointer) == layer.ring.host_pointer
        evictions += ev_fast
    assert evictions >= 3 and not fast.slots.padded and masked.slots.padded
    for name, value in _state(fast).items():
        other = _state(masked)[name]
        assert value == other if isinstance(value, dict) else torch.equal(value, other), name
