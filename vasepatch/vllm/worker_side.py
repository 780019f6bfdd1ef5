"""The worker's half of eviction in vLLM: carry out the orders, keep positions logical, record queries.

Per step, in order (`patches` calls these from vLLM's model runner and attention backend):

1. `before_update` (start of `_update_states`, before vLLM appends this step's new blocks): carry out
   the scheduler's orders, every group of requests that stack in one policy call
   (`compaction.compact_stacked`), and cut each request's block list and its row of the persistent batch
   to the blocks it keeps.
2. `after_prepare` (end of `_prepare_inputs`): RoPE positions and token ids stay logical; the
   attention's `seq_lens` become physical (`- dropped`) and the slot mapping is recomputed from
   `positions - dropped`. Then the query rings are told which tokens to keep.
3. `record` (in the attention backend's `forward`, after RoPE): the planned queries go to the rings.
4. `removed` (the request finished): its side state is freed. A preempted request's rings are freed at once
   (`before_update`), and given again when it resumes: its recompute records its queries anew.
5. `report` (the step's output): each policy's compaction time and the rings' bytes, for the metrics (`metrics`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vasepatch import policies
from vasepatch.cache.paged_rings import QueryRings
from vasepatch.config import VaSEConfig
from vasepatch.vllm import compaction, metrics, paged_layout, settings
from vasepatch.vllm import engine_access as access
from vasepatch.vllm.scheduler_side import STEP_ATTR, Order, Step


@dataclass
class _Request:
    config: VaSEConfig
    policy: policies.Policy
    kept: torch.Tensor | None = None  # positions of the `budget` slots after the pinned ones, after the last eviction


class WorkerEviction:
    """The eviction state of one worker process (one per model runner)."""

    def __init__(self, rank: int = 0, heads_per_rank: int = 0, kv_heads: int = 0) -> None:
        self.head_offset = rank * heads_per_rank  # the global index of this rank's first KV head
        self.kv_heads = kv_heads  # the model's KV heads over all ranks (0: this rank's), for the policies' head_ids
        self.rings = QueryRings()
        self.requests: dict[str, _Request | None] = {}  # None: the request runs with the full cache
        self.dropped: dict[str, int] = {}
        self.evictions = 0
        self.eviction_calls = 0  # one per request evicted alone, one per stacked chunk of requests
        self.generators_restored = 0  # seeded generators put back after a discarded sample (`patches`)
        self.eviction_seconds: dict[str, float] = {}  # compaction time by policy since the last `report`

    def settings_of(self, runner: Any, req_id: str) -> _Request | None:
        if req_id not in self.requests:
            given = access.runner_sampling(runner, req_id)
            engine, caching = access.engine_config(runner), access.prefix_caching(runner)
            config = None if given is None else settings.resolve(engine, *given, prefix_caching=caching)
            self.requests[req_id] = None if config is None else _Request(config, policies.for_config(config))
        state = self.requests[req_id]
        if state is not None and req_id not in self.rings:  # new, or resumed after a preemption freed its rings
            self.rings.assign(req_id, state.config.window)
        return state

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
        for req_id in access.preempted(scheduler_output):  # its recompute records its queries again
            self.rings.release(req_id)
        due = [(req_id, order) for req_id, order in step.orders.items() if access.holds(runner, req_id)]
        if due:
            self.evict(runner, due)

    def evict(self, runner: Any, due: list[tuple[str, Order]]) -> None:
        """Carry out this step's orders: the requests that stack (`compaction.stack_key`) in one policy call
        per group, any other one by itself; then cut each one's block list to the blocks it keeps."""
        names, caches, isa, block_size = access.layer_caches(runner)
        if isa not in paged_layout.SUPPORTED_ISAS:  # checked when the engine started: never reached
            raise RuntimeError(f"vasepatch cannot evict from vLLM's {isa!r} cache layout")
        if self.evictions == 0 and access.alibi_layers(runner):  # refused by config first; a model it missed
            raise RuntimeError("vasepatch cannot evict from a model with an ALiBi bias (slot positions move)")
        groups: dict[Any, list[tuple[str, compaction.Due]]] = {}
        for req_id, order in due:
            state = self.settings_of(runner, req_id)
            positions = compaction.candidate_positions(
                state.kept, len(caches), caches[0].shape[1], order.n, order.dropped, order.pinned
            )
            one = compaction.Due(
                access.request_blocks(runner, req_id), order.n, order.pinned, order.round, state.config.seed,
                self.rings.queries(req_id, names), positions,
            )  # fmt: skip
            key = compaction.stack_key(state.config, state.policy, one, block_size)
            groups.setdefault((None, req_id) if key is None else key, []).append((req_id, one))
        for key, members in groups.items():
            state = self.requests[members[0][0]]
            dues = [one for _, one in members]
            start = time.perf_counter()  # the CPU backend's compaction runs synchronously: no device to wait for
            kept = self._compact(caches, isa, dues, state, alone=key[0] is None)
            for (req_id, one), positions in zip(members, kept, strict=True):
                self.requests[req_id].kept = positions
                access.cut_blocks(runner, req_id, -(-(one.pinned + state.config.budget) // block_size))
                self.evictions += 1
            policy = metrics.policy_name(state.config)
            self.eviction_seconds[policy] = self.eviction_seconds.get(policy, 0.0) + time.perf_counter() - start

    def _compact(
        self, caches: list[torch.Tensor], isa: str, dues: list[compaction.Due], state: _Request, alone: bool
    ) -> list[torch.Tensor]:
        """Each request alone, a layer at a time (`compaction.compact`), or the group stacked, all its layers in one
        call per chunk (a request alone too: one call for its layers is shorter than one per layer), but for a
        request that reads more than `compaction.STACK_BYTES` alone, which goes a layer at a time."""
        config, policy = state.config, state.policy
        if alone:
            return [self._by_layer(caches, isa, d, config, policy) for d in dues]
        kept = []
        for chunk in compaction.chunks(dues, caches):
            if len(chunk) == 1 and compaction.read_bytes(chunk[0], caches) > compaction.STACK_BYTES:
                kept.append(self._by_layer(caches, isa, chunk[0], config, policy))
                continue
            kept += compaction.compact_stacked(
                caches, chunk, config, policy, self.head_offset, isa, kv_heads=self.kv_heads
            )
            self.eviction_calls += 1
        return kept

    def _by_layer(
        self, caches: list[torch.Tensor], isa: str, d: compaction.Due, config: VaSEConfig, policy: policies.Policy
    ) -> torch.Tensor:
        self.eviction_calls += 1
        return compaction.compact(
            caches, d.blocks, d.n, d.queries, d.positions, config, policy, d.round,
            head_offset=self.head_offset, pinned=d.pinned, isa=isa, kv_heads=self.kv_heads,
        )  # fmt: skip

    def after_prepare(self, runner: Any, num_scheduled_tokens: np.ndarray) -> None:
        req_ids, starts, computed = access.batch_rows(runner)
        picked = [i for i, r in enumerate(req_ids) if self.settings_of(runner, r) is not None]
        self.rings.plan(
            [req_ids[i] for i in picked],
            [int(starts[i]) for i in picked],
            [int(num_scheduled_tokens[i]) for i in picked],
            [int(computed[i]) for i in picked],
        )
        dropped = [self.dropped.get(r, 0) for r in req_ids]
        if any(dropped):
            access.make_physical(runner, dropped, num_scheduled_tokens)

    def record(self, layer: str, query: torch.Tensor, num_tokens: int) -> None:
        self.rings.record(layer, query[:num_tokens])

    def removed(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.rings.release(req_id)

    def report(self) -> dict[str, Any]:
        """What this step's output carries to the scheduler (`metrics.worker_report`); the times start over."""
        report = metrics.worker_report(self.eviction_seconds, self.rings.nbytes)
        self.eviction_seconds = {}
        return report
