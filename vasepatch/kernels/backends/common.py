"""What the varlen kernel families (`flash_attn`, `torch_varlen`) share: the record of a
backend (`VarlenBackend`), its prefill, and the decode shape checks.

Both families read the head-major cache buffer `[B, Hkv, C, D]` through free
views, one sequence (or batch row) per `(b, h_kv)` holding the `G = Hq / Hkv`
query heads of its GQA group, and run the prefill on the unpadded prompt
tokens (`vasepatch.kernels.varlen`). Everywhere in this package a `kernel`
is a callable with the real kernel's signature (`Kernel`; None: the CUDA
kernel), so the packing can be tested on CPU against naive stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vasepatch.kernels.varlen import PackedPrompt, pack_prompt, repad, unpad

Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class VarlenBackend:
    """One varlen backend: its name, its decode step, and the call of its varlen kernel, from
    which its prefill follows (the same for both families).

    * `decode(query, keys, values, start, end, scale=None, *, kernel=None)`: `[B, 1, Hq, D]`,
      one new token per row over the slots `[start, end)` (the package docstring says more);
    * `varlen_call(kernel, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)`: the backend's
      varlen kernel (`kernel`, None for the CUDA one) over packed `[T, H, D]` sequences."""

    name: str
    decode: Callable[..., torch.Tensor]
    varlen_call: Callable[..., torch.Tensor]

    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        padding: torch.Tensor | None,
        scale: float | None = None,
        *,
        kernel: Kernel | None = None,
        packing: PackedPrompt | None = None,
    ) -> torch.Tensor:
        """`[B, Q, Hq, D]`: causal attention within the left-padded prompt (`padding` `[B, Q]`, True = real
        token, or None), run by `varlen_call` on the unpadded tokens (GQA native), zeros at the padding.
        `packing`: from `pack_prompt`, reusable across layers."""
        b, _, q_len, d = query.shape
        if packing is None:
            packing = pack_prompt(padding, b, q_len, query.device)
        q, k, v = (unpad(x.transpose(1, 2), packing) for x in (query, key, value))
        cu, n = packing.cu_seqlens, packing.max_len
        return repad(self.varlen_call(kernel, q, k, v, cu, cu, n, n, softmax_scale(scale, d), True), packing)


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
