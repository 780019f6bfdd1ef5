"""Invariants of the static cache under random append sequences, checked against a
shadow copy of everything that was appended."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given

from property_tests.strategies import CacheCase, cache_cases, make_values
from vasepatch import policies
from vasepatch.cache import VaSELayer
from vasepatch.config import VaSEConfig
from vasepatch.integration.kernels import grouped_attention


@dataclass
class Eviction:
    before_positions: torch.Tensor  # [B, H, occ]
    before_valid: torch.Tensor
    before_ranges: torch.Tensor
    occupancy_before: int
    after_positions: torch.Tensor  # [B, H, budget]
    after_valid: torch.Tensor


@dataclass
class Step:
    output: torch.Tensor  # [B, Q, Hq, D]
    queries: torch.Tensor  # [B, Hq, Q, D]
    real: torch.Tensor  # [B, Q] bool: real (non-padding) query tokens
    first_position: list[int]  # per row, the position of the step's first real token


@dataclass
class Trace:
    case: CacheCase
    layer: VaSELayer
    evictions: list[Eviction]
    outputs: list[Step]  # the steps before the first eviction
    shadow: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]  # (row, position) -> (k [H, D], v [H, D])
    pointers_stable: bool
    max_occupancy: int


def run(case: CacheCase, check=None, policy: str | None = None) -> Trace:
    """Drive a `VaSELayer` as the attention integration does; `check(layer)` runs after every step.

    The policy is `policy`, else the case's (drawn among every evicting policy), so the
    cache invariants are checked for every registered policy."""
    name = policy or case.policy
    extra = {"sample": case.sample} if name == "vase" else {}
    cfg = VaSEConfig(
        budget=case.budget, window=case.window, protect=case.protect, sinks=case.sinks, seed=case.seed, policy=name
    )
    layer = VaSELayer(cfg, policies.get(name, protect=cfg.n_protect, sinks=cfg.sinks, smooth=cfg.smooth, **extra))
    g = torch.Generator().manual_seed(case.seed)
    b, h, hq, d = case.batch, case.kv_heads, case.kv_heads * case.groups, case.head_dim
    width = max(case.prompt_lengths)
    padding = torch.zeros(b, width, dtype=torch.long)
    for row, n in enumerate(case.prompt_lengths):
        padding[row, width - n :] = 1
    next_pos = [0] * b
    shadow, evictions, outputs = {}, [], []
    pointers, stable, max_occ = None, True, 0

    for step in range(case.decode_steps + 1):
        q_len = width if step == 0 else 1
        mask = padding if step == 0 else torch.ones(b, width + step, dtype=torch.long)
        k = torch.randn(b, h, q_len, d, generator=g)
        v = make_values((b, h, q_len, d), case.value_kind, g)
        q = torch.randn(b, hq, q_len, d, generator=g)
        first_position = list(next_pos)
        for row in range(b):
            for i in range(q_len):
                if mask[row, -q_len + i]:
                    shadow[(row, next_pos[row])] = (k[row, :, i].clone(), v[row, :, i].clone())
                    next_pos[row] += 1
        layer.prepare_step(mask)
        keys, values = layer.update(k, v)
        out = grouped_attention(q, keys, values, layer.step_mask(), d**-0.5)
        layer.observe_queries(q)
        if not evictions:
            outputs.append(Step(out, q, mask[:, -q_len:].bool(), first_position))
        occ = layer.counters.occupancy
        max_occ = max(max_occ, occ)
        before = (
            layer.positions[:, :, :occ].clone(),
            layer.valid[:, :, :occ].clone(),
            (layer.values[:, :, :occ].amax(-1) - layer.values[:, :, :occ].amin(-1)),
        )
        if layer.maybe_evict():
            bud = case.budget
            evictions.append(
                Eviction(*before, occ, layer.positions[:, :, :bud].clone(), layer.valid[:, :, :bud].clone())
            )
        ptrs = [t.data_ptr() for t in (layer.keys, layer.values, layer.positions, layer.valid)]
        stable &= pointers is None or ptrs == pointers
        pointers = ptrs
        if check is not None:
            check(layer, shadow)
    return Trace(case, layer, evictions, outputs, shadow, stable, max_occ)


# policies that promise to keep the sinks (snapkv, rkv and random do not)
SINK_KEEPERS = [
    "vase",
    "vase-topk",
    "vase-l2",
    "vase-var",
    "protect-random",
    "evict-large",
    "vase-dkv",
    "cur",
    "streaming",
]


@pytest.mark.parametrize("name", SINK_KEEPERS)
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
        assert int(layer.fill) == occ
        valid = layer.valid[:, :, :occ]
        assert not (valid[..., :-1] & ~valid[..., 1:]).any()  # no real token ahead of padding

    run(case, check)


@given(case=cache_cases())
def test_kept_slots_are_bit_identical_to_what_was_appended(case):
    def check(layer, shadow):
        occ = layer.counters.occupancy
        valid = layer.valid[:, :, :occ]
        for b, h, s in valid.nonzero().tolist():
            k, v = shadow[(b, int(layer.positions[b, h, s]))]
            assert torch.equal(layer.keys[b, h, s], k[h]) and torch.equal(layer.values[b, h, s], v[h])
        assert not layer.valid[:, :, occ:].any()

    run(case, check)


@given(case=cache_cases())
def test_occupancy_within_capacity_and_buffers_never_reallocated(case):
    trace = run(case)
    assert trace.pointers_stable
    assert trace.max_occupancy <= trace.layer.capacity == max(max(case.prompt_lengths), case.budget) + case.window


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
