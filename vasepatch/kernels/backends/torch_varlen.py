"""The `torch_varlen` backend: torch's FlashAttention-2 varlen kernel, `torch.nn.attention.varlen.varlen_attn`.

Available from torch 2.10 (2.9 has no `torch.nn.attention.varlen`); its
keywords changed between releases (2.10: `is_causal`, always `D**-0.5`; 2.11+:
`scale`, `window_size`; 2.12+: `enable_gqa`, `seqused_k`), so they are read from the kernel's signature once
(`varlen_spec`) and the call passes only what the kernel knows.

* Decode: the buffer flattened to `[B*Hkv*C, 1, D]` (a free view), one sequence
  per `(b, h_kv)` holding its G queries as G tokens of one head. With
  `seqused_k`: `cu_seq_k[i] = i*C + start`, `seqused_k = end - start` (keys
  `key[cu_k[i] : cu_k[i] + seqused_k[i]]`). Without it (or when autograd
  records, since `seqused_k` is inference-only): the gaps between the valid
  ranges become sequences with no queries, which the kernel skips.
* Prefill: causal (`window_size=(-1, 0)`, or `is_causal=True` on torch 2.10) on
  the unpadded prompt tokens, GQA native: `BACKEND.prefill`, through `varlen_call`.

Both take the kernel as an injectable callable with `varlen_attn`'s signature
(default: `default_kernel()`, the CUDA kernel), so the packing can run on CPU
against a stand-in.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vasepatch.kernels.backends.common import Kernel, VarlenBackend, decode_shapes, softmax_scale, ungroup_decode
from vasepatch.kernels.varlen import decode_gaps, decode_seqused


class VarlenSpec(NamedTuple):
    """Which keywords a `varlen_attn` accepts (torch 2.10: `is_causal`; 2.11+: `scale`,
    `window_size`; 2.12+: `enable_gqa`, `seqused_k`)."""

    scale: bool
    window_size: bool
    is_causal: bool
    enable_gqa: bool
    seqused_k: bool


_SPECS: dict[Callable[..., Any], VarlenSpec] = {}


def varlen_spec(kernel: Kernel) -> VarlenSpec:
    """The keywords `kernel` takes, read from its signature once."""
    spec = _SPECS.get(kernel)
    if spec is None:
        params = inspect.signature(kernel).parameters
        spec = _SPECS[kernel] = VarlenSpec(*(name in params for name in VarlenSpec._fields))
    return spec


def default_kernel() -> Kernel:
    """torch's `varlen_attn` (ImportError before torch 2.10)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def prepare() -> None:
    """Read the default kernel's signature now, so a compiled step finds it memoised and never traces `inspect`."""
    varlen_spec(default_kernel())


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
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Call a `varlen_attn` of any torch release (`kernel`, None for torch's) with the keywords it knows."""
    kernel = default_kernel() if kernel is None else kernel
    spec = varlen_spec(kernel)
    kwargs: dict[str, Any] = {}
    if spec.scale:
        kwargs["scale"] = scale
    else:  # torch 2.10 always scales by D**-0.5: fold the ratio into the query
        q = q * (scale * q.shape[-1] ** 0.5)
    if spec.window_size:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif causal:
        kwargs["is_causal"] = True
    if spec.enable_gqa and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True  # 2.10/2.11 pass GQA straight to FA2, which supports it
    if seqused_k is not None:
        kwargs["seqused_k"] = seqused_k
    return kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def torch_varlen_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    end: int | torch.Tensor,
    scale: float | None = None,
    *,
    kernel: Kernel | None = None,
    use_seqused: bool | None = None,
) -> torch.Tensor:
    """Decode with torch's varlen kernel, one sequence per `(b, h_kv)` (see the module docstring).

    `use_seqused`: None picks `seqused_k` when the kernel has it and autograd is
    not recording; False forces the gap-sequence layout.
    """
    b, hq, hkv, cap, d = decode_shapes(query, keys, start)
    kernel = default_kernel() if kernel is None else kernel
    g, n = hq // hkv, b * hkv
    q = query.reshape(n * g, 1, d)  # rows ordered (b, h_kv, g): pair i owns rows i*G .. i*G+G-1
    k = keys.reshape(n * cap, 1, d)  # free views of the contiguous head-major buffer
    v = values.reshape(n * cap, 1, d)
    s = softmax_scale(scale, d)
    if use_seqused is None:
        use_seqused = varlen_spec(kernel).seqused_k and not (torch.is_grad_enabled() and query.requires_grad)
    if use_seqused:
        cu_k, used = decode_seqused(start, end, cap)
        cu_q = torch.arange(n + 1, dtype=torch.int32, device=query.device) * g
        out = varlen_call(kernel, q, k, v, cu_q, cu_k, g, cap, s, False, used)
    else:
        cu_q, cu_k = decode_gaps(start, end, cap, g)
        per_row = isinstance(end, torch.Tensor) and end.dim() > 0
        out = varlen_call(kernel, q, k, v, cu_q, cu_k, g, 2 * cap if per_row else cap, s, False)
    return ungroup_decode(out, b, hq, d)


BACKEND = VarlenBackend("torch_varlen", decode=torch_varlen_decode, varlen_call=varlen_call)
