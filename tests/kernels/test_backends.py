"""Attention backends on CPU: packing helpers, varlen paths through the reference kernels against a dense
masked softmax, dispatch, compile."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from tests import reference_kernels as ref
from vasepatch.kernels import backends as bk
from vasepatch.kernels.backends import availability
from vasepatch.kernels.varlen import (
    cu_seqlens,
    decode_gaps,
    decode_seqused,
    end_per_row,
    pack_prompt,
    repad,
    unpad,
)

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-5


def _ints(values) -> list[int]:
    return [int(x) for x in values]


# --------------------------------------------------------------------------- packing helpers


def test_cu_seqlens():
    cu = cu_seqlens(torch.tensor([3, 0, 2]))
    assert cu.dtype == torch.int32
    assert _ints(cu) == [0, 3, 3, 5]
    assert _ints(cu_seqlens(torch.zeros(0, dtype=torch.long))) == [0]


def test_end_per_row():
    dev = torch.device("cpu")
    assert _ints(end_per_row(5, 3, dev)) == [5, 5, 5]
    assert _ints(end_per_row(torch.tensor(4), 2, dev)) == [4, 4]
    row = end_per_row(torch.tensor([4, 6]), 2, dev)
    assert row.dtype == torch.int32
    assert _ints(row) == [4, 6]


def test_decode_seqused_hand_case():
    start = torch.tensor([[1, 0], [2, 3]])  # B=2, Hkv=2, C=6: pairs 0..3 live in rows 0, 6, 12, 18
    cu_k, used = decode_seqused(start, 5, capacity=6)
    assert cu_k.dtype == used.dtype == torch.int32
    assert _ints(cu_k) == [1, 6, 14, 21, 24]
    assert _ints(used) == [4, 5, 3, 2]
    _, used = decode_seqused(start, torch.tensor([5, 4]), capacity=6)  # per-row end
    assert _ints(used) == [4, 5, 2, 1]


def test_decode_gaps_hand_case():
    start = torch.tensor([[1, 0], [2, 3]])
    cu_q, cu_k = decode_gaps(start, 5, capacity=6, queries_per_seq=2)
    # gap [0,1) real [1,5) | gap [5,6) real [6,11) | gap [11,14) real [14,17) | gap [17,21) real [21,23)
    assert _ints(cu_k) == [0, 1, 5, 6, 11, 14, 17, 21, 23]
    assert _ints(cu_q) == [0, 0, 2, 2, 4, 4, 6, 6, 8]  # gaps get no queries
    assert cu_q.dtype == cu_k.dtype == torch.int32


def test_pack_prompt_hand_case():
    padding = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    p = pack_prompt(padding)
    assert _ints(p.indices) == [1, 2, 3, 4, 5, 8]
    assert _ints(p.cu_seqlens) == [0, 2, 5, 6]
    assert (p.max_len, p.batch, p.length) == (3, 3, 3)
    x = torch.arange(9.0).reshape(3, 3, 1)
    packed = unpad(x, p)
    assert packed.reshape(-1).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 8.0]
    assert repad(packed, p).reshape(3, 3).tolist() == [[0, 1, 2], [3, 4, 5], [0, 0, 8]]


def test_pack_prompt_without_padding_is_a_view():
    p = pack_prompt(None, batch=2, length=3)
    assert _ints(p.cu_seqlens) == [0, 3, 6]
    assert p.max_len == 3
    x = torch.randn(2, 3, 4, 5)
    assert unpad(x, p).data_ptr() == x.data_ptr()
    assert torch.equal(repad(unpad(x, p), p), x)
    with pytest.raises(ValueError, match="batch and length"):
        pack_prompt(None)


def test_unpad_repad_roundtrip_zeros_padding():
    g = torch.Generator().manual_seed(0)
    padding = torch.rand(4, 7, generator=g) > 0.3
    x = torch.randn(4, 7, 3, 2, generator=g)
    p = pack_prompt(padding)
    assert unpad(x, p).shape == (int(padding.sum()), 3, 2)
    assert torch.equal(repad(unpad(x, p), p), x * padding[:, :, None, None])


# --------------------------------------------------------------------------- random cases


def _decode_case(seed: int, per_row_end: bool = False):
    g = torch.Generator().manual_seed(seed)
    rnd = functools.partial(torch.randint, generator=g)
    b, hkv = int(rnd(1, 4, ())), int(rnd(1, 3, ()))
    groups, d = (1, 2, 4)[seed % 3], (16, 64)[seed % 2]
    cap = int(rnd(4, 25, ()))
    if per_row_end:
        end = rnd(1, cap + 1, (b,))
        start = (torch.rand(b, hkv, generator=g) * end[:, None]).long()  # in [0, end)
    else:
        end = int(rnd(1, cap + 1, ()))
        start = rnd(0, end, (b, hkv))
    query = torch.randn(b, hkv * groups, 1, d, generator=g)
    keys, values = (torch.randn(b, hkv, cap, d, generator=g) for _ in range(2))
    return query, keys, values, start, end


def _prefill_case(seed: int, q_len: int | None = None, padded: bool = True):
    g = torch.Generator().manual_seed(100 + seed)
    b, hkv = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(1, 3, (), generator=g))
    groups, d = (1, 2, 4)[seed % 3], (16, 64)[seed % 2]
    q_len = int(torch.randint(2, 12, (), generator=g)) if q_len is None else q_len
    lengths = torch.randint(1, q_len + 1, (b,), generator=g)
    lengths[0] = q_len  # one full row
    padding = torch.arange(q_len)[None, :] >= (q_len - lengths)[:, None] if padded else None  # left padding
    query = torch.randn(b, hkv * groups, q_len, d, generator=g)
    key, value = (torch.randn(b, hkv, q_len, d, generator=g) for _ in range(2))
    return query, key, value, padding


DECODE_VARIANTS = {
    "torch_varlen/seqused": functools.partial(bk.torch_varlen_decode, kernel=ref.varlen_attn, use_seqused=True),
    "torch_varlen/gaps": functools.partial(bk.torch_varlen_decode, kernel=ref.varlen_attn, use_seqused=False),
    "torch_varlen/auto": functools.partial(bk.torch_varlen_decode, kernel=ref.varlen_attn),
    "flash_attn/reference": functools.partial(bk.flash_attn_decode, kernel=ref.flash_attn_with_kvcache),
    "flash_attn/op": bk.flash_attn_decode,  # default kernel: the custom op, whose CPU kernel is the reference
}

PREFILL_VARIANTS = {
    "torch_varlen": functools.partial(bk.VARLEN["torch_varlen"].prefill, kernel=ref.varlen_attn),
    "flash_attn": functools.partial(bk.VARLEN["flash_attn"].prefill, kernel=ref.flash_attn_varlen_func),
}


@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("per_row_end", [False, True])
def test_decode_matches_reference(variant, seed, per_row_end):
    query, keys, values, start, end = _decode_case(seed, per_row_end)
    scale = 0.7 / query.shape[-1] ** 0.5
    expected = ref.masked_decode(query, keys, values, start, end, scale)
    out = DECODE_VARIANTS[variant](query, keys, values, start, end, scale)
    assert out.shape == (query.shape[0], 1, query.shape[1], query.shape[-1])
    assert torch.allclose(out, expected, atol=ATOL, rtol=0), (out - expected).abs().max()


@pytest.mark.parametrize("per_row_end", [False, True])
def test_masked_decode_reference_is_a_softmax_over_the_range(per_row_end):
    """The decode reference itself: per (b, h) softmax over exactly the slots [start, end)."""
    query, keys, values, start, end = _decode_case(3, per_row_end)
    out = ref.masked_decode(query, keys, values, start, end)
    groups = query.shape[1] // keys.shape[1]
    for b in range(query.shape[0]):
        e = int(end[b]) if per_row_end else end
        for h in range(query.shape[1]):
            s0 = int(start[b, h // groups])
            k, v = keys[b, h // groups, s0:e], values[b, h // groups, s0:e]
            p = torch.softmax(query[b, h, 0] @ k.T / query.shape[-1] ** 0.5, -1)
            assert torch.allclose(out[b, 0, h], p @ v, atol=ATOL)


def test_masked_prefill_reference_is_causal_over_the_real_tokens():
    """The prefill reference itself: token t of a row attends to the row's real tokens <= t; padding gives zeros."""
    query, key, value, padding = _prefill_case(5)
    out = ref.masked_prefill(query, key, value, padding, 0.4)
    groups = query.shape[1] // key.shape[1]
    for b in range(query.shape[0]):
        for t in range(query.shape[2]):
            if not padding[b, t]:
                assert not out[b, t].any()
                continue
            seen = padding[b, : t + 1].nonzero().reshape(-1)
            for h in range(query.shape[1]):
                k, v = key[b, h // groups, seen], value[b, h // groups, seen]
                p = torch.softmax(query[b, h, t] @ k.T * 0.4, -1)
                assert torch.allclose(out[b, t, h], p @ v, atol=ATOL)


@pytest.mark.parametrize("variant", list(PREFILL_VARIANTS))
@pytest.mark.parametrize("seed", range(6))
def test_prefill_matches_reference(variant, seed):
    query, key, value, padding = _prefill_case(seed)
    expected = ref.masked_prefill(query, key, value, padding)
    out = PREFILL_VARIANTS[variant](query, key, value, padding)
    assert out.shape == (query.shape[0], query.shape[2], query.shape[1], query.shape[-1])
    assert torch.allclose(out, expected, atol=ATOL, rtol=0), (out - expected).abs().max()
    assert not out[~padding].any()  # zeros at the padding


@pytest.mark.parametrize("variant", list(PREFILL_VARIANTS))
@pytest.mark.parametrize(("q_len", "padded"), [(1, True), (6, False)])
def test_prefill_edge_cases(variant, q_len, padded):
    query, key, value, padding = _prefill_case(1, q_len=q_len, padded=padded)
    expected = ref.masked_prefill(query, key, value, padding)
    out = PREFILL_VARIANTS[variant](query, key, value, padding, 0.3)
    assert torch.allclose(out, ref.masked_prefill(query, key, value, padding, 0.3), atol=ATOL, rtol=0)
    if not padded:  # plain causal attention
        causal = torch.nn.functional.scaled_dot_product_attention(
            query, *(x.repeat_interleave(query.shape[1] // key.shape[1], 1) for x in (key, value)), is_causal=True
        ).transpose(1, 2)
        assert torch.allclose(expected, causal, atol=ATOL)


def test_prefill_reuses_packing():
    query, key, value, padding = _prefill_case(2)
    packing = pack_prompt(padding)
    out = bk.VARLEN["torch_varlen"].prefill(query, key, value, padding, kernel=ref.varlen_attn, packing=packing)
    assert torch.allclose(out, ref.masked_prefill(query, key, value, padding), atol=ATOL)


# --------------------------------------------------------------------------- torch release compatibility


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature (the first release with varlen_attn): no scale (always D**-0.5), `is_causal`,
    GQA passed straight to FA2."""
    window = (-1, 0) if is_causal else (-1, -1)
    return ref.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window, enable_gqa=True)


def _varlen_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11's signature: `scale` and `window_size`, no `enable_gqa`, no `seqused_k`."""
    kw = {"scale": scale, "window_size": window_size, "enable_gqa": True}
    return ref.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw)


def _varlen_2_12(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.12's signature: adds `enable_gqa` and `seqused_k` (and `block_table`, `num_splits`)."""
    kw = {"scale": scale, "window_size": window_size, "enable_gqa": enable_gqa, "seqused_k": seqused_k}
    return ref.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw)


def _check_varlen_kernel(kernel) -> None:
    query, keys, values, start, end = _decode_case(4)
    out = bk.torch_varlen_decode(query, keys, values, start, end, 0.2, kernel=kernel)
    assert torch.allclose(out, ref.masked_decode(query, keys, values, start, end, 0.2), atol=ATOL)
    query, key, value, padding = _prefill_case(4)
    out = bk.VARLEN["torch_varlen"].prefill(query, key, value, padding, 0.2, kernel=kernel)
    assert torch.allclose(out, ref.masked_prefill(query, key, value, padding, 0.2), atol=ATOL)


@pytest.mark.parametrize(
    ("kernel", "spec"),
    [
        (
            _varlen_2_10,
            bk.VarlenSpec(scale=False, window_size=False, is_causal=True, enable_gqa=False, seqused_k=False),
        ),
        (_varlen_2_11, bk.VarlenSpec(scale=True, window_size=True, is_causal=False, enable_gqa=False, seqused_k=False)),
        (_varlen_2_12, bk.VarlenSpec(scale=True, window_size=True, is_causal=False, enable_gqa=True, seqused_k=True)),
    ],
)
def test_torch_varlen_signatures_by_release(kernel, spec):
    assert bk.varlen_spec(kernel) == spec
    _check_varlen_kernel(kernel)  # 2.10 and 2.11 fall back to the gap sequences for decode


def test_varlen_spec_of_installed_torch():
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    spec = bk.varlen_spec(varlen.varlen_attn)
    assert spec.scale or spec.is_causal
    assert bk.varlen_spec(ref.varlen_attn) == bk.VarlenSpec(True, True, False, True, True)


def test_seqused_skipped_when_autograd_records():
    calls: list[dict] = []

    def spy(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), seqused_k=None):
        calls.append({"seqused_k": seqused_k} if seqused_k is not None else {})
        kw = {"scale": scale, "window_size": window_size, "seqused_k": seqused_k}
        return ref.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw)

    query, keys, values, start, end = _decode_case(0)
    bk.torch_varlen_decode(query, keys, values, start, end, kernel=spy)
    assert "seqused_k" in calls[-1]
    query.requires_grad_(True)
    bk.torch_varlen_decode(query, keys, values, start, end, kernel=spy)
    assert "seqused_k" not in calls[-1]  # torch's seqused_k is inference-only
    with torch.no_grad():
        bk.torch_varlen_decode(query, keys, values, start, end, kernel=spy)
    assert "seqused_k" in calls[-1]


def test_real_torch_varlen_kernel_accepts_the_arguments():
    """The installed torch's `varlen_attn`, run on meta tensors (its fake kernel): names, ranks, dtypes fit."""
    pytest.importorskip("torch.nn.attention.varlen")
    meta = {"device": "meta"}
    query = torch.empty(2, 4, 1, 16, **meta)
    keys = torch.empty(2, 2, 12, 16, **meta)
    start = torch.zeros(2, 2, dtype=torch.long, **meta)
    for use_seqused in (None, False):
        out = bk.torch_varlen_decode(query, keys, keys, start, 9, use_seqused=use_seqused)
        assert out.shape == (2, 1, 4, 16) and out.device.type == "meta"
    key = torch.empty(2, 2, 5, 16, **meta)
    out = bk.VARLEN["torch_varlen"].prefill(torch.empty(2, 4, 5, 16, **meta), key, key, None)
    assert out.shape == (2, 5, 4, 16)


# --------------------------------------------------------------------------- reference kernels


def test_reference_catches_packing_mistakes():
    q = torch.randn(4, 1, 8)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="exceed max_q"):
        ref.varlen_attn(q, q, q, cu, cu, 1, 2)
    with pytest.raises(ValueError, match="int32"):
        ref.varlen_attn(q, q, q, cu.long(), cu, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        ref.varlen_attn(q, q, q, cu, cu, 2, 2, seqused_k=torch.tensor([2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="enable_gqa"):
        ref.varlen_attn(torch.randn(4, 2, 8), q, q, cu, cu, 2, 2)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ref.flash_attn_with_kvcache(q[None], *(torch.randn(1, 8, 1, 6).transpose(1, 3),) * 2)  # [1, 6, 1, 8]


def test_reference_causal_alignment_and_empty_rows():
    """Bottom-right causal alignment; a query that sees nothing gives zeros (FlashAttention's convention)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g)
    out = ref.attend(q, k, v, 0.5, causal=True)  # Lq=3 > Lk=2: query 0 sees nothing, 1 sees key 0, 2 sees both
    assert torch.equal(out[0], torch.zeros(1, 4))
    assert torch.allclose(out[1], v[0], atol=ATOL)
    assert torch.allclose(out[2, 0], torch.softmax(k[:, 0] @ q[2, 0] * 0.5, 0) @ v[:, 0], atol=ATOL)


def test_opcheck_custom_ops():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 1, 2, 8, generator=g)
    k_cache, v_cache = torch.randn(4, 6, 1, 8, generator=g), torch.randn(4, 6, 1, 8, generator=g)
    ends = torch.tensor([6, 5, 3, 4], dtype=torch.int32)
    lefts = torch.tensor([0, 2, 1, 3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.vasepatch.flash_attn_kvcache, (q, k_cache, v_cache, ends, lefts, 0.3))
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 6], dtype=torch.int32)
    used = torch.tensor([3, 2], dtype=torch.int32)
    packed = torch.randn(4, 2, 8, generator=g), torch.randn(6, 1, 8, generator=g), torch.randn(6, 1, 8, generator=g)
    for seqused in (None, used):
        torch.library.opcheck(
            torch.ops.vasepatch_tests.reference_varlen_attn, (*packed, cu_q, cu_k, 2, 3, 0.3, False, seqused)
        )


# --------------------------------------------------------------------------- torch.compile


COMPILED_DECODES = {
    "torch_varlen/seqused": functools.partial(bk.torch_varlen_decode, kernel=ref.varlen_attn, use_seqused=True),
    "torch_varlen/gaps": functools.partial(bk.torch_varlen_decode, kernel=ref.varlen_attn, use_seqused=False),
    "flash_attn/op": bk.flash_attn_decode,
}


@pytest.mark.parametrize("variant", list(COMPILED_DECODES))
@pytest.mark.parametrize("per_row_end", [False, True])
def test_decode_compiles_without_graph_breaks(variant, per_row_end):
    query, keys, values, start, end = _decode_case(1, per_row_end)
    fn = COMPILED_DECODES[variant]
    torch._dynamo.reset()
    counters.clear()
    cc = CompileCounter()
    compiled = torch.compile(lambda q, k, v, s, e: fn(q, k, v, s, e, 0.25), backend=cc, fullgraph=True)
    out = compiled(query, keys, values, start, end)
    assert cc.frame_count == 1
    assert not counters["graph_break"]
    assert torch.allclose(out, ref.masked_decode(query, keys, values, start, end, 0.25), atol=ATOL)


def test_real_torch_varlen_decode_traces_fullgraph():
    pytest.importorskip("torch.nn.attention.varlen")
    meta = {"device": "meta"}
    query, keys = torch.empty(2, 4, 1, 16, **meta), torch.empty(2, 2, 12, 16, **meta)
    start = torch.zeros(2, 2, dtype=torch.long, **meta)
    torch._dynamo.reset()
    counters.clear()
    cc = CompileCounter()
    out = torch.compile(bk.torch_varlen_decode, backend=cc, fullgraph=True)(query, keys, keys, start, 9)
    assert cc.frame_count == 1 and not counters["graph_break"]
    assert out.shape == (2, 1, 4, 16)


# --------------------------------------------------------------------------- dispatch and choice


def test_resolve_backend_on_cpu():
    assert bk.available_backends("cpu") == ["sdpa", "eager"]
    assert bk.resolve_backend(None, "cpu", torch.float32) == "sdpa"
    assert bk.resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert bk.resolve_backend("eager", "cpu", torch.float32) == "eager"
    with pytest.raises(ValueError, match=r"attn_backend='torch_varlen'.*needs a CUDA device"):
        bk.resolve_backend("torch_varlen", "cpu", torch.float16)
    with pytest.raises(ValueError, match=r"attn_backend='flash_attn'.*(not installed|CUDA device)"):
        bk.resolve_backend("flash_attn", "cpu", torch.float16)
    with pytest.raises(ValueError, match=r"attn_backend='flash'.*unknown backend"):
        bk.resolve_backend("flash", "cpu", torch.float16)


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setitem(availability._PACKAGE_PROBLEMS, "flash_attn", None)  # pretend it is installed
    assert bk.unavailable_reason("flash_attn", "cpu") == "flash_attn needs a CUDA device (got cpu)"
    monkeypatch.setitem(availability._PACKAGE_PROBLEMS, "flash_attn", "flash_attn is not installed")
    assert bk.unavailable_reason("flash_attn", "cpu") == "flash_attn is not installed"
    if not torch.cuda.is_available():
        assert "CUDA is not available" in bk.unavailable_reason("torch_varlen", "cuda", torch.bfloat16)


@pytest.fixture
def varlen_available(monkeypatch):
    """Both varlen backends look available on any device (no CUDA here); their kernels are not prepared."""
    for name in bk.VARLEN_BACKENDS:
        monkeypatch.setitem(availability._PACKAGE_PROBLEMS, name, None)
    monkeypatch.setattr(availability, "_cuda_problem", lambda name, device, dtype: None)
    monkeypatch.setattr(availability.torch_varlen, "prepare", lambda: None)
    monkeypatch.setattr(availability.flash_attn, "prepare", lambda: None)


def test_head_dim_problem():
    for d in (8, 64, 128, 256):
        assert bk.head_dim_problem("torch_varlen", d) is None
    for d in (0, 12, 100, 264):
        assert f"head_dim={d}" in bk.head_dim_problem("flash_attn", d)
        assert "[8, 256]" in bk.head_dim_problem("torch_varlen", d)
    assert bk.head_dim_problem("sdpa", 12) is None and bk.head_dim_problem("torch_varlen", None) is None


@pytest.mark.parametrize("head_dim", [12, 264])
def test_auto_falls_back_to_sdpa_for_a_varlen_unfit_head_dim(varlen_available, head_dim):
    assert bk.choose_backend("auto", ["cpu"], torch.bfloat16, 128) == "flash_attn"
    with pytest.warns(UserWarning, match=rf"attn_backend='auto'.*head_dim={head_dim}.*'sdpa'"):
        assert bk.choose_backend("auto", ["cpu"], torch.bfloat16, head_dim) == "sdpa"
    assert bk.available_backends("cpu", torch.bfloat16, head_dim) == ["sdpa", "eager"]


@pytest.mark.parametrize("backend", bk.VARLEN_BACKENDS)
@pytest.mark.parametrize("head_dim", [12, 264])
def test_explicit_varlen_backend_refuses_an_unfit_head_dim(varlen_available, backend, head_dim):
    assert bk.choose_backend(backend, ["cpu"], torch.bfloat16, 64) == backend
    pattern = rf"attn_backend='{backend}'.*head_dim a multiple of 8 in \[8, 256\] \(got head_dim={head_dim}\)"
    with pytest.raises(ValueError, match=pattern):
        bk.choose_backend(backend, ["cpu"], torch.bfloat16, head_dim)
    with pytest.raises(ValueError, match=pattern):
        bk.resolve_backend(backend, "cpu", torch.bfloat16, head_dim)


def test_choose_backend_without_varlen(recwarn):
    assert bk.choose_backend(None, [], torch.float32, 12) == "sdpa"  # no varlen backend here: nothing to warn
    assert bk.choose_backend("eager", ["cpu", torch.device("cpu")], torch.float32, 264) == "eager"
    assert not [w for w in recwarn if "head_dim" in str(w.message)]


def test_one_record_per_varlen_backend():
    """`VARLEN` (the records) and `availability.VARLEN_BACKENDS` (the names) list the same backends, in order."""
    assert tuple(bk.VARLEN) == bk.VARLEN_BACKENDS


def test_dispatch():
    query, keys, values, start, end = _decode_case(2)
    expected = ref.masked_decode(query, keys, values, start, end)
    out = bk.decode_attention("torch_varlen", query, keys, values, start, end, kernel=ref.varlen_attn)
    assert torch.allclose(out, expected, atol=ATOL)
    out = bk.decode_attention("flash_attn", query, keys, values, start, end, kernel=ref.flash_attn_with_kvcache)
    assert torch.allclose(out, expected, atol=ATOL)
    query, key, value, padding = _prefill_case(2)
    expected = ref.masked_prefill(query, key, value, padding)
    out = bk.prefill_attention("flash_attn", query, key, value, padding, kernel=ref.flash_attn_varlen_func)
    assert torch.allclose(out, expected, atol=ATOL)
    out = bk.prefill_attention("torch_varlen", query, key, value, padding, kernel=ref.varlen_attn)
    assert torch.allclose(out, expected, atol=ATOL)
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        bk.decode_attention("flash", query, keys, values, start, end)
    for name in ("sdpa", "eager"):  # they attend with kernels.grouped_attention over the cache's mask
        with pytest.raises(ValueError, match=rf"attn_backend='{name}' has no varlen kernel"):
            bk.decode_attention(name, query, keys, values, start, end)
        with pytest.raises(ValueError, match=rf"attn_backend='{name}' has no varlen kernel"):
            bk.prefill_attention(name, query, key, value, padding)


def test_decode_shape_checks():
    query, keys, values, start, end = _decode_case(0)
    with pytest.raises(ValueError, match="one query per row"):
        bk.flash_attn_decode(torch.cat([query, query], 2), keys, values, start, end, kernel=ref.flash_attn_with_kvcache)
    with pytest.raises(ValueError, match=r"start must be \[B, Hkv\]"):
        bk.torch_varlen_decode(query, keys, values, start[:, :1].expand(-1, 3), end, kernel=ref.varlen_attn)


@pytest.mark.parametrize("head_dim", [12, 264])
def test_patch_checks_head_dim_before_any_work(varlen_available, head_dim):
    """`patch()` itself: "auto" falls back to sdpa with a warning naming head_dim; an explicit varlen
    backend is refused with head_dim and the range named, the model left exactly as it was."""
    import vasepatch
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen3", head_dim=head_dim).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=f"head_dim={head_dim}"), vasepatch.patched(model, budget=16, window=4) as h:
        assert h.attn_backend == "sdpa"
    with pytest.raises(ValueError, match=rf"attn_backend.*head_dim={head_dim}"):
        vasepatch.patch(model, budget=16, window=4, attn_backend="torch_varlen")
    assert not vasepatch.is_patched(model) and "forward" not in model.__dict__
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
