"""Exceptions raised by vasepatch."""

from __future__ import annotations


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
