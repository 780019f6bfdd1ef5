"""The plugin's Prometheus series in vLLM's frontend: a stat logger plugin (`vllm.stat_logger_plugins`).

vLLM's `AsyncLLM` (the OpenAI server) loads every class of that entry-point group and gives it each step's stats;
`VaSEStatLogger` reads the plugin's field of them (`metrics.STATS_FIELD`) into the series of `metrics.Series`, which
`/metrics` serves beside vLLM's own. Offline, `LLM` loads no such plugin: `attach(llm)` adds the logger to it, and
`llm.get_metrics()` then lists the series too. On a vLLM where the plugin is inert the logger records nothing.

The series are made at the first stats, not when the logger is made: vLLM's own Prometheus logger, made after the
plugins' loggers, unregisters every collector named `vllm:...` when it starts.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vasepatch.vllm import engine_access as access
from vasepatch.vllm import metrics, patches

try:
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase
except ImportError:  # no vLLM here (or one without it): vLLM never loads this class then
    AggregateStatLoggerBase = object  # type: ignore[assignment,misc]

_LIVE: list[metrics.Series] = []  # this process's series (a new engine's logger replaces them)


def _new_series(labelnames: list[str], per_engine: dict[int, list[str]]) -> metrics.Series:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    while _LIVE:
        for metric in _LIVE.pop().metrics():
            with contextlib.suppress(KeyError):  # vLLM's Prometheus logger unregistered it already
                REGISTRY.unregister(metric)
    series = metrics.Series(labelnames, per_engine, Counter, Gauge, Histogram)
    _LIVE.append(series)
    return series


class VaSEStatLogger(AggregateStatLoggerBase):
    """The `vllm.stat_logger_plugins` entry point: one logger for all the engines of a frontend, with vLLM's labels
    (`model_name`, `engine`)."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.active = patches.active()
        model_name = vllm_config.model_config.served_model_name
        self.per_engine = {idx: [model_name, str(idx)] for idx in engine_indexes or [0]}
        self.series: metrics.Series | None = None

    def _series(self) -> metrics.Series:
        if self.series is None:
            self.series = _new_series(["model_name", "engine"], self.per_engine)
        return self.series

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        if self.active and scheduler_stats is not None:
            self._series().record(getattr(scheduler_stats, metrics.STATS_FIELD, None), engine_idx)

    def log_engine_initialized(self) -> None:
        if self.active:
            self._series()

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def attach(llm: Any) -> VaSEStatLogger:
    """Give an offline `vllm.LLM` the plugin's series, which `llm.get_metrics()` then lists with vLLM's own. The
    engine must make stats: `LLM(..., disable_log_stats=False)` (`LLM`'s default is to make none)."""
    loggers = access.stat_loggers(llm)
    if loggers is None:
        raise ValueError("this LLM makes no stats: create it with LLM(..., disable_log_stats=False)")
    logger = VaSEStatLogger(llm.llm_engine.vllm_config, [0])
    loggers.insert(0, logger)
    logger.log_engine_initialized()
    return logger
