"""The `flash_attn` backend: the flash-attn package (FlashAttention-2, Dao 2023, arXiv 2307.08691).

* Decode: `flash_attn_with_kvcache` on the buffer seen as `[B*Hkv, C, 1, D]` (a
  free view; the kernel only needs a contiguous last dimension), with
  `cache_leftpad = start` and `cache_seqlens = end`: row `b` reads
  `k_cache[b, leftpad : seqlens]` (FA2 `BlockInfo`: key offset `+ leftpad_k`
  rows, length `cache_seqlens - leftpad_k`; flash-attn >= 2.6.1). The G query
  heads of a KV head are the kernel's heads (`q [B*Hkv, 1, G, D]`), so it can
  use its GQA decode path and split-KV heuristics. Nothing is appended
  (`k=v=None`), so the call is pure; it still goes through the custom op
  `vasepatch::flash_attn_kvcache` (a CUDA kernel and a shape-only fake), so
  `torch.compile` sees an opaque op instead of a pybind call.
  `flash_attn_varlen_func` was the other candidate: its public signature has
  no `seqused_k`.
* Prefill: `flash_attn_varlen_func(..., causal=True)` on the unpadded prompt
  tokens (GQA native): `BACKEND.prefill`, through `varlen_call`.

Both take the kernel as an injectable callable with flash-attn's signature;
the op has no CPU kernel here (a test can register one for it).
"""

from __future__ import annotations

import torch

from vasepatch.kernels.backends.common import Kernel, VarlenBackend, decode_shapes, softmax_scale, ungroup_decode
from vasepatch.kernels.varlen import end_per_row

OP_NAME = "vasepatch::flash_attn_kvcache"


@torch.library.custom_op(OP_NAME, mutates_args=(), device_types="cuda")
def _flash_kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cache_leftpad: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """`flash_attn.flash_attn_with_kvcache` without appending, as an op `torch.compile` can hold."""
    from flash_attn import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, softmax_scale=softmax_scale
    )
    return out.contiguous()


@_flash_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale):
    return q.new_empty(*q.shape[:3], v_cache.shape[-1])


def flash_attn_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    cache_leftpad: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """The default decode kernel: `flash_attn_with_kvcache`'s keywords, through `vasepatch::flash_attn_kvcache`."""
    return torch.ops.vasepatch.flash_attn_kvcache(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale)


def default_varlen_kernel() -> Kernel:
    """flash-attn's `flash_attn_varlen_func` (ImportError without the package)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def prepare() -> None:
    """Import the prefill kernel now, so a compiled step never traces the import."""
    default_varlen_kernel()


def flash_attn_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    end: int | torch.Tensor,
    scale: float | None = None,
    *,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """Decode with `flash_attn_with_kvcache(cache_leftpad=start, cache_seqlens=end)`, one batch row per `(b, h_kv)`."""
    b, hq, hkv, cap, d = decode_shapes(query, keys, start)
    kernel = flash_attn_kvcache if kernel is None else kernel
    n, g = b * hkv, hq // hkv
    q = query.reshape(n, 1, g, d)  # batch (b, h_kv), one token, G heads sharing the single KV head
    k_cache = keys.reshape(n, cap, 1, d)  # free views: [B*Hkv, C, 1, D], last dimension contiguous
    v_cache = values.reshape(n, cap, 1, d)
    ends = end_per_row(end, b, query.device)[:, None].expand(b, hkv).reshape(-1).contiguous()
    lefts = start.to(torch.int32).reshape(-1).contiguous()
    out = kernel(q, k_cache, v_cache, cache_seqlens=ends, cache_leftpad=lefts, softmax_scale=softmax_scale(scale, d))
    return ungroup_decode(out, b, hq, d)


def varlen_call(
    kernel: Kernel | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """`flash_attn_varlen_func` (or `kernel`, with its signature) over packed sequences."""
    kernel = default_varlen_kernel() if kernel is None else kernel
    return kernel(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)


BACKEND = VarlenBackend("flash_attn", decode=flash_attn_decode, varlen_call=varlen_call)
