"""`VaSELayer`: one decoder layer's cache, and its step.

The layer owns its slots (`slots.SlotBuffer`: keys, values, positions, validity), the queries of
its last `window` tokens (`query_ring.QueryRing`), its host counters (`counters.LayerCounters`)
and its policy. `step` runs one attention step of the layer, top to bottom: append the step's
K/V, attend (a callback from the attention integration, which chooses the kernel), record the
queries, evict if the schedule (`schedule.py`) says so, with one eviction decision per step; an
eager step that fails puts everything back. The buffers hold `budget + window` slots
(`prefill="keep"`: `max(prompt, budget) + window`; `"pin"`: `prompt + budget + window`, the
prompt's slots never evicted nor written again), allocated at the first step.

A sliding-window layer (`plan.sliding_window`) masks the keys outside each query's window, and
keeps either exactly its window (`budget` = the window, no policy) or, when the window is larger
than the budget, what the policy picks among the tokens still inside it (`vasepatch.cache.sliding`).

Compiled or not, the step is the same data path; the one difference lives here. Under
`torch.compile` the step touches only tensors (it writes at the device fill pointer and attends
over the whole static buffer) and leaves its host part (counters, eviction) for `complete_step`,
which the patched model runs eagerly after the compiled forward: step now, settle later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from vasepatch.cache import schedule, sliding
from vasepatch.cache.counters import LayerCounters
from vasepatch.cache.fixed_batch import FixedBatchLayer
from vasepatch.cache.plan import LayerPlan
from vasepatch.cache.query_ring import QueryRing
from vasepatch.cache.slots import SlotBuffer, Step
from vasepatch.config import VaSEConfig
from vasepatch.policies.base import Policy, kept_slots
from vasepatch.policies.keyed import EvictionRandomness

T = TypeVar("T")


class VaSELayer(FixedBatchLayer):
    """One layer's cache with VaSE eviction (`policy=None`: never evict)."""

    is_compileable = True

    def __init__(
        self,
        config: VaSEConfig,
        policy: Policy | None,
        rng: EvictionRandomness | None = None,
        counters: LayerCounters | None = None,
        plan: LayerPlan | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.plan = plan if plan is not None else LayerPlan(0)
        self.policy = policy
        # sliding_only: keeps exactly its sliding window, no policy, no prompt kept (`vasepatch.cache.sliding`)
        self.sliding_only = sliding.sliding_only(self.plan.sliding_window, config.budget, policy is not None)
        self.budget = self.plan.sliding_window if self.sliding_only else config.budget  # slots an eviction keeps
        self.prefill = sliding.prefill_mode(config.prefill, self.plan.sliding_window, self.sliding_only)
        self.evicts = policy is not None or self.sliding_only
        self.records_queries = policy is not None and not self.sliding_only  # what the policy scores with
        self.rng = rng if rng is not None else EvictionRandomness(config.seed)
        self.counters = counters if counters is not None else LayerCounters()
        self.slots = SlotBuffer()
        self.ring = QueryRing(config.window)
        self.in_step = False  # set by the patch's wrappers around a patched model's call (`check_patched`)
        self.is_compileable = self.evicts  # a never-evicting layer grows its buffer: generate() does not compile
        self.pending = 0  # tokens of a compiled step whose host part (`complete_step`) is due

    # --- the step -------------------------------------------------------------------------
    def step(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        padding: torch.Tensor | None,
        attend: Callable[[Step], T],
    ) -> tuple[T, bool]:
        """One attention step: append `key`/`value` (`[B, Hkv, Q, D]`, after RoPE; `padding` the
        2-D mask `[B, >= Q]`, 1 = real, or None), `attend(step)`, record `query` (`[B, Hq, Q, D]`),
        evict if due. Returns what `attend` returned and whether the step evicted (False under
        compilation, where the host part waits for `complete_step`)."""
        if torch.compiler.is_compiling():
            if self.slots.keys is None:
                self._allocate(key, value, self.initial_capacity(key), compiling=True)
            step = self.slots.append_at_fill(key, value, padding, None, first=False, **self._window())
            self.slots.padded |= padding is not None
            out = attend(step)
            if self.records_queries:
                self.ring.write_at_pointer(query, step.new_valid)
            self.pending = step.q_len  # stored, not read: no guard on a host int
            return out, False
        step, evicts = self._append(key, value, padding)
        saved = self.ring.save(step.q_len) if evicts and self.records_queries else False  # None: no ring yet
        try:
            out = attend(step)
            if self.records_queries:
                self.ring.write(query, step.new_valid)
            self._settle(step.q_len, evicts, step if step.overflow else None)
        except BaseException:
            self.slots.undo(step, self.counters.occupancy, self.counters.tokens_seen)
            if saved is not False:
                self.ring.restore(saved)
            raise
        return out, evicts

    def _window(self) -> dict:
        return {"sliding_window": self.plan.sliding_window}

    def _append(self, key: torch.Tensor, value: torch.Tensor, padding: torch.Tensor | None) -> tuple[Step, bool]:
        """Eagerly: the step's tokens into the slots, and whether the step ends with an eviction.
        Everything that may refuse the step runs before anything is written."""
        c, slots, q_len = self.counters, self.slots, key.shape[-2]
        if slots.keys is not None and slots.refuses(key, c.tokens_seen, self.plan.index):
            slots.keys = None  # a reset layer given another input: re-allocated below
            self.ring.release()
        if slots.keys is None:
            self.lazy_initialization(key, value)
        overflow = self._make_room(key, value)
        first = c.tokens_seen == 0
        if first:  # the prompt
            c.pinned = schedule.pinned(self.prefill, q_len)
        slots.padded |= padding is not None
        where = {"first": first, **self._window()}
        if overflow:
            return slots.overflow(key, value, padding, c.occupancy, **where), True
        if slots.padded:
            step = slots.append_at_fill(key, value, padding, c.occupancy + q_len, **where)
        else:
            step = slots.append_real(key, value, c.occupancy, c.tokens_seen, **where)
        return step, self.due(q_len)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the slots for the first step's keys."""
        self._allocate(key_states, value_states, self.initial_capacity(key_states))

    def initial_capacity(self, key_states: torch.Tensor) -> int:
        """The slots allocated for a first step of `key_states` (`schedule.capacity`)."""
        return schedule.capacity(self.budget, self.config.window, key_states.shape[-2], self.prefill)

    def _allocate(self, key: torch.Tensor, value: torch.Tensor, capacity: int, compiling: bool = False) -> None:
        """(Re)allocate the slots, keeping the occupied ones; `keys`/`values` stay transformers' view."""
        keep = 0 if self.slots.keys is None else self.counters.occupancy
        self.slots.allocate(key, value, capacity, keep, compiling)
        self.keys, self.values = self.slots.keys, self.slots.values
        self.device, self.batch_size, self.num_heads = key.device, key.shape[0], key.shape[1]
        self.capacity = self.counters.capacity = capacity
        self.counters.kv_bytes = self.keys.nbytes + self.values.nbytes
        self.is_initialized = True

    def _make_room(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Eagerly, before a step moves anything: grow the buffer where `schedule.room` says so (or refuse
        the step); returns whether the step takes the overflow path."""
        c = self.counters
        sized_by_prompt = self.prefill in schedule.SIZED_BY_PROMPT and self.policy is not None
        prompt_need = self.initial_capacity(key) if sized_by_prompt and c.tokens_seen == 0 else 0
        size, overflow = schedule.room(
            self.capacity, c.occupancy, key.shape[-2], self.config.window,
            evicts=self.evicts, sized_by_prompt=sized_by_prompt, prompt_need=prompt_need,
        )  # fmt: skip
        if size > self.capacity:
            self._allocate(key, value, size)
        return overflow

    def complete_step(self) -> bool:
        """The host part of a compiled step, run eagerly after the forward (a no-op after an eager
        step). Returns whether it evicted."""
        q_len, self.pending = self.pending, 0
        if not q_len:
            return False
        if self.ring.queries is not None:
            self.ring.advance(q_len)  # the compiled step wrote the ring at its device pointer
        evicts = self.due(q_len)
        self._settle(q_len, evicts, None)
        return evicts

    def _settle(self, q_len: int, evicts: bool, overflowed: Step | None) -> None:
        """Evict if `evicts`, then count the step (the host counters change only once it has succeeded)."""
        c = self.counters
        if evicts:  # an overflow step's tokens are in its temporaries, the others in the buffer
            sources, n = (
                (overflowed, overflowed.length) if overflowed is not None else (self.slots, c.occupancy + q_len)
            )
            self._compact(sources.keys, sources.values, sources.positions, sources.valid, n)
        else:
            c.occupancy += q_len
        c.tokens_seen += q_len

    def due(self, q_len: int) -> bool:
        """Whether a step of `q_len` tokens written into the buffer ends with an eviction."""
        occupancy, first = self.counters.occupancy + q_len, self.counters.tokens_seen == 0
        budget = self.counters.pinned + self.budget  # a pinned prompt is never over the budget
        return self.evicts and schedule.evict_now(
            budget, self.config.window, self.capacity, occupancy, first_step=first, prefill=self.prefill
        )

    def tokens_until_eviction(self) -> int:
        """How many tokens can be appended before the next eviction, counting the token whose
        step evicts (see `schedule.tokens_until_eviction`); `schedule.NEVER` if it never evicts."""
        if not self.is_initialized:
            raise RuntimeError("the cache has not seen its prefill yet")
        if not self.evicts:
            return schedule.NEVER
        c = self.counters
        return schedule.tokens_until_eviction(c.pinned + self.budget, self.config.window, self.capacity, c.occupancy)

    # --- eviction ---------------------------------------------------------------------------
    def _compact(self, keys, values, positions, valid, n: int) -> None:
        """Keep `budget` of the first `n` slots of (keys, values, positions, valid) past the `pinned`
        ones, gathered to just after them: the most recent ones in a `sliding_only` layer, else those
        chosen by `kept_slots` (in a sliding layer among the tokens still in the window: the others
        count as padding, never candidates while real ones are left, never attended)."""
        p, b, recent = self.counters.pinned, self.budget, self.config.window  # `recent`: always kept
        sliding_window = self.plan.sliding_window  # None: a global layer
        if self.sliding_only:
            kept = sliding.recent_slots(n, b, valid)
        else:
            if sliding_window is not None:  # tokens out of the window count as padding
                valid = sliding.in_window(positions, valid, self.slots.next_position, sliding_window)
            queries = self.ring.read()
            generator = self.rng.for_eviction(self.plan, self.counters.evictions, self.device)
            tail = (t[:, :, p:] for t in (keys, values, positions, valid))  # the candidates: slots p..n-1
            ids = None  # only for a policy that reads them (a step enters no file it does not need)
            if "head_ids" in getattr(self.policy, "inputs", ()):
                ids = self.plan.head_ids(keys.shape[1], keys.shape[0], keys.device)
            kept = kept_slots(self.policy, *tail, queries, n - p, b, recent, generator, ids) + p
        end = self.slots.compact((keys, values, positions, valid), kept, p, n)
        c = self.counters
        c.occupancy, c.evictions, c.evicted = end, c.evictions + 1, c.evicted + n - end

    # --- what transformers and the tests read -------------------------------------------------
    @property
    def positions(self) -> torch.Tensor:
        return self.slots.positions

    @property
    def valid(self) -> torch.Tensor:
        return self.slots.valid

    def check_patched(self) -> None:
        """Eagerly, refuse a call that is not a patched model's (the patch's wrappers set `in_step`), before
        the cache changes: an unpatched model's own kernel would attend to the new tokens only."""
        if not self.in_step and not torch.compiler.is_compiling():
            raise RuntimeError(
                "a vasepatch cache was used by a model that is not patched (or not through its attention "
                "modules); pass VaSECache objects only to the model they came from, while it is patched"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """What a model's attention module calls: hand the new K/V through untouched (the vasepatch
        kernel runs `step` itself), in a patched model's call only (`check_patched`)."""
        self.check_patched()
        return key_states, value_states

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens appended so far (padding included). Under compilation a 0-d device
        tensor, so that reading it neither syncs nor specialises the graph."""
        if torch.compiler.is_compiling() and self.is_initialized:
            return self.slots.seen
        return self.counters.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Asked for before any layer runs: the first place a stray call is refused (`check_patched`).
        # Only vasepatch's mask function sees these, and ignores them. Under compilation report the
        # static buffer, not the growing length, which would specialise the graph on every step.
        self.check_patched()
        if torch.compiler.is_compiling() and self.is_initialized:
            return self.capacity + query_length, 0
        return self.counters.tokens_seen + query_length, 0

    def reset(self) -> None:
        self.slots.reset()
        self.ring.reset()
        self.rng.reset()
        self.counters.restart()
        self.pending = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute rows in place (storage unchanged)."""
        self.slots.reorder(beam_idx)
        self.ring.reorder(beam_idx)
