"""Grouped attention kernels against transformers' repeat-KV formulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vasepatch.integration.kernels import causal_padding_mask, grouped_attention


def _reference(query, key, value, mask, scaling):
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    m = mask.repeat_interleave(groups, dim=1) if mask.shape[1] > 1 else mask
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=m, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize(("hq", "hkv", "q_len"), [(4, 2, 1), (4, 4, 5), (6, 2, 3), (3, 1, 1)])
def test_grouped_equals_repeat_kv(kernel, hq, hkv, q_len):
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 11, 8
    query, key, value = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, q_len), (hkv, s), (hkv, s)))
    mask = torch.rand(b, hkv, q_len, s, generator=g) > 0.4
    mask[..., 0] = True  # no empty rows
    out = grouped_attention(query, key, value, mask, 0.3, kernel)
    assert out.shape == (b, q_len, hq, d)
    assert torch.allclose(out, _reference(query, key, value, mask, 0.3), atol=1e-6)


def test_unknown_kernel():
    x = torch.zeros(1, 1, 1, 4)
    with pytest.raises(ValueError, match="kernel"):
        grouped_attention(x, x, x, torch.ones(1, 1, 1, 1, dtype=torch.bool), 1.0, "flash")


def test_causal_padding_mask():
    padding = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    m = causal_padding_mask(padding, q_len=2, kv_len=4, device=torch.device("cpu"))
    assert m.shape == (2, 1, 2, 4)
    assert m[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert m[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    unpadded = causal_padding_mask(None, q_len=3, kv_len=3, device=torch.device("cpu"))
    assert torch.equal(unpadded[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())
