"""The VaSE settings of one vLLM request: the engine's defaults merged with the request's own.

A pure module (no vLLM import): the plugin's patches call it in every process with what vLLM hands
them, so the API server, the scheduler and the workers read the same settings the same way.

- Engine-wide defaults: `additional_config={"vasepatch": {"budget": 1024, "window": 64, ...}}`
  (`--additional-config` on the command line). With them every request evicts, unless it opts out.
- Per request: flat keys of `SamplingParams.extra_args` (`vllm_xargs` on the OpenAI server, whose values
  cannot nest): `vasepatch_budget`, `vasepatch_window`, `vasepatch_policy`, ... They override the engine's.
  `vasepatch_policy="full"` runs the request with the full cache.
- With neither, a request runs with vLLM's full cache: one engine serves both.

Every value is checked as `VaSEConfig` checks it, with the same messages, plus the policy's options
(`vasepatch.policies.for_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vasepatch.config import BOOL_FIELDS, FULL, VaSEConfig

ENGINE_KEY = "vasepatch"  # additional_config["vasepatch"]
REQUEST_PREFIX = "vasepatch_"  # extra_args["vasepatch_budget"], ...
ENGINE_FIELDS = (
    "budget",
    "window",
    "protect",
    "sinks",
    "policy",
    "temperature",
    "smooth",
    "seed",
    "policy_options",
    "check_policy_output",
    "shared_heads",
)
REQUEST_FIELDS = tuple(f for f in ENGINE_FIELDS if f != "policy_options")  # flat values only
DEFAULT_SEED = 0  # a request with no seed anywhere: the same kept sets run after run


class SettingsError(ValueError):
    """A VaSE setting vLLM was given is wrong; `parameter` names where it came from."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


def engine_settings(additional_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The engine's defaults (`additional_config["vasepatch"]`), keys checked; `{}` when absent."""
    raw = (additional_config or {}).get(ENGINE_KEY)
    if raw is None:
        return {}
    where = f"additional_config[{ENGINE_KEY!r}]"
    if not isinstance(raw, Mapping):
        raise SettingsError(f"{where} must be a JSON object of VaSE settings, got {raw!r}", where)
    unknown = sorted(set(raw) - set(ENGINE_FIELDS))
    if unknown:
        raise SettingsError(
            f"{where} has unknown setting(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(ENGINE_FIELDS)}",
            f"{where}[{unknown[0]!r}]",
        )
    if "budget" not in raw and raw.get("policy", "vase") != FULL:
        raise SettingsError(f"{where} must set 'budget' (KV pairs kept per request, layer and KV head)", where)
    return dict(raw)


def request_settings(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request's own settings (`extra_args["vasepatch_*"]`, prefix removed), keys checked."""
    given = {k: v for k, v in (extra_args or {}).items() if isinstance(k, str) and k.startswith(REQUEST_PREFIX)}
    unknown = sorted(k for k in given if k[len(REQUEST_PREFIX) :] not in REQUEST_FIELDS)
    if unknown:
        allowed = ", ".join(REQUEST_PREFIX + f for f in REQUEST_FIELDS)
        raise SettingsError(f"unknown request setting {unknown[0]!r}; allowed: {allowed}", unknown[0])
    return {k[len(REQUEST_PREFIX) :]: _request_bool(k, v) for k, v in given.items()}


def _request_bool(key: str, value: Any) -> Any:
    """A yes/no setting as HTTP can send it: vLLM's server types `vllm_xargs` values as str, int, float or
    list, so JSON `true`/`false` arrive as 1/0; those and "true"/"false" are taken as the bool."""
    if key[len(REQUEST_PREFIX) :] not in BOOL_FIELDS or isinstance(value, bool):
        return value
    spelled = {1: True, 0: False, "true": True, "false": False}
    key_of = value.lower() if isinstance(value, str) else value
    return spelled.get(key_of, value) if isinstance(key_of, (int, str)) else value


def resolve(
    additional_config: Mapping[str, Any] | None, extra_args: Mapping[str, Any] | None, sampling_seed: int | None
) -> VaSEConfig | None:
    """The request's `VaSEConfig`, or None: the full cache (no settings anywhere, or policy `"full"`).

    The seed is `vasepatch_seed`, else the engine's, else the request's sampling seed, else 0, so that
    the kept sets never depend on what else is in the batch."""
    engine = engine_settings(additional_config)
    own = request_settings(extra_args)
    merged = {**engine, **own}
    if not merged or merged.get("policy") == FULL:
        return None
    if "budget" not in merged:
        raise SettingsError(
            f"a request that evicts must set {REQUEST_PREFIX}budget (this engine has no "
            f"additional_config[{ENGINE_KEY!r}] defaults)",
            REQUEST_PREFIX + "budget",
        )
    if merged.get("seed") is None:
        merged["seed"] = DEFAULT_SEED if sampling_seed is None else sampling_seed
    try:
        config = VaSEConfig(**merged)
        from vasepatch import policies  # the policy's name and options, checked where they live

        policies.for_config(config)
    except ValueError as exc:
        raise SettingsError(str(exc), _blame(str(exc), own, engine)) from None
    return config


def _blame(message: str, own: Mapping[str, Any], engine: Mapping[str, Any]) -> str:
    """Where the setting a message names came from (the first setting it names that was given): the
    request's key, else the engine's."""
    at = {f.name: message.find(f.name) for f in dataclasses.fields(VaSEConfig)}
    named = [name for _, name in sorted((i, name) for name, i in at.items() if i >= 0)]
    if "option(s)" in message:  # the policy's own options: `policy_options`
        named.insert(0, "policy_options")
    for name in named:
        if name in own:
            return REQUEST_PREFIX + name
        if name in engine:
            return f"additional_config[{ENGINE_KEY!r}][{name!r}]"
    return REQUEST_PREFIX + (named[0] if named else "budget") if own else f"additional_config[{ENGINE_KEY!r}]"
