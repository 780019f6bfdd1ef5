"""Prompts longer than the budget: compressed at prefill into budget + window slots
(`prefill="compress"`, the default), or kept whole (`prefill="keep"`); chunked prefill."""

from __future__ import annotations

import pytest
import torch

from tests.drive import step
from vasepatch import policies
from vasepatch.cache import VaSELayer
from vasepatch.config import VaSEConfig


def _layer(budget=16, window=4, seed=0, **kw):
    cfg = VaSEConfig(budget=budget, window=window, seed=seed, **kw)
    return VaSELayer(cfg, policies.for_config(cfg) if cfg.evicts else None)


def _rand(b, h, n, d, g):
    return torch.randn(b, h, n, d, generator=g)


def _causal_reference(q, k, v):
    """Plain causal attention over one unpadded sequence, GQA by repetition: `[B, Q, Hq, D]`."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


@pytest.mark.parametrize("prompt", [17, 20, 37, 90])
def test_long_prompt_is_compressed_at_prefill_into_budget_plus_window_slots(prompt):
    """The buffer has budget + window slots whatever the prompt; the prefill attends to the
    whole prompt exactly, then keeps the last window prompt tokens, the sinks, and
    budget - window - sinks more chosen by the policy."""
    layer = _layer()
    g = torch.Generator().manual_seed(prompt)
    k, v, q = _rand(2, 2, prompt, 8, g), _rand(2, 2, prompt, 8, g), _rand(2, 4, prompt, 8, g)
    out, evicted = step(layer, k, v, q)
    assert layer.capacity == 20 and layer.keys.shape[2] == 20
    assert evicted and layer.counters.evictions == 1 and layer.counters.occupancy == 16
    assert layer.counters.tokens_seen == prompt == layer.get_seq_length()
    torch.testing.assert_close(out, _causal_reference(q, k, v), atol=1e-5, rtol=1e-5)
    kept = layer.positions[:, :, :16]
    assert torch.equal(kept[:, :, -4:], torch.arange(prompt - 4, prompt).expand(2, 2, 4))  # the window, in place
    assert set(range(4)) <= set(kept[0, 0].tolist())  # the sinks
    assert (kept.diff(dim=-1) > 0).all()  # sequence order
    for b, h, s in layer.valid[:, :, :16].nonzero().tolist():  # kept K/V are the prompt's, bit for bit
        pos = int(layer.positions[b, h, s])
        assert torch.equal(layer.keys[b, h, s], k[b, h, pos]) and torch.equal(layer.values[b, h, s], v[b, h, pos])
    assert not layer.valid[:, :, 16:].any()
    # decoding then evicts every window tokens, back to the budget
    evictions = [step(layer, _rand(2, 2, 1, 8, g), _rand(2, 2, 1, 8, g), _rand(2, 4, 1, 8, g))[1] for _ in range(12)]
    assert evictions == [False, False, False, True] * 3


def test_compressed_prompt_is_scored_by_the_last_window_prompt_queries():
    """The policy sees the ring of the last `window` prompt queries: with one slot to fill,
    snapkv keeps the key the last queries aim at, not the one the first queries aim at."""
    layer = _layer(budget=3, window=2, policy="snapkv", smooth=1, sinks=0)
    prompt, d = 30, 8
    k = torch.randn(1, 1, prompt, d, generator=torch.Generator().manual_seed(0)) * 0.01
    k[0, 0, 11, 0] = k[0, 0, 5, 1] = 50.0
    q = torch.zeros(1, 1, prompt, d)
    q[0, 0, :2, 1] = 1.0  # the first queries point at key 5
    q[0, 0, -2:, 0] = 1.0  # the last window queries point at key 11
    step(layer, k, k, q)
    assert layer.positions[0, 0, :3].tolist() == [11, 28, 29]


def test_chunked_prefill_never_exceeds_the_buffer_and_compresses_between_chunks():
    layer = _layer()
    g = torch.Generator().manual_seed(3)
    prompt, chunk = 50, 7
    k, v, q = _rand(1, 2, prompt, 8, g), _rand(1, 2, prompt, 8, g), _rand(1, 4, prompt, 8, g)
    ptr = None
    for start in range(0, prompt, chunk):
        sl = slice(start, min(start + chunk, prompt))
        out, _ = step(layer, k[:, :, sl], v[:, :, sl], q[:, :, sl])
        ptr = ptr or layer.keys.data_ptr()
        assert layer.keys.data_ptr() == ptr and layer.capacity == 20
        assert layer.counters.occupancy <= 20
        if start == 0:
            torch.testing.assert_close(out, _causal_reference(q[:, :, sl], k[:, :, sl], v[:, :, sl]))
    occ = layer.counters.occupancy
    assert layer.counters.evictions >= 5 and layer.counters.tokens_seen == prompt
    assert layer.positions[0, 0, occ - 4 : occ].tolist() == [46, 47, 48, 49]


def test_prefill_keep_keeps_the_prompt_and_refuses_a_later_step_that_does_not_fit():
    layer = _layer(budget=8, window=2, sinks=2, prefill="keep")
    step(layer, torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8))
    assert layer.capacity == 14 and layer.counters.occupancy == 12 and layer.counters.evictions == 0
    with pytest.raises(RuntimeError, match="prefill='compress'"):
        step(layer, torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8))


def test_prefill_keep_refusal_moves_nothing_and_reset_sizes_the_buffer_for_a_longer_prompt():
    layer = _layer(budget=8, window=2, sinks=2, prefill="keep")
    step(layer, torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8))
    before = (
        layer.slots.next_position.clone(),
        int(layer.slots.seen),
        int(layer.slots.fill),
        layer.counters.tokens_seen,
    )
    with pytest.raises(RuntimeError, match="prefill='compress'"):
        step(layer, torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8))
    after = (layer.slots.next_position, int(layer.slots.seen), int(layer.slots.fill), layer.counters.tokens_seen)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    step(layer, torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))  # a fitting step works
    assert layer.counters.tokens_seen == 14 == int(layer.slots.seen) == int(layer.slots.next_position[0])
    assert layer.counters.evictions > 0
    layer.reset()  # a fresh start: counters restart, the next prompt sizes the buffer again
    step(layer, torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8))
    assert layer.capacity == 32 and layer.counters.occupancy == 30 and layer.counters.evictions == 0


def test_full_mode_never_evicts_and_grows_like_a_dynamic_cache():
    layer = _layer(budget=8, window=2, sinks=2, policy="full")
    assert layer.policy is None
    g = torch.Generator().manual_seed(0)
    k = _rand(1, 1, 6, 8, g)
    _, evicted = step(layer, k, k, _rand(1, 1, 6, 8, g))
    assert not evicted and layer.capacity == 10
    for _ in range(30):
        assert not step(layer, _rand(1, 1, 1, 8, g), _rand(1, 1, 1, 8, g), _rand(1, 1, 1, 8, g))[1]
    assert layer.counters.occupancy == 36 <= layer.capacity and layer.counters.evictions == 0
    assert layer.positions[0, 0, :36].tolist() == list(range(36))
    assert layer.counters.kv_bytes == layer.keys.nbytes * 2
    assert torch.equal(layer.keys[:, :, :6], k)


def test_prefill_pin_never_moves_the_prompt_and_bounds_what_is_generated():
    """`prefill="pin"`: the buffer is `prompt + budget + window` slots; the prompt's slots are never written
    again (bit for bit, through every eviction); the schedule runs on the generated tokens alone, which
    come back to `budget` at each eviction."""
    layer = _layer(budget=8, window=2, sinks=2, prefill="pin")
    g = torch.Generator().manual_seed(0)
    prompt = 13
    step(layer, _rand(2, 2, prompt, 8, g), _rand(2, 2, prompt, 8, g), _rand(2, 4, prompt, 8, g))
    assert layer.capacity == prompt + 10 and layer.counters.pinned == prompt and layer.counters.evictions == 0
    saved = [t[:, :, :prompt].clone() for t in (layer.keys, layer.values, layer.positions, layer.valid)]
    generated = []
    for _ in range(40):
        evicted = step(layer, _rand(2, 2, 1, 8, g), _rand(2, 2, 1, 8, g), _rand(2, 4, 1, 8, g))[1]
        generated.append(layer.counters.occupancy - prompt)
        if evicted:
            assert generated[-1] == 8  # the budget, counted past the prompt
    assert max(generated) == 9 and layer.counters.evictions == 16  # evicts on the 10th, 12th, ... generated token
    for now, before in zip((layer.keys, layer.values, layer.positions, layer.valid), saved, strict=True):
        assert torch.equal(now[:, :, :prompt], before)
    kept = layer.positions[0, 0, prompt : layer.counters.occupancy]
    assert kept.min() >= prompt and (kept.diff() > 0).all()  # only generated tokens were candidates


def test_prefill_pin_refuses_a_later_step_that_does_not_fit_and_pins_the_next_prompt_after_reset():
    layer = _layer(budget=8, window=2, sinks=2, prefill="pin")
    step(layer, torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8))
    with pytest.raises(RuntimeError, match="prefill='keep' or 'pin'"):
        step(layer, torch.randn(1, 1, 11, 8), torch.randn(1, 1, 11, 8), torch.randn(1, 1, 11, 8))
    assert layer.counters.tokens_seen == 12 and layer.counters.occupancy == 12
    layer.reset()
    assert layer.counters.pinned == 0
    step(layer, torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 8))
    assert layer.counters.pinned == 30 and layer.capacity == 40 and layer.counters.evictions == 0


def test_prefill_pin_through_generate_on_a_ragged_batch(make_model):
    """`patch(..., prefill="pin")` on a model: with a budget no sequence reaches, the unpatched model's greedy
    tokens; with a small one, every layer keeps its whole (padded) prompt in place and at most
    `budget + window` generated tokens, and evicts."""
    import vasepatch
    from tests.conftest import greedy_with_logits, ragged_batch
    from tests.tiny_models import VOCAB

    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    with torch.no_grad():
        ref = greedy_with_logits(model, ids, mask, 40)
        with vasepatch.patched(model, budget=64, window=8, prefill="pin") as handle:
            assert torch.equal(greedy_with_logits(model, ids, mask, 40).sequences, ref.sequences)
        assert handle.stats()["evictions"] == 0
        with vasepatch.patched(model, budget=12, window=4, sinks=2, prefill="pin") as handle:
            cache = handle.new_cache()
            kwargs = {handle.cache_keyword: cache}
            model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, **kwargs)
            assert handle.stats()["pinned"] == ids.shape[1]
    layer = cache.layers[0]
    prompt = ids.shape[1]
    assert layer.counters.pinned == prompt and layer.capacity == prompt + 16 and layer.counters.evictions > 0
    assert torch.equal(layer.valid[:, :, :prompt], mask.bool()[:, None, :].expand_as(layer.valid[:, :, :prompt]))
