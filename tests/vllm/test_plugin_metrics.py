"""The plugin's metrics without vLLM: what the scheduler counts at each order, the worker's report, the stats payload,
a finished request's own numbers, and the Prometheus series a payload moves (with test doubles of prometheus_client's
classes). The way through vLLM's processes is tested on a server in `test_vllm_metrics.py`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.vllm.test_plugin_parts import _decode, _request, _scheduler
from vasepatch.vllm import metrics, scheduler_side
from vasepatch.vllm.worker_side import WorkerEviction


class _Metric:
    """A test double of a prometheus_client metric: its children by label values."""

    def __init__(self, name, documentation, labelnames, **options):
        self.name, self.labelnames, self.options = name, list(labelnames), options
        self.children: dict[tuple[str, ...], _Child] = {}

    def labels(self, *values):
        assert len(values) == len(self.labelnames), (self.name, values)
        return self.children.setdefault(tuple(values), _Child())


class _Child:
    def __init__(self):
        self.value, self.observed = 0.0, []

    def inc(self, n):
        assert n >= 0
        self.value += n

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


def _series(engines=(0,)):
    return metrics.Series(["model_name", "engine"], {e: ["m", str(e)] for e in engines}, _Metric, _Metric, _Metric)


def test_the_names_follow_vllms_conventions():
    series = _series()
    names = {m.name for m in series.metrics()}
    assert names == {
        "vllm:vasepatch_evictions", "vllm:vasepatch_evicted_tokens", "vllm:vasepatch_blocks_freed",
        "vllm:vasepatch_eviction_seconds", "vllm:vasepatch_num_requests_evicting", "vllm:vasepatch_query_ring_bytes",
    }  # fmt: skip
    for metric in series.metrics():  # counters are exposed with `_total` by prometheus_client
        assert metric.labelnames[:2] == ["model_name", "engine"]
        assert metric.labelnames[2:] == ([] if metric.name == metrics.RING_BYTES else ["policy"])
    assert series.seconds.options["buckets"] == list(metrics.SECONDS_BUCKETS)
    assert series.ring_bytes.children == {("m", "0"): series.ring_bytes.children[("m", "0")]}  # 0 from the start


def test_the_tally_drains_what_changed_and_keeps_times_only_where_stats_are_sent():
    tally = metrics.Tally()
    tally.evicted("vase", 16, 1)
    tally.evicted("vase", 16, 0)
    tally.evicted("snapkv", 10, 2)
    tally.worker({"eviction_seconds": {"vase": 0.25}, "ring_bytes": 4096}, timed=True)
    tally.worker({"eviction_seconds": {"snapkv": 0.5}, "ring_bytes": 2048}, timed=False)  # log_stats off: no times
    tally.worker(None, timed=True)  # a step without a report leaves the rings' bytes as they were
    payload = tally.drain(["vase", "vase", "snapkv"])
    assert payload == {
        "evictions": {"vase": 2, "snapkv": 1},
        "evicted_tokens": {"vase": 32, "snapkv": 10},
        "blocks_freed": {"vase": 1, "snapkv": 2},
        "eviction_seconds": [["vase", 0.25]],
        "requests_evicting": {"vase": 2, "snapkv": 1},
        "ring_bytes": 2048,
    }
    assert tally.drain([]) == {
        "evictions": {}, "evicted_tokens": {}, "blocks_freed": {}, "eviction_seconds": [], "requests_evicting": {},
        "ring_bytes": 2048,
    }  # fmt: skip


def test_a_payload_moves_the_series_by_what_it_holds_and_a_policy_gone_reads_zero():
    series = _series(engines=(0, 1))
    tally = metrics.Tally()
    tally.evicted("vase", 16, 1)
    tally.worker({"eviction_seconds": {"vase": 0.125}, "ring_bytes": 1000}, timed=True)
    series.record(tally.drain(["vase", "snapkv"]), engine=1)
    tally.evicted("vase", 8, 2)
    series.record(tally.drain([]), engine=1)
    series.record(None, engine=1)  # stats without the plugin's field (a frontend or engine without the plugin)
    series.record(tally.drain(["vase"]), engine=7)  # an engine this frontend does not serve
    counts = {k: m.children[("m", "1", "vase")].value for k, m in series.counters.items()}
    assert counts == {"evictions": 2, "evicted_tokens": 24, "blocks_freed": 3}
    assert series.seconds.children[("m", "1", "vase")].observed == [0.125]
    assert series.evicting.children[("m", "1", "vase")].value == 0
    assert series.evicting.children[("m", "1", "snapkv")].value == 0
    assert series.ring_bytes.children[("m", "1")].value == 1000 and series.ring_bytes.children[("m", "0")].value == 0
    assert not any(("m", "0", "vase") in m.children for m in series.counters.values())


def test_the_plan_counts_each_order_with_the_blocks_it_gave_back():
    budget, window, bs = 40, 8, 16
    req = _request("a", 50, {"vasepatch_budget": budget, "vasepatch_window": window, "vasepatch_policy": "snapkv"})
    full = _request("b", 50, None)
    scheduler, manager = _scheduler([req, full], bs)
    manager.req_to_blocks = {"a": list(range(4)), "b": list(range(10, 14))}
    _decode(req, 50)
    _decode(full, 50)
    scheduler_side.finish(scheduler, scheduler_side.plan(scheduler))  # the prompt: 50 -> 40 slots, 4 -> 3 blocks
    for computed in range(51, 51 + window + 1):
        _decode(req, computed)
        manager.req_to_blocks["a"] = list(range(-(-(computed - req.vasepatch.dropped) // bs)))
        scheduler_side.plan(scheduler)  # 48 -> 40 slots at 58 computed: 3 blocks kept, none given back
    tally = metrics.tally_of(scheduler)
    assert tally.drain([]) == {
        "evictions": {"snapkv": 2}, "evicted_tokens": {"snapkv": 10 + window}, "blocks_freed": {"snapkv": 1},
        "eviction_seconds": [], "requests_evicting": {}, "ring_bytes": 0,
    }  # fmt: skip
    assert metrics.request_result(req.vasepatch) == {
        "policy": "snapkv", "budget": budget, "window": window, "evictions": 2, "evicted_tokens": 10 + window,
    }  # fmt: skip
    assert metrics.request_result(full.vasepatch) is None


def _planned_step(budget: int, window: int, report: dict):
    """A `vase` request ("a", planned to evict its 50-token prompt to `budget`) and a full-cache one ("b"), both
    decoding; `plan` ran and the worker's `report` came back. Returns the scheduler and the states to update."""
    req = _request("a", 50, {"vasepatch_budget": budget, "vasepatch_window": window})
    full = _request("b", 50, None)
    scheduler, manager = _scheduler([req, full], 16)
    scheduler.log_stats = True
    manager.req_to_blocks = {"a": list(range(4)), "b": list(range(4))}
    _decode(req, 50)
    _decode(full, 50)
    scheduler_side.plan(scheduler)
    return scheduler, metrics.before_update(scheduler, SimpleNamespace(**{metrics.WORKER_ATTR: report}))


def test_update_from_output_takes_the_workers_report_and_gives_stats_and_results():
    budget, window = 40, 8
    scheduler, states = _planned_step(budget, window, metrics.worker_report({"vase": 0.5}, 123))
    scheduler.running = []  # both finish at this step
    stats = SimpleNamespace()
    done = [SimpleNamespace(request_id=r, finish_reason="length", kv_transfer_params=None) for r in "ab"]
    outputs = {0: SimpleNamespace(outputs=done, scheduler_stats=stats)}
    metrics.after_update(scheduler, outputs, states)
    assert done[0].kv_transfer_params == {
        "vasepatch": {"policy": "vase", "budget": budget, "window": window, "evictions": 1, "evicted_tokens": 10}
    }
    assert done[1].kv_transfer_params is None
    assert getattr(stats, metrics.STATS_FIELD) == {
        "evictions": {"vase": 1}, "evicted_tokens": {"vase": 10}, "blocks_freed": {"vase": 1},
        "eviction_seconds": [["vase", 0.5]], "requests_evicting": {}, "ring_bytes": 123,
    }  # fmt: skip


def test_the_worker_reports_its_times_once_and_its_rings_bytes():
    worker = WorkerEviction()
    worker.eviction_seconds = {"vase": 0.5}
    worker.rings.assign("r", 4)
    worker.rings.plan(["r"], [0], [2], [0])
    import torch

    worker.rings.record("layer", torch.zeros(2, 3, 8))
    first, second = worker.report(), worker.report()
    assert first == {"eviction_seconds": {"vase": 0.5}, "ring_bytes": 1 * 4 * 3 * 8 * 4}
    assert second == {"eviction_seconds": {}, "ring_bytes": first["ring_bytes"]}
    worker.removed("r")
    assert worker.report()["ring_bytes"] == 0


@pytest.mark.parametrize("policy", ["vase", len])
def test_the_policy_label_is_a_name(policy):
    assert metrics.policy_name(SimpleNamespace(policy=policy)) == ("vase" if policy == "vase" else "len")


# --- found by the mutation check (issue 40) --------------------------------------------------------------------


def test_the_stats_count_the_running_requests_that_evict_by_policy():
    scheduler, states = _planned_step(40, 8, metrics.worker_report({}, 0))
    stats = SimpleNamespace()
    metrics.after_update(scheduler, {0: SimpleNamespace(outputs=[], scheduler_stats=stats)}, states)
    assert getattr(stats, metrics.STATS_FIELD)["requests_evicting"] == {"vase": 1}  # both still run; one evicts


def test_every_series_has_a_sentence_for_its_help_text():
    docs = {}

    def metric(name, documentation, labelnames, **options):
        docs[name] = documentation
        return _Metric(name, documentation, labelnames, **options)

    metrics.Series(["model_name", "engine"], {0: ["m", "0"]}, metric, metric, metric)
    assert len(docs) == 6 and all(d[0].isupper() and d.endswith(".") for d in docs.values()), docs
    assert (
        docs["vllm:vasepatch_num_requests_evicting"]
        == "Running requests that evict (vasepatch settings with a budget)."
    )


def test_the_stat_logger_labels_each_engine_and_records_the_plugins_field():
    from vasepatch.vllm import stat_logger

    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m"))
    logger = stat_logger.VaSEStatLogger(config, [0, 1])
    assert logger.per_engine == {0: ["m", "0"], 1: ["m", "1"]}
    logger.active, logger.series = True, _series(engines=(0, 1))  # the test doubles, not prometheus_client's
    tally = metrics.Tally()
    tally.evicted("vase", 16, 1)
    logger.record(SimpleNamespace(**{metrics.STATS_FIELD: tally.drain([])}), None, engine_idx=1)
    assert logger.series.counters["evictions"].children[("m", "1", "vase")].value == 1
