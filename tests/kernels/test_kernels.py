"""Grouped attention kernels against transformers' repeat-KV formulation, and against the backends' dense
references on the masks the `sdpa`/`eager` backends serve (a contiguous slot range per row and KV head; a
left-padded causal prompt)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import reference_kernels as ref
from vasepatch.kernels.grouped import causal_padding_mask, grouped_attention


def _reference(query, key, value, mask, scaling):
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    m = mask.repeat_interleave(groups, dim=1) if mask.shape[1] > 1 else mask
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=m, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(("hq", "hkv", "q_len"), [(4, 2, 1), (4, 4, 5), (6, 2, 3), (3, 1, 1)])
def test_grouped_equals_repeat_kv(backend, hq, hkv, q_len):
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 11, 8
    query, key, value = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, q_len), (hkv, s), (hkv, s)))
    mask = torch.rand(b, hkv, q_len, s, generator=g) > 0.4
    mask[..., 0] = True  # no empty rows
    out = grouped_attention(query, key, value, mask, 0.3, backend)
    assert out.shape == (b, q_len, hq, d)
    assert torch.allclose(out, _reference(query, key, value, mask, 0.3), atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_grouped_decode_over_slot_ranges_matches_the_reference(backend):
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, cap, d = 3, 6, 2, 10, 8
    query = torch.randn(b, hq, 1, d, generator=g)
    keys, values = torch.randn(b, hkv, cap, d, generator=g), torch.randn(b, hkv, cap, d, generator=g)
    end = torch.tensor([10, 7, 4])
    start = torch.tensor([[0, 3], [6, 2], [1, 3]])  # ragged per row and KV head, each range non-empty
    slots = torch.arange(cap)
    mask = ((slots >= start[..., None]) & (slots < end[:, None, None])).unsqueeze(2)
    out = grouped_attention(query, keys, values, mask, 0.3, backend)
    assert torch.allclose(out, ref.masked_decode(query, keys, values, start, end, 0.3), atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_grouped_prefill_with_padding_matches_the_reference(backend):
    g = torch.Generator().manual_seed(2)
    b, hq, hkv, q_len, d = 3, 4, 2, 6, 8
    query = torch.randn(b, hq, q_len, d, generator=g)
    key, value = torch.randn(b, hkv, q_len, d, generator=g), torch.randn(b, hkv, q_len, d, generator=g)
    padding = torch.arange(q_len)[None, :] >= torch.tensor([0, 2, 5])[:, None]  # left padding
    mask = causal_padding_mask(padding, q_len, q_len, torch.device("cpu"))
    out = grouped_attention(query, key, value, mask, 0.3, backend)
    expected = ref.masked_prefill(query, key, value, padding, 0.3)
    assert torch.allclose(out[padding], expected[padding], atol=1e-6)  # padding rows: unspecified here


def test_unknown_backend():
    x = torch.zeros(1, 1, 1, 4)
    with pytest.raises(ValueError, match=r"backend must be one of \('sdpa', 'eager'\), got 'flash'"):
        grouped_attention(x, x, x, torch.ones(1, 1, 1, 1, dtype=torch.bool), 1.0, "flash")


def test_causal_padding_mask():
    padding = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    m = causal_padding_mask(padding, q_len=2, kv_len=4, device=torch.device("cpu"))
    assert m.shape == (2, 1, 2, 4)
    assert m[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert m[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    unpadded = causal_padding_mask(None, q_len=3, kv_len=3, device=torch.device("cpu"))
    assert torch.equal(unpadded[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())
