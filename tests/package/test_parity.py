"""With nothing evicted, a patched model computes what the unpatched model computes."""

from __future__ import annotations

import pytest
import torch

import vasepatch
from tests.conftest import greedy_with_logits, max_logit_diff, ragged_batch
from tests.tiny_models import FAMILIES, VOCAB

TOL = 1e-5
DECODE_STEPS = 72


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_generate_parity_ragged_batch(make_model, family, kv_heads):
    model = make_model(family, kv_heads=kv_heads)
    ids, mask = ragged_batch(VOCAB)
    with torch.no_grad():
        ref = greedy_with_logits(model, ids, mask, DECODE_STEPS)
        with vasepatch.patched(model, budget=256, window=16) as handle:
            out = greedy_with_logits(model, ids, mask, DECODE_STEPS)
    assert handle.stats()["evictions"] == 0
    assert len(out.logits) == DECODE_STEPS
    diff = max_logit_diff(ref, out)
    assert diff <= TOL, f"{family}: max |logit diff| {diff:.3g}"
    assert torch.equal(ref.sequences, out.sequences)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_parity_every_real_position(make_model, family):
    model = make_model(family)
    ids, mask = ragged_batch(VOCAB, lengths=(20, 9, 1, 14))
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        with vasepatch.patched(model, budget=64, window=8) as handle:
            out = model(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: handle.new_cache()}).logits
    real = mask.bool()
    assert (ref[real] - out[real]).abs().max().item() <= TOL


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_kernel_follows_the_model_attention_implementation(make_model, attn):
    model = make_model("qwen3", attn=attn)
    ids, mask = ragged_batch(VOCAB)
    with torch.no_grad():
        ref = greedy_with_logits(model, ids, mask, 16)
        with vasepatch.patched(model, budget=128, window=8):
            assert model.model.layers[0].self_attn.config._vasepatch_backend == attn
            out = greedy_with_logits(model, ids, mask, 16)
    diff = max_logit_diff(ref, out)
    assert diff <= TOL


def test_forward_without_cache_matches(make_model):
    """`use_cache=False` (scoring, training) goes through the plain causal + padding mask."""
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with vasepatch.patched(model, budget=64, window=8):
            out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            no_mask = model(input_ids=ids[:1], use_cache=False).logits
        ref_no_mask = model(input_ids=ids[:1], use_cache=False).logits
    real = mask.bool()
    assert (ref[real] - out[real]).abs().max().item() <= TOL
    assert (ref_no_mask - no_mask).abs().max().item() <= TOL
