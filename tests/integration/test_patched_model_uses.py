"""Every way a user can reach a patched model gives the right answer or a clear error.

One test (or more) per way: compiled wrappers, copies and pickles, static caches, `output_attentions`,
stale handles, used caches, training mode, threads; and the attention function called without a vasepatch
cache (a compiled call, or outside a patched forward). The
tests whose docstring names a mutant were written for one that survived the mutation check
(`benchmarks/mutation/run.sh`, recorded in `docs/results/mutation/`).
"""

from __future__ import annotations

import copy
import io
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers
from packaging.version import Version

import vasepatch
from tests.cache.test_cache_layer import HKV, HQ, B, D
from tests.cache.test_cache_layer import _layer as _vase_layer
from tests.conftest import greedy_with_logits, max_logit_diff, ragged_batch
from tests.integration.test_patching import fingerprint
from tests.tiny_models import VOCAB
from vasepatch.integration import attention, compat
from vasepatch.kernels import grouped as kernels

GEN = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)


def _generate(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, **(GEN | kwargs))


def _state(model):
    return model.__dict__["_vasepatch_state"]


# --- torch.compile wrappers ----------------------------------------------------------------------
def test_patch_refuses_a_compiled_wrapper_and_leaves_the_inner_model_alone(make_model):
    model = make_model("llama")
    compiled = torch.compile(model)
    before = fingerprint(model)
    with pytest.raises(vasepatch.UnsupportedModelError, match=r"torch\.compile") as info:
        vasepatch.patch(compiled, budget=16, window=4, seed=0)
    message = str(info.value)
    assert "_orig_mod" in message and "model.forward = torch.compile(model.forward" in message
    assert fingerprint(model) == before
    assert not vasepatch.is_patched(model) and not vasepatch.is_patched(compiled)


def test_is_patched_and_unpatch_look_through_a_compiled_wrapper(make_model):
    model = make_model("llama")
    compiled = torch.compile(model)
    before = fingerprint(model)
    vasepatch.patch(compiled._orig_mod, budget=16, window=4, seed=0)
    assert vasepatch.is_patched(compiled) and vasepatch.is_patched(model)
    vasepatch.unpatch(compiled)
    assert not vasepatch.is_patched(model)
    assert fingerprint(model) == before


# --- deepcopy and pickling -----------------------------------------------------------------------
def test_deepcopy_carries_a_working_patch_of_its_own(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    handle = vasepatch.patch(model, budget=16, window=4, seed=0)
    ref = _generate(model, ids, mask)
    clone = copy.deepcopy(model)
    clone_handle = _state(clone).handle
    assert vasepatch.is_patched(clone) and clone_handle is not handle and clone_handle.model is clone
    assert clone_handle.active and handle.active
    with torch.no_grad():
        for layer in clone.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    zeroed = _generate(clone, ids, mask)
    assert not torch.equal(zeroed, ref)  # the copy runs its own attention modules
    assert clone_handle.stats()["evictions"] > 0 and clone_handle.stats()["generations"] == 1
    assert torch.equal(_generate(model, ids, mask), ref)

    vasepatch.unpatch(clone)
    assert vasepatch.is_patched(model) and handle.active and not clone_handle.active
    assert "forward" not in clone.model.layers[0].self_attn.__dict__
    assert not clone._forward_hooks and model._forward_hooks  # each removes its own step hook
    assert clone.model.layers[0].self_attn.config is clone.config
    assert torch.equal(_generate(model, ids, mask), ref)
    handle.remove()


def test_pickled_patched_model_loads_patched(make_model):
    model = make_model("qwen2")
    ids, mask = ragged_batch(VOCAB)
    plain = _generate(model, ids, mask)
    handle = vasepatch.patch(model, budget=16, window=4, seed=3)
    ref = _generate(model, ids, mask)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert vasepatch.is_patched(loaded) and handle.active
    assert torch.equal(_generate(loaded, ids, mask), ref)
    assert _state(loaded).handle.stats()["evictions"] > 0
    vasepatch.unpatch(loaded)
    assert torch.equal(_generate(loaded, ids, mask), plain)
    handle.remove()


# --- static caches fall back to transformers' own attention --------------------------------------
@pytest.mark.parametrize("how", ["static", "sliding_window", "user StaticCache"])
def test_static_caches_fall_back_to_transformers(make_model, how):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)

    def run():
        if how == "user StaticCache":
            cache = transformers.StaticCache(config=model.config, max_cache_len=64)
            return greedy_with_logits(model, ids, mask, 16, past_key_values=cache)
        return greedy_with_logits(model, ids, mask, 16, cache_implementation=how)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "sliding_window" is deprecated in recent releases
        ref = run()
        with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
            out = run()
        assert handle.stats()["generations"] == 0
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(ref, out) == 0.0


def test_forward_with_a_static_cache_matches(make_model):
    model = make_model("qwen3")
    ids, mask = ragged_batch(VOCAB)

    def run():
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits

    ref = run()
    with vasepatch.patched(model, budget=16, window=4, seed=0):
        out = run()
    assert torch.equal(out, ref)


# --- a call with another cache evicts nothing, and says so once ----------------------------------
def _hand_loop(model, ids, cache=None, steps=10):
    """The usual research loop: a forward with `use_cache=True`, then one token at a time, feeding back
    `out.past_key_values`."""
    out = model(ids, use_cache=True, **({} if cache is None else {"past_key_values": cache}))
    for _ in range(steps):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    return out


OTHER_CACHES = {
    "a hand-written loop": _hand_loop,
    "cache_implementation='static'": lambda model, ids: model.generate(ids, cache_implementation="static", **GEN),
    "a DynamicCache given to generate": lambda model, ids: model.generate(
        ids, past_key_values=transformers.DynamicCache(), **GEN
    ),
}


def _no_eviction_warnings(run) -> list[warnings.WarningMessage]:
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if issubclass(w.category, vasepatch.NoEvictionWarning)]


@pytest.mark.parametrize("way", list(OTHER_CACHES))
def test_a_call_with_another_cache_warns_once_naming_new_cache(make_model, way):
    model = make_model("llama")
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    handle = vasepatch.patch(model, budget=16, window=4, seed=0)
    caught = _no_eviction_warnings(lambda: [OTHER_CACHES[way](model, ids) for _ in range(2)])
    assert len(caught) == 1  # once per patch, however many calls
    message = str(caught[0].message)
    assert "evicts nothing" in message and "handle.new_cache()" in message
    assert caught[0].filename == __file__  # it points at the user's call, not at transformers
    assert handle.stats()["evictions"] == 0
    handle.remove()
    vasepatch.patch(model, budget=16, window=4, seed=0)  # a new patch says it again
    assert len(_no_eviction_warnings(lambda: OTHER_CACHES[way](model, ids))) == 1
    vasepatch.unpatch(model)


def test_the_patch_cache_and_use_cache_false_are_silent(make_model):
    model = make_model("llama")
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    handle = vasepatch.patch(model, budget=16, window=4, seed=0)
    assert not _no_eviction_warnings(lambda: model.generate(ids, **GEN))
    assert not _no_eviction_warnings(lambda: _hand_loop(model, ids, handle.new_cache(), steps=24))
    assert handle.stats()["evictions"] > 0
    assert not _no_eviction_warnings(lambda: model(ids, use_cache=False))  # nothing to evict
    handle.remove()


@pytest.mark.parametrize("assisted", ["prompt lookup", "assistant model"])
def test_assisted_decoding_is_refused_by_transformers_own_message(make_model, assisted):
    """Draft verification crops the cache back to the accepted tokens; an evicting cache cannot hand back
    tokens it has dropped, so the `VaSECache` is not croppable, and transformers refuses it before any
    eviction: "requires a cache that can be cropped" (recent releases), "not supported with Static cache
    classes" (5.0, which sees a fixed-size cache)."""
    model = make_model("llama")
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    draft = {"assistant_model": make_model("llama")} if assisted == "assistant model" else {}
    kwargs = draft or {"prompt_lookup_num_tokens": 3}
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        with pytest.raises(ValueError, match=r"can be cropped|not supported with Static cache"):
            model.generate(ids, **GEN, **kwargs)
        assert handle.stats()["evictions"] == 0


# --- output_attentions ---------------------------------------------------------------------------
def test_eager_output_attentions_are_real_weights(make_model):
    model = make_model("llama", attn="eager")
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    kwargs = dict(output_attentions=True, return_dict_in_generate=True, max_new_tokens=6)
    ref = _generate(model, ids, mask, **kwargs)
    with vasepatch.patched(model, budget=64, window=8):  # nothing evicted: weights over the same tokens
        out = _generate(model, ids, mask, **kwargs)
    assert len(out.attentions) == len(ref.attentions) == 6
    for step_ref, step_out in zip(ref.attentions, out.attentions, strict=True):
        assert len(step_out) == 2
        for a, b in zip(step_ref, step_out, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_eager_output_attentions_after_eviction_cover_the_cache_slots(make_model):
    model = make_model("llama", attn="eager")
    ids, mask = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        out = _generate(model, ids, mask, output_attentions=True, return_dict_in_generate=True)
        assert handle.stats()["evictions"] > 0
        capacity = handle.stats()["capacity"]
    last = out.attentions[-1][0]
    assert last.shape[:3] == (3, 4, 1) and last.shape[-1] <= capacity
    torch.testing.assert_close(last.sum(-1), torch.ones(3, 4, 1))


def test_sdpa_output_attentions_warns(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = {handle.cache_keyword: handle.new_cache()}
        with pytest.warns(UserWarning, match="attn_implementation='eager'"):
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True, **cache)
    assert not out.attentions  # () or None, as transformers' own sdpa path returns


def test_the_no_weights_warning_points_at_the_caller():
    """`vasepatch_attention` mutant dropping `stacklevel=2`: the `output_attentions` warning was
    reported at vasepatch's own line instead of the code that asked for the weights."""
    module = SimpleNamespace(config=SimpleNamespace(**{attention.BACKEND_ATTR: "sdpa"}))
    layer = _vase_layer()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, n, 4, D, generator=g) for n in (HQ, HKV, HKV))
    kwargs = {attention.LAYER_KWARG: layer, "output_attentions": True}
    with pytest.warns(UserWarning, match="computes no attention weights") as caught:
        out, weights = attention.vasepatch_attention(module, q, k, v, None, **kwargs)
    assert weights is None and out.shape == (B, 4, HQ, D)
    assert caught[0].filename != attention.__file__  # the caller's frame, not vasepatch's


# --- the attention function without a vasepatch cache --------------------------------------------
def _reference_attention(q, k, v, allowed):
    """Plain softmax attention, GQA by repeating KV heads; `allowed` `[B, Q, S]`; out `[B, Q, Hq, D]`."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
    return (probs @ v).transpose(1, 2)


def test_attention_without_a_vase_cache_outside_a_patched_forward_is_causal_over_real_tokens():
    """`_without_vase_cache` mutants dropping the key length or the mask: the plain causal +
    padding path (a compiled call without a vasepatch cache, or the kernel called outside a
    patched model's forward) crashed; only compiled tests reached it."""
    module = SimpleNamespace(config=SimpleNamespace())  # a module of an unpatched config
    g = torch.Generator().manual_seed(0)
    q_len, s_len = 3, 7
    q = torch.randn(B, HQ, q_len, D, generator=g)
    k, v = torch.randn(B, HKV, s_len, D, generator=g), torch.randn(B, HKV, s_len, D, generator=g)
    padding = torch.ones(B, s_len, dtype=torch.long)
    padding[1, :2] = 0
    out, weights = attention.vasepatch_attention(module, q, k, v, padding)
    causal = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]  # [Q, S]
    allowed = causal[None] & padding.bool()[:, None, :]
    assert weights is None
    torch.testing.assert_close(out, _reference_attention(q, k, v, allowed))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_attention_without_a_vase_cache_runs_the_chosen_kernel(backend):
    """`vasepatch_attention` mutant passing `backend=None` on: the plain path ran the sdpa kernel
    whatever the patch chose (the same attention up to rounding: checked bit for bit here)."""
    module = SimpleNamespace(config=SimpleNamespace(**{attention.BACKEND_ATTR: backend}))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, HQ, 3, D, generator=g)
    k, v = torch.randn(B, HKV, 9, D, generator=g), torch.randn(B, HKV, 9, D, generator=g)
    out, _ = attention.vasepatch_attention(module, q, k, v, None)
    mask = kernels.causal_padding_mask(None, 3, 9, q.device)
    assert torch.equal(out, kernels.grouped_attention(q, k, v, mask, D**-0.5, backend))


# --- stale handles -------------------------------------------------------------------------------
def test_stale_handle_does_not_remove_a_newer_patch(make_model):
    model = make_model("llama")
    h1 = vasepatch.patch(model, budget=16, window=4, seed=0)
    vasepatch.unpatch(model)
    h2 = vasepatch.patch(model, budget=16, window=4, seed=0)
    state = fingerprint(model)
    with pytest.raises(vasepatch.NotPatchedError, match="another handle"):
        h1.remove()
    assert h2.active and vasepatch.is_patched(model) and fingerprint(model) == state
    h2.remove()
    with pytest.raises(vasepatch.NotPatchedError, match="already removed"):
        h2.remove()


# --- used caches ---------------------------------------------------------------------------------
def test_used_cache_passed_to_generate_again_is_refused(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4, policy="vase-topk") as handle:  # no sampling
        cache = handle.new_cache()
        _generate(model, ids, mask, **{handle.cache_keyword: cache})
        seen = cache.stats()["tokens_seen"]
        with pytest.raises(ValueError, match=r"already holds .*new_cache\(\).*reset\(\)"):
            _generate(model, ids, mask, **{handle.cache_keyword: cache})
        assert cache.stats()["tokens_seen"] == seen
        cache.reset()
        fresh = _generate(model, ids, mask, **{handle.cache_keyword: handle.new_cache()})
        assert torch.equal(_generate(model, ids, mask, **{handle.cache_keyword: cache}), fresh)


def test_continuing_from_a_used_cache_matches_a_dynamic_cache(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    extra = torch.randint(1, VOCAB, (3, 3), generator=torch.Generator().manual_seed(2))

    def two_rounds(cache):
        first = _generate(model, ids, mask, past_key_values=cache)
        longer = torch.cat([first, extra], 1)
        longer_mask = torch.cat([mask, torch.ones(3, longer.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
        return model.generate(input_ids=longer, attention_mask=longer_mask, past_key_values=cache, **GEN)

    ref = two_rounds(transformers.DynamicCache(config=model.config))
    with vasepatch.patched(model, budget=128, window=8) as handle:
        out = two_rounds(handle.new_cache())
    assert torch.equal(out, ref)


OLD_GENERATE = Version(transformers.__version__) < Version("5.24")


@pytest.mark.parametrize(
    "used",
    [
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                OLD_GENERATE,
                reason="older generate() slices the input by the cache length before the model runs (IndexError)",
                strict=False,
            ),
        ),
        False,
    ],
    ids=["used", "fresh"],
)
def test_vase_cache_on_an_unpatched_model_is_refused(make_model, used):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        if used:
            _generate(model, ids, mask, past_key_values=cache)
    with pytest.raises(RuntimeError, match="not patched"):
        _generate(model, ids, mask, past_key_values=cache)


# --- training mode -------------------------------------------------------------------------------
def test_training_mode_with_attention_dropout_is_refused(make_model):
    model = make_model("llama", attention_dropout=0.25)
    ids, mask = ragged_batch(VOCAB)
    with vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        model.train()
        before = fingerprint(model)
        with pytest.raises(RuntimeError, match=r"dropout.*model\.eval\(\)"):
            _generate(model, ids, mask)
        with pytest.raises(RuntimeError, match="dropout"):
            model(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: handle.new_cache()})
        assert fingerprint(model) == before and handle.stats()["tokens_seen"] == 0
        model.eval()
        _generate(model, ids, mask)
        assert handle.stats()["evictions"] > 0


def test_training_without_a_vase_cache_applies_dropout_like_transformers(make_model):
    model = make_model("llama", attention_dropout=0.25).train()
    ids, mask = ragged_batch(VOCAB)

    def run():
        with torch.random.fork_rng():
            torch.manual_seed(11)
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    ref = run()
    with vasepatch.patched(model, budget=16, window=4, seed=0):
        out = run()
    assert torch.equal(out, ref)
    model.eval()
    assert not torch.equal(run(), ref)  # dropout did act in training mode


# --- threads -------------------------------------------------------------------------------------
class _OnStep:
    """A streamer that runs `action` once, when generate hands it its `at`-th new token."""

    def __init__(self, at: int, action):
        self.at, self.action, self.seen = at, action, 0

    def put(self, value):
        self.seen += 1
        if self.seen == self.at + 1:  # the first put is the prompt
            self.action()

    def end(self):
        pass


def _in_thread(fn):
    """Run `fn` in another thread and wait for it; return what it returned or raised."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as err:  # handed back to the caller
            box["error"] = err

    worker = threading.Thread(target=target)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    return box


@pytest.mark.timeout(120)
def test_one_patched_model_shared_by_threads(make_model):
    model = make_model("llama")
    prompts = [ragged_batch(VOCAB, seed=s) for s in range(3)]
    with vasepatch.patched(model, budget=16, window=4, seed=0):
        expected = [_generate(model, ids, mask) for ids, mask in prompts]
        barrier = threading.Barrier(len(prompts), timeout=60)
        results: dict[int, torch.Tensor] = {}

        def work(i):
            ids, mask = prompts[i]
            results[i] = _generate(model, ids, mask, streamer=_OnStep(3, barrier.wait))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
    assert not any(t.is_alive() for t in threads)
    for i, ref in enumerate(expected):
        assert torch.equal(results[i], ref)


@pytest.mark.timeout(120)
def test_unpatch_while_another_thread_generates_is_refused(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    handle = vasepatch.patch(model, budget=16, window=4, seed=0)
    ref = _generate(model, ids, mask)
    boxes = []
    out = _generate(model, ids, mask, streamer=_OnStep(5, lambda: boxes.append(_in_thread(handle.remove))))
    assert isinstance(boxes[0].get("error"), vasepatch.ModelInUseError)
    assert "generate" in str(boxes[0]["error"]) and "wait" in str(boxes[0]["error"])
    assert torch.equal(out, ref) and handle.active
    handle.remove()


@pytest.mark.timeout(120)
def test_patch_while_another_thread_generates_keeps_that_generation_exact(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    ref = _generate(model, ids, mask)
    boxes = []
    out = _generate(model, ids, mask, streamer=_OnStep(5, lambda: boxes.append(_in_thread(_patch_fn(model)))))
    handle = boxes[0]["value"]
    assert torch.equal(out, ref)  # the running generation keeps its DynamicCache and transformers' attention
    _generate(model, ids, mask)
    assert handle.stats()["evictions"] > 0
    handle.remove()


def _patch_fn(model):
    return lambda: vasepatch.patch(model, budget=16, window=4, seed=0)


@pytest.mark.timeout(120)
def test_patch_landing_between_two_layers_of_a_running_forward(make_model):
    """The patch lands after layer 0 of a decode step ran unpatched: layer 1 then sees the
    patched config with the mask transformers built for the unpatched model."""
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    ref = _generate(model, ids, mask)
    boxes, calls = [], []

    def after_layer_0(module, args, output):
        calls.append(1)
        if len(calls) == 4:
            boxes.append(_in_thread(_patch_fn(model)))

    hook = model.model.layers[0].register_forward_hook(after_layer_0)
    try:
        out = _generate(model, ids, mask)
    finally:
        hook.remove()
    assert "value" in boxes[0], boxes[0]
    assert torch.equal(out, ref)
    boxes[0]["value"].remove()


def test_setting_the_attention_implementation_keeps_the_patch_and_changes_its_own_path():
    """`set_attn_implementation` sets every config of the model, the patch's private copy included: the patch
    keeps its kernel, and the new implementation is what its own path (a call without a vasepatch cache) runs;
    `unpatch` leaves the model with the implementation last set."""
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", attn="eager")
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    handle = vasepatch.patch(model, budget=16, window=4, seed=0)
    before = _generate(model, ids, mask)
    model.set_attn_implementation("sdpa")
    private = model.model.config
    assert private._attn_implementation == attention.ATTN_IMPLEMENTATION
    assert getattr(private, attention.ORIGINAL_ATTR) == "sdpa"
    assert torch.equal(_generate(model, ids, mask), before) and handle.stats()["evictions"] > 0
    vasepatch.unpatch(model)
    assert model.model.config._attn_implementation == "sdpa" and "set_attn_implementation" not in model.__dict__


def test_continuous_batching_leaves_the_patch_as_it_found_it():
    """`generate_batch` on a patched `eager` model switches the model's attention to a paged one and back on
    `stop()`, through `set_attn_implementation`: it evicts as `generate` does where transformers' continuous
    batching is one the patch evicts inside (`compat.CONTINUOUS_BATCHING`; `test_continuous_batching.py`), else its
    tokens are the unpatched model's, with the warning; and the patched `generate` afterwards still evicts and gives
    the tokens it gave before."""
    from tests.tiny_models import tiny_model

    cb_config = pytest.importorskip("transformers.generation.configuration_utils").__dict__.get(
        "ContinuousBatchingConfig"
    )
    if cb_config is None:
        pytest.skip("this transformers has no ContinuousBatchingConfig")
    model = tiny_model("llama", attn="eager")
    prompt = torch.randint(1, VOCAB, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    config = transformers.GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    settings = dict(generation_config=config, continuous_batching_config=cb_config(page_size=16, num_blocks=16,
                    max_batch_tokens=64), warmup=False)  # fmt: skip

    def batch():
        return [o.generated_tokens for o in model.generate_batch([prompt], **settings).values()]

    unpatched = batch()
    handle = vasepatch.patch(model, budget=16, window=4, seed=0)
    ids = torch.tensor([prompt])
    before = model.generate(ids, generation_config=config)
    evictions = handle.stats()["evictions"]
    if compat.evicts_in_continuous_batching():
        assert batch() == [before[0, len(prompt) :].tolist()] != unpatched
    else:
        with pytest.warns(vasepatch.NoEvictionWarning):
            assert batch() == unpatched
    assert model.model.config._attn_implementation == attention.ATTN_IMPLEMENTATION
    assert torch.equal(model.generate(ids, generation_config=config), before)
    assert evictions > 0 and handle.stats()["evictions"] == evictions  # the last generate's
