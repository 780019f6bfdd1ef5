"""The transformers releases vasepatch is tested with."""

from __future__ import annotations

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
