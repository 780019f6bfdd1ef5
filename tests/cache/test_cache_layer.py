"""Edge cases of one cache layer (`VaSELayer`) driven directly: `reset()`, the slots an eviction frees,
`tokens_until_eviction` in both modes, `get_seq_length` eagerly, a compiled-style step settled by
`complete_step`, `Step.start` (read by the varlen backends), and the fixed batch size.

Each test here was written for a mutant that survived the mutation check (`benchmarks/mutation/run.sh`);
its docstring names the mutant (mutmut's name, from the run recorded in `docs/results/mutation/`) and the
behaviour it changed unnoticed. The broader cache tests are in `tests/cache/test_cache.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.drive import step
from vasepatch import policies
from vasepatch.cache import VaSELayer, schedule
from vasepatch.config import VaSEConfig

B, HKV, HQ, D = 2, 2, 4, 8


def _layer(budget: int = 16, window: int = 4, policy: str = "vase", **kw) -> VaSELayer:
    cfg = VaSEConfig(budget=budget, window=window, seed=0, policy=policy, **kw)
    return VaSELayer(cfg, None if policy == "full" else policies.for_config(cfg))


def _feed(layer: VaSELayer, n: int, q_len: int = 1, seed: int = 0) -> None:
    """`n` steps of `q_len` random tokens."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        k, v = torch.randn(B, HKV, q_len, D, generator=g), torch.randn(B, HKV, q_len, D, generator=g)
        step(layer, k, v, torch.randn(B, HQ, q_len, D, generator=g))


def test_reset_leaves_no_pending_step_to_settle():
    """`VaSELayer.reset` mutant `pending = 1`: the first `complete_step` after a reset
    counted a phantom token (tokens_seen and occupancy off by one)."""
    layer = _layer()
    _feed(layer, 1, q_len=10)
    _feed(layer, 3)
    layer.reset()
    assert layer.complete_step() is False
    assert layer.counters.tokens_seen == 0 and layer.counters.occupancy == 0
    _feed(layer, 1, q_len=5)
    assert layer.complete_step() is False  # an eager step leaves nothing for complete_step
    assert layer.counters.tokens_seen == 5 and layer.counters.occupancy == 5


def test_every_slot_an_eviction_empties_holds_position_minus_one():
    """`VaSELayer._compact` mutant `positions[:, :, b:n] = -2`: the slots an eviction freed
    kept a position other than the documented -1 of an empty slot."""
    layer = _layer(budget=16, window=4)
    _feed(layer, 1, q_len=14)
    _feed(layer, 10)  # evicts at occupancy 20 and 20 again (-> 16 each time)
    assert layer.counters.evictions == 2
    assert torch.equal(layer.positions[~layer.valid], torch.full_like(layer.positions[~layer.valid], -1))
    assert int((~layer.valid).sum()) > 0  # the check above looked at some freed slots


def test_tokens_until_eviction_of_a_never_evicting_layer_is_never():
    """`VaSELayer.tokens_until_eviction` mutant `if self.policy is not None`: the two modes swapped."""
    full, evicting = _layer(policy="full"), _layer(budget=16, window=4)
    _feed(full, 1, q_len=10)
    _feed(evicting, 1, q_len=10)
    assert full.tokens_until_eviction() == schedule.NEVER
    assert evicting.tokens_until_eviction() == 10  # occupancy 10 -> 20 = budget + window


def test_sequence_length_is_a_python_int_outside_compilation():
    """`VaSELayer.get_seq_length` mutant `is_compiling() or is_initialized`: eagerly it returned
    the 0-d device tensor meant for compiled graphs (reading it syncs with the device, and it is
    not the documented int)."""
    layer = _layer()
    assert layer.get_seq_length() == 0
    _feed(layer, 1, q_len=10)
    _feed(layer, 3)
    length = layer.get_seq_length()
    assert type(length) is int and length == 13


def test_compiled_style_steps_settled_by_complete_step_match_eager_steps(monkeypatch):
    """`VaSELayer.complete_step` mutant `self._settle(None)`: the host bookkeeping of a compiled
    step (counters, the eviction) raised, or drifted from the eager path. Here the compiled
    path is taken by making `torch.compiler.is_compiling()` true during each step, as dynamo does."""
    eager, compiled = _layer(budget=16, window=4), _layer(budget=16, window=4)
    g = torch.Generator().manual_seed(3)
    prompt = [torch.randn(B, n, 12, D, generator=g) for n in (HKV, HKV, HQ)]
    step(eager, *prompt)
    step(compiled, *prompt)
    evictions = 0
    for _ in range(14):
        k, v, q = (torch.randn(B, n, 1, D, generator=g) for n in (HKV, HKV, HQ))
        out_eager, _ = step(eager, k, v, q)
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            out_compiled, evicted_in_graph = step(compiled, k, v, q)
        assert evicted_in_graph is False
        evictions += compiled.complete_step()
        torch.testing.assert_close(out_compiled, out_eager)
        assert compiled.counters == eager.counters
        assert torch.equal(compiled.positions, eager.positions) and torch.equal(compiled.valid, eager.valid)
    assert evictions == eager.counters.evictions == 2


def test_step_start_is_the_first_attendable_slot_of_each_row_and_head():
    """`Step.start` mutant `valid.sum(+1)` (summing over KV heads instead of slots): the varlen
    backends read each row's range `[start, end)` from it; no CPU test ran them."""
    layer = _layer(budget=16, window=4)
    padding = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, HKV, 7, D, generator=g), torch.randn(B, HKV, 7, D, generator=g)
    st, _ = layer.step(torch.randn(B, HQ, 7, D, generator=g), k, v, padding, lambda s: s)
    assert st.start().shape == (B, HKV)
    assert st.start().tolist() == [[0, 0], [3, 3]] and int(st.end) == 7


def test_batch_expansion_error_says_what_to_do():
    """`FixedBatchLayer.batch_repeat_interleave` mutant upper-casing its message."""
    with pytest.raises(NotImplementedError, match="fixed batch size; expand inputs before the prefill"):
        _layer().batch_repeat_interleave(2)
