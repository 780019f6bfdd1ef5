"""The eviction schedule (`vasepatch.cache.schedule`): pure functions of host ints, checked
by simulating the host counters of one layer over random token streams, plus hand-picked cases that
killed a mutant of the mutation check (`benchmarks/mutation/run.sh`)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from vasepatch.cache import schedule


@st.composite
def settings(draw):
    budget = draw(st.integers(2, 300))
    window = draw(st.integers(1, budget - 1))
    prompt = draw(st.integers(1, 3 * budget))
    prefill = draw(st.sampled_from(["compress", "keep", "pin"]))
    return budget, window, prompt, prefill


def _stream(budget, window, prompt, prefill, steps):
    """Occupancy after every one-token decode step following the prompt, and the steps that evict. A pinned
    prompt's layer runs the same schedule with `pinned + budget` as its budget (`VaSELayer.due`)."""
    cap = schedule.capacity(budget, window, prompt, prefill)
    budget += schedule.pinned(prefill, prompt)
    occ = min(prompt, cap) if schedule.fits(cap, 0, prompt) else budget  # a prompt that does not fit is compressed
    if schedule.fits(cap, 0, prompt) and schedule.evict_now(budget, window, cap, occ, first_step=True, prefill=prefill):
        occ = budget
    trace, evicting = [occ], []
    for i in range(steps):
        occ += 1
        assert occ <= cap
        if schedule.evict_now(budget, window, cap, occ, first_step=False, prefill=prefill):
            evicting.append(i)
            occ = budget
        trace.append(occ)
    return cap, trace, evicting


@given(settings(), st.integers(0, 400))
def test_occupancy_stays_within_capacity_and_returns_to_budget(s, steps):
    budget, window, prompt, prefill = s
    cap, trace, evicting = _stream(budget, window, prompt, prefill, steps)
    assert max(trace) <= cap
    if prefill == "compress":
        assert cap == budget + window and trace[0] == min(prompt, budget)
    elif prefill == "pin":
        assert cap == prompt + budget + window and trace[0] == prompt
        budget += prompt  # what every eviction returns to: the prompt and `budget` generated tokens
    else:
        assert cap == max(prompt, budget) + window and trace[0] == prompt
    for i in evicting:
        assert trace[i + 1] == budget


@given(settings(), st.integers(0, 400))
def test_in_steady_state_evictions_come_every_window_tokens(s, steps):
    budget, window, prompt, prefill = s
    _, trace, evicting = _stream(budget, window, prompt, prefill, steps)
    assert all(b - a == window for a, b in itertools.pairwise(evicting))
    if evicting:  # the first comes within one window of passing the budget (past the pinned prompt)
        assert evicting[0] < max(budget + schedule.pinned(prefill, prompt) - trace[0], 0) + window


@given(settings(), st.integers(0, 200))
def test_tokens_until_eviction_counts_to_the_step_that_evicts(s, warmup):
    """Feeding `tokens_until_eviction` tokens one at a time evicts exactly at the last one."""
    budget, window, prompt, prefill = s
    cap, trace, _ = _stream(budget, window, prompt, prefill, warmup)
    occ, budget = trace[-1], budget + schedule.pinned(prefill, prompt)
    n = schedule.tokens_until_eviction(budget, window, cap, occ)
    assert n >= 1
    for i in range(1, n + 1):
        due = schedule.evict_now(budget, window, cap, occ + i, first_step=False, prefill=prefill)
        assert due == (i == n)


@given(settings())
def test_the_first_step_compresses_only_in_compress_mode(s):
    budget, window, prompt, prefill = s
    cap = schedule.capacity(budget, window, prompt, prefill)
    occ = min(prompt, cap)
    budget += schedule.pinned(prefill, prompt)
    due = schedule.evict_now(budget, window, cap, occ, first_step=True, prefill=prefill)
    assert due == (prefill == "compress" and prompt > budget)


def test_tokens_until_eviction_when_twice_the_budget_is_not_a_multiple_of_the_window():
    """`schedule.tokens_until_eviction` mutant `-(nxt + budget) % window`: the same as the right
    `-(nxt - budget) % window` whenever `2 * budget` is a multiple of `window`, so the usual
    budgets (16, 256) hid it. budget 5, window 4: evictions at occupancy 9, 13, ..."""
    assert schedule.tokens_until_eviction(5, 4, 9, 3) == 6
    assert schedule.tokens_until_eviction(5, 4, 13, 9) == 4
    assert schedule.tokens_until_eviction(7, 2, 9, 7) == 2
