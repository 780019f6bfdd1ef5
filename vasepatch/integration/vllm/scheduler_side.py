"""The scheduler's half of eviction in vLLM (EngineCore process): when, and giving the blocks back.

When a request evicts is a pure function of host ints (`vasepatch.cache.schedule.evict_now`, the
transformers cache's own rule), so the scheduler decides it without asking the worker: before each
`schedule()`, every running request whose physical slot count (`num_computed_tokens - dropped`)
calls for an eviction gets an `Order`, its block list is cut to `ceil(budget / block_size)` and the tail
blocks go back to vLLM's free pool at once (they show in vLLM's KV usage metric). The worker carries
out the order at the start of the same step, before anything writes to those blocks.

`dropped` (positions evicted so far) lives on the request; block math is made physical by subtracting
it while vLLM allocates (`physical`), and it travels to the worker with every step (`Step`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vasepatch.cache.schedule import evict_now
from vasepatch.config import VaSEConfig
from vasepatch.integration.vllm import settings

STEP_ATTR = "vasepatch_step"  # the SchedulerOutput attribute the worker reads


@dataclass(frozen=True)
class Order:
    """Evict one request now: it holds `n` slots, `dropped` positions were evicted before, round `round`."""

    n: int
    dropped: int
    round: int


@dataclass
class Step:
    """What the worker needs each step: the orders, and every evicting request's dropped count."""

    orders: dict[str, Order] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestState:
    """Kept on a vLLM `Request` as `request.vasepatch`."""

    config: VaSEConfig | None
    dropped: int = 0
    rounds: int = 0
    prefilled: bool = False

    def reset(self) -> None:
        """Preempted: vLLM frees every block and recomputes the whole sequence, which then compresses
        again as a prompt does."""
        self.dropped, self.prefilled = 0, False


def state_of(request: Any, additional_config: Any) -> RequestState:
    """The request's eviction state, made on first sight (its settings were checked when it arrived)."""
    state = getattr(request, "vasepatch", None)
    if state is None:
        sp = request.sampling_params
        config = None if sp is None else settings.resolve(additional_config, sp.extra_args, sp.seed)
        state = RequestState(config)
        request.vasepatch = state
    return state


def decoding(request: Any) -> bool:
    """Whether the request's prompt (or its recomputation after preemption) is done: every token but the
    last sampled one has its KV."""
    return request.num_output_tokens >= 1 and request.num_computed_tokens == request.num_tokens - 1


def plan(scheduler: Any) -> Step:
    """Before `schedule()`: issue the orders of the running requests that are due, and free their tails."""
    step = Step()
    additional = scheduler.vllm_config.additional_config
    for request in scheduler.running:
        state = state_of(request, additional)
        config = state.config
        if config is None or not decoding(request):
            continue
        first, state.prefilled = not state.prefilled, True
        phys = request.num_computed_tokens - state.dropped
        cap = config.budget + config.window
        if evict_now(config.budget, config.window, cap, phys, first_step=first, prefill="compress"):
            step.orders[request.request_id] = Order(phys, state.dropped, state.rounds)
            state.dropped += phys - config.budget
            state.rounds += 1
            free_tail(scheduler.kv_cache_manager, request.request_id, config.budget)
    return step


def finish(scheduler: Any, step: Step) -> Step:
    """After `schedule()`: drop the orders of requests preempted meanwhile, attach every dropped count."""
    running = {r.request_id: r for r in scheduler.running}
    kept = {}
    for req_id, order in step.orders.items():
        request = running.get(req_id)
        if request is not None and request.vasepatch.dropped > 0:
            kept[req_id] = order
    step.orders = kept
    step.dropped = {rid: r.vasepatch.dropped for rid, r in running.items() if getattr(r, "vasepatch", None)}
    step.dropped = {rid: d for rid, d in step.dropped.items() if d}
    return step


def free_tail(kv_cache_manager: Any, req_id: str, budget: int) -> None:
    """Cut the request's block lists to `ceil(budget / block_size)` and give the rest back to the pool."""
    for manager in kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(req_id)
        keep = -(-budget // manager.block_size)
        if not blocks or len(blocks) <= keep:
            continue
        tail = blocks[keep:]
        del blocks[keep:]
        if req_id in manager.num_cached_block:
            manager.num_cached_block[req_id] = min(manager.num_cached_block[req_id], keep)
        manager.block_pool.free_blocks(reversed(tail))


@contextmanager
def physical(request: Any) -> Iterator[None]:
    """While vLLM allocates blocks for `request`, its computed-token count is the physical one."""
    state = getattr(request, "vasepatch", None)
    dropped = state.dropped if state is not None else 0
    request.num_computed_tokens -= dropped
    try:
        yield
    finally:
        request.num_computed_tokens += dropped
