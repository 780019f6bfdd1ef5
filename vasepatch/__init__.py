"""vasepatch: a fixed-size KV cache with VaSE eviction for Hugging Face causal LMs.

`handle = vasepatch.patch(model, budget=4096)`, then a plain `model.generate(...)`;
`vasepatch.unpatch(model)` restores the model.

The names that need torch or transformers (`patch`, `VaSECache`, `policies`, ...) are imported on first
use (PEP 562), so that `import vasepatch` and the `vasepatch` command start in a fraction of a second;
`from vasepatch import patch` and `vasepatch.patch` work as with eager imports.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from vasepatch.config import VaSEConfig
from vasepatch.errors import (
    AlreadyPatchedError,
    ModelInUseError,
    NoEvictionWarning,
    NotPatchedError,
    UnsupportedModelError,
)

if _TYPE_CHECKING:
    from vasepatch import policies
    from vasepatch.cache import VaSECache, VaSELayer
    from vasepatch.integration.patching import PatchHandle, is_patched, patch, patched, unpatch
    from vasepatch.policies import PolicyOutputError

__version__ = "0.1.0"

_LAZY = {
    "PatchHandle": "vasepatch.integration.patching",
    "PolicyOutputError": "vasepatch.policies",
    "VaSECache": "vasepatch.cache",
    "VaSELayer": "vasepatch.cache",
    "is_patched": "vasepatch.integration.patching",
    "patch": "vasepatch.integration.patching",
    "patched": "vasepatch.integration.patching",
    "unpatch": "vasepatch.integration.patching",
}
"""Public name -> the module it comes from, imported on first use (these import torch)."""

__all__ = [
    "AlreadyPatchedError",
    "ModelInUseError",
    "NoEvictionWarning",
    "NotPatchedError",
    "PatchHandle",
    "PolicyOutputError",
    "UnsupportedModelError",
    "VaSECache",
    "VaSEConfig",
    "VaSELayer",
    "__version__",
    "is_patched",
    "patch",
    "patched",
    "policies",
    "unpatch",
]


def __getattr__(name: str) -> object:
    if name == "policies":
        value: object = _importlib.import_module("vasepatch.policies")
    elif name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'vasepatch' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included (before their first use too), without the helpers."""
    return sorted({name for name in globals() if not name.startswith("_") or name.startswith("__")} | set(__all__))
