"""Sliding-window layers: attention exactly as transformers', a buffer of their own, bounded memory.

Parity runs compare the patched model with the unpatched one (which applies its window with
sdpa and eager) on a ragged batch of prompts longer than the window, with a budget large
enough that the global layers evict nothing while the sliding layers cut to their window.
"""

from __future__ import annotations

import pytest
import torch

import vasepatch
from tests import reference_kernels as ref
from tests.conftest import greedy_with_logits, max_logit_diff, ragged_batch
from tests.drive import step
from tests.sliding_models import VOCAB, module_windows, patch, sliding_config, tiny
from vasepatch import policies
from vasepatch.cache import VaSECache, VaSELayer, sliding
from vasepatch.cache.plan import LayerPlan
from vasepatch.config import VaSEConfig
from vasepatch.kernels import backends
from vasepatch.kernels.backends import flash_attn as flash_backend

LENGTHS = (60, 45, 30)
NEW = 16
BIG = 128  # > 60 + 16: the global layers never evict
WINDOW = 4


def _run(model, ids, mask, steps=NEW, generate_kw=None, **settings):
    """Greedy logits of the patched model, and its cache (per-layer counters)."""
    handle = patch(model, **settings)
    try:
        cache = handle.new_cache()
        out = greedy_with_logits(model, ids, mask, steps, past_key_values=cache, **(generate_kw or {}))
    finally:
        vasepatch.unpatch(model)
    return out, cache


def _check_layers(model, cache, config: VaSEConfig) -> None:
    """Sliding layers hold their window (capacity `w + window`) and have evicted; global ones have not."""
    for layer, w in zip(cache.layers, module_windows(model), strict=True):
        c = layer.counters
        assert c.occupancy <= c.capacity
        if w is None:
            assert c.evictions == 0
        elif w <= config.budget or config.policy == "full":
            assert layer.sliding_only and c.capacity == w + config.window and c.evictions > 0
            assert c.occupancy <= w + config.window
        assert not torch.isnan(layer.keys).any()


@pytest.mark.parametrize(
    "family,window,attn",
    [
        ("mistral", 8, "sdpa"),
        ("mistral", 24, "eager"),
        ("qwen2", 8, "sdpa"),
        ("qwen2", 20, "eager"),
        ("gemma3", 8, "sdpa"),
        ("gemma3", 24, "eager"),
    ],
)
def test_generate_parity_ragged(family, window, attn):
    model = tiny(sliding_config(family, window), attn)
    assert any(w == window for w in module_windows(model))
    ids, mask = ragged_batch(VOCAB, lengths=LENGTHS)
    expected = greedy_with_logits(model, ids, mask, NEW)
    out, cache = _run(model, ids, mask, budget=BIG, window=WINDOW, seed=0)
    assert max_logit_diff(expected, out) <= 1e-5
    assert torch.equal(expected.sequences, out.sequences)
    _check_layers(model, cache, cache.config)


def test_unpadded_prompt_longer_than_the_window():
    """An unpadded prompt must not take the plain causal SDPA path on a sliding layer."""
    model = tiny(sliding_config("mistral", 8))
    ids, mask = ragged_batch(VOCAB, lengths=(40, 40))
    expected = greedy_with_logits(model, ids, mask, 6)
    out, _ = _run(model, ids, mask, 6, budget=BIG, window=WINDOW)
    assert max_logit_diff(expected, out) <= 1e-5


def test_prefill_parity_every_real_position():
    model = tiny(sliding_config("gemma3", 8))
    ids, mask = ragged_batch(VOCAB, lengths=LENGTHS)
    expected = model(input_ids=ids, attention_mask=mask).logits
    handle = patch(model, budget=BIG, window=WINDOW)
    try:
        got = model(input_ids=ids, attention_mask=mask, past_key_values=handle.new_cache()).logits
    finally:
        vasepatch.unpatch(model)
    real = mask.bool()
    assert (expected[real] - got[real]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("chunk", [7, 32])
def test_chunked_prefill_parity(chunk):
    model = tiny(sliding_config("qwen2", 8))
    ids, mask = ragged_batch(VOCAB, lengths=LENGTHS)
    expected = greedy_with_logits(model, ids, mask, 8)
    out, _ = _run(model, ids, mask, 8, {"prefill_chunk_size": chunk}, budget=BIG, window=WINDOW)
    assert max_logit_diff(expected, out) <= 1e-5


@pytest.mark.parametrize(
    "settings",
    [{"prefill": "keep", "budget": 16}, {"prefill": "pin", "budget": 16}, {"policy": "full", "budget": 16}],
)
def test_keep_and_full_modes(settings):
    """`keep` and `pin`: the global layer keeps the whole prompt (nothing evicted before the end); `full`:
    never evicts a global layer, while the sliding layers keep exactly their window in all three."""
    model = tiny(sliding_config("gemma3", 8))
    ids, mask = ragged_batch(VOCAB, lengths=LENGTHS)
    steps = 3 if settings.get("prefill") == "keep" else NEW  # keep: 60 + 3 < capacity 60 + 4
    expected = greedy_with_logits(model, ids, mask, steps)
    out, cache = _run(model, ids, mask, steps, window=WINDOW, **settings)
    assert max_logit_diff(expected, out) <= 1e-5
    _check_layers(model, cache, cache.config)
    sliding_layer, global_layer = cache.layers
    assert sliding_layer.capacity == 8 + WINDOW and global_layer.capacity >= 60 + steps


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("window", [6, 40])
def test_eviction_run_bounded_no_nan(family, window):
    """A small budget: both kinds of layers evict, memory stays at its capacity, no NaN; a sliding
    layer with a window over the budget keeps only tokens still inside its window."""
    model = tiny(sliding_config(family, window))
    ids, mask = ragged_batch(VOCAB, lengths=LENGTHS)
    out, cache = _run(model, ids, mask, 24, budget=16, window=WINDOW, seed=0)
    assert all(torch.isfinite(x).all() for x in out.logits)
    for layer, w in zip(cache.layers, module_windows(model), strict=True):
        c = layer.counters
        assert c.evictions > 0 and c.occupancy <= c.capacity
        assert c.capacity == (w + WINDOW if w is not None and w <= 16 else 16 + WINDOW)
        if w is not None:
            newest = layer.slots.next_position[:, None, None]
            held = layer.positions[:, :, : c.occupancy]
            kept = layer.valid[:, :, : c.occupancy]
            assert bool((held[kept] > (newest - w - WINDOW).expand_as(held)[kept]).all())
    assert cache.stats()["capacity"] == max(layer.capacity for layer in cache.layers)


# --------------------------------------------------------------------------- layer level


def _layer(window: int | None, budget=16, policy="vase", **kw) -> VaSELayer:
    cfg = VaSEConfig(budget=budget, window=WINDOW, seed=0, policy=policy, **kw)
    return VaSELayer(cfg, None if policy == "full" else policies.for_config(cfg), plan=LayerPlan(0, window))


def _dense_reference(q, keys, values, qpos, kpos, w, scale):
    """Softmax attention of queries at `qpos` over keys at `kpos` (1-D), causal within window `w`."""
    allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w)
    g = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_window_only_layer_keeps_exactly_the_last_w_tokens():
    layer = _layer(window=6, budget=16)
    g = torch.Generator().manual_seed(0)
    d, total = 8, 40
    keys, values, queries = (torch.randn(1, h, total, d, generator=g) for h in (1, 1, 2))
    step(layer, keys[:, :, :20], values[:, :, :20], queries[:, :, :20])  # prompt over capacity 6 + 4
    assert layer.counters.occupancy == 6 and layer.capacity == 10
    pos = torch.arange(total)
    for t in range(20, total):
        out, _ = step(layer, keys[:, :, t : t + 1], values[:, :, t : t + 1], queries[:, :, t : t + 1])
        expected = _dense_reference(queries[:, :, t : t + 1], keys, values, pos[t : t + 1], pos, 6, d**-0.5)
        assert torch.allclose(out, expected, atol=1e-5)
        held = layer.positions[0, 0, : layer.counters.occupancy]
        assert held.tolist() == list(range(t + 1 - len(held), t + 1)) and len(held) <= 10
    assert layer.ring.queries is None  # no policy, no query ring


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["vase", "full"])
def test_window_only_layer_is_exact_for_any_step_sizes(seed, policy):
    """Random step sizes (prompt chunks that overflow the buffer, decode steps) over a left-padded
    batch: every real query's output equals dense sliding-window attention over all tokens."""
    g = torch.Generator().manual_seed(seed)
    w = int(torch.randint(2, 9, (), generator=g))
    layer = _layer(window=w, budget=16, policy=policy)
    assert layer.sliding_only
    keys, values, pos = torch.zeros(2, 2, 0, 8), torch.zeros(2, 2, 0, 8), torch.zeros(2, 0, dtype=torch.long)
    pad = int(torch.randint(1, 6, (), generator=g))
    for i, n in enumerate([pad + 3, *torch.randint(1, 13, (12,), generator=g).tolist()]):
        real = torch.ones(2, n, dtype=torch.bool)
        if i == 0:
            real[1, :pad] = False
        k, v = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
        q = torch.randn(2, 4, n, 8, generator=g)
        out, _ = step(layer, k, v, q, real if i == 0 else None)
        start = pos.amax(-1, keepdim=True) + 1 if pos.numel() else torch.zeros(2, 1, dtype=torch.long)
        new_pos = (start + real.long().cumsum(-1) - 1).masked_fill(~real, -1)
        keys, values, pos = torch.cat([keys, k], 2), torch.cat([values, v], 2), torch.cat([pos, new_pos], 1)
        for b in range(2):
            kp, qp = pos[b], new_pos[b]
            allowed = (kp[None] >= 0) & (kp[None] <= qp[:, None]) & (kp[None] > qp[:, None] - w)
            kk, vv = keys[b].repeat_interleave(2, 0), values[b].repeat_interleave(2, 0)
            scores = (q[b] @ kk.transpose(-1, -2) * 8**-0.5).masked_fill(~allowed, float("-inf"))
            expected = (scores.softmax(-1) @ vv).transpose(0, 1)
            assert torch.allclose(out[b][real[b]], expected[real[b]], atol=1e-5)
        assert layer.counters.occupancy <= layer.capacity == w + WINDOW


def test_a_sliding_layer_with_a_policy_keeps_its_prompt_whole_under_pin():
    """`prefill="pin"` on a sliding layer whose window is over the budget: the prompt is kept whole at prefill
    (`"keep"`), not pinned: later evictions take prompt tokens, out-of-window ones first."""
    layer = _layer(window=20, budget=8, sinks=2, prefill="pin")
    assert layer.prefill == "keep"
    step(layer, torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 4, 13, 8))
    assert layer.counters.occupancy == 13 and layer.counters.evictions == 0 and layer.counters.pinned == 0


def test_window_over_budget_drops_out_of_window_tokens_first():
    layer = _layer(window=20, budget=8, sinks=2)
    assert not layer.sliding_only and layer.budget == 8
    g = torch.Generator().manual_seed(1)
    for n in (30, *([1] * 40)):
        step(layer, torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 4, n, 8))
        occ = layer.counters.occupancy
        pos, valid = layer.positions[:, :, :occ], layer.valid[:, :, :occ]
        # after any step, what is attendable lies within the window of the next query (+ the new window tokens)
        assert bool((pos[valid] > layer.counters.tokens_seen - 20 - WINDOW).all())
        assert bool((pos[~valid] == -1).all())
    assert layer.counters.evictions > 5


def test_varlen_decode_range_is_the_window(monkeypatch):
    """flash_attn backend (its op's CPU kernel is the reference): decode reads `[start, end)`
    clipped to the window; a prompt longer than the window takes the masked kernel."""
    monkeypatch.setattr(flash_backend, "default_varlen_kernel", lambda: ref.flash_attn_varlen_func)
    g = torch.Generator().manual_seed(2)
    for window, prompt in ((6, 20), (6, 5), (20, 12)):
        a, b = _layer(window, budget=16), _layer(window, budget=16)
        padding = torch.ones(2, prompt, dtype=torch.bool)
        padding[1, : prompt // 2] = False
        for t in range(18):
            n = prompt if t == 0 else 1
            k, v = torch.randn(2, 2, n, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
            q = torch.randn(2, 4, n, 8, generator=g)
            pad = padding if t == 0 else None
            out, _ = step(a, k, v, q, pad, backend="flash_attn")
            expected, _ = step(b, k, v, q, pad, backend="eager")
            real = padding[:, :, None, None] if t == 0 else torch.ones(1, dtype=torch.bool)
            assert torch.allclose(out * real, expected * real, atol=1e-5)


def test_decode_range_hand_case():
    """`Step.start` of a sliding step: only the slots within the window of the new token."""
    layer = _layer(window=3, budget=16)
    g = torch.Generator().manual_seed(3)
    step(layer, torch.randn(1, 1, 5, 4, generator=g), torch.randn(1, 1, 5, 4, generator=g), torch.randn(1, 1, 5, 4))
    assert layer.positions[0, 0, :3].tolist() == [2, 3, 4]  # the prompt was cut to its last 3 tokens
    new = torch.randn(1, 1, 1, 4)
    st, _ = layer.step(new, new, torch.randn(1, 1, 1, 4), None, lambda s: s)  # position 5: sees 3, 4, 5
    assert st.start().tolist() == [[1]] and int(st.end) == 4
    assert st.mask()[0, 0, 0, :4].tolist() == [False, True, True, True]
    q = torch.randn(1, 1, 1, 4, generator=g)
    expected = ref.masked_decode(q, st.keys, st.values, st.start(), st.end)
    got = backends.decode_attention("flash_attn", q, st.keys, st.values, st.start(), st.end)
    assert torch.allclose(got, expected, atol=1e-6)


def test_pure_selection_and_plan_checks():
    valid = torch.tensor([[[False, True, True, True, True, True]]])
    assert sliding.recent_slots(6, 3, valid).tolist() == [[[3, 4, 5]]]
    with pytest.raises(ValueError, match="keep the last"):
        sliding.recent_slots(2, 3, valid)
    assert sliding.sliding_only(8, 16, True) and sliding.sliding_only(40, 16, False)
    assert not sliding.sliding_only(40, 16, True) and not sliding.sliding_only(None, 16, False)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            VaSECache(VaSEConfig(budget=16, window=4), None, 1, plans=(LayerPlan(0, bad),))
    pos = torch.tensor([[[0, 1, 2, 3, 4, 5]]])
    assert sliding.in_window(pos, valid, torch.tensor([6]), 3).tolist() == [[[False] * 4 + [True] * 2]]


def test_module_window_must_match_the_plan():
    model = tiny(sliding_config("mistral", 8))
    handle = patch(model, budget=BIG, window=WINDOW)
    try:
        cache = VaSECache(handle.config, handle.policy, 2)  # global plans for a sliding model
        ids, mask = ragged_batch(VOCAB, lengths=(12, 9))
        with pytest.raises(ValueError, match="sliding_window=8, but its vasepatch layer plan has sliding_window=None"):
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    finally:
        vasepatch.unpatch(model)


def test_generate_auto_compiles_the_decode_step():
    """Sliding and global layers in one graph: static shapes, no graph break, the same tokens as
    eager through evictions in both kinds of layers."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True  # generate only auto-compiles on accelerators otherwise
    model = tiny(sliding_config("gemma3", 6))
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7, 3))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    handle = patch(model, budget=16, window=WINDOW, seed=0)
    try:
        eager = model.generate(**kw)
        counters.clear()
        cache = handle.new_cache()
        assert cache.is_compileable
        compiled = model.generate(**kw, compile_config=compile_config, **{handle.cache_keyword: cache})
        assert counters["stats"]["unique_graphs"] == 1 and not dict(counters["graph_break"])
    finally:
        vasepatch.unpatch(model)
        torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    assert all(layer.counters.evictions >= 3 for layer in cache.layers)
