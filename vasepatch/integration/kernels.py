"""Attention kernels over a static buffer, grouped by KV head (no K/V repetition).

`query` is `[B, Hq, Q, D]`, `key`/`value` `[B, Hkv, S, D]`, `mask` a boolean
`[B, Hkv or 1, Q, S]` (True = may attend). The query heads of a GQA group are
folded into the query-length axis, so each KV head is read once, whatever the
group size. Returns `[B, Q, Hq, D]`, the layout transformers' attention
modules expect. This runs once per layer and decode step, so it uses plain
views rather than einops (whose per-call parsing costs show up here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from packaging.version import Version

KERNELS = ("sdpa", "eager")
_HAS_GQA = Version(torch.__version__.split("+")[0]) >= Version("2.5")  # SDPA's enable_gqa


def _group(query: torch.Tensor, mask: torch.Tensor, h_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, Hq, Q, D]` -> `[B, Hkv, G*Q, D]` (rows ordered g-major), mask to match."""
    b, h_q, q_len, d = query.shape
    g = h_q // h_kv
    q = query.reshape(b, h_kv, g * q_len, d)  # heads h*G..h*G+G-1 share KV head h
    if q_len == 1:  # one mask row per KV head serves its whole group: broadcast it
        return q, mask
    m = mask.unsqueeze(2).expand(mask.shape[0], mask.shape[1], g, q_len, mask.shape[-1])
    return q, m.reshape(mask.shape[0], mask.shape[1], g * q_len, mask.shape[-1])


def _ungroup(out: torch.Tensor, h_q: int) -> torch.Tensor:
    """`[B, Hkv, G*Q, D]` -> `[B, Q, Hq, D]`."""
    b, h_kv, gq, d = out.shape
    return out.reshape(b, h_q, gq * h_kv // h_q, d).transpose(1, 2).contiguous()


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    kernel: str = "sdpa",
    dropout: float = 0.0,
) -> torch.Tensor:
    """Masked softmax attention with GQA by grouping; `kernel` is `"sdpa"` or `"eager"`."""
    q, m = _group(query, mask, key.shape[1])
    if kernel == "sdpa":
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=m, dropout_p=dropout, scale=scaling)
    elif kernel == "eager":
        scores = torch.matmul(q, key.transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~m, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if dropout:
            probs = F.dropout(probs, p=dropout)
        out = torch.matmul(probs, value)
    else:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return _ungroup(out, query.shape[1])


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal SDPA over one unpadded sequence per row (query `[B, Hq, Q, D]`, key/value
    `[B, Hkv, Q, D]`): the `is_causal` path, which needs no mask in memory. Returns
    `[B, Q, Hq, D]`."""
    g = query.shape[1] // key.shape[1]
    if g > 1 and not _HAS_GQA:  # torch < 2.5: repeat K/V (one layer's step at a time)
        key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    gqa = {"enable_gqa": True} if g > 1 and _HAS_GQA else {}
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, **gqa)
    return out.transpose(1, 2).contiguous()


def causal_padding_mask(padding: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """`[B or 1, 1, Q, S]` mask for a plain growing cache: causal with the queries at the
    end of the key sequence, padding keys hidden, and each query sees at least itself."""
    q_idx = torch.arange(q_len, device=device).unsqueeze(-1) + (kv_len - q_len)
    kv_idx = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = (kv_idx <= q_idx)[None, None]
    if padding is not None:
        mask = mask & padding[:, -kv_len:].to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = mask | (kv_idx == q_idx)[None, None]
    return mask
