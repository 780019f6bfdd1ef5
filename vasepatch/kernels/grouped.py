"""Attention kernels over a static buffer, grouped by KV head (no K/V repetition).

`query` is `[B, Hq, Q, D]`, `key`/`value` `[B, Hkv, S, D]`, `mask` a boolean
`[B, Hkv or 1, Q, S]` (True = may attend). The query heads of a GQA group are
folded into the query-length axis, so each KV head is read once, whatever the
group size. Returns `[B, Q, Hq, D]`, the layout transformers' attention
modules expect. This runs once per layer and decode step, so it uses plain
views rather than einops (whose per-call parsing costs show up here).

Logit soft-capping (Gemma2: `cap * tanh(scores / cap)` before the mask) and
learned attention sinks (gpt-oss: one extra logit per query head that joins the
softmax and is then dropped) exist only in the eager math path (`grouped_probs`);
`grouped_attention` routes a call that has either to it, whatever `backend` says,
since SDPA can do neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from packaging.version import Version

MASKED_BACKENDS = ("sdpa", "eager")  # the backends that attend here, under the cache's mask
_HAS_GQA = Version(torch.__version__.split("+")[0]) >= Version("2.5")  # SDPA's enable_gqa


def _group(query: torch.Tensor, mask: torch.Tensor | None, h_kv: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[B, Hq, Q, D]` -> `[B, Hkv, G*Q, D]` (rows ordered g-major), mask to match (`None`: none)."""
    b, h_q, q_len, d = query.shape
    g = h_q // h_kv
    q = query.reshape(b, h_kv, g * q_len, d)  # heads h*G..h*G+G-1 share KV head h
    if q_len == 1 or mask is None:  # one mask row per KV head serves its whole group: broadcast it
        return q, mask
    m = mask.unsqueeze(2).expand(mask.shape[0], mask.shape[1], g, q_len, mask.shape[-1])
    return q, m.reshape(mask.shape[0], mask.shape[1], g * q_len, mask.shape[-1])


def _ungroup(out: torch.Tensor, h_q: int) -> torch.Tensor:
    """`[B, Hkv, G*Q, D]` -> `[B, Q, Hq, D]`."""
    b, h_kv, gq, d = out.shape
    return out.reshape(b, h_q, gq * h_kv // h_q, d).transpose(1, 2).contiguous()


def grouped_probs(
    q: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    q_len: int,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities `[B, Hkv, G*Q, S]` of grouped queries `q` (`[B, Hkv, G*Q, D]`,
    from `_group`) over `key` under the grouped `mask`, in the query dtype (softmax in float32).

    `softcap`: logits become `softcap * tanh(logits / softcap)` before the mask. `sink_logits`
    (`[Hq]`): one more logit per query head in the softmax's denominator, dropped after it."""
    scores = torch.matmul(q, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sink_logits is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    b, h_kv, gq, _ = scores.shape
    g = gq // q_len
    sink = sink_logits.to(scores.dtype).reshape(1, h_kv, g, 1, 1).expand(b, h_kv, g, q_len, 1).reshape(b, h_kv, gq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return probs[..., :-1].to(q.dtype)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    backend: str = "sdpa",
    dropout: float = 0.0,
    *,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked softmax attention with GQA by grouping; `backend` is `"sdpa"` or `"eager"`
    (`softcap` or `sink_logits` given: always the eager math path). `mask=None`: every query sees
    every key (a decode step over slots that are all visible)."""
    if backend not in MASKED_BACKENDS:
        raise ValueError(f"backend must be one of {MASKED_BACKENDS}, got {backend!r}")
    q, m = _group(query, mask, key.shape[1])
    if backend == "sdpa" and softcap is None and sink_logits is None:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=m, dropout_p=dropout, scale=scaling)
    else:
        probs = grouped_probs(q, key, m, scaling, query.shape[-2], softcap, sink_logits)
        if dropout:
            probs = F.dropout(probs, p=dropout)
        out = torch.matmul(probs, value)
    return _ungroup(out, query.shape[1])


def eager_attention_with_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    *,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager math path, also returning its weights: `([B, Q, Hq, D], [B, Hq, Q, S])`."""
    b, h_q, q_len, _ = query.shape
    q, m = _group(query, mask, key.shape[1])
    probs = grouped_probs(q, key, m, scaling, q_len, softcap, sink_logits)
    return _ungroup(torch.matmul(probs, value), h_q), probs.reshape(b, h_q, q_len, key.shape[-2])


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal SDPA over one sequence per row (query `[B, Hq, Q, D]`, key/value `[B, Hkv, Q, D]`),
    the step's own tokens: without `padding`, the `is_causal` path, which needs no mask in
    memory; with `padding` (`[B, Q]` bool, True = real token), one `[B, 1, Q, Q]` causal +
    padding mask shared by every head (`causal_padding_mask`). Returns `[B, Q, Hq, D]`."""
    g = query.shape[1] // key.shape[1]
    if g > 1 and not _HAS_GQA:  # torch < 2.5: repeat K/V (one layer's step at a time)
        key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    gqa = {"enable_gqa": True} if g > 1 and _HAS_GQA else {}
    if padding is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, **gqa)
    else:
        mask = causal_padding_mask(padding, query.shape[-2], key.shape[-2], query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, **gqa)
    return out.transpose(1, 2).contiguous()


def causal_padding_mask(
    padding: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`[B or 1, 1, Q, S]` mask for a plain growing cache: causal with the queries at the
    end of the key sequence (and, with `sliding_window` `w`, only the keys less than `w`
    indices back, as transformers counts them), padding keys hidden, and each query sees
    at least itself."""
    q_idx = torch.arange(q_len, device=device).unsqueeze(-1) + (kv_len - q_len)
    kv_idx = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = kv_idx <= q_idx
    if sliding_window is not None:
        mask = mask & (kv_idx > q_idx - sliding_window)
    mask = mask[None, None]
    if padding is not None:
        mask = mask & padding[:, -kv_len:].to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = mask | (kv_idx == q_idx)[None, None]
    return mask
