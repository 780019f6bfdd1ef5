"""Logit soft-capping (Gemma2's `softcap=`) and learned attention sinks (gpt-oss's `s_aux=`):
what a model's attention module passes reaches the vasepatch kernel and is applied, on every
backend (the ones that cannot do it route to the eager math path), never ignored."""

from __future__ import annotations

import pytest
import torch

import vasepatch
from tests.conftest import greedy_with_logits, max_logit_diff, ragged_batch
from tests.sliding_models import VOCAB, patch, sliding_config, tiny
from vasepatch import policies
from vasepatch.cache import VaSELayer
from vasepatch.cache.plan import LayerPlan
from vasepatch.config import VaSEConfig
from vasepatch.integration.attention import attention_step
from vasepatch.kernels.grouped import grouped_attention

LENGTHS = (30, 21, 9)


def _model(family: str, window: int = 8):
    """A tiny eager model whose attention logits are large enough for soft-capping (at 1.0) and
    sinks (spread over [-1, 2]) to matter."""
    overrides = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": None} if family == "gemma2" else {}
    model = tiny(sliding_config(family, window, **overrides), "eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            if family == "gpt_oss":
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    return model


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("backend", [None, "sdpa"])
def test_generate_parity_ragged(family, backend):
    """Nothing evicted in the global layer, the sliding one cut to its window: parity with the
    unpatched model, whether the kernel is eager (the model's) or sdpa (routed to the math path)."""
    model = _model(family)
    ids, mask = ragged_batch(VOCAB, lengths=LENGTHS)
    expected = greedy_with_logits(model, ids, mask, 8)
    handle = patch(model, budget=64, window=4, attn_backend=backend)
    try:
        out = greedy_with_logits(model, ids, mask, 8, past_key_values=handle.new_cache())
        if backend is None:  # the eager kernel's weights path (output_attentions) applies them too
            weights = model(ids, attention_mask=mask, past_key_values=handle.new_cache(), output_attentions=True)
    finally:
        vasepatch.unpatch(model)
    assert max_logit_diff(expected, out) <= 1e-5
    if backend is None:
        real, reference = mask.bool(), model(input_ids=ids, attention_mask=mask).logits
        assert (weights.logits[real] - reference[real]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_ignoring_them_would_be_caught(family):
    """The tiny configs make soft-capping / sinks change the logits, so the parity above can fail."""
    model = _model(family)
    ids, mask = ragged_batch(VOCAB, lengths=LENGTHS)
    base = model(input_ids=ids, attention_mask=mask).logits
    if family == "gemma2":
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
    else:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # a sink of weight ~0: none
    changed = model(input_ids=ids, attention_mask=mask).logits
    assert (base - changed)[mask.bool()].abs().max().item() > 1e-3


def _naive(q, k, v, mask, scale, softcap=None, sinks=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask.repeat_interleave(g, 1), float("-inf"))
    if sinks is not None:
        col = sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, col], -1)
    p = s.softmax(-1)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_kernel_matches_naive(q_len, kernel):
    g = torch.Generator().manual_seed(0)
    b, hkv, groups, s, d = 2, 2, 3, 9, 8
    q = torch.randn(b, hkv * groups, q_len, d, generator=g) * 3
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    mask = torch.rand(b, hkv, q_len, s, generator=g) > 0.3
    mask[..., 0] = True
    sinks = torch.randn(hkv * groups, generator=g)
    for softcap, sk in ((0.7, None), (None, sinks), (2.0, sinks)):
        got = grouped_attention(q, k, v, mask, 0.3, kernel, softcap=softcap, sink_logits=sk)
        assert torch.allclose(got, _naive(q, k, v, mask, 0.3, softcap, sk), atol=1e-5)
    plain = grouped_attention(q, k, v, mask, 0.3, kernel)
    assert not torch.allclose(plain, grouped_attention(q, k, v, mask, 0.3, kernel, sink_logits=sinks), atol=1e-3)


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
def test_varlen_backends_route_to_the_math_path(backend):
    """On CPU the varlen kernels do not exist: a step with sinks/softcap never reaches them."""
    cfg = VaSEConfig(budget=16, window=4, seed=0)
    layers = [VaSELayer(cfg, policies.for_config(cfg), plan=LayerPlan(0)) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(4, generator=g)
    for n in (7, 1, 1):
        k, v, q = (torch.randn(1, h, n, 8, generator=g) for h in (2, 2, 4))
        out, _ = attention_step(layers[0], q, k, v, None, 0.35, backend, softcap=1.5, sink_logits=sinks)
        expected, _ = attention_step(layers[1], q, k, v, None, 0.35, "eager", softcap=1.5, sink_logits=sinks)
        assert torch.allclose(out, expected, atol=1e-6)
