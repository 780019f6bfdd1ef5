"""Eviction inside transformers' continuous batching (`vasepatch.integration.continuous`): a patched model's
`generate_batch` and `init_continuous_batching` managers evict each request as the same request alone through
`generate` evicts it (equal greedy tokens, prompts of several lengths arriving at different times, a prompt
prefilled in chunks), hold at most `ceil((budget + window) / page_size)` blocks per request after its first eviction,
give the rest back, and fit more requests in the same blocks. Refusals, forks, prefix sharing with a pinned prompt,
and the range of transformers releases (outside it, the warning stays)."""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
from transformers import GenerationConfig

import vasepatch
from tests import sliding_models
from tests.tiny_models import VOCAB, tiny_model
from vasepatch.errors import ModelInUseError, NoEvictionWarning
from vasepatch.integration import compat, patching

if not compat.evicts_in_continuous_batching():  # the warning stays there: test_patched_model_uses.py
    pytest.skip(f"a patch evicts in continuous batching of transformers {compat.CONTINUOUS_BATCHING}",
                allow_module_level=True)  # fmt: skip

from transformers.generation.configuration_utils import ContinuousBatchingConfig

BUDGET, WINDOW, PAGE = 32, 8, 16


def _model(family: str = "llama", **settings):
    """A tiny random model in float64: its greedy tokens are the same whichever kernel adds up the attention
    (transformers' over the paged batch, vasepatch's over its own buffer); float32 flips a near tie now and then."""
    return tiny_model(family, **settings).double()


def _prompts(lengths, vocab: int = VOCAB) -> list[list[int]]:
    return [torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def _alone(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _cb(num_blocks: int = 96, max_batch_tokens: int = 128, **more) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **more)


def _greedy(new: int, **more) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0, **more)


def _batch(model, prompts, new: int, cb: ContinuousBatchingConfig | None = None) -> list[list[int]]:
    """`generate_batch`'s tokens, in the prompts' order (a reused manager numbers its requests on: `req_<n>`)."""
    out = model.generate_batch(prompts, generation_config=_greedy(new), continuous_batching_config=cb or _cb())
    assert not [o.error for o in out.values() if o.error]  # a request that failed in the manager's thread
    return [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.rpartition("_")[2]))]


def _arriving(model, prompts, new: int, cb: ContinuousBatchingConfig, pause: float = 0.2) -> list[list[int]]:
    """The tokens of a manager from `init_continuous_batching`, the prompts added one by one while it runs."""
    manager = model.init_continuous_batching(generation_config=_greedy(new), continuous_batching_config=cb)
    manager.start()
    try:
        ids = []
        for prompt in prompts:
            ids.append(manager.add_request(prompt, max_new_tokens=new))
            time.sleep(pause)
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None, "the manager stopped before answering every request"
            if result.is_finished():
                done[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=60)
    return [done[i] for i in ids]


def test_smollm2_requests_arriving_at_different_times_keep_what_generate_alone_keeps(smollm2):
    """SmolLM2, four prompts of 21 to 150 tokens (one prefilled in chunks of at most 96 tokens) added while the
    manager runs: each request's greedy tokens equal the same request's alone through the patched `generate`, and
    differ from the full cache's for at least one (the evictions show)."""
    model, tokenizer = smollm2
    prompts = _prompts((150, 21, 64, 97), vocab=tokenizer.vocab_size)
    new = 48
    full = [_alone(model, p, new) for p in prompts]
    with vasepatch.patched(model, budget=64, window=16, seed=0) as handle:
        want = [_alone(model, p, new) for p in prompts]
        got = _arriving(model, prompts, new, _cb(max_batch_tokens=96))
        stats = handle.batching_stats()
    assert got == want
    assert got != full
    assert stats["evictions"] >= 8 and stats["peak_blocks"] <= math.ceil((64 + 16) / PAGE)


@pytest.mark.parametrize("policy", ["vase", "snapkv", "streaming", "rkv", "random", "triattention"])
def test_each_policy_keeps_in_the_batch_what_it_keeps_alone(policy, tmp_path):
    """Every request keeps the kept sets of the same request alone (the same seed, the request as row 0), a
    300-token prompt prefilled in chunks of 128 included."""
    model = _model()
    options = {}
    if policy == "triattention":  # calibrated statistics of this model
        from vasepatch.integration import calibration

        ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(9))
        options = {"stats": str(calibration.calibrate(model, ids, path=tmp_path / "stats.safetensors"))}
    prompts = _prompts((20, 300, 45, 70))
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=3, policy=policy, policy_options=options) as h:
        want = [_alone(model, p, 40) for p in prompts]
        assert _batch(model, prompts, 40) == want
        assert h.batching_stats()["peak_blocks"] <= math.ceil((BUDGET + WINDOW) / PAGE)


@pytest.mark.parametrize("prefill", ["keep", "pin"])
def test_the_prefill_modes_keep_what_generate_keeps(prefill, monkeypatch):
    """`prefill="keep"` (the prompt whole until the buffer fills) and `"pin"` (the prompt never evicted) give equal
    tokens. With `"pin"` prefix sharing stays on: a prompt that arrives again shares the first one's full prompt
    blocks, which no eviction writes."""
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    shared = []
    acquire = cache_allocator.CacheAllocator.acquire_prefix_blocks

    def acquiring(self, request_id, prefix_len, block_ids):
        shared.append(prefix_len)
        return acquire(self, request_id, prefix_len, block_ids)

    monkeypatch.setattr(cache_allocator.CacheAllocator, "acquire_prefix_blocks", acquiring)
    model = _model()
    prompts = _prompts((20, 70, 45))
    prompts.append(list(prompts[1]))  # the 70-token prompt again, once the first is prefilled
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=1, prefill=prefill) as handle:
        want = [_alone(model, p, 60) for p in prompts]
        assert _arriving(model, prompts, 60, _cb(allow_block_sharing=True)) == want
        assert handle.batching_stats()["evictions"] > 0
    assert shared == ([64] if prefill == "pin" else [])  # four full blocks of the 70-token prompt


def test_with_a_budget_above_every_sequence_the_tokens_are_the_unpatched_models():
    model = _model()
    prompts = _prompts((20, 45, 70))
    want = _batch(model, prompts, 30)
    with vasepatch.patched(model, budget=256, window=8) as handle:
        assert _batch(model, prompts, 30) == want
        assert handle.batching_stats()["evictions"] == 0


def test_the_full_mode_runs_transformers_own_cache_without_a_warning():
    model = _model()
    prompts = _prompts((20, 45))
    want = _batch(model, prompts, 30)
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, policy="full") as handle:
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoEvictionWarning)
            assert _batch(model, prompts, 30) == want
        assert handle.batching_stats()["evictions"] == 0


def test_evicting_requests_give_blocks_back_so_more_run_at_once(monkeypatch):
    """Eight requests of 40 + 80 tokens in 30 blocks of 16: the full cache needs 8 blocks each at the end, so
    requests are offloaded (started over) to make room; evicting at budget 32 + window 8 holds at most 3 each, so
    all eight run together to the end and none is offloaded."""
    from transformers.generation.continuous_batching import offloading_manager

    offloads = []
    offload = offloading_manager.OffloadingManager.offload_requests

    def counting(self, *args, **kwargs):
        done = offload(self, *args, **kwargs)
        offloads.append(done)
        return done

    monkeypatch.setattr(offloading_manager.OffloadingManager, "offload_requests", counting)
    model = _model()
    prompts = _prompts(range(40, 48))
    cb = _cb(num_blocks=30, max_batch_tokens=512)
    _batch(model, prompts, 80, cb)
    assert any(offloads)  # the full cache had to make room
    offloads.clear()
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        want = [_alone(model, p, 80) for p in prompts]
        assert _batch(model, prompts, 80, cb) == want
        stats = handle.batching_stats()
    assert not any(offloads)
    assert stats["peak_blocks"] <= math.ceil((BUDGET + WINDOW) / PAGE) and stats["blocks_freed"] > 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_forked_requests_start_from_their_parents_queries(family):
    """`num_return_sequences=3` (transformers forks a request after its prompt, copying its blocks): each child
    evicts from the parent's queries, so with greedy sampling all three equal the request alone (with sliding
    layers too: each child's ring is its own copy)."""
    model = _model() if family == "llama" else sliding_models.tiny(sliding_models.sliding_config(family, 12)).double()
    prompts = _prompts((20, 45))
    config = GenerationConfig(max_new_tokens=40, do_sample=True, top_k=1, eos_token_id=-1, pad_token_id=0,
                              num_return_sequences=3)  # fmt: skip
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=3):
        want = [_alone(model, p, 40) for p in prompts]
        out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=_cb())
    for i, tokens in enumerate(want):
        children = [out[f"req_{i}"], out[f"req_{i}__child#0"], out[f"req_{i}__child#1"]]
        assert [c.generated_tokens for c in children] == [tokens] * 3


def test_no_warning_and_the_patch_stays_while_a_manager_runs():
    """The batched path evicts, so it does not warn; `unpatch` is refused while a manager's thread runs (a second
    `start` of a running manager takes no second hold) and works once it ends; the unpatched model's batched tokens
    are then the full cache's again."""
    model = _model()
    prompts = _prompts((20, 45))
    full = _batch(model, prompts, 30)
    handle = vasepatch.patch(model, budget=BUDGET, window=WINDOW, seed=0)
    want = [_alone(model, p, 30) for p in prompts]
    with warnings.catch_warnings(record=True) as caught:  # the manager's thread warns into the same list
        warnings.simplefilter("always")
        assert _batch(model, prompts, 30) == want != full
    assert not [w for w in caught if issubclass(w.category, NoEvictionWarning)]
    manager = model.init_continuous_batching(generation_config=_greedy(30), continuous_batching_config=_cb())
    manager.start()
    try:
        manager.start()  # already running: transformers warns and starts nothing
        with pytest.raises(ModelInUseError, match="continuous-batching manager"):
            vasepatch.unpatch(model)
    finally:
        manager.stop(block=True, timeout=60)
    assert handle.active
    vasepatch.unpatch(model)
    assert _batch(model, prompts, 30) == full


def test_outside_the_supported_releases_the_batched_path_warns_that_it_evicts_nothing(monkeypatch):
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):  # seen there with transformers 5.22.2
        pytest.skip("before 5.24 continuous batching gives the decoder stack no cache keyword the warning reads")
    model = _model()
    prompts = _prompts((20, 45))
    full = _batch(model, prompts, 30)
    monkeypatch.setattr(patching, "evicts_in_continuous_batching", lambda: False)
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0):
        assert "init_continuous_batching" not in model.__dict__
        with pytest.warns(NoEvictionWarning, match="PagedAttentionCache"):
            assert _batch(model, prompts, 30) == full


def test_a_manager_cached_before_the_patch_is_refused_until_destroyed():
    """A persistent manager kept from before the patch has settings eviction cannot take (prefix sharing on):
    refused by name; once destroyed, a new one evicts. One kept by the patch itself is reused."""
    model = _model()
    prompts = _prompts((20, 45))
    model.generate_batch(prompts, generation_config=_greedy(10), continuous_batching_config=_cb(),
                         persistent_manager=True)  # fmt: skip
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        with pytest.raises(ValueError, match=r"destroy_cached_continuous_batching_manager\(\) first"):
            _batch(model, prompts, 30)
        model.destroy_cached_continuous_batching_manager()
        want = [_alone(model, p, 30) for p in prompts]
        out = model.generate_batch(prompts, generation_config=_greedy(30), continuous_batching_config=_cb(),
                                   persistent_manager=True)  # fmt: skip
        assert [out[f"req_{i}"].generated_tokens for i in range(2)] == want
        assert _batch(model, prompts, 30) == want  # the patch's own cached manager, reused
        assert handle.batching_stats()["evictions"] > 0
        model.destroy_cached_continuous_batching_manager()


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_sliding_window_layers_stay_as_the_model_defines_them(family):
    """Full-attention layers evict, sliding ones keep exactly their window in transformers' ring (which reads true
    positions after an eviction): each request's tokens are those of `generate` alone, whose sliding layers also
    keep exactly their window (window <= budget)."""
    model = sliding_models.tiny(sliding_models.sliding_config(family, window=12)).double()
    prompts = _prompts([5, 21, 44])
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        want = [_alone(model, p, 40) for p in prompts]
        assert _arriving(model, prompts, 40, _cb()) == want
        stats = handle.batching_stats()
        assert stats["evictions"] > 0 and stats["peak_blocks"] <= math.ceil((BUDGET + WINDOW) / PAGE)
    with vasepatch.patched(model, budget=BUDGET + 40, window=WINDOW, seed=0):  # nothing evicted: the model's tokens
        assert _batch(model, prompts, 40) == [_alone(model, p, 40) for p in prompts]


@pytest.mark.parametrize(
    ("family", "settings", "cb", "message"),
    [
        ("mistral", {"sliding_window": 16}, {}, r"layers are \['sliding_attention'\]"),
        ("gemma3", {"window": 48}, {}, r"window of 48 tokens, more than budget=32.*a budget >= 48"),
        ("llama", {}, {"use_async_batching": True}, r"use_async_batching=True"),
        ("llama", {}, {"use_cuda_graph": True}, r"use_cuda_graph=True"),
        ("llama", {}, {"default_compile_level": 1}, r"compiled continuous batching is not supported"),
        ("llama", {"attn": "flash_attention_2"}, {}, r"runs 'flash_attention_2'.*attn_implementation='sdpa'"),
    ],
    ids=["all-sliding", "sliding-window-over-budget", "async", "cuda-graphs", "compiled", "flash"],
)
def test_what_it_cannot_evict_is_refused_by_name_before_any_work(family, settings, cb, message):
    flash = settings.pop("attn", None)
    if family == "gemma3":
        model = sliding_models.tiny(sliding_models.sliding_config(family, **settings)).double()
    else:
        model = _model(family, **settings)
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW):
        if flash:  # no flash kernel on this machine: the config names it, as a model loaded with one does
            model.config._attn_implementation_internal = flash
        with pytest.raises(ValueError, match=f"vasepatch cannot evict inside this continuous batching: .*{message}"):
            model.init_continuous_batching(generation_config=_greedy(10), continuous_batching_config=_cb(**cb))
        assert getattr(model, "_cached_continuous_batching_manager", None) is None
