"""Exceptions raised by vasepatch, and how to install a missing optional dependency (`install_hint`)."""

from __future__ import annotations

from pathlib import Path


class UnsupportedModelError(ValueError):
    """The model's architecture (or one of its settings) is not supported by vasepatch.

    The message is one line naming the model's class and `model_type` and the reason (for
    detection, one of `vasepatch.integration.families.REASONS`)."""


class AlreadyPatchedError(RuntimeError):
    """`patch` was called on a model that is already patched."""


class NotPatchedError(RuntimeError):
    """`unpatch` was called on a model that vasepatch did not patch."""


class ModelInUseError(RuntimeError):
    """`unpatch` was called while a `generate` or forward call is running on the model."""


class NoEvictionWarning(UserWarning):
    """A patched model ran with a cache that is not vasepatch's (transformers' `DynamicCache` that a plain
    `model(ids)` builds, a `StaticCache`, `cache_implementation="static"`, a cache passed by hand): transformers'
    own path, which evicts nothing. Shown once per patch; `warnings.filterwarnings("ignore",
    category=vasepatch.NoEvictionWarning)` silences it."""


def source_tree(package_dir: Path | None = None) -> Path | None:
    """The checkout vasepatch is imported from (the folder above the package holding a `pyproject.toml`
    of the project `vasepatch`), or None for an installed wheel."""
    package_dir = package_dir or Path(__file__).resolve().parent
    pyproject = package_dir.parent / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return package_dir.parent if 'name = "vasepatch"' in text else None


def install_hint(extra: str, package_dir: Path | None = None) -> str:
    """How to install the optional dependencies `extra` (`eval`, `gpu`, ...) of this copy of vasepatch:
    `pip install -e ".[eval]"` from a checkout (the folder's path instead of `.` when the current directory is
    elsewhere), `pip install "vasepatch[eval]"` for an installed package. Every missing-extra message uses it."""
    root = source_tree(package_dir)
    if root is None:
        return f'pip install "vasepatch[{extra}]"'
    try:
        here = Path.cwd().resolve() == root.resolve()
    except OSError:
        here = False
    return f'pip install -e "{"." if here else root}[{extra}]"'
