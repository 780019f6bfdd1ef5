"""Starting and stopping vLLM engines in the tests: every engine has a bounded start and is shut down."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

ENGINE_DEFAULTS = dict(
    dtype="float32",
    enforce_eager=True,
    enable_prefix_caching=False,
    max_model_len=4096,
    seed=0,
    gpu_memory_utilization=0.3,  # on the CPU: the share of RAM vLLM may take (the KV pool is VLLM_CPU_KVCACHE_SPACE)
    block_size=32,
)


@contextlib.contextmanager
def engine(model: str, **kwargs: Any) -> Iterator[Any]:
    """An offline `vllm.LLM` with the tests' defaults (overridable), shut down on exit."""
    from vllm import LLM

    llm = LLM(model, **{**ENGINE_DEFAULTS, **kwargs})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def worker_state(worker: Any) -> dict[str, Any]:
    """What the plugin holds in a worker (run through `LLM.collective_rpc`)."""
    state = getattr(worker.model_runner, "vasepatch", None)
    if state is None:
        return {"evictions": 0, "eviction_calls": 0, "requests": 0, "ring_bytes": 0, "generators_restored": 0}
    return {
        "evictions": state.evictions,
        "eviction_calls": state.eviction_calls,
        "requests": len(state.requests),
        "ring_bytes": state.rings.nbytes,
        "generators_restored": state.generators_restored,
    }


def record_blocks(worker) -> None:
    """From now on the model runner notes the block ids of every request scheduled at every step, once the
    step's evictions have cut them and vLLM has appended the step's new blocks, and the steps at which a
    preempted request resumed (`collective_rpc`)."""
    runner = worker.model_runner
    runner.seen_blocks, runner.block_steps, runner.resumed_at = {}, [], {}
    update = runner._update_states

    def noting(scheduler_output, *args, **kwargs):
        result = update(scheduler_output, *args, **kwargs)
        scheduled = scheduler_output.num_scheduled_tokens
        step = {r: list(state.block_ids[0]) for r, state in runner.requests.items() if r in scheduled}
        for req_id, blocks in step.items():
            runner.seen_blocks.setdefault(req_id, []).append(blocks)
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            runner.resumed_at.setdefault(req_id, []).append(len(runner.block_steps))
        runner.block_steps.append(step)
        return result

    runner._update_states = noting


def record_eviction_steps(worker) -> None:
    """From now on the worker notes, at every step that evicts, the policy of each due request, how many
    eviction calls it made for them, and each one's eviction round (`collective_rpc`; read with
    `eviction_steps`)."""
    from vasepatch.vllm.patches import _worker

    state = _worker(worker.model_runner)
    state.steps_seen, evict = [], state.evict

    def noting(runner, due):
        before = state.eviction_calls
        evict(runner, due)
        policies = [state.requests[req_id].config.policy for req_id, _ in due]
        state.steps_seen.append((policies, state.eviction_calls - before, [order.round for _, order in due]))

    state.evict = noting


def eviction_steps(worker) -> list[tuple[list[str], int, list[int]]]:
    """`(policies of the due requests, eviction calls, their rounds)` of every step that evicted
    (`record_eviction_steps`)."""
    return worker.model_runner.vasepatch.steps_seen


def seen_blocks(worker) -> dict[str, list[list[int]]]:
    """Each request's block ids at every step it ran (`record_blocks`)."""
    return worker.model_runner.seen_blocks


def resumed_at(worker) -> dict[str, list[int]]:
    """The steps (indices into `block_steps`) at which each preempted request resumed (`record_blocks`)."""
    return worker.model_runner.resumed_at


def block_steps(worker) -> list[dict[str, list[int]]]:
    """Every step's block ids by request (`record_blocks`)."""
    return worker.model_runner.block_steps


def reused_at_once(steps: list[dict[str, list[int]]]) -> int:
    """How many times a block that a running request gave back (an eviction cut it) is held by another request
    at the very next step."""
    count = 0
    for before, after in itertools.pairwise(steps):
        for req_id, blocks in before.items():
            if req_id in after:
                given = set(blocks) - set(after[req_id])
                count += sum(len(given & set(b)) for other, b in after.items() if other != req_id)
    return count


def worker_rss_mib(worker: Any) -> float:
    """The worker process's resident memory in MiB (run through `LLM.collective_rpc`)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def greedy_in_subprocess(spec: dict[str, Any], env: dict[str, str], timeout: float) -> list[list[int]]:
    """Greedy tokens from a fresh engine in its own process (`run_greedy.py`), with `env` added to this one's."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests/vllm/run_greedy.py"), json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
