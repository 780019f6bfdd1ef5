"""Every read and write of vLLM 0.32's private state, in one place: the scheduler's and the worker's halves
of eviction (`scheduler_side`, `worker_side`) call these and hold no vLLM attribute names of their own.

A port to another vLLM version, or to another attention backend, changes this module, the functions
`patches` wraps, and the cache layout (`paged_layout`); the eviction logic stays as it is. The paths
are vLLM 0.32's (shared/docs/vllm-0.32-map.md): `Scheduler`, `Request` and `KVCacheManager` in the
EngineCore process; `GPUModelRunner` (the CPU runner's base), its `InputBatch` and block tables in the
worker.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

# --- the engine's configuration (any process) --------------------------------------------------------------


def attention_isa(vllm_config: Any) -> str:
    """The cache layout vLLM's CPU attention will pick for this engine (`vec`, `vec16`, `amx`, ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    return _get_attn_isa(model.dtype, vllm_config.cache_config.block_size, model.get_head_size(), "auto")


# --- the scheduler (EngineCore process) --------------------------------------------------------------------


def running(scheduler: Any) -> list[Any]:
    """The requests the scheduler runs (in its own order)."""
    return list(scheduler.running)


def waiting(scheduler: Any) -> list[Any]:
    """The requests waiting to be admitted: new ones, preempted ones, and those holding blocks already."""
    return [*scheduler.waiting, *scheduler.kv_holding_waiting]


def largest_chunk(owner: Any) -> int:
    """The most prompt tokens vLLM prefills for one request at one step while others are waiting or running, on
    the engine of a scheduler (or its `VllmConfig`): the step's token budget, or its per-request cap for long
    prompts (`long_prefill_token_threshold`) where set, which the adaptive option raises to a fair share of the
    budget (at most half of it: the cap applies from two requests on). A request alone gets the whole budget."""
    config = getattr(owner, "vllm_config", owner).scheduler_config
    threshold, budget = config.long_prefill_token_threshold, config.max_num_batched_tokens
    if threshold <= 0:
        return budget
    if getattr(config, "long_prefill_token_threshold_adaptive", False):
        threshold = max(threshold, budget // 2)
    return min(threshold, budget)


@contextmanager
def admission_capped(manager: Any, blocks: int | None) -> Iterator[None]:
    """While `manager` (a `KVCacheManager`) allocates for one request, vLLM's full-sequence admission check
    counts at most `blocks` blocks for it: the per-request admission cap vLLM itself sets for layers that
    recycle blocks (sliding windows), set for the call. None: unchanged."""
    if blocks is None:
        yield
        return
    managers = manager.coordinator.single_type_managers
    saved = [m.max_admission_blocks_per_request for m in managers]
    for m, cap in zip(managers, saved, strict=True):
        m.max_admission_blocks_per_request = blocks if cap is None else min(cap, blocks)
    try:
        yield
    finally:
        for m, cap in zip(managers, saved, strict=True):
            m.max_admission_blocks_per_request = cap


def kv_manager(scheduler: Any) -> Any:
    """The scheduler's `KVCacheManager`."""
    return scheduler.kv_cache_manager


def engine_config(owner: Any) -> Any:
    """`additional_config` of the engine a scheduler or a model runner belongs to."""
    return owner.vllm_config.additional_config


def prefix_caching(owner: Any) -> bool:
    """Whether the engine a scheduler or a model runner belongs to (or its `VllmConfig`) caches prefixes."""
    return bool(getattr(owner, "vllm_config", owner).cache_config.enable_prefix_caching)


def request_id(request: Any) -> str:
    return request.request_id


def sampling(params: Any) -> tuple[Any, int | None] | None:
    """A request's `(extra_args, seed)`, or None where it has no sampling parameters (pooling)."""
    return None if params is None else (params.extra_args, params.seed)


def request_sampling(request: Any) -> tuple[Any, int | None] | None:
    return sampling(request.sampling_params)


def decoding(request: Any) -> bool:
    """Whether the request's prompt (or its recomputation after preemption) is done: every token but the
    last sampled one has its KV."""
    return request.num_output_tokens >= 1 and not request.is_prefill_chunk


def prompt_tokens(request: Any) -> int:
    return request.num_prompt_tokens


def computed_tokens(request: Any) -> int:
    """Tokens whose KV vLLM counts as written (logical: evicted ones included)."""
    return request.num_computed_tokens


@contextmanager
def computed_less(request: Any, dropped: int) -> Iterator[None]:
    """While vLLM does block math for `request`, it counts `dropped` fewer computed tokens."""
    request.num_computed_tokens -= dropped
    try:
        yield
    finally:
        request.num_computed_tokens += dropped


def free_tail(scheduler: Any, req_id: str, slots: int) -> int:
    """Cut the request's block lists to `ceil(slots / block_size)` and give the rest back to the free pool; how
    many blocks went back."""
    freed = 0
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(req_id)
        keep = -(-slots // manager.block_size)
        if not blocks or len(blocks) <= keep:
            continue
        tail = blocks[keep:]
        del blocks[keep:]
        if req_id in manager.num_cached_block:
            manager.num_cached_block[req_id] = min(manager.num_cached_block[req_id], keep)
        manager.block_pool.free_blocks(reversed(tail))
        freed += len(tail)
    return freed


def block_size(manager: Any) -> int:
    """The block size of a `KVCacheManager`'s (one) KV cache group."""
    return manager.coordinator.single_type_managers[0].block_size


def capped_hit(manager: Any, found: tuple[Any, ...], tokens: int) -> tuple[Any, ...]:
    """`KVCacheManager.get_computed_blocks`'s result, its prefix-cache hit cut to the full blocks of the first
    `tokens` tokens where it reaches past them."""
    blocks, hit, *rest = found
    if hit <= tokens:
        return found
    keep = tokens // block_size(manager) * block_size(manager)
    return (manager.truncate_computed_blocks(blocks, keep), keep, *rest)


def log_stats(scheduler: Any) -> bool:
    """Whether the scheduler makes stats for the frontend (vLLM's `log_stats`)."""
    return bool(getattr(scheduler, "log_stats", False))


def finished_outputs(outputs: dict[int, Any]) -> list[Any]:
    """The `EngineCoreOutput`s of `update_from_output`'s result (by client) whose request finished at this step."""
    return [o for eco in outputs.values() for o in eco.outputs if o.finish_reason is not None]


def output_request_id(output: Any) -> str:
    return output.request_id


def set_request_result(output: Any, key: str, result: dict[str, Any]) -> None:
    """Put `result` under `key` of a finished request's `kv_transfer_params` (the one dict of an engine output that
    reaches the response body: `RequestOutput.kv_transfer_params`, the OpenAI responses' `kv_transfer_params`),
    unless a KV connector filled it (an engine that evicts has none)."""
    if output.kv_transfer_params is None:
        output.kv_transfer_params = {key: result}


def step_stats(outputs: dict[int, Any]) -> Any:
    """The `SchedulerStats` that `update_from_output` attached to one of its outputs, or None (no `log_stats`)."""
    return next((eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None), None)


def add_stats_field(name: str) -> None:
    """Give vLLM's `SchedulerStats` dataclass a field `name` (a dict of plain numbers, default None, not in its
    `__init__`), so that msgspec's encoding of the stats, which writes a dataclass's fields by name, carries it from
    the EngineCore to the frontend. A decoder without the field ignores it; one with it reads None where it is absent.
    Idempotent."""
    import dataclasses

    from vllm.v1.metrics.stats import SchedulerStats

    if name in SchedulerStats.__dataclass_fields__:
        return
    kind = dict[str, Any] | None
    spec = dataclasses.field(default=None, init=False, repr=False, compare=False)
    added = dataclasses.fields(dataclasses.make_dataclass("Carrier", [(name, kind, spec)]))[0]  # made by dataclasses
    SchedulerStats.__dataclass_fields__[name] = added
    SchedulerStats.__annotations__[name] = kind
    setattr(SchedulerStats, name, None)


def stat_loggers(llm: Any) -> list[Any] | None:
    """The stat loggers of an offline `vllm.LLM` (None where it makes no stats: `disable_log_stats`)."""
    manager = getattr(llm.llm_engine, "logger_manager", None)
    return None if manager is None else manager.stat_loggers


# --- the model runner (worker process) ----------------------------------------------------------------------


def preempted(scheduler_output: Any) -> set[str]:
    """The requests the scheduler preempted since the last step (their blocks are freed)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def with_report(output: Any, attr: str, report: Any) -> Any:
    """A step's output of the model runner with `report` as its attribute `attr` (pickled with it to the EngineCore);
    vLLM's shared empty output is copied first. Anything but a `ModelRunnerOutput` (None: sampling follows) is
    returned as it is, and `report` is not called."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if not isinstance(output, ModelRunnerOutput):
        return output
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy.copy(output)
    setattr(output, attr, report())
    return output


def runner_sampling(runner: Any, req_id: str) -> tuple[Any, int | None] | None:
    """`(extra_args, seed)` of a request the worker holds (vLLM keeps them until it finishes)."""
    return sampling(runner.requests[req_id].sampling_params)


def holds(runner: Any, req_id: str) -> bool:
    return req_id in runner.requests


def alibi_layers(runner: Any) -> list[str]:
    """The attention layers whose backend adds an ALiBi bias (`alibi_slopes` set)."""
    context = runner.compilation_config.static_forward_context
    names = runner.kv_cache_config.kv_cache_groups[0].layer_names
    return [n for n in names if getattr(getattr(context[n], "impl", None), "alibi_slopes", None) is not None]


def layer_caches(runner: Any) -> tuple[list[str], list[torch.Tensor], str | None, int]:
    """The attention layers' names and paged caches (one KV cache group), the layout's ISA, the block size."""
    group = runner.kv_cache_config.kv_cache_groups[0]
    context = runner.compilation_config.static_forward_context
    caches = [context[name].kv_cache for name in group.layer_names]
    isa = getattr(context[group.layer_names[0]], "isa", None)
    return list(group.layer_names), caches, isa, group.kv_cache_spec.block_size


def request_blocks(runner: Any, req_id: str) -> torch.Tensor:
    """The request's block ids (int64), in sequence order."""
    return torch.tensor(runner.requests[req_id].block_ids[0], dtype=torch.int64)


def cut_blocks(runner: Any, req_id: str, keep: int) -> None:
    """The worker's copies of the request's block list (its state and its batch row) cut to `keep` blocks,
    so that vLLM appends the next blocks after them."""
    del runner.requests[req_id].block_ids[0][keep:]
    row = runner.input_batch.req_id_to_index.get(req_id)
    if row is not None:
        table = runner.input_batch.block_table.block_tables[0]
        table.block_table.np[row, keep : table.num_blocks_per_row[row]] = 0
        table.num_blocks_per_row[row] = min(table.num_blocks_per_row[row], keep)


def batch_rows(runner: Any) -> tuple[list[str], np.ndarray, np.ndarray]:
    """This step's batch: request ids by row, each row's first token in the flattened batch, and each row's
    computed-token count before the step (logical)."""
    batch = runner.input_batch
    n = batch.num_reqs
    return list(batch.req_ids[:n]), runner.query_start_loc.np[:n], batch.num_computed_tokens_cpu[:n]


def make_physical(runner: Any, dropped: Sequence[int], num_scheduled_tokens: np.ndarray) -> None:
    """Attention reads physical slots: each row's `seq_lens` less its `dropped`, and the slot mapping
    recomputed from `positions - dropped`. RoPE positions and token ids stay logical."""
    n = len(dropped)
    total = int(num_scheduled_tokens[:n].sum())
    d = torch.as_tensor(np.asarray(dropped, dtype=np.int64))
    runner.seq_lens[:n] -= d.to(runner.seq_lens.device, runner.seq_lens.dtype)
    per_token = d.to(runner.positions.device)[runner.req_indices.gpu[:total].long()]
    physical = runner.positions[:total] - per_token
    runner.input_batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], physical)


def discarded_generators(runner: Any) -> dict[int, torch.Generator]:
    """The seeded CPU generators of this step's rows whose sampled token vLLM discards (a prefill chunk that
    is not the prompt's last), by batch row."""
    batch = runner.input_batch
    rows = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
    found = {int(i): batch.generators.get(int(i)) for i in rows}
    return {i: g for i, g in found.items() if g is not None and g.device.type == "cpu"}


@contextmanager
def discarded_samples_undone(runner: Any) -> Iterator[int]:
    """Around the step's sampling: the seeded CPU generators whose sample vLLM discards are put back as they
    were before it (yields how many)."""
    saved = [(g, g.get_state()) for g in discarded_generators(runner).values()]
    try:
        yield len(saved)
    finally:
        for generator, state in saved:
            generator.set_state(state)


@contextmanager
def generators_hidden(runner: Any, rows: Sequence[int]) -> Iterator[None]:
    """While vLLM's bookkeeping runs, the batch's generators of `rows` are out of its sight."""
    batch = runner.input_batch
    every, hidden = batch.generators, set(rows)
    batch.generators = {i: g for i, g in every.items() if i not in hidden}
    try:
        yield
    finally:
        batch.generators = every
