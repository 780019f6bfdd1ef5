"""Every way a `VaSECache` can be reused: continued, copied, pickled, reset for another
batch or dtype, handed to another model, moved between inference modes, or left by a failed step.
Each case gives the right answer (checked against a `DynamicCache` or a fresh cache) or a clear
error raised before any work, with the cache and the model untouched."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
import transformers

import vasepatch
from tests import sliding_models
from tests.conftest import ragged_batch
from tests.package.test_validation import _registered  # register a policy for one test, then remove it
from tests.tiny_models import VOCAB
from vasepatch import policies
from vasepatch.cache import VaSECache
from vasepatch.policies import PolicyOutputError

GEN = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids without the pad id 0 (so generate drops the all-ones mask)."""
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _dynamic(model) -> transformers.DynamicCache:
    return transformers.DynamicCache(config=model.config)


def _prefill(model, cache, ids, mask=None):
    """Run the prompt through the model into `cache` (the "re-use a prompt cache" pattern)."""
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{key: cache})
    return cache


def _continue(model, cache, ids, mask=None, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **(GEN | kwargs))


# --- 1: continuing from a used cache, without padding ----------------------------------------------
def _two_rounds(model, cache, ids, mask, extra):
    first = _continue(model, cache, ids, mask)
    longer = torch.cat([first, extra], 1)
    longer_mask = None if mask is None else torch.cat([mask, torch.ones_like(longer[:, ids.shape[1] :])], 1)
    return _continue(model, cache, longer, longer_mask)


@pytest.mark.parametrize("batch", ["one-unpadded", "ragged"])
def test_continuing_a_used_cache_matches_a_dynamic_cache(make_model, batch):
    model = make_model("llama")
    if batch == "ragged":
        ids, mask = ragged_batch(VOCAB)
    else:
        ids, mask = _ids(1, 12, 0), None
    extra = _ids(ids.shape[0], 3, 1)
    ref = _two_rounds(model, _dynamic(model), ids, mask, extra)
    with vasepatch.patched(model, budget=128, window=8) as handle:
        out = _two_rounds(model, handle.new_cache(), ids, mask, extra)
    assert torch.equal(out, ref)


def test_a_used_cache_with_a_shorter_unpadded_input_is_still_refused(make_model):
    model = make_model("llama")
    ids = _ids(1, 12, 0)
    with vasepatch.patched(model, budget=16, window=4) as handle:
        cache = handle.new_cache()
        _continue(model, cache, ids)
        seen = cache.tokens_seen()
        with pytest.raises(ValueError, match=rf"already holds {seen} tokens .* the input has 12"):
            _continue(model, cache, ids)
        assert cache.tokens_seen() == seen


# --- 2: copies and pickles of a cache --------------------------------------------------------------
PROMPT, SUFFIX_A, SUFFIX_B = _ids(1, 20, 3), _ids(1, 5, 4), _ids(1, 6, 5)


def _full(suffix):
    return torch.cat([PROMPT, suffix], 1)


@pytest.mark.parametrize("budget", [128, 16], ids=["nothing-evicted", "evicting"])
def test_deep_copies_of_a_prefilled_cache_continue_independently(make_model, budget):
    model = make_model("llama")
    ref = {}
    if budget == 128:
        base = _prefill(model, _dynamic(model), PROMPT)
        ref = {name: _continue(model, copy.deepcopy(base), _full(s)) for name, s in (("a", SUFFIX_A), ("b", SUFFIX_B))}
    with vasepatch.patched(model, budget=budget, window=4, seed=0) as handle:
        base = _prefill(model, handle.new_cache(), PROMPT)
        before = base.stats()
        copy_a, copy_b = copy.deepcopy(base), copy.deepcopy(base)
        out_b = _continue(model, copy_b, _full(SUFFIX_B))
        out_a = _continue(model, copy_a, _full(SUFFIX_A))
        assert base.stats() == before  # the copies did not touch the original
        assert torch.equal(_continue(model, base, _full(SUFFIX_A)), out_a)
    if ref:
        assert torch.equal(out_a, ref["a"]) and torch.equal(out_b, ref["b"])


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
@pytest.mark.parametrize("policy", ["vase", "full"])
def test_a_pickled_cache_continues_like_the_original(make_model, how, policy):
    model = make_model("llama")
    with vasepatch.patched(model, budget=16, window=4, seed=0, policy=policy) as handle:
        base = _prefill(model, handle.new_cache(), PROMPT)
        if how == "pickle":
            loaded = pickle.loads(pickle.dumps(base))
        else:
            buf = io.BytesIO()
            torch.save(base, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
        assert loaded.stats() == base.stats()
        assert torch.equal(_continue(model, loaded, _full(SUFFIX_A)), _continue(model, base, _full(SUFFIX_A)))


def test_a_fresh_evicting_cache_copies(make_model):
    model = make_model("llama")
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        fresh = handle.new_cache()
        clone, loaded = copy.deepcopy(fresh), pickle.loads(pickle.dumps(fresh))
        ref = _continue(model, fresh, PROMPT)
        assert torch.equal(_continue(model, clone, PROMPT), ref)
        assert torch.equal(_continue(model, loaded, PROMPT), ref)


# --- 3: a cache from another model -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (dict(num_hidden_layers=2), dict(num_hidden_layers=4), r"2 layers.*4"),
        (dict(num_hidden_layers=4), dict(num_hidden_layers=2), r"4 layers.*2"),
        (dict(), dict(), r"another patch"),
    ],
    ids=["2-to-4-layers", "4-to-2-layers", "same-shape-other-model"],
)
@pytest.mark.parametrize("used", [False, True], ids=["fresh", "used"])
def test_a_cache_from_another_model_is_refused(make_model, first, second, message, used):
    model_a, model_b = make_model("llama", **first), make_model("llama", seed=1, **second)
    ids = _ids(1, 10, 0)
    handle_a = vasepatch.patch(model_a, budget=16, window=4)
    handle_b = vasepatch.patch(model_b, budget=24, window=4)
    cache = handle_a.new_cache()
    if used:
        _continue(model_a, cache, ids)
    before = cache.stats()
    with pytest.raises(ValueError, match=message):
        _continue(model_b, cache, torch.cat([ids, ids], 1))
    assert cache.stats() == before
    assert handle_b.stats()["generations"] == 0
    ref = _continue(model_b, handle_b.new_cache(), ids)  # the model still works
    handle_b.remove()
    assert torch.equal(_continue(model_b, None, ids), ref)  # nothing evicted: same as unpatched
    handle_a.remove()


def test_a_cache_of_the_same_model_with_other_settings_is_accepted(make_model):
    model = make_model("llama")
    ids = _ids(1, 10, 0)
    with vasepatch.patched(model, budget=16, window=4) as handle:
        cache = handle.new_cache(handle.config.replace(budget=128, window=8))
        out = _continue(model, cache, ids)
    assert torch.equal(out, _continue(model, None, ids))


def test_a_cache_from_before_unpatch_is_refused_after_a_new_patch(make_model):
    model = make_model("llama")
    ids = _ids(1, 10, 0)
    with vasepatch.patched(model, budget=16, window=4) as handle:
        cache = handle.new_cache()
    with vasepatch.patched(model, budget=16, window=4), pytest.raises(ValueError, match=r"another patch"):
        _continue(model, cache, ids)


def test_a_hand_made_cache_with_the_wrong_layer_count_is_refused(make_model):
    model = make_model("llama")
    with vasepatch.patched(model, budget=16, window=4) as handle:
        cache = VaSECache(handle.config, handle.policy, 3)
        with pytest.raises(ValueError, match=r"3 layers.*2"):
            _continue(model, cache, _ids(1, 10, 0))


# --- 4: reset() for another batch size, dtype or length ------------------------------------------------
def test_reset_then_another_batch_size(make_model):
    model = make_model("llama")
    ids3, mask3 = ragged_batch(VOCAB)
    ids2, mask2 = ragged_batch(VOCAB, lengths=(9, 5), seed=1)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        _continue(model, cache, ids3, mask3)
        cache.reset()
        out = _continue(model, cache, ids2, mask2)
        assert torch.equal(out, _continue(model, handle.new_cache(), ids2, mask2))
        assert cache.stats()["capacity"] == 20


def test_a_used_cache_with_another_batch_size_is_refused(make_model):
    model = make_model("llama")
    ids3, mask3 = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        first = _continue(model, cache, ids3, mask3)
        before = cache.stats()
        longer = torch.cat([first[:2], _ids(2, 2, 1)], 1)
        with pytest.raises(ValueError, match=r"batch of 3.*batch of 2.*reset\(\)"):
            _continue(model, cache, longer)
        assert cache.stats() == before


def test_reset_then_another_dtype(make_model):
    model = make_model("llama").to(torch.bfloat16)
    ids = _ids(1, 10, 0)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        _continue(model, cache, ids)
        model.float()
        cache.reset()
        out = _continue(model, cache, ids)
        assert torch.equal(out, _continue(model, handle.new_cache(), ids))
        assert cache.layers[0].keys.dtype == torch.float32


def test_a_used_cache_after_model_half_is_refused(make_model):
    model = make_model("llama")
    ids = _ids(1, 10, 0)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        first = _continue(model, cache, ids)
        before = cache.stats()
        model.to(torch.bfloat16)
        with pytest.raises(ValueError, match=r"float32.*bfloat16"):
            _continue(model, cache, torch.cat([first, _ids(1, 2, 1)], 1))
        assert cache.stats() == before


def test_reset_then_a_longer_prompt_with_prefill_keep(make_model):
    model = make_model("llama")
    with vasepatch.patched(model, budget=16, window=4, seed=0, prefill="keep") as handle:
        cache = handle.new_cache()
        _continue(model, cache, _ids(1, 6, 0))
        cache.reset()
        long = _ids(1, 30, 1)
        assert torch.equal(_continue(model, cache, long), _continue(model, handle.new_cache(), long))


# --- 5: inference_mode then no_grad --------------------------------------------------------------------
def test_prefill_under_inference_mode_then_decode_under_no_grad(make_model):
    model = make_model("llama")

    def run(cache):
        with torch.inference_mode():
            _prefill(model, cache, PROMPT)
        with torch.no_grad():
            return _continue(model, cache, _full(SUFFIX_A))

    ref = run(_dynamic(model))
    with vasepatch.patched(model, budget=128, window=4) as handle:
        assert torch.equal(run(handle.new_cache()), ref)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:  # evicting: the ring and counters too
        out = run(handle.new_cache())
        with torch.no_grad():
            plain = _continue(model, _prefill(model, handle.new_cache(), PROMPT), _full(SUFFIX_A))
        assert torch.equal(out, plain)


def test_a_cache_filled_under_inference_mode_copies_and_resets(make_model):
    model = make_model("llama")
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        with torch.inference_mode():
            ref = _continue(model, cache, PROMPT)
        clone = copy.deepcopy(cache)
        assert clone.stats() == cache.stats()
        cache.reset()
        assert torch.equal(_continue(model, cache, PROMPT), ref)


# --- 10c: a failed prefill leaves consistent counters ----------------------------------------------
def _one_row(keys, valid):
    return keys.float().sum(-1)[:1]


def test_a_policy_error_during_prefill_leaves_the_cache_untouched(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(30, 20, 9))
    bad = vasepatch.VaSEConfig(budget=16, window=4, policy="test-one-row")
    with _registered("test-one-row", _one_row), vasepatch.patched(model, config=bad) as handle:
        cache = handle.new_cache()
        with pytest.raises(PolicyOutputError):
            _continue(model, cache, ids, mask)
        stats = cache.stats()
        assert (stats["tokens_seen"], stats["occupancy"], stats["evictions"]) == (0, 0, 0)
        used = [layer for layer in cache.layers if layer.is_initialized]
        assert used and all(int(layer.slots.seen) == 0 and int(layer.slots.fill) == 0 for layer in used)
        assert all(layer.slots.next_position.eq(0).all() and layer.ring.queries is None for layer in used)
        short, short_mask = ragged_batch(VOCAB, lengths=(10, 7, 3))  # evicts nothing: the policy is not asked
        again = _continue(model, cache, short, short_mask, max_new_tokens=5)
        assert torch.equal(again, _continue(model, handle.new_cache(), short, short_mask, max_new_tokens=5))


# --- 10d: a hand-made prefill="keep" cache with prefill_chunk_size -----------------------------------
@pytest.mark.parametrize("how", ["new_cache", "constructor"])
def test_a_hand_made_keep_cache_with_chunked_prefill_is_refused(make_model, how):
    model = make_model("llama")
    ids = _ids(1, 30, 0)
    with vasepatch.patched(model, budget=16, window=4) as handle:
        keep = handle.config.replace(prefill="keep")
        if how == "new_cache":
            cache = handle.new_cache(keep)
        else:
            cache = VaSECache(keep, handle.policy, 2, plans=handle.layout.layer_plans())
        with pytest.raises(ValueError, match=r"prefill_chunk_size.*prefill='keep'"):
            _continue(model, cache, ids, prefill_chunk_size=8)
        assert cache.tokens_seen() == 0


# --- 11a: new_cache(config) keeps the model's layer plans ------------------------------------------
def test_new_cache_with_a_config_keeps_the_sliding_windows():
    model = sliding_models.tiny(sliding_models.sliding_config("mistral", 6))
    ids = _ids(1, 20, 0)
    ref = _continue(model, None, ids)
    with vasepatch.patched(model, budget=16, window=4) as handle:
        cache = handle.new_cache(vasepatch.VaSEConfig(budget=64, window=8))
        assert [layer.plan.sliding_window for layer in cache.layers] == [6, 6]
        assert torch.equal(_continue(model, cache, ids), ref)


class _FailsOnSecondLayer(policies.base.Policy):
    """Picks like `vase-topk` at the first eviction of a step, then fails (the second layer)."""

    def __init__(self, config) -> None:
        inner = policies.for_config(config)
        super().__init__("fails-later", inner.priority, inner.options)
        self.calls = 0

    def select(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("second layer fails")
        return super().select(*args, **kwargs)


def test_a_step_that_fails_after_some_layers_leaves_the_cache_refusing_until_reset(make_model):
    model = make_model("llama")
    ids = _ids(1, 30, 0)
    with vasepatch.patched(model, budget=16, window=4, policy="vase-topk") as handle:
        cache = VaSECache(handle.config, _FailsOnSecondLayer(handle.config), 2, plans=handle.layout.layer_plans())
        with pytest.raises(RuntimeError, match="second layer fails"):
            _continue(model, cache, ids)
        assert [layer.counters.tokens_seen for layer in cache.layers] == [30, 0]  # what each layer holds
        with pytest.raises(RuntimeError, match=r"left part-way through a step .*second layer fails.*reset\(\)"):
            _continue(model, cache, torch.cat([ids, ids], 1))
        cache.reset()
        assert torch.equal(_continue(model, cache, ids), _continue(model, handle.new_cache(), ids))
