"""The plugin's metrics through vLLM: its series on the OpenAI server's `/metrics`, a request's own numbers in its
response, and the same series offline through `LLM.get_metrics()`.

One server for the module's server tests (`test_vllm_server`'s start and stop, engine defaults budget 256 and
window 32), its requests run one at a time and greedy, so each moves the series by its own evictions only. What a
request evicts is derived from its settings and token counts: with its prompt (`P` tokens) under the budget, the
scheduler orders an eviction before a step whenever the request holds `budget + window` slots, which drops `window`
of them. It last plans before the step that samples its last token, holding KV for `P + G - 1` positions, so it
evicts `k = (P + G - 1 - budget) // window` times (`window` positions each: the positions minus what it holds), and
each eviction gives back the blocks between `ceil((budget + window) / block)` and `ceil(budget / block)`.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: the vLLM tests run in their own venv (vasepatch[vllm])"
)
openai = pytest.importorskip("openai", reason="the openai client is not installed (vasepatch[vllm] brings it)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402  (vLLM brings it)

from tests.vllm.engines import engine  # noqa: E402
from tests.vllm.test_vllm_server import REQUEST_S, STORY, Server, _start, _stop  # noqa: E402
from vasepatch.vllm import metrics  # noqa: E402

pytestmark = pytest.mark.timeout(420)  # the first test's share includes the server's start

BLOCK = 32  # the server's --block-size
BUDGET, WINDOW = 64, 16  # a request's own settings: over the 42-token chat prompt, a block apart
EVICTING = {"vasepatch_budget": BUDGET, "vasepatch_window": WINDOW}
NEW = 100  # generated tokens per request
POLICIES = ("vase", "snapkv")
COUNTERS = {"evictions": metrics.EVICTIONS, "evicted_tokens": metrics.EVICTED_TOKENS, "blocks": metrics.BLOCKS_FREED}


def expected(prompt: int, new: int) -> dict[str, int]:
    """What a request of `prompt` tokens (under the budget) evicts generating `new` tokens (module docstring)."""
    positions = prompt + new - 1
    k = max(0, (positions - BUDGET) // WINDOW)
    per_eviction = -(-(BUDGET + WINDOW) // BLOCK) - -(-BUDGET // BLOCK)
    return {"evictions": k, "evicted_tokens": k * WINDOW, "blocks": k * per_eviction}


def scrape(server: Server) -> dict[tuple[str, frozenset], float]:
    """Every sample of the plugin's series on `/metrics`, by name and labels."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(metrics.PREFIX):
                found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample `name` whose labels include `labels` (0 where there is none yet)."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else 0.0


def eviction_series(samples: dict) -> dict:
    """The samples that evictions move: the counters and the histogram's counts and sums."""
    names = {f"{n}_total" for n in COUNTERS.values()} | {f"{metrics.EVICTION_SECONDS}_{s}" for s in ("count", "sum")}
    return {key: v for key, v in samples.items() if key[0] in names}


@pytest.fixture(scope="module")
def server(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = _start(smollm2_path, tmp_path_factory.mktemp("vllm-metrics") / "server.log")
    try:
        yield running
    finally:
        _stop(running.proc)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", timeout=REQUEST_S, max_retries=0) as api:
        yield api


def chat(server: Server, client: Any, xargs: dict, new: int = NEW) -> Any:
    with server.explained():
        response = client.chat.completions.create(
            model=server.model, messages=STORY, max_tokens=new, temperature=0,
            extra_body={"ignore_eos": True, "vllm_xargs": xargs},
        )  # fmt: skip
    assert response.usage.completion_tokens == new
    return response


def drained(server: Server, seconds: float = 30) -> dict:
    """`/metrics` once no evicting request runs and the rings hold nothing (the drain's last stats have come)."""
    deadline = time.monotonic() + seconds
    while True:
        samples = scrape(server)
        running = sum(v for (n, _), v in samples.items() if n == metrics.REQUESTS_EVICTING)
        if (running == 0 and value(samples, metrics.RING_BYTES) == 0) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def test_the_stats_field_travels_in_vllms_encoding_and_the_shared_empty_output_stays_as_it_is() -> None:
    """No engine: the field added to `SchedulerStats` survives vLLM's msgpack round trip from the EngineCore to the
    frontend (absent: None), and a report goes on a copy of vLLM's shared empty runner output."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vasepatch.vllm import engine_access

    engine_access.add_stats_field(metrics.STATS_FIELD)
    engine_access.add_stats_field(metrics.STATS_FIELD)  # idempotent
    tally = metrics.Tally()
    tally.evicted("vase", 16, 1)
    tally.worker(metrics.worker_report({"vase": 0.5}, 64), timed=True)
    stats, plain = SchedulerStats(num_running_reqs=1), SchedulerStats(num_running_reqs=2)
    setattr(stats, metrics.STATS_FIELD, tally.drain(["vase"]))
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    got = decoder.decode(encoder.encode(EngineCoreOutputs(scheduler_stats=stats))).scheduler_stats
    assert getattr(got, metrics.STATS_FIELD) == getattr(stats, metrics.STATS_FIELD) and got.num_running_reqs == 1
    got = decoder.decode(encoder.encode(EngineCoreOutputs(scheduler_stats=plain))).scheduler_stats
    assert getattr(got, metrics.STATS_FIELD) is None
    reported = engine_access.with_report(EMPTY_MODEL_RUNNER_OUTPUT, metrics.WORKER_ATTR, lambda: {"ring_bytes": 0})
    assert isinstance(reported, ModelRunnerOutput) and reported is not EMPTY_MODEL_RUNNER_OUTPUT
    assert getattr(reported, metrics.WORKER_ATTR) == {"ring_bytes": 0}
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, metrics.WORKER_ATTR)
    assert engine_access.with_report(None, metrics.WORKER_ATTR, lambda: 1 / 0) is None  # sampling follows: untouched


def test_offline_the_same_series_through_get_metrics(smollm2_path: str) -> None:
    """First in the module: its engine is shut down before the server starts (one engine at a time)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram

    from vasepatch.vllm import stat_logger

    prompt = list(range(1000, 1042))  # 42 tokens, as the chat prompt above
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, extra_args=EVICTING)
    with engine(smollm2_path, disable_log_stats=False) as llm:
        stat_logger.attach(llm)
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        found = {(m.name, m.labels.get("policy")): m for m in llm.get_metrics() if m.name.startswith(metrics.PREFIX)}
    want = expected(len(prompt), NEW)
    for key, name in COUNTERS.items():
        assert isinstance(found[(name, "vase")], Counter) and found[(name, "vase")].value == want[key]
    assert isinstance(found[(metrics.EVICTION_SECONDS, "vase")], Histogram)
    assert found[(metrics.EVICTION_SECONDS, "vase")].count == want["evictions"]
    assert isinstance(found[(metrics.RING_BYTES, None)], Gauge)
    assert output.kv_transfer_params["vasepatch"]["evicted_tokens"] == want["evicted_tokens"]


def test_the_series_are_there_with_vllms_labels_before_any_request(server: Server) -> None:
    samples = scrape(server)
    labels = {dict(ls)["model_name"] for (n, ls), _ in samples.items() if n == metrics.RING_BYTES}
    assert labels == {server.model}, samples
    assert value(samples, metrics.RING_BYTES, engine="0") == 0
    assert eviction_series(samples) == {}  # no policy has evicted yet


def test_a_full_cache_request_moves_no_eviction_series(server: Server, client: Any) -> None:
    before = scrape(server)
    response = chat(server, client, {"vasepatch_policy": "full"})
    after = drained(server)
    assert eviction_series(after) == eviction_series(before)
    assert (response.model_extra or {}).get("kv_transfer_params") is None  # nothing evicted: nothing to say


@pytest.mark.parametrize("policy", POLICIES)
def test_an_evicting_request_moves_the_series_by_what_it_evicted(server: Server, client: Any, policy: str) -> None:
    before = scrape(server)
    response = chat(server, client, {**EVICTING, "vasepatch_policy": policy})
    after = drained(server)
    want = expected(response.usage.prompt_tokens, NEW)
    assert want["evictions"] == 4 and response.usage.prompt_tokens < BUDGET  # the settings do what they are for
    for key, name in COUNTERS.items():
        for other in POLICIES:
            moved = value(after, f"{name}_total", policy=other) - value(before, f"{name}_total", policy=other)
            assert moved == (want[key] if other == policy else 0), (key, other, before, after)
    steps = value(after, f"{metrics.EVICTION_SECONDS}_count", policy=policy)
    steps -= value(before, f"{metrics.EVICTION_SECONDS}_count", policy=policy)
    assert steps == want["evictions"]  # alone in the engine: one step per eviction
    assert value(after, f"{metrics.EVICTION_SECONDS}_sum", policy=policy) > 0
    result = (response.model_extra or {}).get("kv_transfer_params")
    assert result == {
        "vasepatch": {"policy": policy, "budget": BUDGET, "window": WINDOW, "evictions": want["evictions"],
                      "evicted_tokens": want["evicted_tokens"]}
    }  # fmt: skip


def test_while_a_request_evicts_the_gauges_show_it_and_read_zero_after_the_drain(
    server: Server, client: Any, smollm2_path: str
) -> None:
    config = json.loads((Path(smollm2_path) / "config.json").read_text())
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    ring = layers * WINDOW * heads * (config["hidden_size"] // heads) * 4  # one row per layer, float32 queries
    seen = []
    with server.explained():
        stream = client.chat.completions.create(
            model=server.model, messages=STORY, max_tokens=200, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "vllm_xargs": EVICTING},
        )  # fmt: skip
        for i, _ in enumerate(stream):
            if i in (60, 120):
                seen.append(scrape(server))
    for samples in seen:
        assert value(samples, metrics.REQUESTS_EVICTING, policy="vase") == 1
        assert value(samples, metrics.RING_BYTES) == ring
    after = drained(server)
    assert value(after, metrics.REQUESTS_EVICTING, policy="vase") == 0
    assert value(after, metrics.RING_BYTES) == 0
    assert value(after, metrics.REQUESTS_EVICTING, policy="snapkv") == 0
