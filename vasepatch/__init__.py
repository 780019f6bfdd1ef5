"""vasepatch: a fixed-size KV cache with VaSE eviction for Hugging Face causal LMs.

`handle = vasepatch.patch(model, budget=4096)`, then a plain `model.generate(...)`;
`vasepatch.unpatch(model)` restores the model.
"""

from vasepatch import policies
from vasepatch.cache import VaSECache, VaSELayer
from vasepatch.config import VaSEConfig
from vasepatch.errors import AlreadyPatchedError, ModelInUseError, NotPatchedError, UnsupportedModelError
from vasepatch.integration.patching import PatchHandle, is_patched, patch, patched, unpatch
from vasepatch.policies import PolicyOutputError

__version__ = "0.1.0"

__all__ = [
    "AlreadyPatchedError",
    "ModelInUseError",
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
