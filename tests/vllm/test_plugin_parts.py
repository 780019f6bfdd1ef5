"""The vLLM plugin's parts that need no vLLM: settings, the paged layout, the query rings, the scheduler's
plan and the compaction, each against a reference written here. The plugin inside vLLM: the `test_vllm_*.py`
modules beside this one."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import hypothesis
import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from tests.query_stats_files import options_for
from vasepatch import policies
from vasepatch.cache.paged_rings import QueryRings
from vasepatch.config import VaSEConfig
from vasepatch.policies import scoring
from vasepatch.policies.base import Policy, kept_slots
from vasepatch.policies.keyed import KeyedGenerator, draws_keyed_noise
from vasepatch.vllm import compaction, engine_access, metrics, paged_layout, patches, scheduler_side, settings
from vasepatch.vllm.worker_side import WorkerEviction

# --- settings -------------------------------------------------------------------------------------------


def test_no_settings_anywhere_is_the_full_cache():
    assert settings.resolve(None, None, None) is None
    assert settings.resolve({}, {"other_plugin_key": 1}, 5) is None
    assert settings.resolve({"vasepatch": {"budget": 128}}, {"vasepatch_policy": "full"}, None) is None


def test_request_settings_override_the_engine_and_the_seed_falls_back():
    engine = {"vasepatch": {"budget": 256, "window": 32, "policy": "snapkv", "seed": 3}}
    config = settings.resolve(engine, {"vasepatch_budget": 128}, 9)
    assert (config.budget, config.window, config.policy, config.seed) == (128, 32, "snapkv", 3)
    assert settings.resolve(None, {"vasepatch_budget": 128}, 9).seed == 9  # the request's sampling seed
    assert settings.resolve(None, {"vasepatch_budget": 128}, None).seed == settings.DEFAULT_SEED


@pytest.mark.parametrize(
    ("engine", "request_args", "parameter", "text"),
    [
        ({"vasepatch": {"budget": -1}}, None, "additional_config['vasepatch']['budget']", "budget must be an int >= 2"),
        (None, {"vasepatch_budget": 8, "vasepatch_window": 16}, "vasepatch_window", "window must be smaller"),
        (None, {"vasepatch_bugdet": 3}, "vasepatch_bugdet", "unknown request setting 'vasepatch_bugdet'"),
        (None, {"vasepatch_budget": 128, "vasepatch_policy": "nope"}, "vasepatch_policy", "unknown policy 'nope'"),
        ({"vasepatch": {"window": 3}}, None, "additional_config['vasepatch']", "must set 'budget'"),
        ({"vasepatch": {"budget": 128}}, {"vasepatch_smooth": 4}, "vasepatch_smooth", "smooth must be an odd int"),
        ({"vasepatch": 5}, None, "additional_config['vasepatch']", "must be a JSON object"),
        ({"vasepatch": {"budget": 128, "typo": 1}}, None, "additional_config['vasepatch']['typo']", "unknown setting"),
        (
            {"vasepatch": {"budget": 128, "policy_options": {"zzz": 1}}},
            None,
            "additional_config['vasepatch']['policy_options']",
            "has no option(s) zzz",
        ),
        (None, {"vasepatch_window": 8}, "vasepatch_budget", "must set vasepatch_budget"),
        (
            None,
            {"vasepatch_budget": 64, "vasepatch_policy": "triattention"},
            "vasepatch_window",
            "(window: the default, set by neither the request nor the engine; set vasepatch_window to change it)",
        ),
    ],
)
def test_bad_settings_name_where_they_came_from(engine, request_args, parameter, text):
    with pytest.raises(settings.SettingsError, match=None) as err:
        settings.resolve(engine, request_args, None)
    assert err.value.parameter == parameter
    assert text in str(err.value)


def test_yes_no_request_settings_take_what_http_can_send():
    """vLLM's server types `vllm_xargs` values as str, int, float or list: JSON true/false arrive as 1/0."""
    for sent, meant in ((True, True), (1, True), ("true", True), ("False", False), (0, False)):
        config = settings.resolve(None, {"vasepatch_budget": 128, "vasepatch_shared_heads": sent}, None)
        assert config.shared_heads is meant
    with pytest.raises(settings.SettingsError, match="shared_heads must be a bool"):
        settings.resolve(None, {"vasepatch_budget": 128, "vasepatch_shared_heads": 2}, None)


def test_settings_errors_are_vaseconfigs_own():
    with pytest.raises(ValueError) as own:
        VaSEConfig(budget=128, protect=1000)
    with pytest.raises(settings.SettingsError) as plugin:
        settings.resolve(None, {"vasepatch_budget": 128, "vasepatch_protect": 1000}, None)
    assert str(plugin.value).startswith(str(own.value))  # then which values were defaults (sinks, window)
    assert plugin.value.parameter == "vasepatch_protect"
    assert str(plugin.value).endswith("(window, sinks: the default, set by neither the request nor the engine; "
                                      "set vasepatch_window, vasepatch_sinks to change it)")  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "text", "defaults"),
    [
        ({"budget": 32}, "window must be smaller than budget", "window"),
        ({"budget": 100, "protect": 200}, "protect must satisfy", "window, sinks"),
        ({"budget": 32, "window": 64}, "window must be smaller than budget", None),
    ],
)
def test_an_engine_error_names_the_values_it_took_as_defaults(engine, text, defaults):
    """An engine's bad settings stop it before it starts, naming the key and which of the values in the
    message the engine did not set (VaSEConfig's defaults), so that the user knows where to change them."""
    from vasepatch.vllm import requirements

    with pytest.raises(settings.SettingsError) as error:
        requirements.check_engine(
            SimpleNamespace(
                additional_config={"vasepatch": engine}, cache_config=SimpleNamespace(enable_prefix_caching=False)
            )
        )
    message = str(error.value)
    assert message.startswith(f"{error.value.parameter}: {text}")
    note = "the default, not set in additional_config['vasepatch']; set it there to change it"
    if defaults is None:
        assert note not in message
    else:
        assert message.endswith(f"({defaults}: {note})")


# --- the paged layout -------------------------------------------------------------------------------------


def _reference_slot(cache: torch.Tensor, blocks: list[int], slot: int, head: int):
    """K and V of one slot, straight from the layout's definition (K transposed per block and head)."""
    bs, d = cache.shape[2], cache.shape[3] // 2
    region = cache[blocks[slot // bs], head].reshape(-1)
    off = slot % bs
    k = region[: bs * d].view(d, bs)[:, off]
    v = region[bs * d :].view(bs, d)[off]
    return k, v


def test_read_slots_follows_the_layout():
    cache = torch.randn(9, 3, 8, 2 * 4)
    blocks = [5, 2, 7]
    keys, values = paged_layout.read_slots(cache, torch.tensor(blocks), 19)
    assert keys.shape == values.shape == (3, 19, 4)
    for slot in (0, 7, 8, 15, 18):
        for head in range(3):
            k, v = _reference_slot(cache, blocks, slot, head)
            assert torch.equal(keys[head, slot], k)
            assert torch.equal(values[head, slot], v)


def _amx_reference_slot(cache, blocks, slot, head):
    """Slot `slot`'s key and value in the `amx` layout, element by element: keys `[bs/16, d/2, 16, 2]`
    (slot group, dimension pair, slot, dimension), values `[d/16, bs/2, 16, 2]` (dimension group, slot pair,
    dimension, slot)."""
    bs, d = cache.shape[2], cache.shape[3] // 2
    region = cache[blocks[slot // bs], head].reshape(-1)
    s = slot % bs
    k = torch.stack([region[((s // 16) * (d // 2) + j // 2) * 32 + (s % 16) * 2 + j % 2] for j in range(d)])
    v = torch.stack([region[bs * d + ((j // 16) * (bs // 2) + s // 2) * 32 + (j % 16) * 2 + s % 2] for j in range(d)])
    return k, v


def test_read_slots_follows_the_amx_layout():
    cache = torch.randn(5, 2, 64, 2 * 32)
    blocks = [3, 0]
    keys, values = paged_layout.read_slots(cache, torch.tensor(blocks), 100, "amx")
    for slot in (0, 1, 15, 16, 17, 63, 64, 99):
        for head in range(2):
            k, v = _amx_reference_slot(cache, blocks, slot, head)
            assert torch.equal(keys[head, slot], k)
            assert torch.equal(values[head, slot], v)


@pytest.mark.parametrize(("isa", "block_size", "head_size"), [("vec", 8, 4), ("vec16", 8, 4), ("amx", 32, 32)])
def test_write_then_read_round_trips_and_touches_only_the_requests_blocks(isa, block_size, head_size):
    cache = torch.randn(9, 2, block_size, 2 * head_size)
    before = cache.clone()
    blocks = torch.tensor([4, 1, 6])
    m = block_size + 3
    keys, values = torch.randn(2, m, head_size), torch.randn(2, m, head_size)
    paged_layout.write_slots(cache, blocks, keys, values, isa)
    k, v = paged_layout.read_slots(cache, blocks, m, isa)
    assert torch.equal(k, keys) and torch.equal(v, values)
    untouched = [b for b in range(9) if b not in (4, 1)]
    assert torch.equal(cache[untouched], before[untouched])  # the third block was not needed for m slots


# --- the query rings ----------------------------------------------------------------------------------------


def test_rings_keep_the_last_window_queries_of_each_request():
    rings = QueryRings()
    rings.assign("a", 4)
    rings.assign("b", 4)
    rings.assign("c", 2)
    seen: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    positions = {"a": 0, "b": 0, "c": 0}
    for step, counts in enumerate([(6, 3, 5), (1, 1, 1), (1, 0, 2), (1, 1, 1)]):
        query = torch.randn(sum(counts), 3, 5) + step
        starts = [0, counts[0], counts[0] + counts[1]]
        rings.plan(["a", "b", "c"], starts, list(counts), [positions[r] for r in "abc"])
        rings.record("layer0", query)
        for r, start, count in zip("abc", starts, counts, strict=True):
            seen[r].extend(query[start : start + count])
            positions[r] += count
    for r, window in (("a", 4), ("b", 4), ("c", 2)):
        got = rings.queries(r, ["layer0"])[0]  # [heads, window, dim], columns by position % window
        want = torch.stack(seen[r][-window:])  # [window, heads, dim] in order
        order = [p % window for p in range(positions[r] - window, positions[r])]
        assert torch.equal(got.transpose(0, 1)[order], want)


def test_ring_rows_are_reused_and_the_pool_grows_keeping_its_rows():
    rings = QueryRings()
    for i in range(3):
        rings.assign(f"r{i}", 2)
    rings.plan(["r0", "r1", "r2"], [0, 2, 4], [2, 2, 2], [0, 0, 0])
    query = torch.arange(6 * 2.0).view(6, 1, 2)
    rings.record("l", query)
    kept = {r: rings.queries(r, ["l"]).clone() for r in ("r0", "r1", "r2")}
    for i in range(3, 9):  # grow past the first allocation
        rings.assign(f"r{i}", 2)
    for r, q in kept.items():
        assert torch.equal(rings.queries(r, ["l"]), q)
    rings.release("r1")
    rings.assign("new", 2)
    assert "new" in rings and "r1" not in rings


# --- the scheduler's plan -------------------------------------------------------------------------------------


class _Manager:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.freed: list[int] = []
        self.block_pool = SimpleNamespace(free_blocks=lambda blocks: self.freed.extend(blocks))


def _scheduler(
    requests,
    block_size=16,
    engine=None,
    prefix_caching=False,
    chunk=64,
    threshold=0,
    waiting=(),
    ring_limit=2**40,
    adaptive=False,
):
    manager = _Manager(block_size)
    coordinator = SimpleNamespace(single_type_managers=(manager,))
    caching = SimpleNamespace(enable_prefix_caching=prefix_caching)
    chunks = SimpleNamespace(
        max_num_batched_tokens=chunk, long_prefill_token_threshold=threshold,
        long_prefill_token_threshold_adaptive=adaptive,
    )  # fmt: skip
    config = SimpleNamespace(additional_config=engine or {}, cache_config=caching, scheduler_config=chunks)
    rings = scheduler_side.RingBudget(per_token=1, limit=ring_limit)
    return SimpleNamespace(
        running=requests, waiting=list(waiting), kv_holding_waiting=[], vllm_config=config,
        kv_cache_manager=SimpleNamespace(coordinator=coordinator, **{scheduler_side.RINGS_ATTR: rings}),
    ), manager  # fmt: skip


def _request(req_id, prompt, extra):
    sp = SimpleNamespace(extra_args=extra, seed=None)
    return SimpleNamespace(
        request_id=req_id, sampling_params=sp, num_prompt_tokens=prompt, num_computed_tokens=0, num_output_tokens=0
    )


def _decode(request, computed):
    request.num_computed_tokens, request.num_output_tokens = computed, computed - request.num_prompt_tokens + 1
    request.num_tokens, request.is_prefill_chunk = computed + 1, False


def test_the_plan_evicts_as_the_transformers_cache_does_and_frees_the_tail():
    budget, window, bs = 40, 8, 16
    req = _request("a", 50, {"vasepatch_budget": budget, "vasepatch_window": window})
    full = _request("b", 50, None)
    scheduler, manager = _scheduler([req, full], bs)
    manager.req_to_blocks = {"a": list(range(4)), "b": list(range(10, 14))}
    _decode(req, 50)
    _decode(full, 50)
    step = scheduler_side.finish(scheduler, scheduler_side.plan(scheduler))
    # the prompt (50 > budget) is compressed at once; 3 blocks of 16 hold 40; the full-cache request is left alone
    assert step.orders == {"a": scheduler_side.Order(50, 0, 0)}
    assert step.dropped == {"a": 10} and manager.req_to_blocks["a"] == [0, 1, 2] and manager.freed == [3]
    assert manager.req_to_blocks["b"] == [10, 11, 12, 13]
    evicted_at = []
    for computed in range(51, 51 + 3 * window):
        _decode(req, computed)
        manager.req_to_blocks["a"] = list(range(-(-(computed - req.vasepatch.dropped) // bs)))
        step = scheduler_side.plan(scheduler)
        if step.orders:
            evicted_at.append((computed, step.orders["a"]))
    # then once every `window` tokens, when the request holds budget + window slots
    assert [c for c, _ in evicted_at] == [50 + window, 50 + 2 * window, 50 + 3 * window]
    assert evicted_at[0][1] == scheduler_side.Order(budget + window, 10, 1)
    assert req.vasepatch.dropped == 10 + 3 * window


def test_the_plan_spreads_requests_due_together_over_the_steps_before():
    """`evictions_per_step: 1` and three requests that decode in step: the first round (their prompts) is due
    for all three at once and all evict; the next round takes one request at each of the three steps up to the
    due one, each evicting what it holds (fewer slots for the two pulled early); later rounds stay apart."""
    budget, window, bs = 40, 8, 8
    asks = {"vasepatch_budget": budget, "vasepatch_window": window}
    reqs = [_request(r, 50, asks) for r in "abc"]
    scheduler, manager = _scheduler(reqs, bs, engine={"vasepatch": {"evictions_per_step": 1}})
    manager.req_to_blocks = {r: list(range(7)) for r in "abc"}
    rounds = []
    for computed in range(50, 50 + 3 * window):
        for req in reqs:
            _decode(req, computed)
        step = scheduler_side.plan(scheduler)
        rounds.append({rid: (order.n, order.round) for rid, order in step.orders.items()})
    assert rounds[0] == {"a": (50, 0), "b": (50, 0), "c": (50, 0)}
    evicting = [(i, r) for i, r in enumerate(rounds[1:], 1) if r]
    assert [len(r) for _, r in evicting] == [1] * len(evicting)  # one request per step after the prompts
    first_decode = [r for _, r in evicting[:3]]
    assert sorted(n for r in first_decode for n, _ in r.values()) == [budget + window - 2, budget + window - 1,
                                                                      budget + window]  # fmt: skip
    assert all(rnd == 1 for r in first_decode for _, rnd in r.values())
    assert all(n == budget + window for _, r in evicting[3:] for n, _ in r.values())  # apart: each when due


def _prefill(request, computed):
    """`computed` of the request's prompt (or of its recompute) prefilled, in chunks: not decoding yet."""
    request.num_computed_tokens, request.num_tokens = computed, max(request.num_prompt_tokens, computed + 2)
    request.num_output_tokens, request.is_prefill_chunk = request.num_tokens - request.num_prompt_tokens, True


def _chunked(req, scheduler, manager, bs, total, chunks):
    """Prefill `total` tokens in `chunks` (sizes; the last is cut to fit), planning before each step as the
    scheduler does; returns the slots held at each plan after it, and during each chunk."""
    between, during, done = [], [], 0
    scheduler_side.state_of(req, scheduler)  # made while it waited
    for size in chunks:
        size = min(size, total - done)
        if size <= 0:
            break
        during.append(done - req.vasepatch.dropped + size)
        done += size
        _prefill(req, done)
        manager.req_to_blocks["a"] = list(range(-(-(done - req.vasepatch.dropped) // bs)))
        scheduler_side.plan(scheduler)
        between.append(done - req.vasepatch.dropped)
    return between, during


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    budget=st.integers(16, 64), window=st.integers(1, 8), prompt=st.integers(1, 400),
    chunks=st.lists(st.integers(1, 96), min_size=1, max_size=40), pin=st.booleans(),
)  # fmt: skip
def test_a_prompt_is_compressed_between_its_chunks(budget, window, prompt, chunks, pin):
    """However vLLM chunks a prompt, between two chunks an evicting request holds at most `pinned + budget +
    window` slots, so during one at most that plus the chunk (`held_at_most`); with `prefill="pin"` the
    prompt itself is never evicted."""
    asks = {"vasepatch_budget": budget, "vasepatch_window": window, "vasepatch_prefill": "pin" if pin else "compress"}
    req = _request("a", prompt, asks)
    scheduler, manager = _scheduler([req], 8, chunk=max(chunks))
    chunks = chunks * (1 + prompt // sum(chunks))  # enough to prefill the whole prompt
    between, during = _chunked(req, scheduler, manager, 8, prompt, chunks)
    pinned = prompt if pin else 0
    assert max(between) <= pinned + budget + window
    assert max(during) <= req.vasepatch.most == pinned + budget + window + max(chunks)
    assert between[-1] >= min(prompt, pinned + budget)  # never below the budget
    if pin or prompt <= budget:
        assert req.vasepatch.dropped == 0
    elif prompt >= budget + window:
        assert req.vasepatch.dropped > 0  # the chunk that reached budget + window was evicted
    # in between, it depends on the chunks, as in the transformers cache: a prompt prefilled at once is compressed
    # at its first step, while one fed a token at a time holds its budget + window like a decode and evicts none


def test_a_chunked_prompt_evicts_when_the_transformers_cache_fed_the_same_chunks_does():
    """Chunks of 32 over a 200-token prompt, budget 40, window 8: the first chunk fits; every later one leaves
    the request past `budget + window` and is evicted before the next (the transformers cache evicts at the end
    of the same chunk steps: `evict_now` on the same counts); the blocks past 40 slots go back at once."""
    budget, window, bs = 40, 8, 16
    req = _request("a", 200, {"vasepatch_budget": budget, "vasepatch_window": window})
    scheduler, manager = _scheduler([req], bs, chunk=32)
    between, during = _chunked(req, scheduler, manager, bs, 200, [32] * 7)
    assert during == [32, 64, 72, 72, 72, 72, 48]
    assert between == [32, 40, 40, 40, 40, 40, 40]
    assert req.vasepatch.rounds == 6 and req.vasepatch.dropped == 160
    assert manager.req_to_blocks["a"] == [0, 1, 2] and len(manager.freed) == 1 + 4 * 2  # 64 slots: 4 blocks


def test_admission_counts_the_blocks_an_evicting_request_will_hold():
    """vLLM's full-sequence admission check counts `pinned + budget + window` plus the largest chunk for an
    evicting request (a preempted one too: its whole sequence is recomputed, in chunks that are compressed as
    they come), vLLM's own count for any other; `long_prefill_token_threshold` lowers the chunk."""
    asks = {"vasepatch_budget": 64, "vasepatch_window": 32}
    evicting, pinned, full = (
        _request("a", 40, asks), _request("b", 40, {**asks, "vasepatch_prefill": "pin"}), _request("c", 40, None)
    )  # fmt: skip
    scheduler, _ = _scheduler([], 32, chunk=256, waiting=[evicting, pinned, full])
    scheduler_side.plan(scheduler)
    blocks = [scheduler_side.admission_blocks(r, 32) for r in (evicting, pinned, full)]
    assert blocks == [-(-(64 + 32 + 256) // 32), -(-(40 + 64 + 32 + 256) // 32), None]
    scheduler, _ = _scheduler([], 32, chunk=256, threshold=64, waiting=[_request("d", 40, asks)])
    scheduler_side.plan(scheduler)
    assert scheduler_side.admission_blocks(scheduler.waiting[0], 32) == (64 + 32 + 64) // 32
    scheduler, _ = _scheduler([], 32, chunk=256, threshold=64, adaptive=True, waiting=[_request("e", 40, asks)])
    scheduler_side.plan(scheduler)  # vLLM raises the cap to a fair share of the budget: half of it with two requests
    assert scheduler_side.admission_blocks(scheduler.waiting[0], 32) == (64 + 32 + 128) // 32


def test_query_rings_are_counted_at_admission_against_the_engines_limit():
    """Rings of 8 per request (window 8, 1 byte a token) against a limit of 16: two new requests are admitted at
    one step, a third waits; a preempted one's rings are freed, so the third fits and the preempted one waits
    like a new one, until a request finishes. What counts is always the running requests' rings: an engine
    with nothing running admits any request whose window passed the check on arrival."""
    asks = {"vasepatch_budget": 16, "vasepatch_window": 8}
    a, b, c = (_request(r, 10, asks) for r in "abc")
    full = _request("f", 10, None)
    scheduler, _ = _scheduler([], waiting=[a, b, c, full], ring_limit=16)
    kv = scheduler.kv_cache_manager
    scheduler_side.plan(scheduler)
    admitted = []
    for request in (a, b, c, full):
        if scheduler_side.rings_admit(kv, request):
            scheduler_side.rings_taken(kv, request)
            admitted.append(request.request_id)
    assert admitted == ["a", "b", "f"]  # a request with no eviction has no rings
    scheduler.running, scheduler.waiting = [a, b, full], [c]
    scheduler_side.plan(scheduler)
    assert getattr(kv, scheduler_side.RINGS_ATTR).held == 16 and not scheduler_side.rings_admit(kv, c)
    scheduler_side.preempted(b)  # the workers free its rings: c fits now, and b waits behind it like any other
    scheduler.running, scheduler.waiting = [a, full], [c, b]
    scheduler_side.plan(scheduler)
    assert getattr(kv, scheduler_side.RINGS_ATTR).held == 8 and scheduler_side.rings_admit(kv, c)
    scheduler_side.rings_taken(kv, c)
    assert not scheduler_side.rings_admit(kv, b)
    scheduler.running, scheduler.waiting = [full, c], [b]  # a finished
    scheduler_side.plan(scheduler)
    assert scheduler_side.rings_admit(kv, b)


def test_the_admission_cap_is_set_for_one_call_and_put_back():
    managers = [SimpleNamespace(max_admission_blocks_per_request=cap) for cap in (None, 4)]
    kv = SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=managers))
    with engine_access.admission_capped(kv, 11):
        assert [m.max_admission_blocks_per_request for m in managers] == [11, 4]
    assert [m.max_admission_blocks_per_request for m in managers] == [None, 4]
    with engine_access.admission_capped(kv, None):
        assert [m.max_admission_blocks_per_request for m in managers] == [None, 4]


def test_a_preempted_request_starts_over_and_physical_counts_slots():
    req = _request("a", 10, {"vasepatch_budget": 40, "vasepatch_window": 8})
    scheduler, _ = _scheduler([req])
    _decode(req, 48)
    scheduler_side.plan(scheduler)  # 48 = budget + window: evicts back to 40
    assert req.vasepatch.dropped == 8
    with scheduler_side.physical(req):
        assert req.num_computed_tokens == 40
    assert req.num_computed_tokens == 48
    req.vasepatch.reset()
    assert (req.vasepatch.dropped, req.vasepatch.prefilled) == (0, False)


def test_the_preemption_line_counts_only_evictions_carried_out(caplog):
    """A request preempted in the `schedule()` that planned its eviction never carries that order out: the log
    line counts the evictions before it, and a request preempted at its first planned eviction logs none."""
    req = _request("a", 10, {"vasepatch_budget": 40, "vasepatch_window": 8})
    first = _request("b", 10, {"vasepatch_budget": 40, "vasepatch_window": 8})
    scheduler, _ = _scheduler([req, first])
    _decode(req, 48)
    scheduler_side.finish(scheduler, scheduler_side.plan(scheduler))  # evicted once: 8 positions dropped
    _decode(req, 56)
    _decode(first, 48)
    step = scheduler_side.plan(scheduler)  # both due: a's second eviction, b's first
    assert set(step.orders) == {"a", "b"}
    scheduler.running, scheduler.waiting = [], [req, first]
    with caplog.at_level(logging.INFO, logger="vllm.vasepatch"):
        scheduler_side.preempted(req)
        scheduler_side.preempted(first)
    assert scheduler_side.finish(scheduler, step).orders == {}
    lines = [r.getMessage() for r in caplog.records if "preempted after" in r.getMessage()]
    assert lines == ["vasepatch: request a preempted after 1 evictions (8 positions dropped): it is recomputed "
                     "from its whole sequence, compressed as its chunks come"]  # fmt: skip
    assert (req.vasepatch.rounds, req.vasepatch.pending, first.vasepatch.rounds) == (1, 0, 0)


# --- the compaction ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["vase", "snapkv", "rkv"])
def test_compaction_keeps_what_the_transformers_cache_keeps(policy_name):
    torch.manual_seed(0)
    layers, heads, q_heads, d, bs = 2, 2, 4, 8, 8
    budget, window, n, dropped = 24, 8, 32, 5
    config = VaSEConfig(budget=budget, window=window, policy=policy_name, seed=11)
    policy = policies.for_config(config)
    caches = [torch.randn(10, heads, bs, 2 * d) for _ in range(layers)]
    blocks = torch.tensor([7, 2, 9, 0])
    dense = [paged_layout.read_slots(c, blocks, n) for c in caches]
    queries = torch.randn(layers, q_heads, window, d)
    earlier = torch.randint(0, 10_000, (layers, heads, budget))
    positions = compaction.candidate_positions(earlier, layers, heads, n, dropped)
    assert torch.equal(positions[..., :budget], earlier)
    assert torch.equal(positions[0, 0, budget:], torch.arange(dropped + budget, dropped + n))
    kept_positions = compaction.compact(caches, blocks, n, queries, positions, config, policy, rounds=3)
    for layer in range(layers):
        keys, values = (t.unsqueeze(0) for t in dense[layer])
        valid = torch.ones(1, heads, n, dtype=torch.bool)
        generator = KeyedGenerator(11, layer, 3, 0)
        kept = kept_slots(policy, keys, values, positions[layer : layer + 1], valid, queries[layer : layer + 1],
                          n, budget, window, generator)  # fmt: skip
        new_keys, new_values = paged_layout.read_slots(caches[layer], blocks, budget)
        want_keys = keys[0].gather(1, kept[0, ..., None].expand(-1, -1, d))
        want_values = values[0].gather(1, kept[0, ..., None].expand(-1, -1, d))
        assert torch.equal(new_keys, want_keys) and torch.equal(new_values, want_values)
        assert torch.equal(kept_positions[layer], positions[layer].gather(-1, kept[0]))


def test_positions_start_over_after_a_preemption():
    """A preempted request is recomputed from its whole sequence (dropped 0): the kept positions of its last
    eviction before the preemption must not be reused, or a policy that ranks by position (`streaming`) keeps
    the wrong tokens."""
    stale = torch.randint(0, 10_000, (2, 3, 8))
    fresh = compaction.candidate_positions(stale, 2, 3, 20, dropped=0)
    assert torch.equal(fresh, torch.arange(20).expand(2, 3, 20))


@pytest.mark.parametrize("policy_name", ["vase", "snapkv", "streaming", "triattention"])
def test_ranks_evict_their_heads_as_one_rank_evicts_all(policy_name):
    """Tensor parallelism: rank r holds KV heads [r * h, (r + 1) * h) and keys its noise by the global head
    (`head_offset = rank * heads per rank`): two ranks of 2 heads keep what one rank of 4 keeps. `triattention`
    reads its statistics by `head_ids` (`layer * total KV heads + global head`): the worker passes the model's
    KV heads over all ranks, without which a rank reads other heads' rows."""
    torch.manual_seed(1)
    layers, heads, ranks, groups, d, bs = 2, 4, 2, 2, 8, 8
    budget, window, n = 24, 8, 40
    options = options_for(policy_name, layers=layers, q_heads=heads * groups, kv_heads=heads, head_dim=d)
    config = VaSEConfig(budget=budget, window=window, policy=policy_name, seed=5, policy_options=options)
    policy = policies.for_config(config)
    caches = [torch.randn(6, heads, bs, 2 * d) for _ in range(layers)]
    blocks = torch.tensor([4, 0, 3, 1, 5])
    queries = torch.randn(layers, heads * groups, window, d)
    positions = compaction.candidate_positions(None, layers, heads, n, 0)
    one_rank = [c.clone() for c in caches]
    want = compaction.compact(one_rank, blocks, n, queries, positions, config, policy, rounds=2)
    per = heads // ranks
    for rank in range(ranks):
        mine = slice(rank * per, (rank + 1) * per)
        shard = [c[:, mine].clone() for c in caches]
        q = queries[:, rank * per * groups : (rank + 1) * per * groups]
        worker = WorkerEviction(rank, heads_per_rank=per, kv_heads=heads)
        where = dict(head_offset=worker.head_offset, kv_heads=worker.kv_heads)
        got = compaction.compact(shard, blocks, n, q, positions[:, mine], config, policy, 2, **where)
        assert torch.equal(got, want[:, mine])
        for layer in range(layers):
            assert torch.equal(shard[layer], one_rank[layer][:, mine])
    if policy_name == "triattention":  # the total matters: a rank's own count reads layer 1 from other rows
        shard = [c[:, per:].clone() for c in caches]
        q = queries[:, per * groups :]
        got = compaction.compact(shard, blocks, n, q, positions[:, per:], config, policy, 2, head_offset=per)
        assert not torch.equal(got[1], want[1, per:])


# --- prefill="pin": the prompt's blocks untouched, only the generated slots evicted -------------------------


@pytest.mark.parametrize("prompt", [19, 24], ids=["prompt-ends-mid-block", "prompt-fills-its-blocks"])
@pytest.mark.parametrize("policy_name", ["vase", "streaming"])
def test_pinned_compaction_keeps_what_the_transformers_cache_keeps_and_writes_no_prompt_block(prompt, policy_name):
    """With `pinned` prompt slots, the candidates are the slots after them, the kept ones land right after them
    (the transformers cache's `prefill="pin"` choice, on the same tensors), the prompt's full blocks are never
    written (not one byte: the prefix cache may share them) and its slots in a part-filled block keep their
    values."""
    torch.manual_seed(2)
    layers, heads, q_heads, d, bs = 2, 2, 4, 8, 8
    budget, window, dropped = 16, 8, 3
    n = prompt + budget + window
    config = VaSEConfig(budget=budget, window=window, policy=policy_name, seed=4, sinks=2, prefill="pin")
    policy = policies.for_config(config)
    caches = [torch.randn(12, heads, bs, 2 * d) for _ in range(layers)]
    blocks = torch.tensor([7, 2, 9, 0, 11, 5])
    dense = [paged_layout.read_slots(c, blocks, n) for c in caches]
    prompt_blocks = blocks[: prompt // bs]
    before = [c[prompt_blocks].clone() for c in caches]
    queries = torch.randn(layers, q_heads, window, d)
    earlier = torch.randint(prompt, 10_000, (layers, heads, budget))
    positions = compaction.candidate_positions(earlier, layers, heads, n, dropped, pinned=prompt)
    assert positions.shape[-1] == n - prompt and torch.equal(positions[..., :budget], earlier)
    assert torch.equal(positions[0, 0, budget:], torch.arange(dropped + prompt + budget, dropped + n))
    got = compaction.compact(caches, blocks, n, queries, positions, config, policy, rounds=1, pinned=prompt)
    for layer in range(layers):
        assert torch.equal(caches[layer][prompt_blocks], before[layer])
        keys, values = (t.unsqueeze(0) for t in dense[layer])
        new_keys, new_values = paged_layout.read_slots(caches[layer], blocks, prompt + budget)
        assert torch.equal(new_keys[:, :prompt], keys[0, :, :prompt])  # the pinned prompt, every slot
        assert torch.equal(new_values[:, :prompt], values[0, :, :prompt])
        valid = torch.ones(1, heads, n - prompt, dtype=torch.bool)
        tail = (keys[:, :, prompt:], values[:, :, prompt:])
        kept = kept_slots(policy, *tail, positions[layer : layer + 1], valid, queries[layer : layer + 1],
                          n - prompt, budget, window, KeyedGenerator(4, layer, 1, 0))  # fmt: skip
        want = keys[0, :, prompt:].gather(1, kept[0, ..., None].expand(-1, -1, d))
        assert torch.equal(new_keys[:, prompt:], want)
        assert torch.equal(got[layer], positions[layer].gather(-1, kept[0]))


def test_the_plan_of_a_pinned_request_counts_its_budget_past_the_prompt():
    budget, window, bs, prompt = 40, 8, 16, 50
    req = _request("a", prompt, {"vasepatch_budget": budget, "vasepatch_window": window, "vasepatch_prefill": "pin"})
    scheduler, manager = _scheduler([req], bs)
    _decode(req, prompt)
    assert scheduler_side.plan(scheduler).orders == {}  # the prompt, over the budget, stays whole
    assert scheduler_side.cacheable(req) == prompt  # the prefix cache may hold the prompt's full blocks only
    evicted_at = []
    for computed in range(prompt + 1, prompt + budget + 3 * window + 1):
        _decode(req, computed)
        manager.req_to_blocks["a"] = list(range(-(-(computed - req.vasepatch.dropped) // bs)))
        step = scheduler_side.plan(scheduler)
        if step.orders:
            evicted_at.append((computed, step.orders["a"], list(manager.req_to_blocks["a"])))
    first = prompt + budget + window
    assert [c for c, _, _ in evicted_at] == [first, first + window, first + 2 * window]
    assert evicted_at[0][1] == scheduler_side.Order(first, 0, 0, pinned=prompt)
    assert evicted_at[0][2] == list(range(-(-(prompt + budget) // bs)))  # the blocks of prompt + budget slots
    assert req.vasepatch.dropped == 3 * window


def test_the_prefill_mode_defaults_to_pin_with_prefix_caching_and_compress_is_refused_there():
    from vasepatch.vllm import requirements

    asks = {"vasepatch_budget": 128}
    assert settings.resolve(None, asks, None).prefill == "compress"
    assert settings.resolve(None, asks, None, prefix_caching=True).prefill == "pin"
    assert settings.resolve({"vasepatch": {"budget": 128, "prefill": "compress"}}, {}, None, True).prefill == "compress"
    with pytest.raises(settings.SettingsError, match="prefill must be one of 'compress', 'pin' in vLLM") as error:
        settings.resolve(None, {**asks, "vasepatch_prefill": "keep"}, None)
    assert error.value.parameter == "vasepatch_prefill"
    engine = SimpleNamespace(
        additional_config={},
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        model_config=SimpleNamespace(
            max_model_len=4096, dtype=torch.float32, get_num_attention_heads=lambda parallel: 4,
            get_num_layers=lambda parallel: 2, get_head_size=lambda: 8,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )  # fmt: skip
    config = settings.resolve(None, {**asks, "vasepatch_prefill": "compress"}, None, True)
    assert list(requirements.config_problems(engine, config)) == ["prefill"]
    assert requirements.config_problems(engine, settings.resolve(None, asks, None, True)) == {}


# --- one eviction call per step: the due requests stacked ---------------------------------------------------


STACK_KV_HEADS = 4  # the model's KV heads per layer over both ranks of `_stack_case`


def _stack_case(policy_name: str, dtype: torch.dtype, pins: bool, shared: bool = False):
    """Three requests due at one step (seeds, rounds, dropped counts and, pinned, prompt lengths of their own),
    their paged caches of 3 layers, and what each request's own `compaction.compact` call leaves. The rank holds
    KV heads 2 and 3 of `STACK_KV_HEADS` = 4 (`head_offset=2`)."""
    gen = torch.Generator().manual_seed(3)
    layers, heads, q_heads, d, bs, budget, window = 3, 2, 4, 16, 8, 20, 4
    pinned = [5, 13, 21] if pins else [0, 0, 0]
    mode = "pin" if pins else "compress"
    group = q_heads // heads
    stats = options_for(policy_name, layers=layers, q_heads=group * STACK_KV_HEADS, kv_heads=STACK_KV_HEADS, head_dim=d)
    configs = [
        VaSEConfig(
            budget=budget, window=window, policy=policy_name, seed=100 + r, prefill=mode, shared_heads=shared,
            policy_options=stats,
        )
        for r in range(3)
    ]  # fmt: skip
    caches = [torch.randn(40, heads, bs, 2 * d, generator=gen).to(dtype) for _ in range(layers)]
    alone, dues, want = [c.clone() for c in caches], [], []
    owned = torch.randperm(40, generator=gen).view(4, 10)  # each request's own blocks, in no order
    for r, (config, p) in enumerate(zip(configs, pinned, strict=True)):
        n, blocks = p + budget + window, owned[r]
        earlier = None if r == 0 else torch.randint(p, 10_000, (layers, heads, budget), generator=gen)
        positions = compaction.candidate_positions(earlier, layers, heads, n, 9 * r, p)
        queries = torch.randn(layers, q_heads, window, d, generator=gen)
        policy = policies.for_config(config)
        want.append(
            compaction.compact(
                alone, blocks, n, queries, positions, config, policy, r + 2, 2, p, kv_heads=STACK_KV_HEADS
            )
        )
        dues.append(compaction.Due(blocks, n, p, r + 2, config.seed, queries, positions))
    return caches, dues, configs, alone, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pins", [False, True], ids=["compress", "pin"])
@pytest.mark.parametrize("policy_name", policies.available())
def test_stacked_eviction_keeps_exactly_what_one_call_per_request_keeps(policy_name, pins, dtype):
    """Every registered policy: three requests evicted by one `compact_stacked` call (all layers, one policy
    call, one read and one write per layer) leave the same bytes in every block, and the same kept positions,
    as one `compact` call per request and layer. Seeds, rounds, dropped counts and prompts differ per request."""
    caches, dues, configs, alone, want = _stack_case(policy_name, dtype, pins)
    policy = policies.for_config(configs[0])
    keys = {compaction.stack_key(config, policy, due, 8) for config, due in zip(configs, dues, strict=True)}
    assert len(keys) == 1 and None not in keys  # the seed is not in the key: it keys each row's noise
    got = compaction.compact_stacked(caches, dues, configs[0], policy, head_offset=2, kv_heads=STACK_KV_HEADS)
    for layer in range(len(caches)):
        assert torch.equal(caches[layer], alone[layer])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_stacked_eviction_with_head_shared_picks():
    caches, dues, configs, alone, want = _stack_case("vase", torch.float32, pins=False, shared=True)
    got = compaction.compact_stacked(caches, dues, configs[0], policies.for_config(configs[0]), head_offset=2)
    assert all(torch.equal(a, b) for a, b in zip(caches, alone, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(got[0][:, 0], got[0][:, 1])  # one set of positions for both heads (the first eviction)


def test_what_stacks_and_what_evicts_alone():
    """Requests stack when their policy, options, budget, window, candidate count and pinned slots in their first
    written block agree; a priority that draws from a `torch.Generator` of its own, or a `Policy` subclass with a
    `select` of its own, evicts alone."""
    due = compaction.Due(torch.arange(8), 40, 0, 0, 1, torch.zeros(1), torch.zeros(1))
    config = VaSEConfig(budget=32, window=8, policy="vase", seed=1)
    key = compaction.stack_key(config, policies.for_config(config), due, 8)
    other_seed = VaSEConfig(budget=32, window=8, policy="vase", seed=2)
    assert compaction.stack_key(other_seed, policies.for_config(other_seed), due, 8) == key
    for changed in (dict(policy="snapkv"), dict(budget=31), dict(window=7), dict(temperature=0.5)):
        other = VaSEConfig(**{**dict(budget=32, window=8, policy="vase", seed=1), **changed})
        assert compaction.stack_key(other, policies.for_config(other), due, 8) != key, changed
    pinned = compaction.Due(torch.arange(8), 43, 3, 0, 1, torch.zeros(1), torch.zeros(1))
    assert compaction.stack_key(config, policies.for_config(config), pinned, 8) != key  # 3 pinned in its block

    def own_draws(valid, generator):
        return torch.rand(valid.shape, generator=generator)

    assert compaction.stack_key(config, Policy("own-draws", own_draws, {}), due, 8) is None

    @draws_keyed_noise
    def users_keyed(valid, generator):  # keyed, but a user's: it keeps the KeyedGenerator it was written for
        return scoring.uniform_noise(valid.shape, valid.device, generator)

    assert compaction.stack_key(config, Policy("users-keyed", users_keyed, {}), due, 8) is None

    class OwnSelect(Policy):
        def select(self, *args, **kwargs):
            return super().select(*args, **kwargs)

    assert compaction.stack_key(config, OwnSelect("own-select", policies.get("streaming").priority, {}), due, 8) is None


def test_a_large_group_is_stacked_in_chunks_that_keep_the_same(monkeypatch):
    """`chunks` bounds what one stacked call reads: with room for one request per call, the three requests go
    in three calls and keep, byte for byte, what one call per request keeps."""
    caches, dues, configs, alone, want = _stack_case("vase", torch.float32, pins=False)
    per_request = 3 * 2 * (20 + 4) * 32 * 4  # layers, KV heads, slots read, K and V of head size 16, float32
    assert compaction.read_bytes(dues[0], caches) == per_request
    assert [len(c) for c in compaction.chunks(dues, caches)] == [3]
    monkeypatch.setattr(compaction, "STACK_BYTES", per_request * 2 - 1)
    parts = compaction.chunks(dues, caches)
    assert [len(c) for c in parts] == [1, 1, 1] and [d for c in parts for d in c] == dues
    monkeypatch.setattr(compaction, "STACK_BYTES", per_request * 2)
    parts = compaction.chunks(dues, caches)
    assert [len(c) for c in parts] == [2, 1]
    policy = policies.for_config(configs[0])
    got = [k for c in parts for k in compaction.compact_stacked(caches, c, configs[0], policy, head_offset=2)]
    assert all(torch.equal(a, b) for a, b in zip(caches, alone, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# --- the worker's blocks after an eviction, and its seeded generators -------------------------------------------


def _worker_runner(blocks: list[int], extra: dict, block_size: int, layers: int = 2, heads: int = 2, head: int = 16):
    """A model runner with what the worker's eviction reads and cuts: paged caches in the `vec` layout, the
    request's block list (its state and its row of the persistent batch, 64 blocks wide)."""
    context = {
        f"layer{i}": SimpleNamespace(
            kv_cache=torch.randn(max(blocks) + 1, heads, block_size, 2 * head), isa="vec",
            impl=SimpleNamespace(alibi_slopes=None),
        )
        for i in range(layers)
    }  # fmt: skip
    row = np.zeros((1, 64), dtype=np.int32)
    row[0, : len(blocks)] = blocks
    table = SimpleNamespace(block_table=SimpleNamespace(np=row), num_blocks_per_row=np.array([len(blocks)]))
    group = SimpleNamespace(layer_names=list(context), kv_cache_spec=SimpleNamespace(block_size=block_size))
    sampling = SimpleNamespace(extra_args=extra, seed=None)
    return SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config={}, cache_config=SimpleNamespace(enable_prefix_caching=False)),
        compilation_config=SimpleNamespace(static_forward_context=context),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[group]),
        requests={"a": SimpleNamespace(sampling_params=sampling, block_ids=(blocks,))},
        input_batch=SimpleNamespace(req_id_to_index={"a": 0}, block_table=SimpleNamespace(block_tables=[table])),
    )


@pytest.mark.parametrize(
    ("budget", "window", "block_size", "prompt", "pin"),
    [(64, 16, 16, 20, False), (100, 24, 32, 20, False), (48, 16, 16, 40, True)],
    ids=["on-blocks", "budget-off-blocks", "pinned-prompt-off-blocks"],
)
def test_after_an_eviction_the_worker_holds_the_blocks_the_scheduler_kept(budget, window, block_size, prompt, pin):
    """The scheduler plans an eviction (`plan` cuts its block list, `free_tail`) and the worker carries out the
    shipped order on the same blocks: its copies of the block list (the request's state and its batch row) then
    hold exactly the scheduler's blocks, `ceil((pinned + budget) / block_size)` of them, the row zeroed past
    them. One block fewer and vLLM's next appends land a block early; one more and they land after a block the
    pool has given to another request."""
    extra = {"vasepatch_budget": budget, "vasepatch_window": window, "vasepatch_prefill": "pin" if pin else "compress"}
    held = (prompt if pin else 0) + budget + window  # due: it holds budget + window past its pinned prompt
    blocks = list(range(3, 3 + -(-held // block_size)))
    req = _request("a", prompt, extra)
    scheduler, manager = _scheduler([req], block_size)
    manager.req_to_blocks = {"a": list(blocks)}
    _decode(req, held)
    step = scheduler_side.finish(scheduler, scheduler_side.plan(scheduler))
    assert set(step.orders) == {"a"}
    runner = _worker_runner(list(blocks), extra, block_size)
    worker = WorkerEviction()
    worker.settings_of(runner, "a")
    worker.rings.plan(["a"], [0], [window], [held - window])  # the window's queries, as the attention records them
    for layer in runner.compilation_config.static_forward_context:
        worker.record(layer, torch.randn(window, 2, 16), window)
    worker.before_update(runner, SimpleNamespace(vasepatch_step=step, preempted_req_ids=set()))
    kept = -(-((prompt if pin else 0) + budget) // block_size)
    assert manager.req_to_blocks["a"] == blocks[:kept]
    assert runner.requests["a"].block_ids[0] == blocks[:kept]
    table = runner.input_batch.block_table.block_tables[0]
    assert table.num_blocks_per_row[0] == kept
    assert table.block_table.np[0, :kept].tolist() == blocks[:kept] and not table.block_table.np[0, kept:].any()
    assert worker.evictions == 1


def test_every_discarded_sample_is_undone_the_last_batch_row_included():
    """A step whose sampled tokens vLLM discards for some rows (prompt chunks that are not the prompt's last):
    every such row's seeded CPU generator is put back as it was before the step sampled, the batch's last row
    included; a row that keeps its token keeps its draw; an unseeded row has nothing to put back. The same rows
    are out of vLLM's sight while its bookkeeping would rewind them by an offset (CPU generators have none)."""
    rows = 4  # rows 1 and 3 (the last) discard their sample; row 2 is unseeded; the mask's padding is not a row
    generators = {i: torch.Generator().manual_seed(100 + i) for i in (0, 1, 3)}
    batch = SimpleNamespace(num_reqs=rows, generators=generators)
    runner = SimpleNamespace(
        input_batch=batch, discard_request_mask=SimpleNamespace(np=np.array([False, True, True, True, True]))
    )
    before = {i: g.get_state() for i, g in generators.items()}
    with engine_access.discarded_samples_undone(runner) as undone:
        for generator in generators.values():
            torch.rand(8, generator=generator)  # the step's sampling draws from every seeded row
    assert [i for i in (1, 3) if not torch.equal(generators[i].get_state(), before[i])] == []  # none left advanced
    assert undone == 2
    assert not torch.equal(generators[0].get_state(), before[0])
    assert sorted(engine_access.discarded_generators(runner)) == [1, 3]
    with engine_access.generators_hidden(runner, list(engine_access.discarded_generators(runner))):
        assert sorted(batch.generators) == [0]
    assert sorted(batch.generators) == [0, 1, 3]


# --- found by the mutation check (issue 40) --------------------------------------------------------------------


def test_a_request_preempted_after_an_eviction_carried_out_counts_it(caplog):
    req = _request("a", 10, {"vasepatch_budget": 40, "vasepatch_window": 8})
    scheduler, _ = _scheduler([req])
    _decode(req, 48)
    scheduler_side.finish(scheduler, scheduler_side.plan(scheduler))  # evicted once, and carried out
    with caplog.at_level(logging.INFO, logger="vllm.vasepatch"):
        scheduler_side.preempted(req)
    lines = [r.getMessage() for r in caplog.records if "preempted after" in r.getMessage()]
    assert len(lines) == 1 and "request a preempted after 1 evictions (8 positions dropped)" in lines[0]


def test_the_worker_resolves_a_requests_settings_with_the_engines_prefix_caching():
    """With prefix caching on, a request that names no prefill mode pins its prompt, on the worker as on the
    scheduler (`settings.default_prefill`)."""
    runner = _worker_runner([3, 4], {"vasepatch_budget": 64, "vasepatch_window": 16}, 16)
    runner.vllm_config.cache_config.enable_prefix_caching = True
    assert WorkerEviction().settings_of(runner, "a").config.prefill == "pin"


def _one_eviction(worker: WorkerEviction) -> WorkerEviction:
    """One request (budget 64, window 16, blocks of 16) due, planned by the scheduler and carried out by `worker`."""
    budget, window, bs = 64, 16, 16
    extra = {"vasepatch_budget": budget, "vasepatch_window": window}
    held = budget + window
    blocks = list(range(3, 3 + -(-held // bs)))
    req = _request("a", 20, extra)
    scheduler, manager = _scheduler([req], bs)
    manager.req_to_blocks = {"a": list(blocks)}
    _decode(req, held)
    step = scheduler_side.finish(scheduler, scheduler_side.plan(scheduler))
    runner = _worker_runner(list(blocks), extra, bs)
    worker.settings_of(runner, "a")
    worker.rings.plan(["a"], [0], [window], [held - window])
    for layer in runner.compilation_config.static_forward_context:
        worker.record(layer, torch.randn(window, 2, 16), window)
    worker.before_update(runner, SimpleNamespace(vasepatch_step=step, preempted_req_ids=set()))
    return worker


def test_a_request_that_does_not_stack_is_evicted_alone(monkeypatch):
    monkeypatch.setattr(compaction, "stack_key", lambda *args: None)  # as for a user's policy
    worker = _one_eviction(WorkerEviction())
    assert (worker.evictions, worker.eviction_calls) == (1, 1)


def test_a_request_due_alone_is_evicted_in_one_call_for_all_its_layers(monkeypatch):
    """One stackable request due at a step goes through `compact_stacked`: all layers in one policy call, which
    keeps what `compact` keeps a layer at a time (`test_a_large_group_is_stacked_in_chunks_that_keep_the_same`
    checks it for a chunk of one request)."""
    calls = []
    stacked = compaction.compact_stacked
    monkeypatch.setattr(compaction, "compact", lambda *a, **k: calls.append("by layer"))
    monkeypatch.setattr(compaction, "compact_stacked", lambda *a, **k: calls.append("stacked") or stacked(*a, **k))
    worker = _one_eviction(WorkerEviction())
    assert calls == ["stacked"] and (worker.evictions, worker.eviction_calls) == (1, 1)


def test_a_request_too_large_to_stack_is_evicted_a_layer_at_a_time(monkeypatch):
    """A request that reads more than `STACK_BYTES` in all its layers goes a layer at a time (`compact`), so that
    the temporaries of its eviction stay those of one layer."""
    calls = []
    by_layer = compaction.compact
    monkeypatch.setattr(compaction, "STACK_BYTES", 1024)
    monkeypatch.setattr(compaction, "compact", lambda *a, **k: calls.append("by layer") or by_layer(*a, **k))
    monkeypatch.setattr(compaction, "compact_stacked", lambda *a, **k: calls.append("stacked"))
    worker = _one_eviction(WorkerEviction())
    assert calls == ["by layer"] and (worker.evictions, worker.eviction_calls) == (1, 1)


def test_a_steps_eviction_seconds_add_up_per_policy():
    worker = WorkerEviction()
    worker.eviction_seconds = {"vase": 5.0}  # an earlier group of this step
    _one_eviction(worker)
    assert worker.eviction_seconds["vase"] > 5.0


def test_a_stacked_eviction_reads_the_runners_cache_layout(monkeypatch):
    """The stacked call gets the layout the runner's cache is in (`amx` differs from `vec` and `vec16`)."""
    caches, dues, configs, _, _ = _stack_case("vase", torch.float32, pins=False)
    seen = []

    def stacked(caches, chunk, config, policy, head_offset=0, isa="vec", kv_heads=0):
        seen.append(isa)
        return [torch.zeros(0)] * len(chunk)

    monkeypatch.setattr(compaction, "compact_stacked", stacked)
    state = SimpleNamespace(config=configs[0], policy=policies.for_config(configs[0]))
    WorkerEviction()._compact(caches, "amx", dues, state, alone=False)
    assert seen == ["amx"]


class _Worker:
    """A stand-in for the worker's `WorkerEviction`: records what the wraps hand it."""

    def __init__(self, rank, heads, kv_heads):
        self.seen, self.generators_restored = [], 0
        self.rings = SimpleNamespace(clear_plan=lambda: None)

    def before_update(self, runner, scheduler_output):
        self.seen.append(("before_update", scheduler_output))

    def after_prepare(self, runner, num_scheduled_tokens):
        self.seen.append(("after_prepare", num_scheduled_tokens))

    def removed(self, req_id):
        self.seen.append(("removed", req_id))

    def record(self, layer, query, num_tokens):
        self.seen.append(("record", layer, num_tokens))

    def report(self):
        return "report"


def _fake_runner_modules(monkeypatch, calls):
    """vLLM's model runner, CPU attention and scheduler classes, faked: each records the arguments it gets."""

    def method(name):
        return lambda self, *args, **kwargs: calls.append((name, args, kwargs)) or name

    runner = type("GPUModelRunner", (), {n: method(n) for n in ("_update_states", "_prepare_inputs", "_sample",
                  "_on_request_state_removed", "_bookkeeping_sync", "execute_model", "sample_tokens")})  # fmt: skip
    runner.model_config = SimpleNamespace(get_num_kv_heads=lambda parallel: 2, get_total_num_kv_heads=lambda: 4)
    runner.parallel_config = None
    attention = type("CPUAttentionBackendImpl", (), {"forward": method("forward")})
    scheduler = type("Scheduler", (), {"update_from_output": method("update_from_output")})
    found = {"vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": runner},
             "vllm.v1.attention.backends.cpu_attn": {"CPUAttentionBackendImpl": attention},
             "vllm.v1.core.sched.scheduler": {"Scheduler": scheduler},
             "vllm.distributed": {"get_tensor_model_parallel_rank": lambda: 0}}  # fmt: skip
    for name, attrs in found.items():
        module = types.ModuleType(name)
        vars(module).update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(patches, "WorkerEviction", _Worker)
    monkeypatch.setattr(engine_access, "add_stats_field", lambda name: None)
    monkeypatch.setattr(engine_access, "with_report", lambda output, attr, report: (output, report()))
    monkeypatch.setattr(patches, "_CURRENT", None)
    monkeypatch.setattr(patches, "_INSTALLED", [])  # the process's own wraps (vLLM's, if any) stay as they are
    monkeypatch.setattr(patches, "_INACTIVE", [])
    return runner, attention, scheduler


def test_the_workers_wraps_hand_every_argument_on_and_keep_one_worker_state(monkeypatch):
    """Each wrap of the model runner and the CPU attention calls vLLM's function with all its arguments (by
    position and by keyword), and every wrap of one runner talks to the same worker state."""
    calls = []
    runner_class, attention_class, _ = _fake_runner_modules(monkeypatch, calls)
    try:
        patches._patch_runner()
        patches._patch_metrics()
        runner = runner_class()
        assert runner._update_states("out", 1, k=2) == "_update_states"
        assert runner._prepare_inputs("out", "tokens", k=3) == "_prepare_inputs"
        runner._on_request_state_removed("r", "state", k=4)
        meta = SimpleNamespace(num_actual_tokens=5)
        layer = SimpleNamespace(layer_name="l0")
        attention_class().forward(layer, "q", "k", "v", "cache", meta, k=6)
        assert runner.sample_tokens("grammar", k=7) == ("sample_tokens", "report")
        assert runner.execute_model("out", "tensors", k=8) == ("execute_model", "report")
    finally:
        patches.uninstall()  # the fakes' wraps only
    assert calls == [
        ("_update_states", ("out", 1), {"k": 2}),
        ("_prepare_inputs", ("out", "tokens"), {"k": 3}),
        ("_on_request_state_removed", ("r", "state"), {"k": 4}),
        ("forward", (layer, "q", "k", "v", "cache", meta), {"k": 6}),
        ("sample_tokens", ("grammar",), {"k": 7}),
        ("execute_model", ("out", "tensors"), {"k": 8}),
    ]
    seen = [("before_update", "out"), ("after_prepare", "tokens"), ("removed", "r"), ("record", "l0", 5)]
    assert runner.vasepatch.seen == seen


def test_the_schedulers_output_wrap_hands_the_states_taken_before_the_update_to_after_it(monkeypatch):
    calls, seen = [], []
    _, _, scheduler_class = _fake_runner_modules(monkeypatch, calls)
    monkeypatch.setattr(metrics, "before_update", lambda scheduler, output: {"a": "state"})
    monkeypatch.setattr(metrics, "after_update", lambda scheduler, outputs, states: seen.append((outputs, states)))
    try:
        patches._patch_metrics()
        assert scheduler_class().update_from_output("sched", "runner_out", k=1) == "update_from_output"
    finally:
        patches.uninstall()  # the fakes' wraps only
    assert calls == [("update_from_output", ("sched", "runner_out"), {"k": 1})]
    assert seen == [("update_from_output", {"a": "state"})]


def test_the_worker_makes_the_batch_physical_only_where_a_request_has_dropped_positions(monkeypatch):
    made = []
    monkeypatch.setattr(engine_access, "make_physical", lambda runner, dropped, tokens: made.append(list(dropped)))
    runner = _worker_runner([3, 4, 5], {"vasepatch_budget": 64, "vasepatch_window": 16}, 16)
    runner.input_batch.req_ids, runner.input_batch.num_reqs = ["a"], 1
    runner.input_batch.num_computed_tokens_cpu = np.array([70])
    runner.query_start_loc = SimpleNamespace(np=np.array([0, 1]))
    worker = WorkerEviction()
    worker.after_prepare(runner, np.array([1]))  # nothing dropped yet: the batch stays as vLLM made it
    worker.dropped = {"a": 16}
    worker.after_prepare(runner, np.array([1]))
    assert made == [[16]]
