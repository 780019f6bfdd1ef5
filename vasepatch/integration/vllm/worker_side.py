"""The worker's half of eviction in vLLM: carry out the orders, keep positions logical, record queries.

Per step, in order (`patches` calls these from vLLM's model runner and attention backend):

1. `before_update` (start of `_update_states`, before vLLM appends this step's new blocks): carry out
   the scheduler's orders (`compaction.compact`) and cut the request's block list and its row of the
   persistent batch to the blocks it keeps.
2. `after_prepare` (end of `_prepare_inputs`): RoPE positions and token ids stay logical; the
   attention's `seq_lens` become physical (`- dropped`) and the slot mapping is recomputed from
   `positions - dropped`. Then the query rings are told which tokens to keep.
3. `record` (in the attention backend's `forward`, after RoPE): the planned queries go to the rings.
4. `removed` (the request finished): its side state is freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vasepatch import policies
from vasepatch.config import VaSEConfig
from vasepatch.integration.vllm import compaction, paged_layout, settings
from vasepatch.integration.vllm.query_rings import QueryRings
from vasepatch.integration.vllm.scheduler_side import STEP_ATTR, Order, Step


@dataclass
class _Request:
    config: VaSEConfig
    policy: policies.Policy
    kept: torch.Tensor | None = None  # positions of slots 0..budget-1 after the last eviction


class WorkerEviction:
    """The eviction state of one worker process (one per model runner)."""

    def __init__(self, rank: int = 0, heads_per_rank: int = 0) -> None:
        self.head_offset = rank * heads_per_rank  # the global index of this rank's first KV head
        self.rings = QueryRings()
        self.requests: dict[str, _Request | None] = {}  # None: the request runs with the full cache
        self.dropped: dict[str, int] = {}
        self.evictions = 0

    def settings_of(self, runner: Any, req_id: str) -> _Request | None:
        if req_id not in self.requests:
            sp = runner.requests[req_id].sampling_params
            config = None
            if sp is not None:
                config = settings.resolve(runner.vllm_config.additional_config, sp.extra_args, sp.seed)
            self.requests[req_id] = None if config is None else _Request(config, policies.for_config(config))
            if config is not None:
                self.rings.assign(req_id, config.window)
        return self.requests[req_id]

    def before_update(self, runner: Any, scheduler_output: Any) -> None:
        self.rings.clear_plan()
        step: Step | None = getattr(scheduler_output, STEP_ATTR, None)
        if step is None:
            if any(state is not None for state in self.requests.values()):
                raise RuntimeError(
                    "vasepatch: a scheduler output reached the worker without its eviction step "
                    f"({STEP_ATTR}) while evicting requests are running; the scheduler has freed their tail "
                    "blocks, so running on would read a corrupted cache"
                )
            step = Step()
        self.dropped = step.dropped
        for req_id, order in step.orders.items():
            if req_id in runner.requests:
                self.evict(runner, req_id, order)

    def evict(self, runner: Any, req_id: str, order: Order) -> None:
        state = self.settings_of(runner, req_id)
        group = runner.kv_cache_config.kv_cache_groups[0]
        context = runner.compilation_config.static_forward_context
        caches = [context[name].kv_cache for name in group.layer_names]
        isa = getattr(context[group.layer_names[0]], "isa", None)
        if isa not in paged_layout.SUPPORTED_ISAS:  # checked when the engine started: never reached
            raise RuntimeError(f"vasepatch cannot evict from vLLM's {isa!r} cache layout")
        req_state = runner.requests[req_id]
        blocks = torch.tensor(req_state.block_ids[0], dtype=torch.int64)
        heads = caches[0].shape[1]
        positions = compaction.candidate_positions(state.kept, len(caches), heads, order.n, order.dropped)
        queries = self.rings.queries(req_id, group.layer_names)
        state.kept = compaction.compact(
            caches, blocks, order.n, queries, positions, state.config, state.policy, order.round, self.head_offset
        )
        keep = -(-state.config.budget // group.kv_cache_spec.block_size)
        del req_state.block_ids[0][keep:]
        row = runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            table = runner.input_batch.block_table.block_tables[0]
            table.block_table.np[row, keep : table.num_blocks_per_row[row]] = 0
            table.num_blocks_per_row[row] = min(table.num_blocks_per_row[row], keep)
        self.evictions += 1

    def after_prepare(self, runner: Any, num_scheduled_tokens: np.ndarray) -> None:
        batch = runner.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        starts = runner.query_start_loc.np[:n]
        computed = batch.num_computed_tokens_cpu[:n]
        evicting = [self.settings_of(runner, r) is not None for r in req_ids]
        picked = [i for i in range(n) if evicting[i]]
        self.rings.plan(
            [req_ids[i] for i in picked],
            [int(starts[i]) for i in picked],
            [int(num_scheduled_tokens[i]) for i in picked],
            [int(computed[i]) for i in picked],
        )
        dropped = np.array([self.dropped.get(r, 0) for r in req_ids], dtype=np.int64)
        if not dropped.any():
            return
        total = int(num_scheduled_tokens[:n].sum())
        d = torch.from_numpy(dropped)
        runner.seq_lens[:n] -= d.to(runner.seq_lens.device, runner.seq_lens.dtype)
        per_token = d.to(runner.positions.device)[runner.req_indices.gpu[:total].long()]
        physical = runner.positions[:total] - per_token
        batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], physical)

    def record(self, layer: str, query: torch.Tensor, num_tokens: int) -> None:
        self.rings.record(layer, query[:num_tokens])

    def removed(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.rings.release(req_id)
