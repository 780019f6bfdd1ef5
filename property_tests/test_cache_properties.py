"""Invariants of the static cache under random append sequences, checked against a
shadow copy of everything that was appended."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings

from property_tests.strategies import CacheCase, cache_cases, cache_policy_options, make_values
from tests.drive import step as drive_step
from vasepatch import policies
from vasepatch.cache import VaSELayer, schedule
from vasepatch.config import VaSEConfig


@dataclass
class Eviction:
    before_positions: torch.Tensor  # [B, H, n]: candidates, then the window
    before_valid: torch.Tensor
    before_ranges: torch.Tensor  # value ranges of the candidates (the window's are 0: never needed)
    occupancy_before: int  # n: slots the eviction chose from
    after_positions: torch.Tensor  # [B, H, budget]
    after_valid: torch.Tensor


@dataclass
class Step:
    output: torch.Tensor  # [B, Q, Hq, D]
    queries: torch.Tensor  # [B, Hq, Q, D]
    real: torch.Tensor  # [B, Q] bool: real (non-padding) query tokens
    first_position: list[int]  # per row, the position of the step's first real token


class Shadow(dict):
    """Everything appended: `(row, position) -> (k [H, D], v [H, D])`; `dense()` gives the same as tensors
    for checks over whole buffers (filled in on demand, so that runs which never ask pay nothing)."""

    def __init__(self, batch: int, positions: int, heads: int, head_dim: int):
        super().__init__()
        self.k = torch.zeros(batch, positions, heads, head_dim)
        self.v = torch.zeros(batch, positions, heads, head_dim)
        self.seen = torch.zeros(batch, positions, dtype=torch.bool)
        self._pending: list[tuple[int, int]] = []

    def add(self, row: int, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self[(row, position)] = (k.clone(), v.clone())
        self._pending.append((row, position))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`k`, `v` `[B, positions, H, D]` and `seen` `[B, positions]` (appended or not)."""
        if self._pending:
            rows, positions = torch.tensor(self._pending).T
            self.k[rows, positions] = torch.stack([self[key][0] for key in self._pending])
            self.v[rows, positions] = torch.stack([self[key][1] for key in self._pending])
            self.seen[rows, positions] = True
            self._pending.clear()
        return self.k, self.v, self.seen


@dataclass
class Trace:
    case: CacheCase
    layer: VaSELayer
    evictions: list[Eviction]
    outputs: list[Step]  # the steps before the first eviction
    shadow: Shadow
    pointers_stable: bool
    max_occupancy: int


class SpyPolicy:
    """Hands `select` through to a real policy and records the candidates it was shown."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def select(self, keys, values, queries, positions, valid, n_keep, generator=None):
        ranges = values.amax(-1) - values.amin(-1) if values.shape[2] else values.sum(-1)
        self.calls.append((positions.clone(), valid.clone(), ranges))
        return self.inner.select(keys, values, queries, positions, valid, n_keep, generator=generator)


def _layer(case: CacheCase, name: str) -> tuple[VaSELayer, SpyPolicy]:
    options = {"sample": case.sample} if name == "vase" else {}
    options.update(cache_policy_options(name, case))  # a statistics file of the case's shapes, if `name` reads one
    cfg = VaSEConfig(
        budget=case.budget,
        window=case.window,
        protect=case.protect,
        sinks=case.sinks,
        seed=case.seed,
        policy=name,
        prefill=case.prefill,
        policy_options=options,
    )
    spy = SpyPolicy(policies.for_config(cfg))
    return VaSELayer(cfg, spy), spy


def _steps(case: CacheCase, padding: torch.Tensor):
    """(q_len, 2-D mask) of every step: the prompt (whole or in chunks), then one-token decode steps."""
    width = padding.shape[1]
    chunk = case.chunk or width
    for start in range(0, width, chunk):
        end = min(start + chunk, width)
        yield end - start, padding[:, :end]
    for step in range(case.decode_steps):
        yield 1, torch.ones(case.batch, width + step + 1, dtype=torch.long)


def _eviction(case: CacheCase, layer: VaSELayer, call, appended: list[list[int]]) -> Eviction:
    """What the eviction chose from: the candidates the policy saw, then the window (the last
    `window` slots appended, whatever came before: evictions keep the order of appends)."""
    cand_pos, cand_valid, cand_ranges = call
    b, h, w = case.batch, case.kv_heads, case.window
    window = torch.tensor([row[-w:] for row in appended]).view(b, 1, w).expand(b, h, w)
    start, bud = layer.counters.pinned, case.budget  # what the eviction wrote: the slots past a pinned prompt
    end = start + bud
    return Eviction(
        torch.cat([cand_pos, window], -1),
        torch.cat([cand_valid, window >= 0], -1),
        torch.cat([cand_ranges, torch.zeros(b, h, w)], -1),
        cand_pos.shape[-1] + w,
        layer.positions[:, :, start:end].clone(),
        layer.valid[:, :, start:end].clone(),
    )


def run(case: CacheCase, check=None, policy: str | None = None) -> Trace:
    """Drive a `VaSELayer` through the production step function (`tests.drive.step`, which is
    `attention_step`); `check(layer, shadow)` runs after every step.

    The policy is `policy`, else the case's (drawn among every registered policy), so the
    cache invariants are checked for every policy."""
    layer, spy = _layer(case, policy or case.policy)
    g = torch.Generator().manual_seed(case.seed)
    b, h, hq, d = case.batch, case.kv_heads, case.kv_heads * case.groups, case.head_dim
    width = max(case.prompt_lengths)
    padding = torch.zeros(b, width, dtype=torch.long)
    for row, n in enumerate(case.prompt_lengths):
        padding[row, width - n :] = 1
    next_pos, appended = [0] * b, [[] for _ in range(b)]
    shadow, evictions, outputs = Shadow(b, width + case.decode_steps, h, d), [], []
    pointers, stable, max_occ = None, True, 0
    for q_len, mask in _steps(case, padding):
        k = torch.randn(b, h, q_len, d, generator=g)
        v = make_values((b, h, q_len, d), case.value_kind, g)
        q = torch.randn(b, hq, q_len, d, generator=g)
        first_position = list(next_pos)
        for row in range(b):
            for i in range(q_len):
                real = bool(mask[row, -q_len + i])
                appended[row].append(next_pos[row] if real else -1)
                if real:
                    shadow.add(row, next_pos[row], k[row, :, i], v[row, :, i])
                    next_pos[row] += 1
        out, evicted = drive_step(layer, k, v, q, mask)
        if not evictions:
            outputs.append(Step(out, q, mask[:, -q_len:].bool(), first_position))
        if evicted:
            evictions.append(_eviction(case, layer, spy.calls[-1], appended))
        max_occ = max(max_occ, layer.counters.occupancy)
        ptrs = [t.data_ptr() for t in (layer.keys, layer.values, layer.positions, layer.valid)]
        stable &= pointers is None or ptrs == pointers
        pointers = ptrs
        if check is not None:
            check(layer, shadow)
    return Trace(case, layer, evictions, outputs, shadow, stable, max_occ)


# a policy with a `sinks` option promises to keep the sinks (snapkv, rkv and random have none)
SINK_KEEPERS = [name for name in policies.available() if "sinks" in policies.get(name).options]


# A quarter of the profile's examples per policy (50 in CI): the cache path is the same for every policy (what each
# one's priority does with the sinks is checked per policy at the full count in test_policy_properties.py), and the
# 10 policies together still run this property 2.5 times as often as any other here.
@pytest.mark.parametrize("name", SINK_KEEPERS)
@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(case=cache_cases())
def test_sinks_are_never_evicted(name, case):
    for ev in run(case, policy=name).evictions:
        sink_before = ev.before_valid & (ev.before_positions < case.sinks)
        for b in range(case.batch):
            for h in range(case.kv_heads):
                want = set(ev.before_positions[b, h][sink_before[b, h]].tolist())
                have = set(ev.after_positions[b, h][ev.after_valid[b, h]].tolist())
                assert want <= have


@pytest.mark.parametrize("name", ["vase", "vase-topk"])
@given(case=cache_cases())
def test_largest_range_candidates_filling_protect_are_kept(name, case):
    for ev in run(case, policy=name).evictions:
        n_cand = ev.occupancy_before - case.window
        for b in range(case.batch):
            for h in range(case.kv_heads):
                pos = ev.before_positions[b, h, :n_cand]
                valid = ev.before_valid[b, h, :n_cand]
                ranges = ev.before_ranges[b, h, :n_cand]
                sink = valid & (pos < case.sinks)
                others = valid & ~sink
                free = max(case.protect - int(sink.sum()), 0)
                r = ranges[others].sort(descending=True).values
                threshold = r[free].item() if free < len(r) else -math.inf
                must = set(pos[others & (ranges > threshold)].tolist())
                have = set(ev.after_positions[b, h][ev.after_valid[b, h]].tolist())
                assert must <= have


@given(case=cache_cases())
def test_last_window_tokens_are_kept_in_place(case):
    for ev in run(case).evictions:
        recent = slice(ev.occupancy_before - case.window, ev.occupancy_before)
        assert torch.equal(ev.after_positions[:, :, -case.window :], ev.before_positions[:, :, recent])
        assert torch.equal(ev.after_valid[:, :, -case.window :], ev.before_valid[:, :, recent])


@given(case=cache_cases())
def test_eviction_keeps_exactly_min_budget_valid_without_duplicates(case):
    for ev in run(case).evictions:
        n_valid_before = ev.before_valid.sum(-1)
        assert torch.equal(ev.after_valid.sum(-1), n_valid_before.clamp(max=case.budget))
        for b in range(case.batch):
            for h in range(case.kv_heads):
                pos = ev.after_positions[b, h][ev.after_valid[b, h]].tolist()
                assert len(pos) == len(set(pos))


@given(case=cache_cases())
def test_attendable_slots_are_one_contiguous_range_ending_at_the_fill_pointer(case):
    """What varlen kernels rely on: per row and KV head, padding first, then real tokens
    up to the fill pointer, after every step and every eviction."""

    def check(layer, shadow):
        occ = layer.counters.occupancy
        assert int(layer.slots.fill) == occ
        valid = layer.valid[:, :, :occ]
        assert not (valid[..., :-1] & ~valid[..., 1:]).any()  # no real token ahead of padding

    run(case, check)


@given(case=cache_cases())
def test_kept_slots_are_bit_identical_to_what_was_appended(case):
    def check(layer, shadow):
        occ = layer.counters.occupancy
        valid = layer.valid[:, :, :occ]
        rows, heads, _ = valid.nonzero(as_tuple=True)  # every kept slot, at once
        positions = layer.positions[:, :, :occ][valid]
        keys, values, seen = shadow.dense()
        assert (positions >= 0).all() and seen[rows, positions].all()  # appended to that row
        assert torch.equal(layer.keys[:, :, :occ][valid], keys[rows, positions, heads])
        assert torch.equal(layer.values[:, :, :occ][valid], values[rows, positions, heads])
        assert not layer.valid[:, :, occ:].any()

    run(case, check)


@given(case=cache_cases())
def test_occupancy_within_capacity_and_buffers_never_reallocated(case):
    trace = run(case)
    assert trace.pointers_stable
    want = schedule.capacity(case.budget, case.window, max(case.prompt_lengths), case.prefill)
    assert trace.max_occupancy <= trace.layer.capacity == want
    if case.prefill == "compress":
        assert trace.layer.capacity == case.budget + case.window  # fixed by the budget, whatever the prompt


@given(case=cache_cases())
def test_without_eviction_attention_equals_full_attention(case):
    """Until the first eviction, each real query attends exactly as full causal attention
    over the real tokens appended so far (recomputed from the shadow copy)."""
    trace = run(case)
    scale = case.head_dim**-0.5
    for step in trace.outputs:
        for b in range(case.batch):
            for i in step.real[b].nonzero().flatten().tolist():
                position = step.first_position[b] + int(step.real[b, : i + 1].sum()) - 1
                keys = torch.stack([trace.shadow[(b, p)][0] for p in range(position + 1)], dim=1)  # [H, n, D]
                vals = torch.stack([trace.shadow[(b, p)][1] for p in range(position + 1)], dim=1)
                for hq in range(case.kv_heads * case.groups):
                    hk = hq // case.groups
                    weights = torch.softmax(keys[hk] @ step.queries[b, hq, i] * scale, dim=0)
                    expected = weights @ vals[hk]
                    assert torch.allclose(step.output[b, i, hq], expected, atol=1e-5, rtol=1e-4)
