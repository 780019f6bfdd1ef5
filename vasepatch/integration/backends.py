"""Attention backends over the static VaSE cache: FlashAttention-2 kernels on GPU, SDPA/eager anywhere.

Two entry points per backend, both returning the `[B, Q, Hq, D]` layout
transformers' attention modules expect (GQA: query heads `h*G .. h*G+G-1`
share KV head `h`):

* `decode(query [B, Hq, 1, D], keys [B, Hkv, C, D], values, start [B, Hkv], end, scale)`:
  one new token per row; row `b`, KV head `h` attends to the contiguous slots
  `[start[b, h], end)` (`end`: an int, a 0-d or a `[B]` tensor).
* `prefill(query [B, Hq, Q, D], key [B, Hkv, Q, D], value, padding [B, Q] | None, scale)`:
  causal attention within a left-padded prompt (True = real token), zeros at
  the padding positions.

Backends (`BACKENDS`, in `auto` order):

* `flash_attn`, the flash-attn package (FlashAttention-2, Dao 2023, arXiv
  2307.08691). Decode: `flash_attn_with_kvcache` on the buffer seen as
  `[B*Hkv, C, 1, D]` (a free view; the kernel only needs a contiguous last
  dimension), with `cache_leftpad = start` and `cache_seqlens = end`: row `b`
  reads `k_cache[b, leftpad : seqlens]` (FA2 `BlockInfo`: key offset
  `+ leftpad_k` rows, length `cache_seqlens - leftpad_k`; flash-attn >= 2.6).
  The G query heads of a KV head are the kernel's heads (`q [B*Hkv, 1, G, D]`),
  so it can use its GQA decode path and split-KV heuristics. Nothing is
  appended (`k=v=None`), so the call is pure; it still goes through the custom
  op `vasepatch::flash_attn_kvcache` so `torch.compile` sees an opaque op with a
  fake implementation instead of a pybind call. `flash_attn_varlen_func` was
  the other candidate: its public signature has no `seqused_k`.
  Prefill: `flash_attn_varlen_func(..., causal=True)` on the unpadded tokens.
* `torch_varlen`, torch's FA2 varlen kernel `torch.nn.attention.varlen.varlen_attn`
  (torch >= 2.9; its keywords changed between releases, so they are read from
  the signature). Decode: the buffer flattened to `[B*Hkv*C, 1, D]` (free view),
  one sequence per `(b, h)` holding its G queries as G tokens of one head.
  With `seqused_k` (torch >= 2.12): `cu_seq_k[i] = i*C + start`,
  `seqused_k = end - start` (keys `key[cu_k[i] : cu_k[i] + seqused_k[i]]`).
  Without it (or when autograd records, since `seqused_k` is inference-only):
  the gaps between valid ranges become sequences with no queries. Prefill:
  causal `window_size=(-1, 0)` (or `is_causal=True` on torch 2.9) on the
  unpadded tokens, GQA native.
* `sdpa` (the reference) and `eager`: masked attention over the static buffer
  with `kernels.grouped_attention`.

Every varlen backend takes its kernel as an injectable callable with the real
kernel's signature (default: the CUDA kernel), so the packing runs on CPU
against `reference_kernels`.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vasepatch.integration import reference_kernels
from vasepatch.integration.kernels import causal_padding_mask, grouped_attention
from vasepatch.integration.varlen import (
    PackedPrompt,
    decode_gaps,
    decode_seqused,
    end_per_row,
    pack_prompt,
    repad,
    unpad,
)

BACKENDS = ("flash_attn", "torch_varlen", "sdpa", "eager")
VARLEN_BACKENDS = ("flash_attn", "torch_varlen")  # need each row's attendable slots to be one range
HALF_DTYPES = (torch.float16, torch.bfloat16)

Kernel = Callable[..., torch.Tensor]

# --------------------------------------------------------------------------- availability

_PACKAGE_PROBLEMS: dict[str, str | None] = {}


def _flash_attn_problem() -> str | None:
    """Why the flash-attn package cannot serve (None when it can); probed once."""
    if "flash_attn" not in _PACKAGE_PROBLEMS:
        problem = None
        if importlib.util.find_spec("flash_attn") is None:
            problem = "flash_attn is not installed (pip install 'vasepatch[gpu]')"
        else:
            try:
                import flash_attn
            except Exception as err:  # a CUDA/ABI mismatch surfaces as any error type
                problem = f"flash_attn failed to import: {err}"
            else:
                fn = getattr(flash_attn, "flash_attn_with_kvcache", None)
                if fn is None or "cache_leftpad" not in inspect.signature(fn).parameters:
                    version = getattr(flash_attn, "__version__", "?")
                    problem = f"flash_attn {version} has no flash_attn_with_kvcache(cache_leftpad=...) (needs >= 2.6)"
        _PACKAGE_PROBLEMS["flash_attn"] = problem
    return _PACKAGE_PROBLEMS["flash_attn"]


def _torch_varlen_problem() -> str | None:
    if "torch_varlen" not in _PACKAGE_PROBLEMS:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            _PACKAGE_PROBLEMS["torch_varlen"] = (
                f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.9)"
            )
        else:
            _PACKAGE_PROBLEMS["torch_varlen"] = None
    return _PACKAGE_PROBLEMS["torch_varlen"]


def _cuda_problem(name: str, device: torch.device, dtype: torch.dtype | None) -> str | None:
    if device.type != "cuda":
        return f"{name} needs a CUDA device (got {device.type})"
    if not torch.cuda.is_available():
        return f"{name} needs a CUDA device (CUDA is not available)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"{name} needs an Ampere or newer GPU (compute capability >= 8.0)"
    if dtype is not None and dtype not in HALF_DTYPES:
        return f"{name} needs float16 or bfloat16 (got {dtype})"
    return None


def unavailable_reason(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
    """Why backend `name` cannot run on `device` (and `dtype`, if given); None when it can."""
    if name not in BACKENDS:
        return f"unknown backend; choose one of {', '.join(BACKENDS)} or 'auto'"
    device = torch.device(device)
    if name == "flash_attn":
        return _flash_attn_problem() or _cuda_problem(name, device, dtype)
    if name == "torch_varlen":
        return _torch_varlen_problem() or _cuda_problem(name, device, dtype)
    return None


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None) -> list[str]:
    """The backends that can run on `device` (and `dtype`, if given), in `auto` order."""
    return [name for name in BACKENDS if unavailable_reason(name, device, dtype) is None]


def resolve_backend(requested: str | None, device: torch.device | str, dtype: torch.dtype | None) -> str:
    """`None`/`"auto"`: the first available of `BACKENDS`; a name: itself, or ValueError saying why not.

    Also reads the chosen kernel's signature now, eagerly, so that a compiled step
    finds it memoised and never traces `inspect` (nor guards on a growing memo)."""
    if requested is None or requested == "auto":
        requested = available_backends(device, dtype)[0]
    reason = unavailable_reason(requested, device, dtype)
    if reason is not None:
        raise ValueError(f"attn_backend={requested!r} is not available: {reason}")
    if requested == "torch_varlen":
        varlen_spec(_torch_varlen_kernel())
    elif requested == "flash_attn":
        varlen_spec(_flash_varlen_kernel())
    return requested


# --------------------------------------------------------------------------- shared checks


def _scale(scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scale is None else float(scale)


def _decode_shapes(query: torch.Tensor, keys: torch.Tensor, start: torch.Tensor) -> tuple[int, int, int, int, int]:
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


def _ungroup_decode(out: torch.Tensor, b: int, hq: int, d: int) -> torch.Tensor:
    """Kernel output ordered `(b, h_kv, g)` -> `[B, 1, Hq, D]` (a view: the query axis has size 1)."""
    return out.reshape(b, hq, 1, d).transpose(1, 2)


# --------------------------------------------------------------------------- sdpa / eager


def decode_mask(start: torch.Tensor, end: int | torch.Tensor, length: int) -> torch.Tensor:
    """`[B, Hkv, 1, length]` bool: slot `s` of `(b, h)` is attended iff `start[b, h] <= s < end`."""
    slots = torch.arange(length, device=start.device)
    ends = end_per_row(end, start.shape[0], start.device)
    return ((slots >= start[..., None]) & (slots < ends[:, None, None])).unsqueeze(2)


def _masked_decode(kernel: str, query, keys, values, start, end, scale) -> torch.Tensor:
    _decode_shapes(query, keys, start)
    n = int(end) if isinstance(end, int) else keys.shape[2]  # a Python int end bounds the slots read
    mask = decode_mask(start, end, n)
    return grouped_attention(query, keys[:, :, :n], values[:, :, :n], mask, _scale(scale, query.shape[-1]), kernel)


def sdpa_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    end: int | torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode with `F.scaled_dot_product_attention` and a boolean slot mask (the reference)."""
    return _masked_decode("sdpa", query, keys, values, start, end, scale)


def eager_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    end: int | torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode with an explicit fp32 softmax over the masked slots."""
    return _masked_decode("eager", query, keys, values, start, end, scale)


def _masked_prefill(kernel: str, query, key, value, padding, scale) -> torch.Tensor:
    q_len = query.shape[2]
    mask = causal_padding_mask(padding, q_len, q_len, query.device)
    out = grouped_attention(query, key, value, mask, _scale(scale, query.shape[-1]), kernel)
    if padding is not None:
        out = out.masked_fill(~padding.to(device=out.device, dtype=torch.bool)[:, :, None, None], 0.0)
    return out


def sdpa_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None = None,
    *,
    packing: PackedPrompt | None = None,
) -> torch.Tensor:
    """Causal + padding-masked SDPA over the padded prompt (the reference); `packing` is ignored."""
    return _masked_prefill("sdpa", query, key, value, padding, scale)


def eager_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None = None,
    *,
    packing: PackedPrompt | None = None,
) -> torch.Tensor:
    """Causal + padding-masked explicit softmax over the padded prompt; `packing` is ignored."""
    return _masked_prefill("eager", query, key, value, padding, scale)


# --------------------------------------------------------------------------- torch varlen


class VarlenSpec(NamedTuple):
    """Which keywords a `varlen_attn` accepts (torch 2.9: `is_causal`; 2.10+: `scale`,
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


def _torch_varlen_kernel() -> Kernel:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _varlen_call(
    kernel: Kernel,
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
    """Call a `varlen_attn` of any torch release with the keywords it knows."""
    spec = varlen_spec(kernel)
    kwargs: dict[str, Any] = {}
    if spec.scale:
        kwargs["scale"] = scale
    else:  # torch 2.9 always scales by D**-0.5: fold the ratio into the query
        q = q * (scale * q.shape[-1] ** 0.5)
    if spec.window_size:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif causal:
        kwargs["is_causal"] = True
    if spec.enable_gqa and q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True  # older wrappers pass GQA straight to FA2, which supports it
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
    b, hq, hkv, cap, d = _decode_shapes(query, keys, start)
    kernel = _torch_varlen_kernel() if kernel is None else kernel
    g, n = hq // hkv, b * hkv
    q = query.reshape(n * g, 1, d)  # rows ordered (b, h_kv, g): pair i owns rows i*G .. i*G+G-1
    k = keys.reshape(n * cap, 1, d)  # free views of the contiguous head-major buffer
    v = values.reshape(n * cap, 1, d)
    s = _scale(scale, d)
    if use_seqused is None:
        use_seqused = varlen_spec(kernel).seqused_k and not (torch.is_grad_enabled() and query.requires_grad)
    if use_seqused:
        cu_k, used = decode_seqused(start, end, cap)
        cu_q = torch.arange(n + 1, dtype=torch.int32, device=query.device) * g
        out = _varlen_call(kernel, q, k, v, cu_q, cu_k, g, cap, s, False, used)
    else:
        cu_q, cu_k = decode_gaps(start, end, cap, g)
        per_row = isinstance(end, torch.Tensor) and end.dim() > 0
        out = _varlen_call(kernel, q, k, v, cu_q, cu_k, g, 2 * cap if per_row else cap, s, False)
    return _ungroup_decode(out, b, hq, d)


def _packed_prefill(
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedPrompt], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    packing: PackedPrompt | None,
) -> torch.Tensor:
    b, _, q_len, _ = query.shape
    if packing is None:
        packing = pack_prompt(padding, b, q_len, query.device)
    q, k, v = (unpad(x.transpose(1, 2), packing) for x in (query, key, value))  # [T, H, D]
    return repad(call(q, k, v, packing), packing)


def torch_varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None = None,
    *,
    kernel: Kernel | None = None,
    packing: PackedPrompt | None = None,
) -> torch.Tensor:
    """Causal prefill with torch's varlen kernel on the unpadded tokens; `packing` from `pack_prompt` (reusable)."""
    kernel = _torch_varlen_kernel() if kernel is None else kernel
    s = _scale(scale, query.shape[-1])

    def call(q, k, v, p: PackedPrompt) -> torch.Tensor:
        return _varlen_call(kernel, q, k, v, p.cu_seqlens, p.cu_seqlens, p.max_len, p.max_len, s, True)

    return _packed_prefill(call, query, key, value, padding, packing)


# --------------------------------------------------------------------------- flash-attn package


@torch.library.custom_op("vasepatch::flash_attn_kvcache", mutates_args=(), device_types="cuda")
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


@_flash_kvcache_op.register_kernel("cpu")
def _(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale):
    return reference_kernels.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, softmax_scale=softmax_scale
    )


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
    b, hq, hkv, cap, d = _decode_shapes(query, keys, start)
    kernel = flash_attn_kvcache if kernel is None else kernel
    n, g = b * hkv, hq // hkv
    q = query.reshape(n, 1, g, d)  # batch (b, h_kv), one token, G heads sharing the single KV head
    k_cache = keys.reshape(n, cap, 1, d)  # free views: [B*Hkv, C, 1, D], last dimension contiguous
    v_cache = values.reshape(n, cap, 1, d)
    ends = end_per_row(end, b, query.device)[:, None].expand(b, hkv).reshape(-1).contiguous()
    lefts = start.to(torch.int32).reshape(-1).contiguous()
    out = kernel(q, k_cache, v_cache, cache_seqlens=ends, cache_leftpad=lefts, softmax_scale=_scale(scale, d))
    return _ungroup_decode(out, b, hq, d)


def _flash_varlen_kernel() -> Kernel:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def flash_attn_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None = None,
    *,
    kernel: Kernel | None = None,
    packing: PackedPrompt | None = None,
) -> torch.Tensor:
    """Causal prefill with `flash_attn_varlen_func(causal=True)` on the unpadded tokens (GQA native)."""
    kernel = _flash_varlen_kernel() if kernel is None else kernel
    s = _scale(scale, query.shape[-1])

    def call(q, k, v, p: PackedPrompt) -> torch.Tensor:
        return kernel(q, k, v, p.cu_seqlens, p.cu_seqlens, p.max_len, p.max_len, softmax_scale=s, causal=True)

    return _packed_prefill(call, query, key, value, padding, packing)


# --------------------------------------------------------------------------- dispatch

DECODE: dict[str, Callable[..., torch.Tensor]] = {
    "flash_attn": flash_attn_decode,
    "torch_varlen": torch_varlen_decode,
    "sdpa": sdpa_decode,
    "eager": eager_decode,
}
PREFILL: dict[str, Callable[..., torch.Tensor]] = {
    "flash_attn": flash_attn_prefill,
    "torch_varlen": torch_varlen_prefill,
    "sdpa": sdpa_prefill,
    "eager": eager_prefill,
}


def _lookup(table: dict[str, Callable[..., torch.Tensor]], backend: str) -> Callable[..., torch.Tensor]:
    if backend not in table:
        raise ValueError(f"attn_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return table[backend]


def decode_attention(
    backend: str,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    end: int | torch.Tensor,
    scale: float | None = None,
    *,
    kernel: Kernel | None = None,
) -> torch.Tensor:
    """`[B, 1, Hq, D]`: one new token per row over slots `[start, end)` with `backend`."""
    fn = _lookup(DECODE, backend)
    if kernel is None:
        return fn(query, keys, values, start, end, scale)
    if backend in ("sdpa", "eager"):
        raise ValueError(f"attn_backend={backend!r} takes no kernel")
    return fn(query, keys, values, start, end, scale, kernel=kernel)


def prefill_attention(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None = None,
    *,
    kernel: Kernel | None = None,
    packing: PackedPrompt | None = None,
) -> torch.Tensor:
    """`[B, Q, Hq, D]`: causal attention within the (left-padded) prompt with `backend`, zeros at padding."""
    fn = _lookup(PREFILL, backend)
    if kernel is None:
        return fn(query, key, value, padding, scale, packing=packing)
    if backend in ("sdpa", "eager"):
        raise ValueError(f"attn_backend={backend!r} takes no kernel")
    return fn(query, key, value, padding, scale, kernel=kernel, packing=packing)
