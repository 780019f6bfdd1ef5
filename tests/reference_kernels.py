"""Naive reference kernels for the attention backend tests (and `benchmarks/gpu_check.py --allow-cpu`).

CPU stand-ins for the CUDA varlen kernels, with the same call signatures:
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
`varlen_attn` runs through a custom op of its own, opaque to `torch.compile`
like the real one; importing this module also registers `flash_attn_with_kvcache`
as the CPU kernel of the backends' `vasepatch::flash_attn_kvcache` op (which has
only a CUDA kernel in production).

`masked_decode` and `masked_prefill` are the dense references the varlen paths
are compared with: the backends' decode/prefill contract written as an explicit
fp32 masked softmax over the padded tensors, with the mask built from
`start`/`end` or from the padding.
"""

from __future__ import annotations

import torch

from vasepatch.kernels.backends import flash_attn as flash_backend


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


@torch.library.custom_op("vasepatch_tests::reference_varlen_attn", mutates_args=())
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
    return torch.ops.vasepatch_tests.reference_varlen_attn(
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


@torch.library.register_kernel(flash_backend.OP_NAME, "cpu")
def _flash_kvcache_cpu(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale):
    """The CPU kernel of the backends' `vasepatch::flash_attn_kvcache` op: the stand-in above."""
    return flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, softmax_scale=softmax_scale
    )


# --------------------------------------------------------------------------- dense masked references


def _masked_softmax_attention(q, k, v, allowed, scale):
    """`q [..., Lq, D]`, `k`/`v` `[..., Lk, D]`, `allowed [..., Lq, Lk]` bool: fp32 softmax over the
    allowed keys, zeros for a query that may see none."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    probs = torch.where(allowed.any(-1, keepdim=True), probs, torch.zeros((), device=q.device))
    return torch.matmul(probs, v.float())


def masked_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    end: int | torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The decode contract, densely: `query [B, Hq, 1, D]`, `keys`/`values` `[B, Hkv, C, D]`; query head `h` of
    row `b` attends to slots `[start[b, h // G], end_b)` of its KV head. `[B, 1, Hq, D]` out, in `query`'s dtype."""
    b, hq, _, d = query.shape
    groups, cap = hq // keys.shape[1], keys.shape[2]
    ends = end.reshape(-1).expand(b) if isinstance(end, torch.Tensor) else torch.full((b,), int(end))
    slots = torch.arange(cap, device=query.device)
    allowed = (slots >= start[..., None]) & (slots < ends.to(query.device)[:, None, None])  # [B, Hkv, C]
    allowed = allowed.repeat_interleave(groups, dim=1)[:, :, None, :]  # [B, Hq, 1, C]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (keys, values))
    s = d**-0.5 if scale is None else float(scale)
    return _masked_softmax_attention(query, k, v, allowed, s).transpose(1, 2).to(query.dtype)


def masked_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """The prefill contract, densely: `query [B, Hq, Q, D]`, `key`/`value` `[B, Hkv, Q, D]`, `padding [B, Q]`
    (True = real token) or None; token `t` attends to the real tokens `<= t`, padding rows are zeros.
    `[B, Q, Hq, D]` out, in `query`'s dtype."""
    b, hq, q_len, d = query.shape
    groups = hq // key.shape[1]
    allowed = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()[None, None]
    real = torch.ones(b, q_len, dtype=torch.bool, device=query.device) if padding is None else padding.bool()
    allowed = allowed & real[:, None, None, :]  # [B, 1, Q, Q]: causal, padding keys hidden
    k, v = (x.repeat_interleave(groups, dim=1) for x in (key, value))
    s = d**-0.5 if scale is None else float(scale)
    out = _masked_softmax_attention(query, k, v, allowed, s).transpose(1, 2)  # [B, Q, Hq, D]
    return out.masked_fill(~real[:, :, None, None], 0.0).to(query.dtype)
