"""The transformers releases vasepatch is tested with, and the names that differ between them."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import transformers
from packaging.version import Version

MIN_TRANSFORMERS = "5.0.0"  # CI runs the tests with this release and the newest
MAX_TRANSFORMERS = "6.0.0"  # exclusive


def check_transformers(version: str | None = None) -> None:
    """Raise `RuntimeError` if the installed transformers is outside the tested range."""
    found = Version(version or transformers.__version__)
    if not Version(MIN_TRANSFORMERS) <= found < Version(MAX_TRANSFORMERS):
        raise RuntimeError(
            f"vasepatch supports transformers >={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS}; found {found}. "
            f'Install a supported release: pip install "transformers>={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS}"'
        )


CONTINUOUS_BATCHING = ("5.22.0", "5.26.0")
"""The transformers releases whose continuous batching a patched model evicts inside (`integration.continuous`):
from the first whose paged-cache internals the hooks read (5.22) to the newest tested, exclusive. Outside it the
batched path runs transformers' own full cache, and the patch warns that it evicts nothing."""


def evicts_in_continuous_batching(version: str | None = None) -> bool:
    """Whether this transformers' continuous batching is one a patched model evicts inside (`CONTINUOUS_BATCHING`)."""
    low, high = CONTINUOUS_BATCHING
    return Version(low) <= Version(version or transformers.__version__) < Version(high)


CACHE_NAMES = ("cache", "past_key_values")
"""What transformers calls the KV cache, in a model's keyword arguments and its outputs: `cache` in recent
releases, `past_key_values` before them. Recent releases still take and return the old name, but log
"`past_key_values`/`cache_params` are deprecated. Use `cache` instead." when it is used."""


def cache_keyword(forward: Callable[..., Any]) -> str:
    """The keyword under which `forward` takes its cache: `cache` where its signature has it, else the old
    `past_key_values`. Read from the signature (a feature), not from the transformers version."""
    return CACHE_NAMES[0] if CACHE_NAMES[0] in inspect.signature(forward).parameters else CACHE_NAMES[1]


def output_cache(output: Any, default: Any = None) -> Any:
    """The cache a model or `generate` output carries, read under the name its class declares, so that a
    recent output is not read under the deprecated name (which logs a deprecation line); `default` for an
    output that declares neither (a tuple, an output without a cache)."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    for name in CACHE_NAMES:
        if name in fields:
            return getattr(output, name)
    return default
