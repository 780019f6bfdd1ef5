"""`VaSELayer`: the static K/V buffers of one decoder layer, and its step API.

Per row `b` and KV head `h`, slot `s` holds `keys[b, h, s]`, `values[b, h, s]`,
the token's absolute position `positions[b, h, s]` (-1 for padding) and whether
it is a real token `valid[b, h, s]`. The buffers are allocated once, at the first
step, with `budget + window` slots (`prefill="keep"`: `max(prompt, budget) +
window`; `"pin"`: `prompt + budget + window`, the prompt's slots never evicted nor
written again), and never move. Appends write at a fill pointer (`vasepatch.cache.writes`:
eagerly, real tokens into a layer that never held padding go to the host-known
occupancy, with fewer ops); an eviction gathers the kept slots to the front in place.

A sliding-window layer (`plan.sliding_window`) masks the keys outside each query's window,
and keeps either exactly its window (`budget` = the window, no policy) or, when the window
is larger than the budget, what the policy picks among the tokens still inside it
(`vasepatch.cache.sliding`).

Layout invariant: in every row and KV head the attendable slots form one
contiguous range `[fill - n_valid, fill)` (left padding first, then real tokens
in sequence order), which is what varlen attention kernels need.

The attention integration drives one step as `append` -> attend over the
returned `Step` -> `record_queries` -> `evict_if_due`. Under `torch.compile` the
step touches only tensors (the fill pointer and sequence length are 0-d device
tensors); its host bookkeeping (counters, eviction) runs in `complete_step`,
eagerly, after the compiled forward.
"""

from __future__ import annotations

import torch

from vasepatch.cache import eviction, reuse, schedule, sliding, writes
from vasepatch.cache.counters import LayerCounters
from vasepatch.cache.fixed_batch import FixedBatchLayer
from vasepatch.cache.plan import LayerPlan
from vasepatch.cache.query_ring import QueryRing
from vasepatch.cache.randomness import EvictionRandomness
from vasepatch.cache.static import mark_static, outside_inference_mode
from vasepatch.cache.step import Step, overflow_step
from vasepatch.config import VaSEConfig
from vasepatch.policies.base import Policy


def new_valid_mask(padding: torch.Tensor | None, q_len: int, batch_size: int, device: torch.device) -> torch.Tensor:
    """`[B, Q]` bool: which of a step's `q_len` tokens are real, from the 2-D `padding` mask."""
    if padding is None:
        return torch.ones((batch_size, q_len), dtype=torch.bool, device=device)
    if padding.dim() != 2:
        raise ValueError(
            "vasepatch needs a 2-D attention mask ([batch, sequence], 1 = real token, 0 = padding); "
            f"got a {padding.dim()}-D mask of shape {tuple(padding.shape)}"
        )
    if padding.shape[-1] < q_len:
        raise ValueError(f"attention mask has {padding.shape[-1]} columns, fewer than the {q_len} new tokens")
    return padding[:, -q_len:].to(device=device, dtype=torch.bool)


class VaSELayer(FixedBatchLayer):
    """Static KV buffers of one decoder layer with VaSE eviction (`policy=None`: never evict)."""

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
        self.rng = rng if rng is not None else EvictionRandomness(config.seed)
        self.counters = counters if counters is not None else LayerCounters()
        self.ring = QueryRing(config.window)
        self.in_step = False  # set by the attention integration around a patched module's forward
        self.is_compileable = self.evicts  # a never-evicting layer grows its buffer: generate() does not compile
        self._pending = 0  # tokens appended by compiled steps whose host bookkeeping is due
        self.padded = False  # a step came with a padding mask: slots may hold padding (sticky until reset)

    # --- allocation -------------------------------------------------------------------------
    @outside_inference_mode
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        b, h, q_len, _ = key_states.shape
        self.device = key_states.device
        self.batch_size, self.num_heads = b, h
        self.next_position = torch.zeros((b,), dtype=torch.long, device=self.device)
        self.fill = torch.zeros((), dtype=torch.long, device=self.device)  # next free slot
        self.seen = torch.zeros((), dtype=torch.long, device=self.device)  # tokens appended (= tokens_seen)
        self._allocate(key_states, value_states, schedule.capacity(self.budget, cfg.window, q_len, self.prefill))
        self._real_row = torch.ones((b, 1), dtype=torch.bool, device=self.device)  # a real token's validity
        self.is_initialized = True
        mark_static(self.next_position, self.fill, self.seen)

    @outside_inference_mode
    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """(Re)allocate the buffers with `capacity` slots, keeping the occupied ones."""
        b, h, dev = self.batch_size, self.num_heads, self.device
        keys = key_states.new_zeros((b, h, capacity, key_states.shape[-1]))
        values = value_states.new_zeros((b, h, capacity, value_states.shape[-1]))
        positions = torch.full((b, h, capacity), -1, dtype=torch.long, device=dev)
        valid = torch.zeros((b, h, capacity), dtype=torch.bool, device=dev)
        if self.is_initialized:  # growing (never-evicting mode only): carry the occupied slots over
            occ = self.counters.occupancy
            for new, old in ((keys, self.keys), (values, self.values), (positions, self.positions)):
                new[:, :, :occ] = old[:, :, :occ]
            valid[:, :, :occ] = self.valid[:, :, :occ]
        self.keys, self.values, self.positions, self.valid = keys, values, positions, valid
        self.slot_index = torch.arange(capacity, device=dev)
        self.capacity = self.counters.capacity = capacity
        self.counters.kv_bytes = keys.nbytes + values.nbytes
        mark_static(keys, values, positions, valid, self.slot_index)

    # --- the step API -----------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a model's attention module calls: hand the new K/V through untouched.

        The vasepatch attention kernel appends them itself (`append`), attends, and
        evicts; outside a patched module's forward this is an error, since the
        module's own kernel would attend to the new tokens only."""
        if not torch.compiler.is_compiling() and not self.in_step:
            raise RuntimeError(
                "a vasepatch cache was used by a model that is not patched (or not through its attention "
                "modules); pass VaSECache objects only to the model they came from, while it is patched"
            )
        return key_states, value_states

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, padding: torch.Tensor | None) -> Step:
        """Add a step's `Q` new tokens (keys after RoPE, `[B, Hkv, Q, D]`); `padding` is the
        2-D mask (`[B, >= Q]`, last `Q` columns for these tokens; 1 = real) or None.
        Returns what the step's queries attend over."""
        reuse.refit(self, key_states)  # eagerly: a used layer refuses other inputs; a reset one re-allocates
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q_len, sliding_window = key_states.shape[-2], self.plan.sliding_window
        compiling = torch.compiler.is_compiling()
        overflow = False if compiling else self._make_room(key_states, value_states)  # may raise: nothing moved yet
        if not compiling and self.counters.tokens_seen == 0:  # the prompt
            self.counters.pinned = schedule.pinned(self.prefill, q_len)
        if padding is not None:
            self.padded = True
        if not (compiling or overflow or self.padded):
            return self._append_real(key_states, value_states)
        new_valid = new_valid_mask(padding, q_len, self.batch_size, self.device)
        new_pos = writes.new_positions(self.next_position, new_valid, padding is None)
        self.seen += q_len
        buffers = (self.keys, self.values, self.positions, self.valid)
        first, occ = not compiling and self.counters.tokens_seen == 0, self.counters.occupancy
        if overflow:
            return overflow_step(buffers, occ, key_states, value_states, new_pos, new_valid, first, sliding_window)
        slots = writes.write_at_fill(buffers, self.fill, self.slot_index, key_states, value_states, new_pos, new_valid)
        length = self.capacity if compiling else occ + q_len  # compiled: static shapes, no host counter is read
        return Step(*buffers, length, slots, new_valid, self.fill, first, False, sliding_window)

    def _append_real(self, key_states: torch.Tensor, value_states: torch.Tensor) -> Step:
        """Eagerly, real tokens into a layer that never held padding and has room for them: written at
        the host-known occupancy (`writes.write_real`). The device counters advance as in any step; a
        global layer's step is `dense` (every slot up to its length visible)."""
        c, q_len, sliding_window = self.counters, key_states.shape[-2], self.plan.sliding_window
        buffers = (self.keys, self.values, self.positions, self.valid)
        writes.write_real(buffers, c.occupancy, c.tokens_seen, key_states, value_states)
        for t in (self.next_position, self.seen, self.fill):
            t.add_(q_len)
        new_valid = self._real_row if q_len == 1 else self._real_row.expand(-1, q_len)
        slots = self.slot_index.narrow(0, c.occupancy, q_len)
        length, first = c.occupancy + q_len, c.tokens_seen == 0
        return Step(*buffers, length, slots, new_valid, self.fill, first, False, sliding_window, sliding_window is None)

    def _make_room(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Eagerly, before a step moves anything: whether it must take the overflow path. Grows the buffer
        where a mode allows it (never-evicting; `keep` after a `reset`), refuses a step `keep` cannot hold."""
        cfg, occ, q_len = self.config, self.counters.occupancy, key_states.shape[-2]
        keep = self.prefill in schedule.SIZED_BY_PROMPT and self.policy is not None
        if keep and self.counters.tokens_seen == 0:  # a prompt after reset(): room for it plus one window
            need = schedule.capacity(self.budget, cfg.window, q_len, self.prefill)
            if need > self.capacity:
                self._allocate(key_states, value_states, need)
            return False
        if schedule.fits(self.capacity, occ, q_len):
            return False
        if not self.evicts:  # grow `window` slots past the need: a realloc every `window` tokens
            self._allocate(key_states, value_states, occ + q_len + cfg.window)
            return False
        if not keep:
            return True
        raise schedule.keep_overflow_error(occ, q_len, self.capacity)

    def record_queries(self, query: torch.Tensor, step: Step) -> None:
        """Keep the queries (after RoPE, `[B, Hq, Q, D]`) of the last `window` tokens."""
        if self.policy is not None and not self.sliding_only:
            self.ring.write(query, step.new_valid)

    def evict_if_due(self, step: Step) -> bool:
        """End of a step: advance the host counters and evict if the schedule says so.
        Under compilation both wait for `complete_step`, after the graph."""
        if torch.compiler.is_compiling():
            self._pending = step.q_len  # stored, not read: no guard on a host int
            return False
        return self._settle(step.q_len, step if step.overflow else None)

    def complete_step(self) -> bool:
        """Host-side bookkeeping of compiled steps, run eagerly after the forward (a no-op
        after an eager step). Returns whether it evicted."""
        q_len, self._pending = self._pending, 0
        if q_len and self.ring.queries is not None:
            self.ring.advance(q_len)  # the compiled step wrote the ring at its device pointer
        return self._settle(q_len, None) if q_len else False

    def _settle(self, q_len: int, overflowed: Step | None) -> bool:
        """Evict if due, then count the step (the host counters change only once it has succeeded)."""
        c, evicts = self.counters, overflowed is not None or self.due(q_len)
        if evicts:  # an overflow step's tokens are in its temporaries, the others in the buffer
            src, n = (overflowed, overflowed.length) if overflowed is not None else (self, c.occupancy + q_len)
            self._compact(src.keys, src.values, src.positions, src.valid, n)
        else:
            c.occupancy += q_len
        c.tokens_seen += q_len
        return evicts

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
        budget = c.pinned + self.budget
        return schedule.tokens_until_eviction(budget, self.config.window, self.capacity, c.occupancy)

    # --- eviction ---------------------------------------------------------------------------
    def _compact(self, keys, values, positions, valid, n: int) -> None:
        """Keep `budget` of the first `n` slots of (keys, values, positions, valid) past the `pinned`
        ones, gathered to just after them: the most recent ones in a `sliding_only` layer, else those
        chosen by `eviction.kept_slots` (in a sliding layer among the tokens still in the window: the
        others count as padding, never candidates while real ones are left, never attended)."""
        p, b, recent = self.counters.pinned, self.budget, self.config.window  # `recent`: always kept
        sliding_window = self.plan.sliding_window  # None: a global layer
        if self.sliding_only:
            kept = sliding.recent_slots(n, b, valid)
        else:
            if sliding_window is not None:  # tokens out of the window count as padding
                valid = sliding.in_window(positions, valid, self.next_position, sliding_window)
            queries = self.ring.read()
            generator = self.rng.for_eviction(self.plan, self.counters.evictions, self.device)
            tail = (t[:, :, p:] for t in (keys, values, positions, valid))  # the candidates: slots p..n-1
            kept = eviction.kept_slots(self.policy, *tail, queries, n - p, b, recent, generator) + p
        buffers = (self.keys, self.values, self.positions, self.valid)
        end = eviction.write_kept(buffers, (keys, values, positions, valid), kept, p, n)
        self.fill.fill_(end)
        c = self.counters
        c.occupancy, c.evictions, c.evicted = end, c.evictions + 1, c.evicted + n - end

    # --- CacheLayerMixin API ----------------------------------------------------------------
    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens appended so far (padding included). Under compilation a 0-d device
        tensor, so that reading it neither syncs nor specialises the graph."""
        if torch.compiler.is_compiling() and self.is_initialized:
            return self.seen
        return self.counters.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only vasepatch's mask function sees these, and ignores them. Under compilation report the
        # static buffer, not the growing length, which would specialise the graph on every step.
        if torch.compiler.is_compiling() and self.is_initialized:
            return self.capacity + query_length, 0
        return self.counters.tokens_seen + query_length, 0

    def reset(self) -> None:
        if self.is_initialized:
            self.valid.zero_()
            self.positions.fill_(-1)
            for t in (self.next_position, self.fill, self.seen):
                t.zero_()
        self.ring.reset()
        self.rng.reset()
        self.counters.restart()
        self._pending = 0
        self.padded = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute rows in place (storage unchanged)."""
        if not self.is_initialized:
            return
        beam_idx = beam_idx.to(self.device)
        for t in (self.keys, self.values, self.positions, self.valid, self.next_position):
            t.copy_(t.index_select(0, beam_idx))
        self.ring.reorder(beam_idx)
