"""A stateful test of one cache layer: random interleavings of ragged prefills (any length,
whole or in chunks), decode steps, multi-token steps, beam reorders, resets and new
generations, driven through the production step (`tests.drive.step` = `attention_step`)
and checked after every step against a shadow model of what must be kept:

- every kept slot holds the K/V appended for that row at the position it stores (positions
  are the tokens' original ones), and real positions increase along the slots;
- the tokens appended since the last eviction, and the `window` before it, are the suffix of
  the buffer, in order; before any eviction the buffer is exactly what was appended;
- the sinks (for the policies that keep them) and the largest-range candidates (`vase`,
  `vase-topk`) survive every eviction, which keeps exactly `min(budget - window, real
  candidates)` real candidates plus the window;
- each real query's output is exact attention over the real tokens the cache held before the
  step plus the step's own tokens up to its position: padding is never attended;
- occupancy = the fill pointer <= capacity, which is `budget + window` with
  `prefill="compress"`; `next_position` counts each row's real tokens.

Sizes: `ci` (default) 40 examples of up to 20 steps; `VASEPATCH_HYPOTHESIS_PROFILE=thorough`
1,000 examples of up to 50 steps.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from hypothesis import event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from property_tests.strategies import VALUE_KINDS, make_values
from tests.drive import step as drive_step
from tests.query_stats_files import options_for
from vasepatch import policies
from vasepatch.cache import VaSELayer
from vasepatch.config import FULL, VaSEConfig

THOROUGH = os.environ.get("VASEPATCH_HYPOTHESIS_PROFILE") == "thorough"
SINK_KEEPERS = {name for name in policies.available() if "sinks" in policies.get(name).options}
RANGE_PROTECTORS = {"vase", "vase-topk"}
PAD_KV = 1e4  # padding K/V: huge, so that attending to them would show in any output


class Spy:
    """Hands `select` through to a real policy and records the candidates of the last call."""

    def __init__(self, inner):
        self.inner, self.last = inner, None
        self.name, self.options = inner.name, inner.options
        self.check_output = getattr(inner, "check_output", True)

    def select(self, keys, values, queries, positions, valid, n_keep, generator=None):
        ranges = values.float().amax(-1) - values.float().amin(-1) if values.shape[2] else values.sum(-1).float()
        self.last = (positions.clone(), valid.clone(), ranges)
        return self.inner.select(keys, values, queries, positions, valid, n_keep, generator=generator)


@dataclass
class Row:
    """What one row must hold: its real tokens' K/V by position, the next position, and the
    appended tokens (positions, -1 for padding) that must form the buffer's suffix."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    next_pos: int = 0
    tail: list[int] = field(default_factory=list)

    def copy(self) -> Row:
        return Row(dict(self.kv), self.next_pos, list(self.tail))


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        budget=st.integers(3, 16),
        data=st.data(),
        policy=st.sampled_from([*policies.available(), FULL]),
        prefill=st.sampled_from(["compress", "keep", "pin"]),
        batch=st.integers(1, 3),
        kv_heads=st.integers(1, 2),
        groups=st.integers(1, 2),
        kind=st.sampled_from(VALUE_KINDS),
        seed=st.integers(0, 2**31 - 1),
    )
    def setup(self, budget, data, policy, prefill, batch, kv_heads, groups, kind, seed):
        window = data.draw(st.integers(1, budget - 1), label="window")
        sinks = data.draw(st.integers(0, min(4, budget - window)), label="sinks")
        protect = data.draw(st.integers(sinks, budget - window), label="protect")
        self.b, self.h, self.hq, self.d, self.kind = batch, kv_heads, kv_heads * groups, 4, kind
        shapes = dict(layers=1, q_heads=self.hq, kv_heads=self.h, head_dim=self.d)
        options = {} if policy == FULL else options_for(policy, **shapes)  # a statistics file, if it reads one
        self.cfg = VaSEConfig(
            budget=budget, window=window, sinks=sinks, protect=protect, policy=policy, prefill=prefill, seed=seed,
            policy_options=options,
        )  # fmt: skip
        self.g = torch.Generator().manual_seed(seed)
        self.evictions = 0
        self._new_layer()
        self.prefill(data)  # every run starts with a prompt; later ones follow resets and new generations

    def _new_layer(self) -> None:
        self.spy = None if self.cfg.policy == FULL else Spy(policies.for_config(self.cfg))
        self.layer = VaSELayer(self.cfg, self.spy)
        self._restart()

    def _restart(self) -> None:
        self.rows = [Row() for _ in range(self.b)]
        self.evicted_since_reset = False
        self.tokens = self.rounds = self.dropped = 0  # what the layer's counters must say
        self.pinned, self.pinned_real = 0, [0] * self.b  # prefill="pin": the prompt's slots, its real tokens by row

    @property
    def started(self) -> bool:
        return self.layer.counters.tokens_seen > 0

    # --- rules ------------------------------------------------------------------------------
    @precondition(lambda self: not self.started)
    @rule(data=st.data())
    def prefill(self, data):
        """A ragged left-padded prompt of any width (up to 3 x budget), whole or in chunks."""
        width = data.draw(st.integers(1, 3 * self.cfg.budget), label="width")
        lengths = [width] + [data.draw(st.integers(0, width), label="length") for _ in range(self.b - 1)]
        lengths = data.draw(st.permutations(lengths), label="lengths")
        mask = torch.zeros(self.b, width, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, width - n :] = 1
        chunk = width
        if self.cfg.prefill == "compress":
            chunk = data.draw(st.sampled_from([width, 1 + width // 2, 1 + width // 4]), label="chunk")
        for start in range(0, width, chunk):
            self._step(mask[:, : min(start + chunk, width)], min(chunk, width - start))

    @precondition(lambda self: self.started)
    @rule(steps=st.integers(1, 24))
    def decode(self, steps):
        """A run of one-token steps (runs, so that most examples reach evictions)."""
        for _ in range(steps):
            self._step(torch.ones(self.b, 1, dtype=torch.long), 1)

    @precondition(lambda self: self.started)
    @rule(n=st.integers(2, 40))
    def multi_token(self, n):
        """Several tokens at once (a continuation); with `prefill="keep"` or `"pin"` at most as many as fit."""
        if self.cfg.prefill in ("keep", "pin") and self.cfg.policy != FULL:
            n = max(1, min(n, self.layer.tokens_until_eviction()))
        self._step(torch.ones(self.b, n, dtype=torch.long), n)

    @rule(perm=st.data())
    def beam_reorder(self, perm):
        idx = perm.draw(st.lists(st.integers(0, self.b - 1), min_size=self.b, max_size=self.b), label="beam_idx")
        self.layer.reorder_cache(torch.tensor(idx))
        self.rows = [self.rows[i].copy() for i in idx]
        self.pinned_real = [self.pinned_real[i] for i in idx]

    @rule()
    def reset(self):
        self.layer.reset()
        self._restart()
        assert self.layer.counters.evictions == 0 and self.layer.counters.occupancy == 0

    @rule()
    def new_generation(self):
        self._new_layer()

    # --- one step ---------------------------------------------------------------------------
    def _step(self, mask: torch.Tensor, q_len: int) -> None:
        b, h, hq, d = self.b, self.h, self.hq, self.d
        new_valid = mask[:, -q_len:].bool()
        k = torch.randn(b, h, q_len, d, generator=self.g)
        v = make_values((b, h, q_len, d), self.kind, self.g)
        pad = ~new_valid[:, None, :, None]
        k, v = k.masked_fill(pad, PAD_KV), v.masked_fill(pad, PAD_KV)
        q = torch.randn(b, hq, q_len, d, generator=self.g)
        before = self._held()
        occupancy = self.layer.counters.occupancy + q_len if self.layer.is_initialized else q_len
        if self.tokens == 0 and self.cfg.prefill == "pin":
            self.pinned, self.pinned_real = q_len, mask.sum(-1).tolist()
        self.tokens += q_len
        new_pos = []
        for row, shadow in zip(range(b), self.rows, strict=True):
            pos = []
            for i in range(q_len):
                if new_valid[row, i]:
                    shadow.kv[shadow.next_pos] = (k[row, :, i].clone(), v[row, :, i].clone())
                    pos.append(shadow.next_pos)
                    shadow.next_pos += 1
                else:
                    pos.append(-1)
            shadow.tail.extend(pos)
            new_pos.append(pos)
        out, evicted = drive_step(self.layer, k, v, q, mask)
        self._check_attention(out, q, before, new_pos)
        if evicted:
            self.evictions += 1
            self.evicted_since_reset = True
            self.rounds, self.dropped = self.rounds + 1, self.dropped + occupancy - self.pinned - self.cfg.budget
            self._check_eviction()
            for shadow in self.rows:
                shadow.tail = shadow.tail[-self.cfg.window :]

    def _held(self) -> list[list[list[int]]]:
        """Per row and KV head, the real positions the cache holds now."""
        layer = self.layer
        if not layer.is_initialized:
            return [[[] for _ in range(self.h)] for _ in range(self.b)]
        occ = layer.counters.occupancy
        pos, valid = layer.positions[:, :, :occ], layer.valid[:, :, :occ]
        return [[pos[r, hk][valid[r, hk]].tolist() for hk in range(self.h)] for r in range(self.b)]

    def _check_attention(self, out, q, before, new_pos) -> None:
        scale = self.d**-0.5
        groups = self.hq // self.h
        for r, shadow in enumerate(self.rows):
            for i, p in enumerate(new_pos[r]):
                if p < 0:
                    continue
                for hq in range(self.hq):
                    hk = hq // groups
                    seen = before[r][hk] + [x for x in new_pos[r] if 0 <= x <= p]
                    keys = torch.stack([shadow.kv[x][0][hk] for x in seen])
                    vals = torch.stack([shadow.kv[x][1][hk] for x in seen])
                    want = torch.softmax(keys @ q[r, hq, i] * scale, 0) @ vals
                    assert torch.allclose(out[r, i, hq], want, atol=1e-4, rtol=1e-4), (r, i, hq)

    def _check_eviction(self) -> None:
        """What the policy was shown, against what the eviction kept."""
        cand_pos, cand_valid, ranges = self.spy.last
        cfg, held = self.cfg, self._held()
        n_keep = cfg.budget - cfg.window
        for r in range(self.b):
            window_real = sum(p >= 0 for p in self.rows[r].tail[-cfg.window :])
            for hk in range(self.h):
                have = set(held[r][hk])
                valid = cand_valid[r, hk]
                assert len(have) == self.pinned_real[r] + min(n_keep, int(valid.sum())) + window_real
                assert all(p in have for p in range(self.pinned_real[r]))  # the pinned prompt, never evicted
                if cfg.policy in RANGE_PROTECTORS:
                    pos, rng = cand_pos[r, hk], ranges[r, hk]
                    sink = valid & (pos < cfg.sinks)
                    others = valid & ~sink
                    free = max(cfg.n_protect - int(sink.sum()), 0)
                    top = rng[others].sort(descending=True).values
                    threshold = top[free].item() if free < len(top) else -math.inf
                    assert set(pos[others & (rng > threshold)].tolist()) <= have

    def teardown(self):
        bucket = "0" if not self.evictions else "1-4" if self.evictions < 5 else ">=5"
        event(f"evictions per run: {bucket}")
        target(float(self.evictions), label="evictions")

    # --- invariants -------------------------------------------------------------------------
    @invariant()
    def buffer_matches_the_shadow(self):
        layer = self.layer
        if not layer.is_initialized:
            return
        occ, cfg = layer.counters.occupancy, self.cfg
        assert int(layer.slots.fill) == occ <= layer.capacity
        c = layer.counters
        assert (c.tokens_seen, c.evictions, c.evicted) == (self.tokens, self.rounds, self.dropped)
        if cfg.prefill == "compress" and cfg.policy != FULL:
            assert layer.capacity == cfg.budget + cfg.window
        if cfg.prefill == "pin" and cfg.policy != FULL:  # the prompt, then at most budget + window generated
            assert layer.counters.pinned == self.pinned and occ <= self.pinned + cfg.budget + cfg.window
        assert not layer.valid[:, :, occ:].any()
        assert layer.slots.next_position.tolist() == [row.next_pos for row in self.rows]
        for r, shadow in enumerate(self.rows):
            tail = shadow.tail
            if not self.evicted_since_reset:
                assert len(tail) == occ
            for hk in range(self.h):
                pos = layer.positions[r, hk, :occ].tolist()
                valid = layer.valid[r, hk, :occ].tolist()
                assert pos[occ - len(tail) :] == tail  # the recent tokens, in order, at the end
                real = [p for p, ok in zip(pos, valid, strict=True) if ok]
                assert all(p >= 0 for p in real) and all(p == -1 for p, ok in zip(pos, valid, strict=True) if not ok)
                assert real == sorted(set(real))
                assert not any(valid[i] and not valid[i + 1] for i in range(occ - 1))  # one contiguous range
                for s, p in enumerate(pos):
                    if valid[s]:
                        k, v = shadow.kv[p]
                        assert torch.equal(layer.keys[r, hk, s], k[hk]) and torch.equal(layer.values[r, hk, s], v[hk])
                if cfg.policy in SINK_KEEPERS:
                    assert set(range(min(cfg.sinks, shadow.next_pos))) <= set(real)


CacheMachine.TestCase.settings = settings(
    max_examples=1000 if THOROUGH else 40,
    stateful_step_count=50 if THOROUGH else 20,
    deadline=None,
)
TestCacheStateMachine = CacheMachine.TestCase
