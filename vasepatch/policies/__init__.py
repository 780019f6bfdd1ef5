"""Selection policies, by name.

`get(name, **options)` builds a policy; `register(name, factory)` adds one.
Every registered policy is checked by the property tests automatically.

| name | policy |
|---|---|
| `vase` | VaSE-AttnV: sinks + largest value ranges protected, the rest sampled by attention |
| `vase-topk` | the same with deterministic top-k instead of sampling |
| `vase-l2`, `vase-var` | protection by the l2 norm / variance of the values instead of their range |
| `protect-random` | the protected slots go to random candidates |
| `evict-large` | the largest-range values are evicted on purpose (the paper's catastrophic ablation) |
| `vase-dkv` | VaSE-DKV: `‖KG‖²·‖VG‖²` with `G` redrawn at every eviction, top-k |
| `cur` | the same with one fixed `G` |
| `snapkv` | window attention, deterministic top-k |
| `rkv` | R-KV: `0.5·attention - 0.5·key redundancy`, top-k |
| `streaming` | StreamingLLM: sinks + most recent |
| `random` | uniform among the valid candidates |
| `full` | never evicts (the reference; `budget` must cover the whole sequence) |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vasepatch.policies.base import Policy
from vasepatch.policies.dkv import DKVPolicy
from vasepatch.policies.rkv import RKVPolicy
from vasepatch.policies.simple import FullPolicy, RandomPolicy, StreamingPolicy
from vasepatch.policies.snapkv import SnapKVPolicy
from vasepatch.policies.vase import VaSEPolicy

COMMON_OPTIONS = ("protect", "sinks", "temperature", "smooth")
_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str, factory: Callable[..., Policy], *, overwrite: bool = False) -> None:
    """Register `factory(**options) -> Policy` under `name`.

    The cache calls the factory with the common options `protect`, `sinks`,
    `temperature` and `smooth` (plus any `policy_options` of the config), so a
    factory must accept those keywords, using the ones it needs
    (`from_dataclass` builds such a factory from a policy dataclass).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for policy {name!r} must be callable")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"policy {name!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[name] = factory


def from_dataclass(cls: type, **preset: Any) -> Callable[..., Policy]:
    """A factory for the policy dataclass `cls` with `preset` fields: the common options
    that `cls` has no field for are dropped; any other unknown option is an error."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}

    def factory(**options: Any) -> Policy:
        kwargs = {k: v for k, v in options.items() if k in fields or k not in COMMON_OPTIONS}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"{cls.__name__} has no option(s) {unknown}; its options are {sorted(fields)}")
        return cls(**{**preset, **kwargs})

    factory.__doc__ = cls.__doc__
    return factory


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


def for_config(config: Any) -> Policy:
    """The policy a `VaSEConfig` asks for, built with its common options and `policy_options`."""
    return get(
        config.policy,
        protect=config.n_protect,
        sinks=config.sinks,
        temperature=config.temperature,
        smooth=config.smooth,
        **dict(config.policy_options),
    )


def evicts(policy: Policy) -> bool:
    """Whether a cache with `policy` ever evicts (False only for reference policies like `full`)."""
    return bool(getattr(policy, "evicts", True))


register("vase", from_dataclass(VaSEPolicy))
register("vase-topk", from_dataclass(VaSEPolicy, sample=False))
register("vase-l2", from_dataclass(VaSEPolicy, score="l2"))
register("vase-var", from_dataclass(VaSEPolicy, score="var"))
register("protect-random", from_dataclass(VaSEPolicy, protection="random"))
register("evict-large", from_dataclass(VaSEPolicy, protection="evict-largest"))
register("vase-dkv", from_dataclass(DKVPolicy, resample=True))
register("cur", from_dataclass(DKVPolicy, resample=False))
register("snapkv", from_dataclass(SnapKVPolicy))
register("rkv", from_dataclass(RKVPolicy))
register("streaming", from_dataclass(StreamingPolicy))
register("random", from_dataclass(RandomPolicy))
register("full", from_dataclass(FullPolicy))

__all__ = [
    "COMMON_OPTIONS",
    "DKVPolicy",
    "FullPolicy",
    "Policy",
    "RKVPolicy",
    "RandomPolicy",
    "SnapKVPolicy",
    "StreamingPolicy",
    "VaSEPolicy",
    "available",
    "evicts",
    "for_config",
    "from_dataclass",
    "get",
    "register",
]
