"""Whole models: a footprint fixed by the budget for any prompt, and transformers' chunked
prefill (`generate(..., prefill_chunk_size=N)`) on a patched model."""

from __future__ import annotations

import pytest
import torch

import vasepatch
from tests.conftest import greedy_with_logits, max_logit_diff, ragged_batch
from tests.tiny_models import FAMILIES, VOCAB

TOL = 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_equals_unchunked_when_nothing_is_evicted(make_model, family, chunk):
    model = make_model(family)
    ids, mask = ragged_batch(VOCAB, lengths=(13, 7, 3))
    with torch.no_grad(), vasepatch.patched(model, budget=64, window=8) as handle:
        ref = greedy_with_logits(model, ids, mask, 24)
        out = greedy_with_logits(model, ids, mask, 24, prefill_chunk_size=chunk)
        assert handle.stats()["evictions"] == 0
    assert torch.equal(ref.sequences, out.sequences)
    assert max_logit_diff(ref, out) <= TOL


class _OccupancyProbe:
    """Records the cache's occupancy after every forward (each prefill chunk, each decode step)."""

    def __init__(self, model, handle):
        self.handle, self.seen = handle, []
        self.hook = model.register_forward_hook(lambda *_: self.seen.append(handle.stats()["occupancy"]))


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
def test_chunked_prefill_of_a_long_prompt_never_exceeds_the_buffer(make_model, chunk):
    model = make_model("qwen3")
    ids, mask = ragged_batch(VOCAB, lengths=(70, 52, 9), seed=1)
    with torch.no_grad(), vasepatch.patched(model, budget=24, window=8, seed=0) as handle:
        probe = _OccupancyProbe(model, handle)
        out = greedy_with_logits(model, ids, mask, 20, prefill_chunk_size=chunk)
        probe.hook.remove()
        stats = handle.stats()
    n_prefill = -(-ids.shape[1] // chunk)
    assert len(probe.seen) == n_prefill + 19
    assert max(probe.seen) <= stats["capacity"] == 24 + 8
    assert stats["kv_bytes"] == 2 * 2 * 3 * 2 * 32 * 16 * 4  # K+V, layers, rows, KV heads, slots, head_dim, fp32
    assert stats["evictions"] > 0 and stats["tokens_seen"] == ids.shape[1] + 19
    assert all(torch.isfinite(x).all() for x in out.logits)


def test_chunked_prefill_with_prefill_keep_is_refused_before_any_work(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(30, 12))
    with vasepatch.patched(model, budget=16, window=4, prefill="keep") as handle:
        with pytest.raises(ValueError, match="prefill_chunk_size cannot be used with prefill='keep'"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, prefill_chunk_size=8, pad_token_id=0)
        assert handle.stats()["generations"] == 0


def test_footprint_is_fixed_by_the_budget_whatever_the_prompt(make_model):
    model = make_model("llama")
    kv = {}
    with torch.no_grad(), vasepatch.patched(model, budget=16, window=4) as handle:
        for n in (5, 60, 300):
            ids, mask = ragged_batch(VOCAB, lengths=(n, max(n // 2, 1)))
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
            kv[n] = (handle.stats()["capacity"], handle.stats()["kv_bytes"])
    assert kv[5] == kv[60] == kv[300] and kv[5][0] == 20


def test_prefill_keep_sizes_the_buffer_by_the_prompt(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(60, 30))
    with torch.no_grad(), vasepatch.patched(model, budget=16, window=4, prefill="keep") as handle:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        stats = handle.stats()
    assert stats["capacity"] == 64 and stats["evictions"] >= 1


def test_compressed_prefill_logits_are_exact(make_model):
    """The prefill attends to the whole prompt even when it is then compressed: the first
    generated token's logits equal the unpatched model's."""
    model = make_model("mistral")
    ids, mask = ragged_batch(VOCAB, lengths=(80, 41, 17))
    with torch.no_grad():
        ref = greedy_with_logits(model, ids, mask, 1)
        with vasepatch.patched(model, budget=16, window=4) as handle:
            out = greedy_with_logits(model, ids, mask, 1)
            assert handle.stats()["evictions"] == 1 and handle.stats()["capacity"] == 20
    assert max_logit_diff(ref, out) <= TOL
