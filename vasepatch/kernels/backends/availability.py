"""Which attention backend can run where, and the choice made at patch time.

`flash_attn` needs the flash-attn package (>= 2.6.1, for `cache_leftpad`),
`torch_varlen` torch >= 2.10 (the first release with `torch.nn.attention.varlen`);
both need an Ampere or newer CUDA GPU, fp16/bf16 and a head dim that is a
multiple of 8 and at most 256 (`VARLEN_HEAD_DIMS`). `sdpa` and `eager` run
anywhere. The package probes run once per process.

`choose_backend` is the choice made at patch time: `auto` takes the first
backend every device can run, and says so (a warning naming `head_dim`) when a
varlen backend is passed over only because of the model's head dim; a varlen
backend asked for by name with an unsupported head dim is a ValueError.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Sequence

import torch

from vasepatch.errors import install_hint
from vasepatch.kernels.backends import flash_attn, torch_varlen

BACKENDS = ("flash_attn", "torch_varlen", "sdpa", "eager")  # in `auto` order
VARLEN_BACKENDS = ("flash_attn", "torch_varlen")  # need each row's attendable slots to be one range
HALF_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dim; both varlen kernels also need a multiple of 8

_PACKAGE_PROBLEMS: dict[str, str | None] = {}


def _flash_attn_problem() -> str | None:
    """Why the flash-attn package cannot serve (None when it can); probed once."""
    if "flash_attn" not in _PACKAGE_PROBLEMS:
        problem = None
        if importlib.util.find_spec("flash_attn") is None:
            problem = f"flash_attn is not installed ({install_hint('gpu')})"
        else:
            try:
                import flash_attn as package
            except Exception as err:  # a CUDA/ABI mismatch surfaces as any error type
                problem = f"flash_attn failed to import: {err}"
            else:
                fn = getattr(package, "flash_attn_with_kvcache", None)
                if fn is None or "cache_leftpad" not in inspect.signature(fn).parameters:
                    version = getattr(package, "__version__", "?")
                    problem = f"flash_attn {version} has no flash_attn_with_kvcache(cache_leftpad=...) (needs >= 2.6.1)"
        _PACKAGE_PROBLEMS["flash_attn"] = problem
    return _PACKAGE_PROBLEMS["flash_attn"]


def _torch_varlen_problem() -> str | None:
    """Why torch's varlen kernel cannot serve (None when it can); probed once."""
    if "torch_varlen" not in _PACKAGE_PROBLEMS:
        try:
            torch_varlen.default_kernel()
        except ImportError:
            _PACKAGE_PROBLEMS["torch_varlen"] = (
                f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"
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


def head_dim_problem(name: str, head_dim: int | None) -> str | None:
    """Why varlen backend `name` cannot attend with heads of `head_dim` (None when it can, or when not varlen)."""
    if name not in VARLEN_BACKENDS or head_dim is None:
        return None
    if head_dim % 8 or not 0 < head_dim <= VARLEN_MAX_HEAD_DIM:
        return f"{name} needs head_dim a multiple of 8 in [8, {VARLEN_MAX_HEAD_DIM}] (got head_dim={head_dim})"
    return None


def unavailable_reason(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str | None:
    """Why backend `name` cannot run on `device` (and `dtype`, `head_dim`, if given); None when it can."""
    if name not in BACKENDS:
        return f"unknown backend; choose one of {', '.join(BACKENDS)} or 'auto'"
    device = torch.device(device)
    if name == "flash_attn":
        return _flash_attn_problem() or _cuda_problem(name, device, dtype) or head_dim_problem(name, head_dim)
    if name == "torch_varlen":
        return _torch_varlen_problem() or _cuda_problem(name, device, dtype) or head_dim_problem(name, head_dim)
    return None


def available_backends(
    device: torch.device | str, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> list[str]:
    """The backends that can run on `device` (and `dtype`, `head_dim`, if given), in `auto` order."""
    return [name for name in BACKENDS if unavailable_reason(name, device, dtype, head_dim) is None]


def resolve_backend(
    requested: str | None, device: torch.device | str, dtype: torch.dtype | None, head_dim: int | None = None
) -> str:
    """`None`/`"auto"`: the first available of `BACKENDS`; a name: itself, or ValueError saying why not.

    Also prepares the chosen kernel now, eagerly (imports it, reads its signature),
    so that a compiled step finds it memoised and never traces `inspect` (nor
    guards on a growing memo)."""
    if requested is None or requested == "auto":
        requested = available_backends(device, dtype, head_dim)[0]
    reason = unavailable_reason(requested, device, dtype, head_dim)
    if reason is not None:
        raise ValueError(f"attn_backend={requested!r} is not available: {reason}")
    if requested == "torch_varlen":
        torch_varlen.prepare()
    elif requested == "flash_attn":
        flash_attn.prepare()
    return requested


def _common(devices: Sequence[torch.device], dtype: torch.dtype | None, head_dim: int | None) -> list[str]:
    """The backends every one of `devices` can run, in `auto` order."""
    return [b for b in BACKENDS if all(unavailable_reason(b, d, dtype, head_dim) is None for d in devices)]


def choose_backend(
    requested: str | None,
    devices: Sequence[torch.device | str],
    dtype: torch.dtype | None,
    head_dim: int | None,
) -> str:
    """The backend for a model whose attention runs on `devices` with heads of `head_dim`, checked before any work.

    `None`/`"auto"`: the first backend of `BACKENDS` that runs on every device; when a
    varlen backend would have been chosen but for `head_dim`, a warning says so and the
    choice falls back (to `sdpa`). A name: itself, or ValueError naming `attn_backend`
    (and `head_dim` with the allowed range when that is the reason)."""
    distinct = list(dict.fromkeys(torch.device(d) for d in devices)) or [torch.device("cpu")]
    if requested is None or requested == "auto":
        usable = _common(distinct, dtype, head_dim)
        passed_over = [b for b in _common(distinct, dtype, None) if b in VARLEN_BACKENDS and b not in usable]
        if passed_over:
            warnings.warn(
                f"attn_backend='auto': {head_dim_problem(passed_over[0], head_dim)}; using {usable[0]!r} instead",
                UserWarning,
                stacklevel=3,
            )
        return resolve_backend(usable[0], distinct[0], dtype, head_dim)
    for device in distinct:
        resolve_backend(requested, device, dtype, head_dim)
    return requested
