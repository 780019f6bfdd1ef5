"""Naive CPU stand-ins for the CUDA varlen kernels, with the same call signatures.

`varlen_attn` mirrors `torch.nn.attention.varlen.varlen_attn` (torch 2.12+ API),
`flash_attn_varlen_func` and `flash_attn_with_kvcache` mirror flash-attn 2.x
(`flash_attn/flash_attn_interface.py`). Each loops over the sequences with a
plain fp32 softmax and follows the documented semantics the backends rely on:

* keys of varlen sequence `i` are `key[cu_k[i] : cu_k[i + 1]]`, or
  `key[cu_k[i] : cu_k[i] + seqused_k[i]]` when `seqused_k` is given;
* `flash_attn_with_kvcache` row `b` attends to `k_cache[b, cache_leftpad[b] : cache_seqlens[b]]`
  (FlashAttention-2 `BlockInfo`: the key offset moves by `leftpad_k`, the length
  is `cache_seqlens - leftpad_k`);
* causal masks align to the bottom right (query `r` of `Lq` sees key `j` iff
  `j <= r + Lk - Lq`), rows with nothing to attend (and sequences with no keys)
  give zeros, GQA maps query head `h` to KV head `h // (Hq / Hkv)`.

They also check what the CUDA kernels check (int32 offsets, contiguous last
dimension) and what they silently trust (`max_q`/`max_k` bounding every
sequence), so the tests catch packing bugs the GPU would turn into garbage.
`varlen_attn` runs through a registered custom op, opaque to `torch.compile`
like the real one. For tests and `benchmarks/gpu_check.py --allow-cpu` only.
"""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: `q [Lq, Hq, D]`, `k`/`v` `[Lk, Hkv, D]` -> `[Lq, Hq, D]` (fp32 math, 0 where none is seen)."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    out = torch.zeros(lq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    if lq == 0 or lk == 0:
        return out
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads {hkv}")
    kk = k.float().repeat_interleave(hq // hkv, dim=1)
    vv = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        rows = torch.arange(lq, device=q.device)[:, None]
        allowed = torch.arange(lk, device=q.device)[None, :] <= rows + (lk - lq)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    probs = torch.where(allowed.any(-1)[:, None], probs, torch.zeros((), device=q.device))
    return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)


def _check_offsets(name: str, cu: torch.Tensor) -> list[int]:
    if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
    return cu.tolist()


def _check_last_dim(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous last dimension")


def _varlen_loop(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int],
    used: list[int] | None,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seq_q has {len(cu_q)} entries, cu_seq_k {len(cu_k)}")
    out = torch.zeros(query.shape[0], query.shape[1], value.shape[-1], dtype=query.dtype, device=query.device)
    for i in range(len(cu_q) - 1):
        q0, q1 = cu_q[i], cu_q[i + 1]
        k0 = cu_k[i]
        k1 = k0 + used[i] if used is not None else cu_k[i + 1]
        if not (0 <= q0 <= q1 <= query.shape[0]) or not (0 <= k0 <= k1 <= key.shape[0]):
            raise ValueError(f"sequence {i}: queries [{q0}, {q1}) keys [{k0}, {k1}) fall outside the packed tensors")
        if q1 - q0 > max_q or k1 - k0 > max_k:
            raise ValueError(f"sequence {i}: lengths ({q1 - q0}, {k1 - k0}) exceed max_q={max_q}, max_k={max_k}")
        out[q0:q1] = attend(query[q0:q1], key[k0:k1], value[k0:k1], scale, causal)
    return out


@torch.library.custom_op("vasepatch::reference_varlen_attn", mutates_args=())
def _reference_varlen_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
    seqused_k: torch.Tensor | None,
) -> torch.Tensor:
    used = None if seqused_k is None else _check_offsets("seqused_k", seqused_k)
    cu_q, cu_k = _check_offsets("cu_seq_q", cu_seq_q), _check_offsets("cu_seq_k", cu_seq_k)
    if used is not None and len(used) != len(cu_q) - 1:
        raise ValueError(f"seqused_k has {len(used)} entries for {len(cu_q) - 1} sequences")
    return _varlen_loop(query, key, value, cu_q, cu_k, used, max_q, max_k, scale, causal)


@_reference_varlen_op.register_fake
def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, causal, seqused_k):
    return query.new_empty(query.shape[0], query.shape[1], value.shape[-1])


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU stand-in for `torch.nn.attention.varlen.varlen_attn`: `[T_q, Hq, D]` out."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("query, key and value must be [tokens, heads, head_dim]")
    _check_last_dim(query=query, key=key, value=value)
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not enable_gqa:
        raise ValueError(f"query has {hq} heads and key/value {hkv}: pass enable_gqa=True")
    if tuple(window_size) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"the reference supports full or causal attention, not window_size={window_size}")
    causal = tuple(window_size) == (-1, 0)
    s = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.vasepatch.reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, s, causal, seqused_k
    )


def _unsupported(**options: object) -> None:
    for name, value in options.items():
        if value:
            raise NotImplementedError(f"the reference kernel does not implement {name}")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU stand-in for `flash_attn.flash_attn_varlen_func` (GQA native): `[T_q, Hq, D]` out."""
    _unsupported(
        dropout_p=dropout_p,
        window_size=tuple(window_size) != (-1, -1),
        softcap=softcap,
        alibi_slopes=alibi_slopes is not None,
        return_attn_probs=return_attn_probs,
        block_table=block_table is not None,
    )
    _check_last_dim(q=q, k=k, v=v)
    cu_q, cu_k = _check_offsets("cu_seqlens_q", cu_seqlens_q), _check_offsets("cu_seqlens_k", cu_seqlens_k)
    s = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _varlen_loop(q, k, v, cu_q, cu_k, None, max_seqlen_q, max_seqlen_k, s, causal)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor:
    """CPU stand-in for `flash_attn.flash_attn_with_kvcache` without appending: `[B, Lq, H, D]` out.

    Row `b` attends to `k_cache[b, cache_leftpad[b] : cache_seqlens[b]]`.
    """
    _unsupported(
        k=k is not None or v is not None,
        rotary=rotary_cos is not None or rotary_sin is not None,
        cache_batch_idx=cache_batch_idx is not None,
        block_table=block_table is not None,
        window_size=tuple(window_size) != (-1, -1),
        softcap=softcap,
        alibi_slopes=alibi_slopes is not None,
        return_softmax_lse=return_softmax_lse,
    )
    _check_last_dim(k_cache=k_cache, v_cache=v_cache)
    batch, seqlen = q.shape[0], k_cache.shape[1]
    if isinstance(cache_seqlens, torch.Tensor):
        ends = _check_offsets("cache_seqlens", cache_seqlens)
    else:
        ends = [seqlen if cache_seqlens is None else int(cache_seqlens)] * batch
    lefts = [0] * batch if cache_leftpad is None else _check_offsets("cache_leftpad", cache_leftpad)
    if len(ends) != batch or len(lefts) != batch:
        raise ValueError(f"cache_seqlens/cache_leftpad must have {batch} entries")
    s = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty(*q.shape[:3], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    for b in range(batch):
        if not 0 <= lefts[b] <= ends[b] <= seqlen:
            raise ValueError(f"row {b}: cache range [{lefts[b]}, {ends[b]}) is outside [0, {seqlen}]")
        out[b] = attend(q[b], k_cache[b, lefts[b] : ends[b]], v_cache[b, lefts[b] : ends[b]], s, causal)
    return out
