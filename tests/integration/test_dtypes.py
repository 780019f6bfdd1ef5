"""Half precision on CPU: the cache takes the model's dtype (K, V and the query ring), a
bf16/fp16 patched model matches the unpatched one in that dtype, and evictions run."""

from __future__ import annotations

import pytest
import torch

import vasepatch
from tests.conftest import greedy_with_logits, ragged_batch
from tests.tiny_models import VOCAB

DTYPES = [torch.bfloat16, torch.float16]
# Tolerance: one unit in the last place of the dtype at the logits' magnitude (bf16 2**-7,
# fp16 2**-10, relative to the largest logit). Measured on these tiny models: 0 (bit-identical).
REL_TOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10}
STEPS = 8


def _half_model(make_model, family: str, dtype: torch.dtype):
    return make_model(family).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_buffers_take_the_model_dtype_and_evictions_run(make_model, family, dtype):
    model = _half_model(make_model, family, dtype)
    ids, mask = ragged_batch(VOCAB)
    with torch.no_grad(), vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=30,
            do_sample=False,
            pad_token_id=0,
            **{handle.cache_keyword: cache},
        )
    assert cache.stats()["evictions"] >= 5
    for layer in cache.layers:
        assert layer.keys.dtype == dtype and layer.values.dtype == dtype
        assert layer.ring.queries.dtype == dtype
        assert torch.isfinite(layer.keys[layer.valid]).all() and torch.isfinite(layer.values[layer.valid]).all()
    b, hkv, slots, head_dim = cache.layers[0].keys.shape
    assert slots == 16 + 4
    assert cache.stats()["kv_bytes"] == len(cache.layers) * 2 * b * hkv * slots * head_dim * dtype.itemsize


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_parity_with_the_unpatched_model_in_half_precision(make_model, family, dtype):
    model = _half_model(make_model, family, dtype)
    ids, mask = ragged_batch(VOCAB)
    with torch.no_grad():
        ref = greedy_with_logits(model, ids, mask, STEPS)
        with vasepatch.patched(model, budget=256, window=16) as handle:
            out = greedy_with_logits(model, ids, mask, STEPS)
    assert handle.stats()["evictions"] == 0
    scale = max(x.float().abs().max().item() for x in ref.logits)
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(ref.logits, out.logits, strict=True))
    assert diff <= REL_TOL[dtype] * scale, f"max |logit diff| {diff:.3g} vs scale {scale:.3g}"
    assert torch.equal(out.sequences, ref.sequences)
