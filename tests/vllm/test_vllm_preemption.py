"""Pools too small for every request: vLLM preempts running requests and later recomputes them.

- Six requests growing together: the preemptions hit requests before their first eviction (and the
  full-cache one); every request finishes with all its tokens and every block comes back.
- A full-cache request that arrived first outgrows the pool: the evicting requests behind it are preempted
  long after their first eviction, and recomputed from their whole sequence, in chunks compressed as they
  come, and seeded.
- vLLM's admission check counts what an evicting request will hold, not its logical length.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.vllm.engines import block_steps, engine, record_blocks, resumed_at, reused_at_once, worker_state

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
    blocks one request's eviction gives back are held by another in the very next step, and every request's
    greedy tokens are those of a pool large enough that blocks wait in the free queue."""
    prompts = [[1 + (5 * i + 3 * j) % 500 for j in range(64 + 8 * i)] for i in range(6)]
    asks = {"vasepatch_budget": 64, "vasepatch_window": 32, "vasepatch_policy": "vase"}
    params = SamplingParams(max_tokens=300, min_tokens=300, temperature=0, extra_args=asks)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    with engine(smollm2_path, num_gpu_blocks_override=24, max_model_len=512, disable_log_stats=False) as llm:
        llm.collective_rpc(record_blocks)
        tight = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        steps = llm.collective_rpc(block_steps)[0]
    with engine(smollm2_path, max_model_len=512) as llm:
        roomy = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]
    assert metrics["vllm:num_preemptions"] == 0
    assert reused_at_once(steps) > 0
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
