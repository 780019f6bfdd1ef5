"""Selection policies, by name.

`get(name, **options)` builds a policy; `register(name, priority, **preset)` adds
one. Every registered policy is checked by the property tests automatically.
Never evicting (`policy="full"`) is a mode of the cache, not a policy.

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
| `knorm` | sinks + the keys with the smallest L2 norm |
| `streaming` | StreamingLLM: sinks + most recent |
| `random` | uniform among the valid candidates |
| `triattention` | TriAttention: the attention calibrated future queries would pay each key (`vasepatch calibrate`) |
"""

from __future__ import annotations

from typing import Any

from vasepatch.config import FULL, plain
from vasepatch.policies.base import INPUTS, Policy, PolicyOutputError, PriorityFn, check_picks, inputs_of
from vasepatch.policies.dkv import dkv
from vasepatch.policies.keyed import KeyedGenerator
from vasepatch.policies.knorm import knorm
from vasepatch.policies.options import COMMON_OPTIONS, Option, options_of, resolve
from vasepatch.policies.rkv import rkv
from vasepatch.policies.simple import streaming, uniform
from vasepatch.policies.snapkv import snapkv
from vasepatch.policies.triattention import triattention
from vasepatch.policies.vase import vase

_REGISTRY: dict[str, tuple[PriorityFn, dict[str, Option], dict[str, Any]]] = {}


def _not_a_policy(name: str) -> ValueError:
    return ValueError(f"{name!r} is the cache's never-evict mode (VaSEConfig(policy={name!r})), not a policy")


def register(name: str, priority: PriorityFn, *, overwrite: bool = False, **preset: Any) -> None:
    """Register the priority function `priority` under `name`, with some options preset.

    `priority`'s positional parameters name the inputs it reads (out of
    `base.INPUTS`), its keyword-only parameters are its options (each with a
    default). The presets are checked now; options given to `get` override them.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if name == FULL:
        raise _not_a_policy(name)
    if not callable(priority):
        raise TypeError(f"priority function of policy {name!r} must be callable")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"policy {name!r} is already registered (pass overwrite=True to replace it)")
    inputs_of(priority)
    declared = options_of(priority)
    resolve(name, declared, {k: v for k, v in preset.items() if k in declared or k not in COMMON_OPTIONS})
    _REGISTRY[name] = (priority, declared, preset)


def available() -> list[str]:
    """Names of the registered policies, sorted."""
    return sorted(_REGISTRY)


def config_names() -> list[str]:
    """Every name `VaSEConfig.policy` accepts: `"full"` (the cache's never-evict mode) first,
    then the registered policies."""
    return [FULL, *available()]


def get(name: str, *, shared_heads: bool = False, **options: Any) -> Policy:
    """Build the policy registered under `name` with `options`, checked now (ValueError naming
    the option and what it accepts). The common options (`COMMON_OPTIONS`) reach only the
    policies that declare them; any other unknown option is a ValueError. `shared_heads=True`:
    all KV heads keep the same candidates (`vasepatch.policies.shared`)."""
    return _build(name, options, check_output=True, shared_heads=shared_heads)


def _build(name: str, options: dict[str, Any], check_output: bool, shared_heads: bool = False) -> Policy:
    if name == FULL:
        raise _not_a_policy(name)
    try:
        priority, declared, preset = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; registered policies: {', '.join(available())}") from None
    if not isinstance(plain(shared_heads), bool):
        raise ValueError(f"shared_heads must be a bool, got {shared_heads!r}")
    options = resolve(name, declared, {**preset, **options})
    shared_heads = plain(shared_heads)
    return Policy(name, priority, options, check_output=check_output, shared_heads=shared_heads)


def for_config(config: Any) -> Policy:
    """The policy a `VaSEConfig` asks for, built with its common options and `policy_options`
    (checked now), its picks checked at each eviction unless `config.check_policy_output` is False,
    one set of candidates for all KV heads if `config.shared_heads`."""
    common = {"protect": config.n_protect, "sinks": config.sinks}
    common.update(temperature=config.temperature, smooth=config.smooth)
    repeated = sorted(set(common) & set(config.policy_options))
    if repeated:
        raise ValueError(f"policy_options may not set {', '.join(repeated)}: set the VaSEConfig field(s) instead")
    options = {**common, **config.policy_options}
    return _build(config.policy, options, config.check_policy_output, config.shared_heads)


register("vase", vase)
register("vase-topk", vase, sample=False)
register("vase-l2", vase, score="l2")
register("vase-var", vase, score="var")
register("protect-random", vase, protection="random")
register("evict-large", vase, protection="evict-largest")
register("vase-dkv", dkv, resample=True)
register("cur", dkv, resample=False)
register("snapkv", snapkv)
register("rkv", rkv)
register("knorm", knorm)
register("streaming", streaming)
register("random", uniform)
register("triattention", triattention)

__all__ = [
    "COMMON_OPTIONS",
    "INPUTS",
    "KeyedGenerator",
    "Policy",
    "PolicyOutputError",
    "available",
    "check_picks",
    "config_names",
    "dkv",
    "for_config",
    "get",
    "knorm",
    "register",
    "rkv",
    "snapkv",
    "streaming",
    "triattention",
    "uniform",
    "vase",
]
