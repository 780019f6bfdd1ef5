"""Shape checks and layouts shared by the varlen kernel families (`flash_attn`, `torch_varlen`).

Both families read the head-major cache buffer `[B, Hkv, C, D]` through free
views, one sequence (or batch row) per `(b, h_kv)` holding the `G = Hq / Hkv`
query heads of its GQA group, and run the prefill on the unpadded prompt
tokens (`vasepatch.integration.varlen`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vasepatch.integration.varlen import PackedPrompt, pack_prompt, repad, unpad

Kernel = Callable[..., torch.Tensor]


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """`scale`, or `head_dim ** -0.5` when it is None."""
    return head_dim**-0.5 if scale is None else float(scale)


def decode_shapes(query: torch.Tensor, keys: torch.Tensor, start: torch.Tensor) -> tuple[int, int, int, int, int]:
    """`(B, Hq, Hkv, C, D)` after checking the decode shapes."""
    b, hq, q_len, d = query.shape
    _, hkv, cap, _ = keys.shape
    if q_len != 1:
        raise ValueError(f"decode attention takes one query per row, got {q_len}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if tuple(start.shape) != (b, hkv):
        raise ValueError(f"start must be [B, Hkv] = {(b, hkv)}, got {tuple(start.shape)}")
    return b, hq, hkv, cap, d


def ungroup_decode(out: torch.Tensor, b: int, hq: int, d: int) -> torch.Tensor:
    """Kernel output ordered `(b, h_kv, g)` -> `[B, 1, Hq, D]` (a view: the query axis has size 1)."""
    return out.reshape(b, hq, 1, d).transpose(1, 2)


def packed_prefill(
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedPrompt], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    packing: PackedPrompt | None,
) -> torch.Tensor:
    """Unpad `[B, H, Q, D]` inputs to `[T, H, D]`, run `call(q, k, v, packing)`, re-pad to `[B, Q, Hq, D]`."""
    b, _, q_len, _ = query.shape
    if packing is None:
        packing = pack_prompt(padding, b, q_len, query.device)
    q, k, v = (unpad(x.transpose(1, 2), packing) for x in (query, key, value))
    return repad(call(q, k, v, packing), packing)
