"""The scheduler's half of eviction in vLLM (EngineCore process): when, and giving the blocks back.

When a request evicts is a pure function of host ints (`vasepatch.cache.schedule.evict_now`, the
transformers cache's own rule), so the scheduler decides it without asking the worker: before each
`schedule()`, every running request whose physical slot count (`num_computed_tokens - dropped`)
calls for an eviction gets an `Order`, its block list is cut to `ceil((pinned + budget) / block_size)` and
the tail blocks go back to vLLM's free pool at once (they show in vLLM's KV usage metric). The worker carries
out the order at the start of the same step, before anything writes to those blocks.

A prompt is compressed as its chunks are prefilled (vLLM's chunked prefill), by the same rule: between chunks
a request holds at most `budget + window` slots (plus its pinned prompt), so during one it holds at most that
plus the chunk (`held_at_most`). A request preempted and recomputed is prefilled the same way, and vLLM's
admission check counts those blocks for it, not its logical length (`admission_blocks`), so it comes back as
soon as that much of the pool is free, and does not hold up the requests behind it.

`dropped` (positions evicted so far) lives on the request; block math is made physical by subtracting
it while vLLM allocates (`physical`), and it travels to the worker with every step (`Step`).

With `evictions_per_step` (engine-wide) the scheduler evicts some requests a few steps before they are due, so
that requests that started together (and would all evict at the same steps, every `window` steps, each one
a pause for every request in flight) spread their evictions over consecutive steps (`spread`).

With `prefill="pin"` the prompt's `pinned` slots are never evicted nor written: the schedule runs with
`pinned + budget` as its budget, and the prefix cache publishes and shares only the prompt's full blocks
(`cacheable`), which the compaction never reaches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vasepatch.cache.footprint import blocks, held_at_most
from vasepatch.cache.schedule import evict_now
from vasepatch.config import VaSEConfig
from vasepatch.vllm import LOG, metrics, requirements, settings
from vasepatch.vllm import engine_access as access

STEP_ATTR = "vasepatch_step"  # the SchedulerOutput attribute the worker reads
RINGS_ATTR = "vasepatch_rings"  # the KVCacheManager attribute holding the engine's `RingBudget`


@dataclass(frozen=True)
class Order:
    """Evict one request now: it holds `n` slots, `dropped` positions were evicted before, round `round`; its
    first `pinned` slots (the prompt, with `prefill="pin"`) stay as they are."""

    n: int
    dropped: int
    round: int
    pinned: int = 0


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
    pinned: int = 0  # slots no eviction touches: the prompt as the scheduler first saw it, with prefill="pin" (a
    # streaming-input session later counts what it generated as prompt, and those slots have been compacted)
    most: int | None = None  # the most slots it ever holds (`held_at_most`); None: it never evicts
    ringed: bool = False  # the workers hold its query rings: it runs (a preempted one's are freed, `preempted`)
    evicted: int = 0  # positions evicted over its life, preemptions included (`metrics.request_result`)
    pending: int = 0  # positions of an order this `schedule()` planned, not yet carried out (`finish` clears it)

    def reset(self) -> None:
        """Preempted: vLLM frees every block and recomputes the whole sequence, which then compresses
        again as a prompt does."""
        self.dropped, self.prefilled = 0, False


def state_of(request: Any, scheduler: Any) -> RequestState:
    """The request's eviction state, made on first sight (its settings were checked when it arrived)."""
    state = getattr(request, "vasepatch", None)
    if state is None:
        given = access.request_sampling(request)
        engine, caching = access.engine_config(scheduler), access.prefix_caching(scheduler)
        config = None if given is None else settings.resolve(engine, *given, prefix_caching=caching)
        pins = config is not None and config.prefill == "pin"
        state = RequestState(config, pinned=access.prompt_tokens(request) if pins else 0)
        if config is not None:
            state.most = held_at_most(state.pinned, config, access.largest_chunk(scheduler))
        request.vasepatch = state
    return state


@dataclass
class RingBudget:
    """The query rings the workers hold for the engine's evicting requests (bytes per rank, `held`), against
    the engine's limit (`requirements.ring_limit`): a request is admitted only while its rings fit beside them."""

    per_token: int
    limit: int
    held: int = 0

    def need(self, state: RequestState) -> int:
        return 0 if state.config is None else state.config.window * self.per_token


def ring_budget(scheduler: Any) -> RingBudget:
    """The engine's `RingBudget`, made once, kept where the admission wrapper finds it (the KV cache manager)."""
    manager = access.kv_manager(scheduler)
    rings = getattr(manager, RINGS_ATTR, None)
    if rings is None:
        rings = RingBudget(*requirements.ring_limit(scheduler.vllm_config))
        setattr(manager, RINGS_ATTR, rings)
    return rings


def rings_admit(manager: Any, request: Any) -> bool:
    """Whether `request` may start now for its query rings: any request that has run (its rings exist) or
    evicts nothing may; a new evicting one only if its rings fit beside those held. One admitted is counted at
    once, so that several admitted at one step add up."""
    rings, state = getattr(manager, RINGS_ATTR, None), getattr(request, "vasepatch", None)
    if rings is None or state is None or state.config is None or state.ringed:
        return True
    return rings.held + rings.need(state) <= rings.limit


def rings_taken(manager: Any, request: Any) -> None:
    """`request` was admitted: its rings now count (`rings_admit`)."""
    rings, state = getattr(manager, RINGS_ATTR, None), getattr(request, "vasepatch", None)
    if rings is not None and state is not None and state.config is not None and not state.ringed:
        state.ringed = True
        rings.held += rings.need(state)


def admission_blocks(request: Any, block_size: int) -> int | None:
    """The blocks vLLM's full-sequence admission check (`scheduler_reserve_full_isl`) counts for an evicting
    request: what it will hold (`held_at_most`), not its logical length; None: vLLM's own count."""
    state = getattr(request, "vasepatch", None)
    if state is None or state.most is None:
        return None
    return blocks(state.most, block_size)


def preempted(request: Any) -> None:
    """vLLM preempted `request`: it starts over (`RequestState.reset`), saying so if it had evicted. The workers
    free its query rings (`worker_side`), so they no longer count against the limit: what the rings hold is
    always the running requests', and an engine with nothing running admits any request."""
    state = getattr(request, "vasepatch", None)
    if state is None:
        return
    state.ringed = False
    done, dropped = state.rounds - (state.pending > 0), state.dropped - state.pending  # an order it planned is off
    if dropped:
        LOG.info(
            "vasepatch: request %s preempted after %d evictions (%d positions dropped): it is recomputed from its "
            "whole sequence, compressed as its chunks come",
            access.request_id(request), done, dropped,
        )  # fmt: skip
    state.reset()


def cacheable(request: Any) -> int | None:
    """How many of a request's first tokens the prefix cache may publish or share (None: all of them). An
    evicting request's blocks past its pinned prompt are rewritten by compaction, so none of them: its
    hashes are logical, and such a block would be published, or a shared one rewritten, under the wrong
    tokens. Before the scheduler first sees a request (its prompt's own prefill) the prompt's are."""
    state = getattr(request, "vasepatch", None)
    if state is None or state.config is None:
        return None
    return state.pinned


def spread(steps_left: Sequence[int], per_step: int | None) -> int:
    """How many of the requests not yet due evict now, `steps_left` (ascending, each >= 1) being the tokens
    until each one is due, so that at most `per_step` of them evict at each later step.

    Earliest deadline first: the first `i + 1` of them are all due within `steps_left[i]` steps (one token per
    decode step), and the steps after this one take at most `steps_left[i] * per_step` of them, so the rest
    evict now. The requests due at this step evict whatever `per_step` says. A request is never evicted later
    than it is due (its footprint stays `pinned + budget + window` slots), only earlier. The bound is an aim,
    not a guarantee: more requests due at once than it allows all evict (prompts compressed together), and a
    request that is not yet a candidate (nothing past its budget yet: just evicted with a small window, or
    just prefilled) is not counted until it is."""
    if per_step is None:
        return 0
    pulled = 0
    for i, left in enumerate(steps_left):
        pulled = max(pulled, i + 1 - left * per_step)
    return pulled


def plan(scheduler: Any) -> Step:
    """Before `schedule()`: issue the orders of the running requests that are due, whether decoding or between
    two chunks of their prompt (and, with `evictions_per_step`, of decoding ones that `spread` evicts early),
    and free their tails. Waiting requests get their state, which admission reads."""
    step = Step()
    per_step = settings.evictions_per_step(access.engine_config(scheduler))
    due, early = [], []
    rings, held = ring_budget(scheduler), 0
    for request in access.waiting(scheduler):  # admission reads their state (`admission_blocks`, `rings_admit`)
        state_of(request, scheduler)
    for request in access.running(scheduler):
        state = state_of(request, scheduler)
        config, state.ringed = state.config, True
        held += rings.need(state)
        decoding = access.decoding(request)
        if config is None or not (decoding or access.computed_tokens(request) > 0):
            continue
        first, state.prefilled = not state.prefilled, True
        phys, keep = access.computed_tokens(request) - state.dropped, state.pinned + config.budget
        if evict_now(keep, config.window, keep + config.window, phys, first_step=first, prefill="compress"):
            due.append((request, state, phys, keep))
        elif decoding and per_step is not None and phys > keep:  # something to evict: it could go early
            early.append((keep + config.window - phys, request, state, phys, keep))
    rings.held = held
    early.sort(key=lambda e: e[0])
    pulled = spread([e[0] for e in early], per_step)
    tally = metrics.tally_of(scheduler)
    for request, state, phys, keep in due + [e[1:] for e in early[:pulled]]:
        step.orders[access.request_id(request)] = Order(phys, state.dropped, state.rounds, state.pinned)
        state.dropped += phys - keep
        state.evicted += phys - keep
        state.pending = phys - keep
        state.rounds += 1
        freed = access.free_tail(scheduler, access.request_id(request), keep)
        tally.evicted(metrics.policy_name(state.config), phys - keep, freed)
    return step


def finish(scheduler: Any, step: Step) -> Step:
    """After `schedule()`: drop the orders of requests preempted meanwhile (and `plan`'s counts of them: they are
    never carried out), attach every dropped count."""
    states = {access.request_id(r): getattr(r, "vasepatch", None) for r in access.running(scheduler)}
    kept = {rid: o for rid, o in step.orders.items() if states.get(rid) is not None and states[rid].dropped}
    if len(kept) < len(step.orders):
        uncount(scheduler, {rid: o for rid, o in step.orders.items() if rid not in kept})
    for state in states.values():
        if state is not None:
            state.pending = 0
    step.orders = kept
    step.dropped = {rid: state.dropped for rid, state in states.items() if state is not None and state.dropped}
    return step


def uncount(scheduler: Any, cancelled: dict[str, Order]) -> None:
    """Take back what `plan` counted of orders that a preemption in the same `schedule()` cancelled (the request
    waits again): the eviction, the positions it would have evicted and its round, in the scheduler's tally and
    the request's own numbers. The tail blocks it gave back stay counted: the pool got them."""
    tally = metrics.tally_of(scheduler)
    for request in access.waiting(scheduler):
        order, state = cancelled.get(access.request_id(request)), getattr(request, "vasepatch", None)
        if order is None or state is None or state.config is None:
            continue
        tokens, policy = order.n - order.pinned - state.config.budget, metrics.policy_name(state.config)
        state.rounds, state.evicted, state.pending = state.rounds - 1, state.evicted - tokens, 0
        tally.evictions -= Counter({policy: 1})
        tally.evicted_tokens -= Counter({policy: tokens})


@contextmanager
def physical(request: Any) -> Iterator[None]:
    """While vLLM allocates blocks for `request`, its computed-token count is the physical one."""
    state = getattr(request, "vasepatch", None)
    with access.computed_less(request, state.dropped if state is not None else 0):
        yield
