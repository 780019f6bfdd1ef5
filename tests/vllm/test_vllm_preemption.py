"""Pools too small for every request: vLLM preempts running requests and later recomputes them.

- Six requests growing together: the preemptions hit requests before their first eviction (and the
  full-cache one); every request finishes with all its tokens and every block comes back.
- A full-cache request that arrived first outgrows the pool: the evicting requests behind it are preempted
  long after their first eviction, and recomputed from their whole sequence, in chunks compressed as they
  come, and seeded.
- vLLM's admission check counts what an evicting request will hold, not its logical length.
- A request preempted in the very `schedule()` that planned its eviction is not evicted (vLLM's own scheduler).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.vllm.engines import (
    block_steps,
    engine,
    record_blocks,
    resumed_at,
    reused_at_once,
    seen_blocks,
    worker_state,
)

POOL_BLOCKS, BLOCK, CHUNK = 40, 32, 256  # 1,280 slots; CHUNK: max_num_batched_tokens of the seeded test
BUDGET, WINDOW, NEW = 320, 32, 600  # an evicting request holds up to 11 blocks: 5 of them need 55


@pytest.mark.timeout(900)
def test_preempted_requests_start_over_and_every_block_comes_back(smollm2_path):
    prompts = [[1 + (5 * i + 3 * j) % 500 for j in range(64)] for i in range(6)]
    evicting = {"vasepatch_budget": BUDGET, "vasepatch_window": WINDOW, "vasepatch_policy": "vase"}
    params = [
        SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=None if i == 5 else evicting)
        for i in range(6)
    ]
    with engine(smollm2_path, num_gpu_blocks_override=POOL_BLOCKS, max_model_len=1024, disable_log_stats=False) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        state = llm.collective_rpc(worker_state)[0]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [NEW] * 6
    assert metrics["vllm:num_preemptions"] > 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    assert state["evictions"] >= 5 * ((64 + NEW - BUDGET) // WINDOW)  # every evicting request evicted, again and again
    assert state["requests"] == 0  # nothing kept of finished requests


@pytest.mark.timeout(900)
def test_seeded_requests_preempted_after_evicting_are_recomputed_in_chunks(smollm2_path, capfd):
    """A full-cache request that arrived first outgrows the pool, so vLLM preempts the evicting requests
    that arrived after it, long after their first eviction (they evict every 32 tokens from the 96th slot).
    Each is recomputed later from its whole sequence, in chunks of at most 256 tokens, with its sampling
    seed, compressed as the chunks come: it never holds more than `budget + window` plus one chunk (11 blocks,
    where its whole sequence would take up to 34), it finishes with all its tokens, and every block comes
    back."""
    full_new, evicting_new, prompt_len = 1150, 1000, 64  # the full request ends at 1,214 tokens: 38 of 39 blocks
    prompts = [[1 + (5 * i + 3 * j) % 500 for j in range(prompt_len)] for i in range(4)]
    asks = {"vasepatch_budget": 64, "vasepatch_window": 32, "vasepatch_policy": "vase"}  # 3 blocks each
    params = [SamplingParams(max_tokens=full_new, min_tokens=full_new, temperature=0.8, seed=0)]
    params += [
        SamplingParams(max_tokens=evicting_new, min_tokens=evicting_new, temperature=0.8, seed=i, extra_args=asks)
        for i in (1, 2, 3)
    ]
    with engine(
        smollm2_path, num_gpu_blocks_override=POOL_BLOCKS, max_model_len=1248, max_num_batched_tokens=CHUNK,
        disable_log_stats=False,
    ) as llm:  # fmt: skip
        llm.collective_rpc(record_blocks)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        state = llm.collective_rpc(worker_state)[0]
        steps, resumed = llm.collective_rpc(block_steps)[0], llm.collective_rpc(resumed_at)[0]
    log = capfd.readouterr()
    preempted = [line for line in (log.out + log.err).splitlines() if "preempted after" in line]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [full_new] + [evicting_new] * 3
    assert metrics["vllm:num_preemptions"] > 0 and preempted, "no evicting request was preempted"
    assert all("recomputed from its whole sequence" in line for line in preempted)
    evicting = {o.request_id for o in outputs[1:]}  # vLLM's own ids add a suffix: "1-<8 hex digits>"
    evicting = {r for step in steps for r in step if r.rsplit("-", 1)[0] in evicting}
    recomputing = [len(step[r]) for r, at in resumed.items() if r in evicting for step in steps[at[0] :] if r in step]
    print(f"largest blocks held by a preempted evicting request after it resumed: {max(recomputing)}")
    bound = -(-(64 + 32 + CHUNK) // BLOCK)  # budget + window + one chunk: 11 blocks, not its sequence's 34
    assert recomputing and max(recomputing) <= bound
    assert max(len(step[r]) for step in steps for r in evicting if r in step) <= bound
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    assert (state["requests"], state["ring_bytes"]) == (0, 0)
    assert state["generators_restored"] >= 3  # the recomputes were chunked: 4 chunks or more each


@pytest.mark.timeout(900)
def test_blocks_an_eviction_gives_back_serve_another_request_at_once(smollm2_path):
    """Six requests with staggered prompts in a pool of 24 blocks (no preemption: each holds at most 4): the
    blocks one request's eviction gives back are held by another in the very next step, every request holds
    exactly `ceil((budget + window) / block_size)` blocks at every step after its prompt's (the worker's own block
    lists), and every request's greedy tokens are those of a pool large enough that blocks wait in the free
    queue."""
    prompts = [[1 + (5 * i + 3 * j) % 500 for j in range(64 + 8 * i)] for i in range(6)]
    asks = {"vasepatch_budget": 64, "vasepatch_window": 32, "vasepatch_policy": "vase"}
    params = SamplingParams(max_tokens=300, min_tokens=300, temperature=0, extra_args=asks)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    with engine(smollm2_path, num_gpu_blocks_override=24, max_model_len=512, disable_log_stats=False) as llm:
        llm.collective_rpc(record_blocks)
        tight = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        steps = llm.collective_rpc(block_steps)[0]
        held = {len(blocks) for runs in llm.collective_rpc(seen_blocks)[0].values() for blocks in runs[1:]}
    with engine(smollm2_path, max_model_len=512) as llm:
        roomy = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
    assert metrics["vllm:num_preemptions"] == 0
    assert reused_at_once(steps) > 0
    assert held == {-(-(64 + 32) // BLOCK)}  # the budget's 2 blocks and the window's one: no block fewer, none more
    assert tight == roomy


def _kv_manager(blocks: int):
    """vLLM's own KV cache manager over a pool of `blocks` blocks of 32 slots (one of them vLLM's null block)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    return KVCacheManager(
        config, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=False
    )


def test_admission_counts_what_an_evicting_request_will_hold():
    """vLLM's full-sequence admission check (`scheduler_reserve_full_isl`), through the plugin's wrapper of
    `KVCacheManager.allocate_slots`: a 1,000-token sequence to (re)compute in chunks of 256, budget 64, window
    32, needs `ceil((64 + 32 + 256) / 32)` = 11 free blocks, not the 32 of its logical length; a full-cache
    request of the same length still needs 32; vLLM's own admission cap is put back after the call."""
    from vllm.v1.request import Request

    from vasepatch.vllm import patches, scheduler_side

    patches.install()
    asks = {"vasepatch_budget": 64, "vasepatch_window": 32}
    config = SimpleNamespace(
        additional_config={}, cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=CHUNK, long_prefill_token_threshold=0),
    )  # fmt: skip
    scheduler = SimpleNamespace(vllm_config=config)

    def admitted(blocks: int, extra: dict | None) -> bool:
        manager = _kv_manager(blocks + 1)
        request = Request("r", list(range(1, 1001)), SamplingParams(max_tokens=8, extra_args=extra), None)
        scheduler_side.state_of(request, scheduler)
        got = manager.allocate_slots(request, CHUNK, full_sequence_must_fit=True)
        assert [m.max_admission_blocks_per_request for m in manager.coordinator.single_type_managers] == [None]
        return got is not None and len(got.blocks[0]) == CHUNK // BLOCK

    assert admitted(11, asks) and not admitted(10, asks)
    assert admitted(32, None) and not admitted(31, None)


def _scheduler(path: str, blocks: int, block_size: int):
    """vLLM's own `Scheduler` and KV cache manager (the plugin installed), for SmolLM2's config, over a pool of
    `blocks` blocks (one of them vLLM's null block): no model runs, the test plays the workers' outputs."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vasepatch.vllm import patches

    patches.install()
    args = dict(dtype="float32", enable_prefix_caching=False, max_model_len=160, block_size=block_size, seed=0)
    config = EngineArgs(model=path, skip_tokenizer_init=True, **args).create_engine_config()
    config.cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer"], spec)]
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=block_size)


@pytest.mark.timeout(300)
def test_a_request_preempted_in_the_step_that_planned_its_eviction_is_not_evicted(smollm2_path):
    """vLLM's own scheduler, blocks of 16, 10 usable: a full-cache request and an evicting one (budget 64,
    window 16) with one 56-token prompt fill the pool. At the step where the evicting one is due (80 slots), its
    eviction gives a block back, which the full-cache one, first in line, takes for its next token; the
    evicting one then has no block for its own, and vLLM preempts it in the same `schedule()`. That step orders
    no eviction of it: its blocks are freed (a worker carrying the order out would compact freed blocks, and
    give it again the query rings the step has it free). No block is lost, and it resumes and evicts later. The
    plugin's numbers (the scheduler's tally behind `/metrics`, the request's own result) count the evictions
    carried out, not the one cancelled."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from vasepatch.vllm import metrics
    from vasepatch.vllm.scheduler_side import STEP_ATTR

    block, budget, window, new = 16, 64, 16, 60
    scheduler = _scheduler(smollm2_path, 11, block)
    asks = {"vasepatch_budget": budget, "vasepatch_window": window}
    requests = [
        Request(req_id, list(range(1, 57)), SamplingParams(max_tokens=new, min_tokens=new, extra_args=extra), None)
        for req_id, extra in (("full", None), ("evicting", asks))
    ]
    for request in requests:
        scheduler.add_request(request)
    steps, shipped = [], []  # (slots the evicting request held before the step, preempted, scheduled, orders)
    while scheduler.has_unfinished_requests() and len(steps) < 400:
        held = requests[1].num_computed_tokens
        output = scheduler.schedule()
        scheduled, orders = list(output.num_scheduled_tokens), getattr(output, STEP_ATTR).orders
        steps.append((held, set(output.preempted_req_ids), set(scheduled), set(orders)))
        shipped += [order.n - budget for order in orders.values()]  # positions each shipped order evicts
        played = ModelRunnerOutput(
            req_ids=scheduled, req_id_to_index={r: i for i, r in enumerate(scheduled)},
            sampled_token_ids=[[7] for _ in scheduled],
        )  # fmt: skip
        scheduler.update_from_output(output, played)
    hit = [i for i, (held, preempted, _, _) in enumerate(steps) if "evicting" in preempted]
    assert hit and steps[hit[0]][0] == budget + window, steps  # preempted at the step it was due: the case tested
    stale = [(i, o) for i, (_, preempted, scheduled, o) in enumerate(steps) if o - (scheduled - preempted)]
    assert stale == []  # no step orders the eviction of a request it preempted, or of one it does not run
    assert any("evicting" in orders for _, _, _, orders in steps[hit[0] + 1 :])  # it resumed and evicted again
    assert [r.num_output_tokens for r in requests] == [new, new] and all(r.is_finished() for r in requests)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 10  # every block back, none twice
    tally = metrics.tally_of(scheduler)  # never drained: no stats without log_stats
    assert (dict(tally.evictions), dict(tally.evicted_tokens)) == ({"vase": len(shipped)}, {"vase": sum(shipped)})
    result = metrics.request_result(requests[1].vasepatch)
    assert (result["evictions"], result["evicted_tokens"]) == (len(shipped), sum(shipped))


def record_preempted_and_evicted(worker) -> None:
    """From now on the worker notes, at every step, the requests preempted since the last step and those it
    evicted (`collective_rpc`; read with `preempted_and_evicted`)."""
    from vasepatch.vllm.patches import _worker

    runner, state = worker.model_runner, _worker(worker.model_runner)
    runner.preempted_and_evicted, update, evict = [], runner._update_states, state.evict

    def noting_update(scheduler_output, *args, **kwargs):
        runner.preempted_and_evicted.append((set(scheduler_output.preempted_req_ids or ()), set()))
        return update(scheduler_output, *args, **kwargs)

    def noting_evict(model_runner, due):
        runner.preempted_and_evicted[-1][1].update(req_id for req_id, _ in due)
        return evict(model_runner, due)

    runner._update_states, state.evict = noting_update, noting_evict


def preempted_and_evicted(worker) -> list[tuple[set[str], set[str]]]:
    return worker.model_runner.preempted_and_evicted


@pytest.mark.timeout(600)
def test_an_engine_that_preempts_a_request_in_the_step_that_planned_its_eviction_runs_on(smollm2_path, monkeypatch):
    """The case of the test above in an engine (blocks of 32, 10 usable): a full-cache request and an evicting
    one (budget 128, window 32) with one 112-token prompt. At the step where the evicting one is due (160 slots),
    the full-cache one takes the block its eviction gave back, and vLLM preempts it in that `schedule()`. The
    worker evicts nothing of it at that step (its blocks are freed), the engine runs on, and both requests finish
    with all their tokens, every block back."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here: both prompts in its first step
    budget, window, new = 128, 32, 100
    asks = {"vasepatch_budget": budget, "vasepatch_window": window, "vasepatch_policy": "vase"}
    params = [SamplingParams(max_tokens=new, min_tokens=new, temperature=0, extra_args=extra) for extra in (None, asks)]
    prompt = [1 + (3 * j) % 500 for j in range(112)]
    with engine(smollm2_path, num_gpu_blocks_override=11, max_model_len=320, disable_log_stats=False) as llm:
        scheduler, seen = llm.llm_engine.engine_core.engine_core.scheduler, []
        schedule = scheduler.schedule

        def noting(*args, **kwargs):  # the evicting request's slots before the step, and whom the step preempted
            held = {r.request_id: r.num_computed_tokens for r in scheduler.running}
            output = schedule(*args, **kwargs)
            seen.append((held, set(output.preempted_req_ids)))
            return output

        scheduler.schedule = noting
        llm.collective_rpc(record_preempted_and_evicted)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * 2, params, use_tqdm=False)
        llm.llm_engine.step()  # an engine core in this process steps only while requests run: this step tells the
        # worker that the last request finished, as the core's own loop does in a process of its own
        steps = llm.collective_rpc(preempted_and_evicted)[0]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        state = llm.collective_rpc(worker_state)[0]
    evicting = next(r for held, _ in seen for r in held if r.rsplit("-", 1)[0] == outputs[1].request_id)
    at = [held[evicting] for held, preempted in seen if evicting in preempted]
    assert at == [budget + window], seen  # preempted once, at the step it was due: the case tested
    assert [len(o.outputs[0].token_ids) for o in outputs] == [new, new]
    assert [(p, e) for p, e in steps if p & e] == []  # no request evicted at the step that preempted it
    assert any(evicting in e for _, e in steps)  # it evicted once it resumed
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    assert (state["requests"], state["ring_bytes"]) == (0, 0)
