"""The static KV cache: fixed buffers, true positions, host-side eviction triggers.

One `VaSELayer` per decoder layer, gathered in a `VaSECache` (a transformers
`Cache`). Buffers are allocated once, at the first update (the prefill), with
`max(prompt_len, budget) + window` slots per row and KV head, and never
reallocated: appends write at a device-side fill pointer, evictions gather the
kept slots to the front in place. The trigger is a host-side counter (the number
of appended tokens is known from input shapes), so the decode path never syncs
with the device. Which slots survive is decided by a `Policy`; the cache only
moves data.

Layout invariant: in every row and KV head the attendable slots form one
contiguous range `[fill - n_valid, fill)` (left padding first, then real tokens
in sequence order), which is what varlen attention kernels need.

Under `torch.compile` the step touches only tensors: the write slot, the query
ring pointer and the sequence length live on the device, so one decode graph
serves every step. The host-side bookkeeping (counters, eviction trigger) of a
compiled step is deferred to `VaSELayer.complete_step`, which the patched
model runs eagerly after each forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from vasepatch.config import VaSEConfig
from vasepatch.policies import evicts
from vasepatch.policies.base import Policy


@dataclass
class LayerCounters:
    """Host-side bookkeeping of one layer (plain ints: reading them never syncs)."""

    occupancy: int = 0  # slots in use (padding slots included)
    tokens_seen: int = 0  # tokens appended since the start (the sequence length HF sees)
    evictions: int = 0  # eviction rounds
    evicted: int = 0  # slots dropped per row and KV head, summed over rounds
    capacity: int = 0  # slots allocated per row and KV head
    kv_bytes: int = 0  # bytes held by the K and V buffers


@dataclass
class CacheMonitor:
    """Counters of the most recent cache of a patch; outlives the cache's tensors."""

    layers: list[LayerCounters] = field(default_factory=list)
    generations: int = 0

    def snapshot(self, budget: int, window: int) -> dict[str, int]:
        ls = self.layers
        return {
            "evictions": max((c.evictions for c in ls), default=0),
            "evicted_tokens": max((c.evicted for c in ls), default=0),
            "tokens_seen": max((c.tokens_seen for c in ls), default=0),
            "occupancy": max((c.occupancy for c in ls), default=0),
            "budget": budget,
            "window": window,
            "capacity": max((c.capacity for c in ls), default=0),
            "kv_bytes": sum(c.kv_bytes for c in ls),
            "layers": len(ls),
            "generations": self.generations,
        }


class SeededGenerator:
    """A `torch.Generator` created on first use, on the device of the cache, from `seed`
    (`None`: torch's global generator). Shared by all layers of one cache."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._generator: torch.Generator | None = None

    def get(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != torch.device(device):
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator


class VaSELayer(CacheLayerMixin):
    """Static KV buffers of one decoder layer with VaSE eviction.

    Per row `b` and KV head `h`, slot `s` holds `keys[b, h, s]`,
    `values[b, h, s]`, its absolute position `positions[b, h, s]` and whether it
    is a real token `valid[b, h, s]`. A small ring holds the queries of the last
    `window` steps; it is seeded with the last prompt queries at prefill.

    Protocol per forward step (driven by the attention integration):
    `prepare_step(padding_mask)` -> `update(k, v)` -> `step_mask()` for the
    kernel -> `observe_queries(q)` -> `maybe_evict()`.
    """

    is_compileable = True
    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        config: VaSEConfig,
        policy: Policy,
        rng: SeededGenerator | None = None,
        counters: LayerCounters | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.policy = policy
        self.rng = rng if rng is not None else SeededGenerator(config.seed)
        self.counters = counters if counters is not None else LayerCounters()
        self._pending_padding: torch.Tensor | None = None
        self._step_len = 0  # tokens appended by the most recent step
        self._pending_len = 0  # tokens appended by a compiled step whose host bookkeeping is due
        self.prefilling = False  # whether the most recent step was the first since allocation/reset
        self._evicts = evicts(policy)

    # --- allocation -------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        b, h, q_len, d = key_states.shape
        capacity = max(q_len, cfg.budget) + cfg.window
        dev = key_states.device
        self.device = dev
        self.batch_size, self.num_heads = b, h
        self.keys = torch.zeros((b, h, capacity, d), dtype=key_states.dtype, device=dev)
        self.values = torch.zeros((b, h, capacity, value_states.shape[-1]), dtype=value_states.dtype, device=dev)
        self.positions = torch.full((b, h, capacity), -1, dtype=torch.long, device=dev)
        self.valid = torch.zeros((b, h, capacity), dtype=torch.bool, device=dev)
        self.next_position = torch.zeros((b,), dtype=torch.long, device=dev)
        # device-side step state: read and advanced inside the (compiled) step, never on the host
        self.fill = torch.zeros((), dtype=torch.long, device=dev)  # next free slot
        self.seen = torch.zeros((), dtype=torch.long, device=dev)  # tokens appended (= tokens_seen)
        self.ring = torch.zeros((), dtype=torch.long, device=dev)  # next slot of the query ring
        self.slot_index = torch.arange(capacity, device=dev)
        self.queries: torch.Tensor | None = None  # [B, Hq, W, D], allocated at the first observe_queries
        self.query_valid: torch.Tensor | None = None
        self.capacity = capacity
        self.counters.capacity = capacity
        self.counters.kv_bytes = self.keys.nbytes + self.values.nbytes
        self.is_initialized = True
        self._mark_static(self.keys, self.values, self.positions, self.valid, self.next_position)
        self._mark_static(self.fill, self.seen, self.ring, self.slot_index)

    @staticmethod
    def _mark_static(*tensors: torch.Tensor) -> None:
        """Tell dynamo these buffers keep their address (CUDA graphs may then read and
        write them in place). Only eagerly: marking is not allowed while tracing."""
        if not torch.compiler.is_compiling():
            for t in tensors:
                torch._dynamo.mark_static_address(t)

    # --- one step ---------------------------------------------------------------------------
    def prepare_step(self, padding_mask: torch.Tensor | None) -> None:
        """Record the 2-D padding mask (`[B, seen + Q]`, 1/True = real token) of the next update."""
        if padding_mask is not None and padding_mask.dim() != 2:
            raise ValueError(
                "vasepatch needs a 2-D attention mask ([batch, sequence], 1 = real token, 0 = padding); "
                f"got a {padding_mask.dim()}-D mask of shape {tuple(padding_mask.shape)}"
            )
        self._pending_padding = padding_mask

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `Q` new tokens (keys after RoPE) at the fill pointer; return the whole
        static buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q_len = key_states.shape[-2]
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self._check_room(q_len)
            self.prefilling = self.counters.tokens_seen == 0
        padding, self._pending_padding = self._pending_padding, None
        if padding is None:
            new_valid = torch.ones((self.batch_size, q_len), dtype=torch.bool, device=self.device)
        else:
            if padding.shape[-1] < q_len:
                raise ValueError(f"attention mask has {padding.shape[-1]} columns, fewer than the {q_len} new tokens")
            new_valid = padding[:, -q_len:].to(device=self.device, dtype=torch.bool)
        counts = new_valid.long()
        if q_len > 1:
            counts = counts.cumsum(-1)
        new_pos = (self.next_position.unsqueeze(-1) + counts - 1).masked_fill_(~new_valid, -1)
        self.next_position += counts[:, -1]

        slots = self.fill + self.slot_index[:q_len]  # device-side: no host offset, no recompile
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        h = self.num_heads
        self.positions.index_copy_(2, slots, new_pos.unsqueeze(1).expand(-1, h, -1))
        self.valid.index_copy_(2, slots, new_valid.unsqueeze(1).expand(-1, h, -1))
        self.fill += q_len
        self.seen += q_len
        self._step_len = q_len
        if compiling:
            self._pending_len = q_len  # host counters catch up in complete_step, outside the graph
        else:
            self._advance(q_len)
        return self.keys, self.values

    def _check_room(self, q_len: int) -> None:
        start = self.counters.occupancy
        if start + q_len > self.capacity and not self._evicts:
            raise RuntimeError(
                f"vasepatch cache full: policy {self.config.policy!r} never evicts and {start} + {q_len} tokens "
                f"exceed the {self.capacity} slots; give it a budget that covers the prompt and every generated token"
            )
        if start + q_len > self.capacity:
            raise RuntimeError(
                f"vasepatch cache overflow: {start} slots in use + {q_len} new tokens > capacity {self.capacity}. "
                "The capacity is fixed at the first forward (max(prompt, budget) + window); feed later tokens one "
                "decode step at a time, as generate() does."
            )

    def _advance(self, q_len: int) -> None:
        self.counters.occupancy += q_len
        self.counters.tokens_seen += q_len

    def _step_slots(self, q_len: int) -> torch.Tensor:
        """Slots written by the current step (the last `q_len` before the fill pointer)."""
        return self.fill - q_len + self.slot_index[:q_len]

    def attend_start(self) -> torch.Tensor:
        """`[B, Hkv]`: first attendable slot of each row and KV head (the attendable slots
        are `[start, fill)`: padding, if any, sits before them)."""
        return self.fill - self.valid.sum(-1)

    def attended_slots(self) -> int:
        """How many leading slots the kernel should read: the occupied ones when running
        eagerly (less work), the whole buffer under `torch.compile` (static shapes)."""
        return self.capacity if torch.compiler.is_compiling() else self.counters.occupancy

    def step_mask(self, length: int | None = None, q_len: int | None = None) -> torch.Tensor:
        """Boolean `[B, Hkv, Q, length]` (default: the capacity): which of the first
        `length` slots each of the current step's `Q` queries may attend to.

        A slot is visible if it holds a real token at a position not after the
        query's. In a multi-token step a padding query sees only its own slot, so
        no row is empty. A decode step (one token) sees every valid slot: its own
        slot is one of them, and the mask is a view of `valid`, with no copy.
        """
        q_len = self._step_len if q_len is None else q_len
        n = self.capacity if length is None else length
        valid = self.valid.narrow(2, 0, n)
        if q_len == 1:  # decode: every valid slot is in the past
            return valid.unsqueeze(-2)
        own = self._step_slots(q_len)
        qpos = self.positions[:, 0].index_select(-1, own)[:, None, :, None]  # [B, 1, Q, 1]
        mask = valid.unsqueeze(-2) & (self.positions.narrow(2, 0, n).unsqueeze(-2) <= qpos)
        mask[:, :, self.slot_index[:q_len], own] = True
        return mask

    def observe_queries(self, query_states: torch.Tensor) -> None:
        """Keep the queries (after RoPE, `[B, Hq, Q, D]`) of the last `window` tokens."""
        window = self.config.window
        if self.queries is None:
            b, hq, _, d = query_states.shape
            self.queries = torch.zeros((b, hq, window, d), dtype=query_states.dtype, device=self.device)
            self.query_valid = torch.zeros((b, window), dtype=torch.bool, device=self.device)
            self._mark_static(self.queries, self.query_valid)
        q_len = query_states.shape[-2]
        m = min(q_len, window)
        new_valid = self.valid[:, 0].index_select(-1, self._step_slots(m))  # [B, m]
        ring_slots = (self.ring + self.slot_index[:m]) % window
        self.queries.index_copy_(2, ring_slots, query_states.narrow(2, q_len - m, m))
        self.query_valid.index_copy_(1, ring_slots, new_valid)
        self.ring.add_(m).remainder_(window)

    def window_queries(self) -> torch.Tensor:
        """The ring of recent queries `[B, Hq, W, D]`, padding queries zeroed (a zero query
        spreads its attention uniformly)."""
        return self.queries * self.query_valid[:, None, :, None]

    def should_evict(self) -> bool:
        """Host-side trigger: not at prefill; occupancy over budget at a multiple of `window`
        past the budget, or the buffer full."""
        c, cfg = self.counters, self.config
        if not self._evicts or c.tokens_seen == self._step_len:  # the prefill keeps the prompt whole
            return False
        over = c.occupancy - cfg.budget
        return over > 0 and (over % cfg.window == 0 or c.occupancy + 1 > self.capacity)

    def tokens_until_eviction(self) -> int:
        """How many tokens can be appended before the next eviction, counting the token
        whose step evicts (the free slots when the policy never evicts). Feeding exactly
        this many tokens in one step evicts at the same point as one-token decode steps."""
        c, cfg = self.counters, self.config
        if not self.is_initialized:
            raise RuntimeError("the cache has not seen its prefill yet")
        if not self._evicts:
            return self.capacity - c.occupancy
        nxt = max(c.occupancy + 1, cfg.budget + 1)
        nxt += -(nxt - cfg.budget) % cfg.window  # next multiple of window past the budget
        return min(nxt, self.capacity) - c.occupancy

    def maybe_evict(self) -> bool:
        if not self.should_evict():
            return False
        self.evict()
        return True

    def end_step(self) -> None:
        """Last call of a step from the attention kernel: evict now when running
        eagerly; under compilation leave it to `complete_step` (after the graph)."""
        if not torch.compiler.is_compiling():
            self.maybe_evict()

    def complete_step(self) -> bool:
        """Host-side bookkeeping of a compiled step (counters, eviction), run eagerly
        after the forward; a no-op after an eager step. Returns whether it evicted."""
        if not self._pending_len:
            return False
        self._advance(self._pending_len)
        self._pending_len = 0
        return self.maybe_evict()

    def evict(self) -> None:
        """Bring occupancy back to `budget`: keep the last `window` slots, let the policy
        pick `budget - window` of the older ones, gather all kept slots to the front."""
        cfg = self.config
        occ = self.counters.occupancy
        n_cand, n_keep = occ - cfg.window, cfg.budget - cfg.window
        cand = slice(0, n_cand)
        idx = self.policy.select(
            self.keys[:, :, cand],
            self.values[:, :, cand],
            self.window_queries(),
            self.positions[:, :, cand],
            self.valid[:, :, cand],
            n_keep,
            generator=self.rng.get(self.device),
        )
        # Kept padding first, then real tokens in slot (= sequence) order: each row's
        # attendable slots stay one contiguous range ending at the fill pointer.
        kept_valid = self.valid[:, :, cand].gather(-1, idx)
        order = torch.argsort(idx + n_cand * kept_valid.long(), dim=-1)
        idx = idx.gather(-1, order)
        recent = torch.arange(n_cand, occ, device=self.device).expand(*idx.shape[:2], cfg.window)
        full = torch.cat([idx, recent], dim=-1)  # [B, Hkv, budget]
        b = cfg.budget
        self.keys[:, :, :b] = self.keys.gather(2, full.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1]))
        self.values[:, :, :b] = self.values.gather(2, full.unsqueeze(-1).expand(-1, -1, -1, self.values.shape[-1]))
        self.positions[:, :, :b] = self.positions.gather(2, full)
        self.valid[:, :, :b] = self.valid.gather(2, full)
        self.valid[:, :, b:occ] = False
        self.positions[:, :, b:occ] = -1
        self.fill.fill_(b)
        self.counters.occupancy = b
        self.counters.evictions += 1
        self.counters.evicted += occ - b

    # --- CacheLayerMixin API ----------------------------------------------------------------
    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens appended so far (padding included). Under compilation a 0-d device
        tensor, so that reading it neither syncs nor specialises the graph."""
        if torch.compiler.is_compiling() and self.is_initialized:
            return self.seen
        return self.counters.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Only vasepatch's own mask function sees these, and it ignores them: the cache
        # builds the real mask. Under compilation report the static buffer instead of
        # the growing length, which would specialise the graph on every step.
        if torch.compiler.is_compiling() and self.is_initialized:
            return self.capacity + query_length, 0
        return self.counters.tokens_seen + query_length, 0

    def get_max_length(self) -> int:
        return -1  # the sequence length is unbounded; the buffer is not

    def get_max_cache_shape(self) -> int:  # what older 5.x releases call `get_max_length`
        return self.get_max_length()

    def reset(self) -> None:
        if self.is_initialized:
            self.valid.zero_()
            self.positions.fill_(-1)
            self.next_position.zero_()
            for t in (self.fill, self.seen, self.ring):
                t.zero_()
            if self.queries is not None:
                self.queries.zero_()
                self.query_valid.zero_()
        self.counters.occupancy = self.counters.tokens_seen = 0
        self._pending_len = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute rows in place (storage unchanged)."""
        if not self.is_initialized:
            return
        beam_idx = beam_idx.to(self.device)
        ring = (self.queries, self.query_valid) if self.queries is not None else ()
        for t in (self.keys, self.values, self.positions, self.valid, self.next_position, *ring):
            t.copy_(t.index_select(0, beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("vasepatch caches cannot be cropped (evicted tokens are gone)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("vasepatch caches have a fixed batch size; expand inputs before the prefill")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("vasepatch caches have a fixed batch size")


class VaSECache(Cache):
    """A transformers `Cache` of `VaSELayer`s: what a patched model's `generate` uses."""

    def __init__(
        self,
        config: VaSEConfig,
        policy: Policy,
        num_layers: int,
        monitor: CacheMonitor | None = None,
    ) -> None:
        rng = SeededGenerator(config.seed)
        counters = [LayerCounters() for _ in range(num_layers)]
        if monitor is not None:
            monitor.layers = counters
            monitor.generations += 1
        layers = [VaSELayer(config, policy, rng, c) for c in counters]
        super().__init__(layers=layers)
        self.config = config

    def complete_step(self) -> int:
        """Host-side bookkeeping of a compiled forward, run eagerly after it (the patched
        model does this itself); returns how many layers evicted."""
        return sum(layer.complete_step() for layer in self.layers)

    def tokens_until_eviction(self) -> int:
        """Tokens that one step can append so that it ends exactly where the next eviction
        runs (see `VaSELayer.tokens_until_eviction`)."""
        return min(layer.tokens_until_eviction() for layer in self.layers)

    def stats(self) -> dict[str, int]:
        return CacheMonitor([layer.counters for layer in self.layers]).snapshot(self.config.budget, self.config.window)
