"""torch.compile: fullgraph, one decode graph across evictions, same tokens as eager.

Both of transformers' routes are covered: compiling `model.forward` by hand, and
`generate()` compiling the decode step itself because the cache is compileable.
Graphs and graph breaks are counted with dynamo's own counters.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import CompileConfig

import vasepatch
from tests.conftest import ragged_batch
from tests.tiny_models import VOCAB

# prompt width 12, budget 16, window 4: capacity 20; 48 new tokens -> 10 eviction rounds
BUDGET, WINDOW, NEW_TOKENS = 16, 4, 48


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(**overrides):
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7, 3))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0) | overrides


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> dict:
    return dict(counters["graph_break"])


@pytest.mark.timeout(600)
def test_compiled_forward_fullgraph_inductor_matches_eager(make_model):
    """`model.forward = torch.compile(model.forward, fullgraph=True)`: one graph for the
    prefill, one for every decode step (plain or evicting), identical greedy tokens."""
    model = make_model("qwen3")
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        eager = model.generate(**_inputs(do_sample=False))
        eager_evictions = handle.stats()["evictions"]
        assert eager_evictions >= 4

        model.forward = torch.compile(model.forward, fullgraph=True)
        try:
            compiled = model.generate(**_inputs(do_sample=False))
            assert handle.stats()["evictions"] == eager_evictions
            assert _breaks() == {}
            assert _graphs() == 2  # prefill + decode; evicting steps reuse the decode graph
            # a second generation (fresh cache, same shapes) compiles nothing new
            again = model.generate(**_inputs(do_sample=False))
            assert _graphs() == 2 and not counters["recompiles"]
        finally:
            del model.forward
    assert torch.equal(compiled, eager) and torch.equal(again, eager)


def _auto_compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # generate only auto-compiles on accelerators otherwise
    return config


def test_generate_auto_compiles_the_decode_step(make_model):
    """generate's own route: the cache reports `is_compileable`, so generate compiles the
    decode step (one graph through every eviction); the prefill stays eager."""
    model = make_model("llama")
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        assert handle.new_cache().is_compileable
        eager = model.generate(**_inputs(do_sample=False))
        counters.clear()
        compiled = model.generate(**_inputs(do_sample=False), compile_config=_auto_compile_config())
        assert handle.stats()["evictions"] >= 4
        assert _graphs() == 1 and _breaks() == {}
    assert torch.equal(compiled, eager)
    assert not hasattr(model, "_compiled_call")  # the compiled call lived on the patch, now gone


def test_generate_compile_route_with_chunked_prefill_and_the_full_mode(make_model):
    """On an accelerator generate compiles every prefill chunk too: chunks run eagerly
    (a chunk may need the overflow path, which a static graph cannot take), decode steps
    compiled. The never-evicting mode grows its buffer, so it reports not compileable
    and generate keeps it eager."""
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(40, 23, 9))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        eager = model.generate(**kw, prefill_chunk_size=8)
        counters.clear()
        compiled = model.generate(**kw, prefill_chunk_size=8, compile_config=_auto_compile_config())
        assert handle.stats()["capacity"] == BUDGET + WINDOW and handle.stats()["evictions"] >= 6
        assert _graphs() == 1 and _breaks() == {}
        full = handle.new_cache(vasepatch.VaSEConfig(budget=BUDGET, window=WINDOW, policy="full"))
        assert not full.is_compileable
        counters.clear()
        grown = model.generate(**kw, compile_config=_auto_compile_config(), **{handle.cache_keyword: full})
        assert _graphs() == 0 and full.stats()["capacity"] >= 40 + 24
    assert torch.equal(compiled, eager)
    with torch.no_grad():
        assert torch.equal(grown, model.generate(**kw))  # full mode == the unpatched model


def test_compiled_sampling_is_seeded_and_matches_eager(make_model):
    """Sampling (tokens and VaSE's stochastic eviction) is reproducible from the seeds."""
    model = make_model("qwen2")

    def sample():
        torch.manual_seed(123)
        return model.generate(**_inputs(do_sample=True, top_k=0))

    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=7):
        eager = sample()
        model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        try:
            first, second = sample(), sample()
        finally:
            del model.forward
    assert torch.equal(first, eager) and torch.equal(second, eager)
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=8):
        other_seed = sample()  # same global RNG, another eviction seed: the seed must matter
    assert not torch.equal(other_seed, eager)


def test_compiled_step_defers_bookkeeping_to_the_forward_hook(make_model):
    """Inside the graph the cache touches only tensors; host counters and eviction run
    after the forward, so `stats()` and `tokens_until_eviction` stay exact."""
    model = make_model("mistral")
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7, 3))
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        kw = handle.cache_keyword
        eager_cache, compiled_cache = handle.new_cache(), handle.new_cache()
        compiled_forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        token = ids[:, -1:]
        takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{kw: eager_cache})
            model(input_ids=ids, attention_mask=mask, **{kw: compiled_cache})
            for step in range(4 * WINDOW + 1):
                pos = ids.shape[1] + step
                full = torch.cat([mask, torch.ones(3, step + 1, dtype=mask.dtype)], dim=1)
                position_ids = full.long().cumsum(-1)[:, -1:] - 1
                args = dict(input_ids=token, attention_mask=full, position_ids=position_ids)
                if takes_cache_position:  # older 5.x releases derive it from the cache length otherwise
                    args["cache_position"] = torch.tensor([pos])
                a = model(**args, **{kw: eager_cache}).logits
                model.forward = compiled_forward  # through __call__, so the hook runs
                try:
                    b = model(**args, **{kw: compiled_cache}).logits
                finally:
                    del model.forward
                assert torch.allclose(a, b, atol=1e-5), step
                assert compiled_cache.stats() == eager_cache.stats(), step
                assert compiled_cache.tokens_until_eviction() == eager_cache.tokens_until_eviction()
                assert compiled_cache.get_seq_length() == pos + 1
                token = a.argmax(-1)
    assert eager_cache.stats()["evictions"] >= 3
