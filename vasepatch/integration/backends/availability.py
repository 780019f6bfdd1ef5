"""Which attention backend can run where, and the choice made at patch time.

`flash_attn` needs the flash-attn package (>= 2.6, for `cache_leftpad`),
`torch_varlen` torch >= 2.9; both need an Ampere or newer CUDA GPU and
fp16/bf16. `sdpa` and `eager` run anywhere. The package probes run once per
process.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

from vasepatch.integration.backends import flash_attn, torch_varlen

BACKENDS = ("flash_attn", "torch_varlen", "sdpa", "eager")  # in `auto` order
VARLEN_BACKENDS = ("flash_attn", "torch_varlen")  # need each row's attendable slots to be one range
HALF_DTYPES = (torch.float16, torch.bfloat16)

_PACKAGE_PROBLEMS: dict[str, str | None] = {}


def _flash_attn_problem() -> str | None:
    """Why the flash-attn package cannot serve (None when it can); probed once."""
    if "flash_attn" not in _PACKAGE_PROBLEMS:
        problem = None
        if importlib.util.find_spec("flash_attn") is None:
            problem = "flash_attn is not installed (pip install 'vasepatch[gpu]')"
        else:
            try:
                import flash_attn as package
            except Exception as err:  # a CUDA/ABI mismatch surfaces as any error type
                problem = f"flash_attn failed to import: {err}"
            else:
                fn = getattr(package, "flash_attn_with_kvcache", None)
                if fn is None or "cache_leftpad" not in inspect.signature(fn).parameters:
                    version = getattr(package, "__version__", "?")
                    problem = f"flash_attn {version} has no flash_attn_with_kvcache(cache_leftpad=...) (needs >= 2.6)"
        _PACKAGE_PROBLEMS["flash_attn"] = problem
    return _PACKAGE_PROBLEMS["flash_attn"]


def _torch_varlen_problem() -> str | None:
    """Why torch's varlen kernel cannot serve (None when it can); probed once."""
    if "torch_varlen" not in _PACKAGE_PROBLEMS:
        try:
            torch_varlen.default_kernel()
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

    Also prepares the chosen kernel now, eagerly (imports it, reads its signature),
    so that a compiled step finds it memoised and never traces `inspect` (nor
    guards on a growing memo)."""
    if requested is None or requested == "auto":
        requested = available_backends(device, dtype)[0]
    reason = unavailable_reason(requested, device, dtype)
    if reason is not None:
        raise ValueError(f"attn_backend={requested!r} is not available: {reason}")
    if requested == "torch_varlen":
        torch_varlen.prepare()
    elif requested == "flash_attn":
        flash_attn.prepare()
    return requested
