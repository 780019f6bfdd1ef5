"""Attention backends on CUDA: every available varlen backend in bf16 against a dense fp32 masked softmax
(ragged starts, GQA, left padding)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from tests import reference_kernels as ref
from vasepatch.kernels import backends as bk
from vasepatch.kernels.backends import torch_varlen

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPE = torch.bfloat16
TOL = 2e-2
GPU_BACKENDS = bk.VARLEN_BACKENDS


def _require(backend: str) -> None:
    reason = bk.unavailable_reason(backend, "cuda", DTYPE)
    if reason:
        pytest.skip(reason)


def _decode_inputs(hq: int, hkv: int, per_row_end: bool, seed: int = 0, b: int = 4, cap: int = 1040, d: int = 128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"device": "cuda", "generator": g}
    query = torch.randn(b, hq, 1, d, dtype=DTYPE, **kw)
    keys, values = (torch.randn(b, hkv, cap, d, dtype=DTYPE, **kw) for _ in range(2))
    if per_row_end:
        end = torch.randint(1, cap + 1, (b,), **kw)
        start = (torch.rand(b, hkv, **kw) * end[:, None]).long()
    else:
        end = cap - 16
        start = torch.randint(0, end, (b, hkv), **kw)
    start[0, 0] = 0
    return query, keys, values, start, end


def _decoders(backend: str) -> dict[str, functools.partial]:
    fn = bk.VARLEN[backend].decode
    if backend != "torch_varlen":
        return {backend: functools.partial(fn)}
    out = {"gaps": functools.partial(fn, use_seqused=False)}
    if bk.varlen_spec(torch_varlen.default_kernel()).seqused_k:
        out["seqused"] = functools.partial(fn, use_seqused=True)
    return out


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (40, 8), (8, 8), (16, 2)])
@pytest.mark.parametrize("per_row_end", [False, True])
def test_decode_matches_reference_bf16(backend, hq, hkv, per_row_end):
    _require(backend)
    args = _decode_inputs(hq, hkv, per_row_end)
    expected = ref.masked_decode(*args)
    for name, fn in _decoders(backend).items():
        with torch.no_grad():
            out = fn(*args)
        diff = (out.float() - expected.float()).abs().max().item()
        print(f"{backend}/{name} hq={hq} hkv={hkv} per_row_end={per_row_end}: max |diff| {diff:.2e}")
        assert out.shape == expected.shape
        assert diff < TOL, (name, diff)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (8, 8)])
@pytest.mark.parametrize("padded", [True, False])
def test_prefill_matches_reference_bf16(backend, hq, hkv, padded):
    _require(backend)
    g = torch.Generator(device="cuda").manual_seed(1)
    kw = {"device": "cuda", "generator": g}
    b, q_len, d = 4, 300, 128
    lengths = torch.randint(1, q_len + 1, (b,), **kw)
    lengths[0] = q_len
    padding = torch.arange(q_len, device="cuda")[None, :] >= (q_len - lengths)[:, None] if padded else None
    query = torch.randn(b, hq, q_len, d, dtype=DTYPE, **kw)
    key, value = (torch.randn(b, hkv, q_len, d, dtype=DTYPE, **kw) for _ in range(2))
    expected = ref.masked_prefill(query, key, value, padding)
    with torch.no_grad():
        out = bk.VARLEN[backend].prefill(query, key, value, padding)
    diff = (out.float() - expected.float()).abs().max().item()
    print(f"{backend} prefill hq={hq} hkv={hkv} padded={padded}: max |diff| {diff:.2e}")
    assert diff < TOL
    if padded:
        assert not out[~padding].any()


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_decode_compiles_fullgraph_on_cuda(backend):
    _require(backend)
    args = _decode_inputs(32, 8, per_row_end=False)
    torch._dynamo.reset()
    counters.clear()
    cc = CompileCounter()
    with torch.no_grad():
        out = torch.compile(bk.VARLEN[backend].decode, backend=cc, fullgraph=True)(*args)
    assert cc.frame_count == 1 and not counters["graph_break"]
    assert (out.float() - ref.masked_decode(*args).float()).abs().max().item() < TOL


def test_resolve_backend_on_cuda():
    auto = bk.resolve_backend(None, "cuda", DTYPE)
    assert auto == bk.available_backends("cuda", DTYPE)[0]
    assert bk.resolve_backend(None, "cuda", torch.float32) == "sdpa"
    if bk.unavailable_reason("torch_varlen", "cuda") is None:
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            bk.resolve_backend("torch_varlen", "cuda", torch.float32)
