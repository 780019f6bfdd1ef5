"""Attention backends over the static VaSE cache, one module per kernel family.

Backends (`BACKENDS`, in `auto` order; `availability` says which can run where):

* `flash_attn` (`backends.flash_attn`): the flash-attn package's
  FlashAttention-2 kernels (flash-attn >= 2.6.1), CUDA only;
* `torch_varlen` (`backends.torch_varlen`): torch's FlashAttention-2 varlen
  kernel (torch >= 2.10), CUDA only;
* `sdpa` and `eager`: masked attention over the static buffer with
  `vasepatch.kernels.grouped.grouped_attention` and the mask the cache
  builds; they have no entry point here.

The two varlen backends (`VARLEN_BACKENDS`) need each row and KV head's
attendable slots to be one contiguous range, which the cache guarantees, and
a head dim that is a multiple of 8 and at most 256 (`auto` falls back to `sdpa`
otherwise, with a warning; see `choose_backend`). Each is one `VarlenBackend`
record in `VARLEN` (its decode step, and its prefill), reached through two calls,
both returning the `[B, Q, Hq, D]` layout transformers' attention modules
expect (GQA: query heads `h*G .. h*G+G-1` share KV head `h`):

* `decode_attention(backend, query [B, Hq, 1, D], keys [B, Hkv, C, D], values, start [B, Hkv], end, scale)`:
  one new token per row; row `b`, KV head `h` attends to the contiguous slots
  `[start[b, h], end)` (`end`: an int, a 0-d or a `[B]` tensor).
* `prefill_attention(backend, query [B, Hq, Q, D], key [B, Hkv, Q, D], value, padding [B, Q] | None, scale)`:
  causal attention within a left-padded prompt (True = real token), zeros at
  the padding positions; `packing=` reuses a `pack_prompt` result.

Each takes its kernel as an injectable callable with the real kernel's
signature (`kernel=`, default: the CUDA kernel), so the packing can be tested on
CPU against naive stand-ins (`tests/reference_kernels.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from vasepatch.kernels.backends import flash_attn, torch_varlen
from vasepatch.kernels.backends.availability import (
    BACKENDS,
    HALF_DTYPES,
    VARLEN_BACKENDS,
    VARLEN_MAX_HEAD_DIM,
    available_backends,
    choose_backend,
    head_dim_problem,
    resolve_backend,
    unavailable_reason,
)
from vasepatch.kernels.backends.common import Kernel, VarlenBackend
from vasepatch.kernels.backends.flash_attn import flash_attn_decode
from vasepatch.kernels.backends.torch_varlen import VarlenSpec, torch_varlen_decode, varlen_spec

__all__ = [
    "BACKENDS",
    "HALF_DTYPES",
    "VARLEN",
    "VARLEN_BACKENDS",
    "VARLEN_MAX_HEAD_DIM",
    "Kernel",
    "VarlenBackend",
    "VarlenSpec",
    "available_backends",
    "choose_backend",
    "decode_attention",
    "flash_attn_decode",
    "head_dim_problem",
    "prefill_attention",
    "resolve_backend",
    "torch_varlen_decode",
    "unavailable_reason",
    "varlen_spec",
]

VARLEN: dict[str, VarlenBackend] = {b.name: b for b in (flash_attn.BACKEND, torch_varlen.BACKEND)}


def _varlen(backend: str) -> VarlenBackend:
    if backend in VARLEN:
        return VARLEN[backend]
    if backend in BACKENDS:
        raise ValueError(
            f"attn_backend={backend!r} has no varlen kernel: decode_attention and prefill_attention serve "
            f"{', '.join(VARLEN)} only ({backend} attends with kernels.grouped_attention and the cache's mask)"
        )
    raise ValueError(f"attn_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def decode_attention(backend: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`[B, 1, Hq, D]`: one new token per row over the slots `[start, end)`, with the varlen
    `backend`'s `decode` (arguments: see the module docstring)."""
    return _varlen(backend).decode(*args, **kwargs)


def prefill_attention(backend: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`[B, Q, Hq, D]`: causal attention within the (left-padded) prompt, zeros at the padding, with
    the varlen `backend`'s `prefill` (arguments: see the module docstring)."""
    return _varlen(backend).prefill(*args, **kwargs)
