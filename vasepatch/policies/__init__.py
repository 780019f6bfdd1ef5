"""Selection policies, by name.

`get(name, **options)` builds a policy; `register(name, factory)` adds one.
Every registered policy is checked by the property tests automatically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vasepatch.policies.base import Policy
from vasepatch.policies.vase import VaSEPolicy

_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str, factory: Callable[..., Policy], *, overwrite: bool = False) -> None:
    """Register `factory(**options) -> Policy` under `name`.

    The cache calls the factory with the common options `protect`, `sinks`,
    `temperature` and `smooth` (plus any `policy_options` of the config), so a
    factory must accept those keywords, using the ones it needs.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for policy {name!r} must be callable")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"policy {name!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[name] = factory


def available() -> list[str]:
    """Names of the registered policies, sorted."""
    return sorted(_REGISTRY)


def get(name: str, **options: Any) -> Policy:
    """Build the policy registered under `name` with `options`."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; registered policies: {', '.join(available())}") from None
    return factory(**options)


register("vase", VaSEPolicy)

__all__ = ["Policy", "VaSEPolicy", "available", "get", "register"]
