"""Eviction inside one batch processor of transformers' continuous batching: each request evicts as it would alone.

A patched model's processor (`hooks`) calls three methods:

1. `before_schedule` (before the scheduler picks the next batch): the requests it holds are registered (a query
   ring each, `QueryRings`), those gone are forgotten, and every request whose last step brought it to an eviction
   point is evicted. The point is the cache's own rule (`schedule.evict_now`) on the request's physical length,
   with the prompt's completion as the first step: a prompt prefilled in chunks is compressed once it is whole,
   as `generate` compresses it in one step.
2. `after_prepare` (after the batch's inputs are built): transformers reads `position_offset` both as the length
   of a request's cache and as the position of its next token; after an eviction it is the former (the slots
   the request holds), so each request's position ids get back the tokens it dropped. The rings are told which
   tokens of the batch are each request's last `window`.
3. `record` (in each layer's attention, after RoPE): those queries go to the rings.

An eviction (`_evict`) reads the request's slots from its blocks (`layout`), lets the policy choose with the
same inputs as the transformers cache (`kept_slots`; the keyed randomness of `(seed, layer, eviction round)` with
the request as row 0; positions after earlier evictions, `candidate_positions`), gathers the kept slots to the
front of its blocks in sequence order, gives its tail blocks back to the allocator, and sets `position_offset` to
the slots it keeps. So a request keeps the kept sets that the same request alone through `generate` keeps.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from vasepatch import policies
from vasepatch.cache import schedule
from vasepatch.cache.paged_positions import candidate_positions
from vasepatch.cache.paged_rings import QueryRings
from vasepatch.cache.slots import gather_slots
from vasepatch.config import VaSEConfig
from vasepatch.integration.continuous import layout
from vasepatch.policies.base import head_ids, kept_slots
from vasepatch.policies.keyed import EvictionRandomness, KeyedGenerator

LOG = logging.getLogger("vasepatch")
WARMUP_PREFIX = "__warmup"  # transformers' warmup requests (model_runner.py): never evicted
CHILD_MARK = "__child#"  # transformers' forked requests: `<parent id>__child#<i>` (`num_return_sequences`)
DECODING = 2  # transformers' RequestStatus.DECODING: the prompt is scheduled whole


@dataclasses.dataclass
class _Request:
    """What one request's evictions need between steps (host ints, and the kept positions of the last one)."""

    state: Any  # transformers' RequestState; a soft reset replaces it under the same id
    pinned: int  # leading slots never evicted (the prompt with prefill="pin")
    capacity: int  # the slots at which an eviction is due whatever the window (`schedule.capacity`)
    rng: EvictionRandomness
    dropped: int = 0
    rounds: int = 0
    seen: int = -1  # the physical length at the last check
    prefilled: bool = False
    peak_blocks: int = 0  # the most blocks it held at a step after its first eviction
    kept: torch.Tensor | None = None  # [layers, kv_heads, budget]: positions of the slots after the pinned ones


class PagedEviction:
    """The eviction state of one batch processor (see the module's docstring)."""

    def __init__(self, config: VaSEConfig, cache: Any) -> None:
        self.config = config
        self.policy = policies.for_config(config)
        groups = list(cache.cache_allocators.values())  # `hooks.check_cache`: one full, at most one sliding
        self.allocator = next(g for g in groups if g.layer_type == "full_attention")
        self.sliding = [g for g in groups if g is not self.allocator]  # each keeps exactly its window
        self.views = [self.allocator._kv_token_views[i] for i in self.allocator.layer_indices]
        self.layers = set(self.allocator.layer_indices)
        self.rings = QueryRings()
        self.requests: dict[str, _Request] = {}
        self.evictions = 0
        self.evicted_tokens = 0
        self.blocks_freed = 0
        self.peak_blocks = 0  # the most blocks a request held at a step after its first eviction

    def reset(self) -> None:
        """The processor was reset for a new run (its cache emptied): every request is forgotten, the counters
        start over."""
        for req_id in list(self.requests):
            self._forget(req_id)
        self.evictions = self.evicted_tokens = self.blocks_freed = self.peak_blocks = 0

    # --- between steps -------------------------------------------------------------------------------------

    def before_schedule(self, scheduler: Any) -> None:
        held = {**scheduler.waiting_requests, **scheduler.active_requests}
        for req_id in [r for r in self.requests if r not in held]:
            self.ended(req_id)
        for req_id, state in held.items():
            self._register(req_id, state)
        due = [r for r, s in scheduler.active_requests.items() if r in self.requests and self._due(r, s)]
        for req_id in due:
            self._evict(req_id, scheduler.active_requests[req_id])

    def _register(self, req_id: str, state: Any) -> _Request | None:
        """The request's record, made on its first sight (and again after a soft reset, a new state)."""
        if req_id.startswith(WARMUP_PREFIX):
            return None
        known = self.requests.get(req_id)
        if known is not None and known.state is state:
            return known
        if known is not None:  # transformers' offloading started it over (a soft reset): a new prompt, a new record
            LOG.info(
                "vasepatch: request %s started over (transformers' offloading) after %d evictions; it is compressed "
                "again from its prompt and generated tokens", req_id, known.rounds,
            )  # fmt: skip
            self._forget(req_id)
        parent = self.requests.get(req_id.rpartition(CHILD_MARK)[0]) if CHILD_MARK in req_id else None
        if parent is not None and 0 < state.position_offset == parent.state.position_offset:  # a copy of its cache
            return self._fork(req_id, state, parent)
        prompt, mode, config = len(state.initial_tokens), self.config.prefill, self.config
        pinned = schedule.pinned(mode, prompt)
        capacity = schedule.capacity(config.budget, config.window, prompt, mode)
        self.requests[req_id] = _Request(state, pinned, capacity, EvictionRandomness(config.seed))
        return self.requests[req_id]  # its ring comes with its first step (`after_prepare`), not while it waits

    def _fork(self, req_id: str, state: Any, parent: _Request) -> _Request:
        """A child forked from `parent` (its cache copied from the parent's, `num_return_sequences`): the parent's
        record and queries, its own state."""
        self.requests[req_id] = dataclasses.replace(parent, state=state, rng=EvictionRandomness(self.config.seed))
        self.rings.copy(parent.state.request_id, req_id)
        return self.requests[req_id]

    def ended(self, req_id: str) -> None:
        """The request left the processor (finished, failed or cancelled): forgotten, and one info line if it evicted
        (what `vasepatch serve` shows an operator)."""
        r = self.requests[req_id]
        if r.rounds:
            LOG.info(
                "vasepatch: request %s ended: %d evictions, %d tokens dropped, held at most %d blocks",
                req_id, r.rounds, r.dropped, r.peak_blocks,
            )  # fmt: skip
        self._forget(req_id)

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.rings.release(req_id)

    def _due(self, req_id: str, state: Any) -> bool:
        """Whether the request's last step (one it has run since the last check, its prompt whole) ends with an
        eviction: `schedule.evict_now` on its physical length, its prompt's completion as the first step."""
        if int(state.status) != DECODING or state.remaining_prefill_tokens:
            return False
        r, n = self.requests[req_id], state.position_offset
        if n == r.seen:
            return False
        first, r.prefilled, r.seen = not r.prefilled, True, n
        config = self.config
        return schedule.evict_now(
            r.pinned + config.budget, config.window, r.capacity, n, first_step=first, prefill=config.prefill
        )

    def _evict(self, req_id: str, state: Any) -> None:
        """Keep `pinned + budget` slots of the request (module docstring), a layer at a time (one layer's slots read
        at once), then give its tail blocks back."""
        r, config, alloc = self.requests[req_id], self.config, self.allocator
        n, keep = state.position_offset, r.pinned + self.config.budget
        device = self.views[0][0].device
        rows = layout.slot_rows(
            alloc.block_table[req_id], r.pinned, n, alloc.tokens_per_page, alloc.block_physical_stride, device
        )
        heads = self.views[0][0].shape[1]
        positions = candidate_positions(r.kept, len(self.views), heads, n, r.dropped, r.pinned).to(device)
        queries = self.rings.queries(req_id, alloc.layer_indices)
        kept_positions = []
        for i, view in enumerate(self.views):
            keys, values = layout.read_slots([view], rows)  # [1, kv_heads, n - pinned, head_dim]
            kept = self._choose(r, i, keys, values, positions[i : i + 1], queries[i : i + 1], n - r.pinned)
            layout.write_slots([view], rows[: config.budget], gather_slots(keys, kept), gather_slots(values, kept))
            kept_positions.append(positions[i : i + 1].gather(-1, kept))
        r.kept = torch.cat(kept_positions)
        self._cut(req_id, -(-keep // alloc.tokens_per_page))
        state.position_offset = r.seen = keep
        r.dropped += n - keep
        self.evicted_tokens += n - keep
        r.rounds += 1
        self.evictions += 1

    def _choose(self, r: _Request, i: int, keys, values, positions, queries, n: int) -> torch.Tensor:
        """`[1, kv_heads, budget]`: the slots layer `i` (`keys`, `values`, `positions`, `queries` its own, batch 1)
        keeps, chosen as the transformers cache chooses."""
        layer = self.allocator.layer_indices[i]
        device = keys.device
        generator = KeyedGenerator(r.rng.generation_seed(), layer, r.rounds, 0, device)
        ids = (
            head_ids(torch.tensor([layer], device=device), keys.shape[1]) if "head_ids" in self.policy.inputs else None
        )
        valid = torch.ones(1, keys.shape[1], n, dtype=torch.bool, device=device)
        return kept_slots(
            self.policy, keys, values, positions, valid, queries, n, self.config.budget, self.config.window,
            generator, ids,
        )  # fmt: skip

    def _cut(self, req_id: str, blocks: int) -> None:
        """Keep the first `blocks` of the request's block table; the others go back to the allocator's pool."""
        alloc = self.allocator
        table = alloc.block_table[req_id]
        tail, table[blocks:] = table[blocks:], []
        freed = [b for b in tail if alloc.ledger.release(b, no_cache=True)]
        alloc.pool.free_blocks(alloc.index, freed)
        self.blocks_freed += len(freed)

    # --- the step's inputs and its queries -----------------------------------------------------------------

    def after_prepare(self, io: Any, requests_in_batch: list[Any], past: list[int]) -> None:
        """The batch's position ids made logical, and the rings' plan (`past`: each request's `position_offset`
        before the inputs were built)."""
        ids, starts, counts, firsts, offsets = [], [], [], [], []
        start = 0
        for future, before in zip(requests_in_batch, past, strict=True):
            req_id, count = future.state.request_id, future.query_length
            r = self._register(req_id, future.state)
            dropped = 0 if r is None else r.dropped
            if r is not None:
                self.rings.assign(req_id, self.config.window)  # once
                ids.append(req_id), starts.append(start), counts.append(count), firsts.append(before + dropped)
                if r.rounds:  # the blocks it holds for this step, new ones included
                    r.peak_blocks = max(r.peak_blocks, len(self.allocator.block_table[req_id]))
                    self.peak_blocks = max(self.peak_blocks, r.peak_blocks)
            offsets.append((dropped, count))
            start += count
        self.rings.plan(ids, starts, counts, firsts)
        if any(d for d, _ in offsets):
            shift = torch.tensor([d for d, c in offsets for _ in range(c)], dtype=io.position_ids.dtype)
            io.position_ids[: len(shift)] += shift.to(io.position_ids.device)

    def record(self, layer: int, query: torch.Tensor) -> None:
        """Layer `layer`'s planned queries (`query`: `[1, q_heads, tokens, head_dim]`, after RoPE); a sliding layer's
        are not needed."""
        if layer in self.layers:
            self.rings.record(layer, query[0].transpose(0, 1))

    def stats(self) -> dict[str, int]:
        """Evictions, slots dropped (per request: each of its layers and KV heads drops as many), blocks given back to
        the allocator, and the most blocks a request held at a step after its first eviction
        (`PatchHandle.batching_stats`)."""
        return {
            "evictions": self.evictions, "evicted_tokens": self.evicted_tokens, "blocks_freed": self.blocks_freed,
            "peak_blocks": self.peak_blocks,
        }  # fmt: skip
