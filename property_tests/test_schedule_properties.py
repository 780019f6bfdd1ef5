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


# --- vLLM's evictions_per_step: due requests spread over the steps before they are due ---------------------


@given(
    window=st.integers(2, 64),
    per_step=st.integers(1, 8),
    arrivals=st.lists(st.integers(0, 40), min_size=1, max_size=40),
)
def test_spread_evictions_are_never_late_and_soon_at_most_per_step(window, per_step, arrivals):
    """Requests whose decode starts at the steps `arrivals` (several at once: they would evict together, every
    `window` steps), planned step by step by `spread` as the vLLM scheduler plans them. No request ever goes past
    its due step (the footprint bound), none evicts with nothing to evict, and once `window` steps have passed
    since the last arrival no step evicts more than `per_step` requests when the load allows it (`per_step`
    per step over a window holds every request)."""
    from vasepatch.vllm.scheduler_side import spread

    since = {}  # request -> decode steps since its last eviction (or its start)
    counts = []
    last = max(arrivals)
    for t in range(last + 4 * window):
        since.update({r: 0 for r, start in enumerate(arrivals) if start == t})
        left = {r: window - s for r, s in since.items()}
        assert all(v >= 0 for v in left.values())  # never past due
        due = [r for r, v in left.items() if v == 0]
        early = sorted((v, r) for r, v in left.items() if 0 < v < window)  # something to evict
        pulled = spread([v for v, _ in early], per_step)
        assert 0 <= pulled <= len(early)
        evicted = due + [r for _, r in early[:pulled]]
        counts.append(len(evicted))
        since = {r: (0 if r in evicted else s) + 1 for r, s in since.items()}
    if len(arrivals) <= per_step * (window - 1):
        assert max(counts[last + window :]) <= per_step


def test_spread_pulls_a_synchronised_burst_apart_once():
    """16 requests due together every 32 steps, 4 per step: the three steps before they are due take 4 each."""
    from vasepatch.vllm.scheduler_side import spread

    assert [spread([left] * 16, 4) for left in (5, 4)] == [0, 0]
    assert spread([3] * 16, 4) == 4  # 12 more fit in the 3 steps after this one
    assert spread([2] * 12, 4) == 4 and spread([1] * 8, 4) == 4 and spread([], 4) == 0
    assert spread([1] * 5, None) == 0  # no cap: nothing pulled
