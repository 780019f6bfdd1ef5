"""The VaSE settings of one vLLM request: the engine's defaults merged with the request's own.

A pure module (no vLLM import): the plugin's patches call it in every process with what vLLM hands
them, so the API server, the scheduler and the workers read the same settings the same way.

- Engine-wide defaults: `additional_config={"vasepatch": {"budget": 1024, "window": 64, ...}}`
  (`--additional-config` on the command line). With them every request evicts, unless it opts out.
- Per request: flat keys of `SamplingParams.extra_args` (`vllm_xargs` on the OpenAI server, whose values
  cannot nest): `vasepatch_budget`, `vasepatch_window`, `vasepatch_policy`, ... They override the engine's.
  `vasepatch_policy="full"` runs the request with the full cache.
- With neither, a request runs with vLLM's full cache: one engine serves both.
- `prefill`: `"pin"` keeps the prompt's slots as they are (the prefix cache may share them) and evicts only
  what the request generates; `"compress"` evicts from the whole sequence. Unset, it is `"pin"` on an engine
  with prefix caching on (vLLM's default) and `"compress"` without (`default_prefill`).
- Operator limits, engine-only (`LIMIT_FIELDS`): per-request settings come from HTTP clients, so the
  engine caps what a request may ask for (`Limits`: the largest budget and window, or no per-request
  settings at all). A request over a cap is refused (HTTP 400) naming the cap. `max_ring_mib` limits the
  query rings of the requests in flight together: a request whose rings would pass it waits.
- Scheduling, engine-only (`SCHEDULE_FIELDS`): `evictions_per_step` spreads the evictions of requests that
  would all evict at one step over the steps before it (`evictions_per_step`, `scheduler_side.spread`).
- Statistics, engine-only (`STATS_FIELDS`): `stats`, the file of the model's calibrated query statistics
  (`vasepatch calibrate MODEL`) that every request whose policy reads one (`triattention`) reads. Only the
  operator names it: a per-request path would let HTTP clients name files on the server. The engine checks it
  against its model when it starts (`requirements.check_stats`).

Every value is checked as `VaSEConfig` checks it, with the same messages, plus the policy's options
(`vasepatch.policies.for_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
    "prefill",
)
REQUEST_FIELDS = tuple(f for f in ENGINE_FIELDS if f != "policy_options")  # flat values only
LIMIT_FIELDS = ("max_request_budget", "max_request_window", "request_settings", "max_ring_mib")  # the operator's
SCHEDULE_FIELDS = ("evictions_per_step",)  # engine-only: how the scheduler spreads the evictions of its requests
STATS_FIELDS = ("stats",)  # engine-only: the query statistics file a policy with a `stats` option reads
DEFAULT_MAX_WINDOW = 512  # the default cap on a request's window (with max_model_len): its query rings' size
DEFAULT_SEED = 0  # a request with no seed anywhere: the same kept sets run after run
PREFILL_MODES = ("compress", "pin")  # vLLM's; "keep" sizes a buffer by the prompt, which a paged pool has not


def default_prefill(prefix_caching: bool) -> str:
    """A request's prefill mode when no setting names one: `"pin"` on an engine with prefix caching on (the
    prompt's blocks stay as the prefix cache published them, and may be shared), else `"compress"`."""
    return "pin" if prefix_caching else "compress"


class SettingsError(ValueError):
    """A VaSE setting vLLM was given is wrong; `parameter` names where it came from."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


ENGINE_WHERE = f"additional_config[{ENGINE_KEY!r}]"


def _engine_raw(additional_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """`additional_config["vasepatch"]`, keys checked (VaSE defaults and operator limits); `{}` when absent."""
    raw = (additional_config or {}).get(ENGINE_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SettingsError(f"{ENGINE_WHERE} must be a JSON object of VaSE settings, got {raw!r}", ENGINE_WHERE)
    unknown = sorted(set(raw) - set(ENGINE_FIELDS) - set(LIMIT_FIELDS) - set(SCHEDULE_FIELDS) - set(STATS_FIELDS))
    if unknown:
        allowed = ", ".join((*ENGINE_FIELDS, *LIMIT_FIELDS, *SCHEDULE_FIELDS, *STATS_FIELDS))
        raise SettingsError(
            f"{ENGINE_WHERE} has unknown setting(s) {', '.join(map(repr, unknown))}; allowed: {allowed}",
            f"{ENGINE_WHERE}[{unknown[0]!r}]",
        )
    return dict(raw)


def engine_settings(additional_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The engine's VaSE defaults (`additional_config["vasepatch"]` less its limits); `{}` when none.
    With any, `budget` is required: every request of the engine evicts unless it opts out."""
    raw = {k: v for k, v in _engine_raw(additional_config).items() if k in ENGINE_FIELDS}
    if raw and "budget" not in raw and raw.get("policy", "vase") != FULL:
        where = ENGINE_WHERE
        raise SettingsError(f"{where} must set 'budget' (KV pairs kept per request, layer and KV head)", where)
    return raw


@dataclass(frozen=True)
class Limits:
    """What one request may ask for on this engine (the operator's caps, or their defaults)."""

    budget: int
    window: int
    requests_allowed: bool = True
    ring_mib: float | None = None  # the query rings' limit per rank (None: `max_num_seqs` requests at the window cap)

    def check(self, config: VaSEConfig | None, own: Mapping[str, Any]) -> None:
        """Refuse a request whose own settings pass a cap, naming the request's key and the cap."""
        if own and not self.requests_allowed:
            key = REQUEST_PREFIX + next(iter(own))
            raise SettingsError(
                f"{key}: this engine takes no per-request VaSE settings ({ENGINE_WHERE}['request_settings'] "
                "is false); its own settings apply to every request",
                key,
            )
        for field, cap in (("budget", self.budget), ("window", self.window)):
            value = getattr(config, field, 0)
            if field in own and value > cap:
                key = REQUEST_PREFIX + field
                raise SettingsError(
                    f"{key}={value} is over this engine's cap of {cap} "
                    f"({ENGINE_WHERE}['max_request_{field}'], set by the operator or derived from the engine)",
                    key,
                )


def _int_or_zero(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def engine_limits(additional_config: Mapping[str, Any] | None, max_model_len: int) -> Limits:
    """The engine's `Limits`: `max_request_budget` (default `max_model_len`), `max_request_window` (default
    the smaller of `DEFAULT_MAX_WINDOW` and `max_model_len`), `request_settings` (default true) and
    `max_ring_mib` (default None: `requirements.ring_limit` derives it). The defaults never fall below the
    engine's own budget and window."""
    raw = _engine_raw(additional_config)
    own = engine_settings(additional_config)
    budget, window = (_int_or_zero(own.get(k)) for k in ("budget", "window"))  # bad ones are VaSEConfig's to refuse
    defaults = {
        "max_request_budget": max(max_model_len, budget),
        "max_request_window": max(min(DEFAULT_MAX_WINDOW, max_model_len), window),
        "request_settings": True,
        "max_ring_mib": None,
    }
    values = {**defaults, **{k: raw[k] for k in LIMIT_FIELDS if k in raw}}
    for key in LIMIT_FIELDS:
        value, where = values[key], f"{ENGINE_WHERE}[{key!r}]"
        if key == "request_settings" and not isinstance(value, bool):
            raise SettingsError(f"{where} must be true or false, got {value!r}", where)
        if key == "max_ring_mib" and value is not None and not _positive_number(value):
            raise SettingsError(f"{where} must be a positive number of MiB (per rank), got {value!r}", where)
        if key.startswith("max_request") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SettingsError(f"{where} must be a positive integer, got {value!r}", where)
    return Limits(
        values["max_request_budget"], values["max_request_window"], values["request_settings"], values["max_ring_mib"]
    )


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def evictions_per_step(additional_config: Mapping[str, Any] | None) -> int | None:
    """`evictions_per_step`: the number of requests the scheduler aims to evict at one step (a positive int), or
    None (unset: every request evicts when it is due, `scheduler_side.spread`)."""
    value = _engine_raw(additional_config).get("evictions_per_step")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        where = f"{ENGINE_WHERE}['evictions_per_step']"
        raise SettingsError(f"{where} must be a positive integer (or unset: no spreading), got {value!r}", where)
    return value


STATS_WHERE = f"{ENGINE_WHERE}['stats']"


def engine_stats(additional_config: Mapping[str, Any] | None) -> str | None:
    """`stats`: the path of the engine's query statistics file, or None (unset: no policy that reads one runs)."""
    value = _engine_raw(additional_config).get("stats")
    if value is not None and (not isinstance(value, str) or not value):
        raise SettingsError(
            f"{STATS_WHERE} must be the path of a query statistics file (`vasepatch calibrate MODEL` writes one), "
            f"got {value!r}",
            STATS_WHERE,
        )
    return value


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
    additional_config: Mapping[str, Any] | None,
    extra_args: Mapping[str, Any] | None,
    sampling_seed: int | None,
    prefix_caching: bool = False,
) -> VaSEConfig | None:
    """The request's `VaSEConfig`, or None: the full cache (no settings anywhere, or policy `"full"`).

    The seed is `vasepatch_seed`, else the engine's, else the request's sampling seed, else 0, so that
    the kept sets never depend on what else is in the batch. The prefill mode is `vasepatch_prefill`, else
    the engine's, else `default_prefill(prefix_caching)`."""
    engine = engine_settings(additional_config)
    own = request_settings(extra_args)
    merged = {**engine, **own}
    if not merged or merged.get("policy") == FULL:
        return None
    if "budget" not in merged:
        raise SettingsError(
            f"a request that evicts must set {REQUEST_PREFIX}budget (this engine has no {ENGINE_WHERE} defaults)",
            REQUEST_PREFIX + "budget",
        )
    if merged.get("seed") is None:
        merged["seed"] = DEFAULT_SEED if sampling_seed is None else sampling_seed
    merged.setdefault("prefill", default_prefill(prefix_caching))
    if merged["prefill"] not in PREFILL_MODES:
        where = REQUEST_PREFIX + "prefill" if "prefill" in own else f"{ENGINE_WHERE}['prefill']"
        raise SettingsError(
            f"{where}: prefill must be one of {', '.join(map(repr, PREFILL_MODES))} in vLLM, got "
            f"{merged['prefill']!r} ('keep' sizes a buffer by its prompt and may evict it later: the transformers "
            "path's; 'pin' keeps the prompt and evicts only what is generated)",
            where,
        )
    try:
        config = VaSEConfig(**merged)
        from vasepatch import policies  # the policy's name and options, checked where they live

        policy = policies.for_config(config)
    except ValueError as exc:
        raise _request_error(str(exc), own, engine) from None
    if "stats" in policy.options:
        return _with_stats(config, additional_config, own)
    return config


def _with_stats(config: VaSEConfig, additional_config: Mapping[str, Any] | None, own: Mapping[str, Any]) -> VaSEConfig:
    """`config` whose policy options name the engine's statistics file (`engine_stats`), and the rotary's float32
    frequencies (vLLM's rotary computes them in float32 whatever the model's dtype): SettingsError when the engine
    names none, or names one in `policy_options`, where it would apply to one policy only."""
    if "stats" in config.policy_options:
        where = f"{ENGINE_WHERE}['policy_options']"
        raise SettingsError(
            f"{where}: name the statistics file in {STATS_WHERE}, which every request whose policy reads one uses, "
            "not in policy_options",
            where,
        )
    path = engine_stats(additional_config)
    if path is None:
        where = REQUEST_PREFIX + "policy" if "policy" in own else f"{ENGINE_WHERE}['policy']"
        raise SettingsError(
            f"{where}: policy {config.policy!r} reads the model's calibrated query statistics, and this engine has "
            f"none: the operator names the file `vasepatch calibrate MODEL` writes in {STATS_WHERE}",
            where,
        )
    options = {"rotary_dtype": "float32", **config.policy_options, "stats": path}
    return dataclasses.replace(config, policy_options=options)


def defaults_named(message: str, given: Mapping[str, Any], fields: Sequence[str]) -> list[str]:
    """The settings of `fields` that `message` names with a value (`window=64`) and `given` does not set: the values
    it took from VaSEConfig's defaults."""
    return [f for f in fields if f"{f}=" in message and f not in given]


def _request_error(message: str, own: Mapping[str, Any], engine: Mapping[str, Any]) -> SettingsError:
    """The error of a request's bad settings, naming where they came from (`_blame`). When its message names values
    neither the request nor the engine set (VaSEConfig's defaults), it says which and the request keys that change
    them, and a default the message is about is the parameter named (a request with `vasepatch_budget` 64 and no
    window fails on the default window of 64: `vasepatch_window` is what to set)."""
    unset = defaults_named(message, {**engine, **own}, REQUEST_FIELDS) if own else []
    if not unset:
        return SettingsError(message, _blame(message, own, engine))
    keys = ", ".join(REQUEST_PREFIX + f for f in unset)
    note = f" ({', '.join(unset)}: the default, set by neither the request nor the engine; set {keys} to change it)"
    subject = next((f for f in unset if message.startswith(f + " ")), None)
    return SettingsError(message + note, REQUEST_PREFIX + subject if subject else _blame(message, own, engine))


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
            return f"{ENGINE_WHERE}[{name!r}]"
    return REQUEST_PREFIX + (named[0] if named else "budget") if own else ENGINE_WHERE
