"""Tests written for the mutants that survived the mutation check (`benchmarks/mutation/run.sh`).

Each test names the mutant it kills (mutmut's name, from the run recorded in
`docs/results/mutation/`) and the behaviour that mutant changed unnoticed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.drive import step
from vasepatch import policies
from vasepatch.cache import VaSECache, VaSELayer, schedule
from vasepatch.config import VaSEConfig
from vasepatch.integration import attention, kernels
from vasepatch.policies import scoring
from vasepatch.policies.vase import protected_mask

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


@pytest.fixture
def scratch_policy_name():
    """A policy name that is unregistered again after the test, whatever it did."""
    name = "test-mutation-scratch"
    yield name
    policies._REGISTRY.pop(name, None)


# --- cache/layer.py ------------------------------------------------------------------------------
def test_reset_leaves_no_pending_step_to_settle():
    """`VaSELayer.reset` mutant `_pending = 1`: the first `complete_step` after a reset
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


# --- cache/schedule.py ---------------------------------------------------------------------------
def test_tokens_until_eviction_when_twice_the_budget_is_not_a_multiple_of_the_window():
    """`schedule.tokens_until_eviction` mutant `-(nxt + budget) % window`: the same as the right
    `-(nxt - budget) % window` whenever `2 * budget` is a multiple of `window`, so the usual
    budgets (16, 256) hid it. budget 5, window 4: evictions at occupancy 9, 13, ..."""
    assert schedule.tokens_until_eviction(5, 4, 9, 3) == 6
    assert schedule.tokens_until_eviction(5, 4, 13, 9) == 4
    assert schedule.tokens_until_eviction(7, 2, 9, 7) == 2


# --- policies -----------------------------------------------------------------------------------
def test_register_refuses_an_unknown_preset_at_once(scratch_policy_name):
    """`policies.register` mutant `k in COMMON_OPTIONS`: an unknown preset was dropped at
    registration and only failed later, at `get`."""
    with pytest.raises(ValueError, match="bogus"):
        policies.register(scratch_policy_name, policies.knorm, bogus=1)
    assert scratch_policy_name not in policies.available()


def test_policy_repr_lists_its_options():
    """`Policy.__repr__` mutant `"XX, XX".join`: the repr of a policy with several options."""
    text = repr(policies.get("rkv", lam=0.25))
    assert text == "Policy('rkv', lam=0.25, temperature=1.0, smooth=5)"


def test_dkv_head_dim_mismatch_names_the_problem():
    """`dkv` mutant upper-casing its message: the error text users see."""
    keys, values = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 4)
    positions, valid = torch.arange(6).expand(1, 1, 6), torch.ones(1, 1, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="dkv projects keys and values with one G: head dims must match"):
        policies.dkv(keys, values, positions, valid, None)


def test_cur_scores_are_zero_for_invalid_candidates_and_sum_to_one():
    """`scoring.cur_scores` mutant `masked_fill(~valid, 1.0)`: invalid candidates scored, and
    the valid ones no longer summing to 1 (top-k over them is unchanged, the scores are not)."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, 7, 8, generator=g), torch.randn(2, 1, 7, 8, generator=g)
    valid = torch.ones(2, 1, 7, dtype=torch.bool)
    valid[0, 0, :3] = False
    s = scoring.cur_scores(keys, values, scoring.gaussian_projection(8, 4, keys.device, g), valid)
    assert torch.equal(s[~valid], torch.zeros_like(s[~valid]))
    torch.testing.assert_close(s.sum(-1), torch.ones(2, 1))


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


# --- cache/step.py, cache/fixed_batch.py -------------------------------------------------------
def test_step_start_is_the_first_attendable_slot_of_each_row_and_head():
    """`Step.start` mutant `valid.sum(+1)` (summing over KV heads instead of slots): the varlen
    backends read each row's range `[start, end)` from it; no CPU test ran them."""
    layer = _layer(budget=16, window=4)
    padding = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, HKV, 7, D, generator=g), torch.randn(B, HKV, 7, D, generator=g)
    st = layer.append(k, v, padding)
    assert st.start().shape == (B, HKV)
    assert st.start().tolist() == [[0, 0], [3, 3]] and int(st.end) == 7


def test_batch_expansion_error_says_what_to_do():
    """`FixedBatchLayer.batch_repeat_interleave` mutant upper-casing its message."""
    with pytest.raises(NotImplementedError, match="fixed batch size; expand inputs before the prefill"):
        _layer().batch_repeat_interleave(2)


# --- integration/attention.py -------------------------------------------------------------------
def _reference_attention(q, k, v, allowed):
    """Plain softmax attention, GQA by repeating KV heads; `allowed` `[B, Q, S]`; out `[B, Q, Hq, D]`."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
    return (probs @ v).transpose(1, 2)


def test_attention_without_a_vase_cache_outside_a_patched_forward_is_causal_over_real_tokens():
    """`_without_vase_cache` mutants dropping the key length or the mask: the plain causal +
    padding path (a compiled call without a vasepatch cache, or the kernel called outside a
    patched model's forward) crashed; only compiled tests reached it."""
    module = SimpleNamespace(config=SimpleNamespace())  # a module of an unpatched config
    g = torch.Generator().manual_seed(0)
    q_len, s_len = 3, 7
    q = torch.randn(B, HQ, q_len, D, generator=g)
    k, v = torch.randn(B, HKV, s_len, D, generator=g), torch.randn(B, HKV, s_len, D, generator=g)
    padding = torch.ones(B, s_len, dtype=torch.long)
    padding[1, :2] = 0
    out, weights = attention.vasepatch_attention(module, q, k, v, padding)
    causal = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]  # [Q, S]
    allowed = causal[None] & padding.bool()[:, None, :]
    assert weights is None
    torch.testing.assert_close(out, _reference_attention(q, k, v, allowed))


# --- cache/cache.py -----------------------------------------------------------------------------
def test_the_layers_of_one_cache_draw_from_one_seeded_stream():
    """`VaSECache.__init__` mutant `rng = None`: every layer made its own generator from the same
    seed, so layers fed identical inputs drew identical noise (reproducible, but not the one
    stream per cache that `seed` documents)."""
    cfg = VaSEConfig(budget=16, window=4, seed=5, policy="random", sinks=0, protect=0)
    cache = VaSECache(cfg, policies.for_config(cfg), num_layers=2)
    g = torch.Generator().manual_seed(1)
    for q_len in (14, *[1] * 10):  # the prompt, then decode steps: two evictions
        k, v, q = (torch.randn(B, n, q_len, D, generator=g) for n in (HKV, HKV, HQ))
        for layer in cache.layers:
            step(layer, k, v, q)
    first, second = cache.layers
    assert first.counters.evictions == second.counters.evictions == 2
    assert not torch.equal(first.positions, second.positions)
    again = VaSECache(cfg, policies.for_config(cfg), num_layers=2)
    g = torch.Generator().manual_seed(1)
    for q_len in (14, *[1] * 10):
        k, v, q = (torch.randn(B, n, q_len, D, generator=g) for n in (HKV, HKV, HQ))
        for layer in again.layers:
            step(layer, k, v, q)
    assert all(torch.equal(a.positions, b.positions) for a, b in zip(cache.layers, again.layers, strict=True))


def test_gumbel_noise_is_finite_even_for_a_draw_of_exactly_zero(monkeypatch):
    """`scoring.gumbel_noise` mutant `u.clamp(None, ...)`: a uniform draw of exactly 0 (which
    `torch.rand` can return) became `-inf` noise instead of the finite noise of the smallest
    positive float."""
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape, dtype=torch.float32))
    noise = scoring.gumbel_noise(torch.Size([2, 3]), torch.device("cpu"))
    tiny = torch.tensor(torch.finfo(torch.float32).tiny)
    assert torch.isfinite(noise).all()
    torch.testing.assert_close(noise, (-torch.log(-torch.log(tiny))).expand(2, 3))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_attention_without_a_vase_cache_runs_the_chosen_kernel(backend):
    """`vasepatch_attention` mutant passing `backend=None` on: the plain path ran the sdpa kernel
    whatever the patch chose (the same attention up to rounding: checked bit for bit here)."""
    module = SimpleNamespace(config=SimpleNamespace(**{attention.BACKEND_ATTR: backend}))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, HQ, 3, D, generator=g)
    k, v = torch.randn(B, HKV, 9, D, generator=g), torch.randn(B, HKV, 9, D, generator=g)
    out, _ = attention.vasepatch_attention(module, q, k, v, None)
    mask = kernels.causal_padding_mask(None, 3, 9, q.device)
    assert torch.equal(out, kernels.grouped_attention(q, k, v, mask, D**-0.5, backend))


def test_the_no_weights_warning_points_at_the_caller():
    """`vasepatch_attention` mutant dropping `stacklevel=2`: the `output_attentions` warning was
    reported at vasepatch's own line instead of the code that asked for the weights."""
    module = SimpleNamespace(config=SimpleNamespace(**{attention.BACKEND_ATTR: "sdpa"}))
    layer = _layer()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, n, 4, D, generator=g) for n in (HQ, HKV, HKV))
    kwargs = {attention.LAYER_KWARG: layer, "output_attentions": True}
    with pytest.warns(UserWarning, match="computes no attention weights") as caught:
        out, weights = attention.vasepatch_attention(module, q, k, v, None, **kwargs)
    assert weights is None and out.shape == (B, 4, HQ, D)
    assert caught[0].filename != attention.__file__  # the caller's frame, not vasepatch's


def test_random_protection_draws_on_the_candidates_device():
    """`vase.protected_mask` mutant `torch.rand(..., device=None)`: the `protect-random` draw
    landed on the default device (the CPU) whatever the cache's device; on a GPU that fails. The
    `meta` device stands in for one here."""
    valid = torch.ones(1, 2, 6, dtype=torch.bool, device="meta")
    positions = torch.arange(6, device="meta").expand(1, 2, 6)
    values = torch.empty(1, 2, 6, 4, device="meta")
    mask = protected_mask(values, positions, valid, 3, None, protect=3, sinks=1, score="range", protection="random")
    assert mask.device.type == "meta" and mask.shape == (1, 2, 6)


def test_select_refuses_a_validity_mask_of_the_wrong_shape_alone():
    """`scoring.check_inputs` mutant `... and valid.shape != ...`: a wrong `valid` with right
    `positions` (or the reverse) passed the input check and reached torch (broadcasting)."""
    keys = torch.randn(2, 2, 6, 4)
    positions = torch.arange(6).expand(2, 2, 6)
    valid = torch.ones(2, 2, 6, dtype=torch.bool)
    policy = policies.get("knorm")
    with pytest.raises(ValueError, match=r"positions and valid must be \[B, Hkv, N\]"):
        policy.select(keys, keys, None, positions, valid[:1], 3)
    with pytest.raises(ValueError, match=r"positions and valid must be \[B, Hkv, N\]"):
        policy.select(keys, keys, None, positions[:1], valid, 3)


def test_select_refuses_queries_of_another_batch():
    """`scoring.check_inputs` mutant `... shape[0] != ... and shape[-1] != ...` (found by a smoke run
    outside the recorded sample): queries of the wrong batch but the right head dim passed the check."""
    keys = torch.randn(2, 2, 6, 4)
    positions, valid = torch.arange(6).expand(2, 2, 6), torch.ones(2, 2, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"queries must be \[B, Hq, W, D\]"):
        policies.get("snapkv").select(keys, keys, torch.randn(1, 4, 3, 4), positions, valid, 3)
