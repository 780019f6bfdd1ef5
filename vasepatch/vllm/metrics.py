"""The plugin's numbers for an operator: what is counted where, and how it reaches vLLM's `/metrics`.

Three processes take part (in vLLM's multiprocessing mode):

- **The scheduler (EngineCore)** issues every eviction order (`scheduler_side.plan`), so it counts them, the
  positions each one evicts (`n - pinned - budget`: what the request held less what it keeps) and the tail blocks
  each one gives back to the pool (`Tally`), per policy. It knows which running requests evict.
- **The worker** runs the compaction, so it times it (per policy, once per step: the requests of a policy due at
  one step are compacted together, and that is the pause the step takes) and knows what its query rings hold
  (`QueryRings.nbytes`, the pools' allocated bytes). It puts both on the `ModelRunnerOutput` it returns each step
  (`WORKER_ATTR`), which vLLM pickles back to the EngineCore as it is; only the output rank's (rank 0) comes back.
  The last step of a drain (the one that tells the workers which requests finished) returns vLLM's empty output,
  and carries the report too, so the ring bytes read 0 once every request is done.
- **The frontend** (the API server, or `LLM`'s process) gets the scheduler's stats at every step
  (`SchedulerStats`, sent with the step's outputs). The plugin adds one field to that dataclass (`STATS_FIELD`,
  a dict of plain numbers, `payload`), which vLLM's msgpack encoding carries as it carries the others; a frontend
  without the field drops it. Its stat logger plugin (`stat_logger.VaSEStatLogger`) turns it into Prometheus series
  (`Series`), named as vLLM names its own.

Counters travel as what changed since the last stats (`Tally.drain`), so that with several API servers, each step's
stats going to one of them, nothing is counted twice. This module imports no vLLM: `engine_access` holds the vLLM
side, `patches` the wrappers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vasepatch.vllm import engine_access as access

STATS_FIELD = "vasepatch"  # the SchedulerStats field that carries `payload` to the frontend
WORKER_ATTR = "vasepatch_worker"  # the ModelRunnerOutput attribute that carries the worker's report
TALLY_ATTR = "vasepatch_tally"  # the Scheduler attribute holding its `Tally`
RESULT_KEY = "vasepatch"  # a finished evicting request's numbers, under this key of its `kv_transfer_params`

PREFIX = "vllm:vasepatch_"
EVICTIONS = PREFIX + "evictions"  # counter (exposed as ..._total): one per request per eviction
EVICTED_TOKENS = PREFIX + "evicted_tokens"  # counter: positions evicted
BLOCKS_FREED = PREFIX + "blocks_freed"  # counter: KV blocks given back to vLLM's pool by evictions
EVICTION_SECONDS = PREFIX + "eviction_seconds"  # histogram: a step's compaction time, per policy
REQUESTS_EVICTING = PREFIX + "num_requests_evicting"  # gauge: running requests with eviction settings
RING_BYTES = PREFIX + "query_ring_bytes"  # gauge: bytes the worker's query rings hold (rank 0)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COUNTERS = {
    "evictions": (EVICTIONS, "Evictions by vasepatch: one per request evicted, per eviction."),
    "evicted_tokens": (EVICTED_TOKENS, "Positions (tokens) evicted from requests' KV caches by vasepatch."),
    "blocks_freed": (BLOCKS_FREED, "KV cache blocks that vasepatch's evictions gave back to the pool."),
}


def policy_name(config: Any) -> str:
    """The `policy` label of a request's settings (a registered name, or the callable's name)."""
    policy = config.policy
    return policy if isinstance(policy, str) else getattr(policy, "__name__", type(policy).__name__)


@dataclass
class Tally:
    """The scheduler's counts since it last sent stats (`drain`), and the worker's last report."""

    evictions: Counter[str] = field(default_factory=Counter)
    evicted_tokens: Counter[str] = field(default_factory=Counter)
    blocks_freed: Counter[str] = field(default_factory=Counter)
    seconds: list[tuple[str, float]] = field(default_factory=list)  # (policy, a step's compaction time)
    ring_bytes: int = 0

    def evicted(self, policy: str, tokens: int, blocks: int) -> None:
        """One order: a request of `policy` evicts `tokens` positions and gives `blocks` blocks back."""
        self.evictions[policy] += 1
        self.evicted_tokens[policy] += tokens
        self.blocks_freed[policy] += blocks

    def worker(self, report: dict[str, Any] | None, timed: bool) -> None:
        """The worker's report of one step (`worker_report`); its times are kept only where stats are sent
        (`timed`: vLLM's `log_stats`), so that nothing grows unread."""
        if report is None:
            return
        self.ring_bytes = int(report["ring_bytes"])
        if timed:
            self.seconds.extend((policy, float(s)) for policy, s in report["eviction_seconds"].items())

    def drain(self, evicting: Iterable[str]) -> dict[str, Any]:
        """The stats payload (`STATS_FIELD`): what changed since the last one, the running evicting requests by
        policy (`evicting`: one policy name per request) and the rings' bytes now; the counts start over."""
        payload = {
            "evictions": dict(self.evictions),
            "evicted_tokens": dict(self.evicted_tokens),
            "blocks_freed": dict(self.blocks_freed),
            "eviction_seconds": [[policy, s] for policy, s in self.seconds],
            "requests_evicting": dict(Counter(evicting)),
            "ring_bytes": self.ring_bytes,
        }
        self.evictions, self.evicted_tokens, self.blocks_freed, self.seconds = Counter(), Counter(), Counter(), []
        return payload


def tally_of(scheduler: Any) -> Tally:
    """The scheduler's `Tally`, made on first use."""
    tally = getattr(scheduler, TALLY_ATTR, None)
    if tally is None:
        tally = Tally()
        setattr(scheduler, TALLY_ATTR, tally)
    return tally


def worker_report(seconds: dict[str, float], ring_bytes: int) -> dict[str, Any]:
    """What a worker sends with a step's output: each policy's compaction time since its last report, and what its
    query rings hold."""
    return {"eviction_seconds": dict(seconds), "ring_bytes": int(ring_bytes)}


def request_result(state: Any) -> dict[str, Any] | None:
    """A finished request's own numbers (its `RequestState`), or None where it ran with the full cache."""
    config = getattr(state, "config", None)
    if config is None:
        return None
    return {
        "policy": policy_name(config),
        "budget": config.budget,
        "window": config.window,
        "evictions": state.rounds,
        "evicted_tokens": state.evicted,
    }


def before_update(scheduler: Any, model_runner_output: Any) -> dict[str, Any]:
    """Before the scheduler's `update_from_output`: the worker's report of the step in (`WORKER_ATTR`); the running
    requests' states, by id (a request that finishes at this step is gone from the scheduler after it)."""
    tally_of(scheduler).worker(getattr(model_runner_output, WORKER_ATTR, None), timed=access.log_stats(scheduler))
    return {access.request_id(r): getattr(r, "vasepatch", None) for r in access.running(scheduler)}


def after_update(scheduler: Any, outputs: dict[int, Any], states: dict[str, Any]) -> None:
    """After `update_from_output`: each evicting request that finished gets its numbers (`request_result`) in its
    output, and the step's stats, where vLLM made them, the payload (`Tally.drain`)."""
    for output in access.finished_outputs(outputs):
        result = request_result(states.get(access.output_request_id(output)))
        if result is not None:
            access.set_request_result(output, RESULT_KEY, result)
    stats = access.step_stats(outputs)
    if stats is not None:
        running = [getattr(r, "vasepatch", None) for r in access.running(scheduler)]
        evicting = [policy_name(state.config) for state in running if state is not None and state.config is not None]
        setattr(stats, STATS_FIELD, tally_of(scheduler).drain(evicting))


Factory = Callable[..., Any]


class Series:
    """The plugin's Prometheus series in a frontend, labelled as vLLM labels its own (`labelnames`, one list of label
    values per engine) plus `policy` where one applies; `counter`, `gauge` and `histogram` make the metrics
    (prometheus_client's classes, or test doubles)."""

    def __init__(
        self,
        labelnames: list[str],
        per_engine: dict[int, list[str]],
        counter: Factory,
        gauge: Factory,
        histogram: Factory,
    ) -> None:
        self.per_engine = per_engine
        policy = [*labelnames, "policy"]
        self.counters = {
            key: counter(name=name, documentation=doc, labelnames=policy) for key, (name, doc) in COUNTERS.items()
        }
        self.seconds = histogram(
            name=EVICTION_SECONDS,
            documentation="Time a step spends compacting the KV caches of the requests of one policy due at it "
            "(vasepatch, measured on the worker of rank 0).",
            labelnames=policy,
            buckets=list(SECONDS_BUCKETS),
        )
        self.evicting = gauge(
            name=REQUESTS_EVICTING,
            documentation="Running requests that evict (vasepatch settings with a budget).",
            multiprocess_mode="mostrecent",
            labelnames=policy,
        )
        self.ring_bytes = gauge(
            name=RING_BYTES,
            documentation="Bytes held by vasepatch's query rings on the worker of rank 0 (outside vLLM's KV pool).",
            multiprocess_mode="mostrecent",
            labelnames=labelnames,
        )
        self.policies: dict[int, set[str]] = {engine: set() for engine in per_engine}
        for labels in per_engine.values():
            self.ring_bytes.labels(*labels).set(0)

    def metrics(self) -> list[Any]:
        return [*self.counters.values(), self.seconds, self.evicting, self.ring_bytes]

    def record(self, payload: dict[str, Any] | None, engine: int) -> None:
        """One step's stats payload (`Tally.drain`) of `engine`."""
        if payload is None or engine not in self.per_engine:
            return
        labels = self.per_engine[engine]
        seen = self.policies[engine]
        for key, metric in self.counters.items():
            for policy, n in payload[key].items():
                seen.add(policy)
                metric.labels(*labels, policy).inc(n)
        for policy, seconds in payload["eviction_seconds"]:
            seen.add(policy)
            self.seconds.labels(*labels, policy).observe(seconds)
        running = payload["requests_evicting"]
        seen.update(running)
        for policy in seen:  # a policy with none running any more reads 0, not its last count
            self.evicting.labels(*labels, policy).set(running.get(policy, 0))
        self.ring_bytes.labels(*labels).set(payload["ring_bytes"])
