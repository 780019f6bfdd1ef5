"""Hypothesis strategies: random shapes, budgets, paddings and value distributions.

Tensors are generated from a drawn seed (fast), while everything structural
(shapes, settings, padding, the kind of value distribution) is drawn by
hypothesis so that it can shrink failures.

Most examples are drawn where a policy really chooses (`0 < n_keep <` the valid
candidates of some row; caches that evict more than once), and a tenth at the edges
(nothing to keep, everything kept, no valid candidate, no eviction): with uniform draws
only 20% of the policy examples and 55% of the cache examples chose anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from tests.query_stats_files import options_for

VALUE_KINDS = ("normal", "outliers", "constant", "tiny")


def make_values(shape, kind: str, g: torch.Generator) -> torch.Tensor:
    v = torch.randn(shape, generator=g)
    if kind == "outliers":  # a few value vectors with an abnormally large range
        big = torch.rand(shape[:-1], generator=g) < 0.1
        v = torch.where(big.unsqueeze(-1), v * 50, v)
    elif kind == "constant":  # every range equal: ties everywhere
        v = torch.ones(shape)
    elif kind == "tiny":
        v = v * 1e-6
    return v


@dataclass
class PolicyCase:
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    n_keep: int
    protect: int
    sinks: int
    temperature: float
    smooth: int
    seed: int


@st.composite
def policy_cases(draw, kv_heads: st.SearchStrategy[int] | None = None, same_layout: bool = False) -> PolicyCase:
    """A policy input. `kv_heads`: the strategy of the KV head count (default 1 to 3);
    `same_layout`: every KV head has the same padding (as in a head-shared cache)."""
    b = draw(st.integers(1, 3))
    h = draw(kv_heads if kv_heads is not None else st.integers(1, 3))
    g_size = draw(st.integers(1, 3))
    edge = draw(st.integers(0, 9)) == 0  # a tenth of the examples: any sizes and layouts
    n = draw(st.integers(1, 40) if edge else st.integers(4, 40))
    d, w = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(VALUE_KINDS))
    layouts = ["left_padding", "random_holes", "all_valid"] + (["none_valid"] if edge else [])
    layout = draw(st.sampled_from(layouts))
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, n, d, generator=g) * draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
    values = make_values((b, h, n, d), kind, g)
    queries = torch.randn(b, h * g_size, w, d, generator=g)
    if layout == "left_padding":
        pad = torch.randint(0, n + 1, (b, 1, 1), generator=g)
        valid = (torch.arange(n).view(1, 1, n) >= pad).expand(b, h, n).clone()
    elif layout == "random_holes":
        valid = torch.rand(b, 1 if same_layout else h, n, generator=g).expand(b, h, n) > 0.3
    elif layout == "all_valid":
        valid = torch.ones(b, h, n, dtype=torch.bool)
    else:
        valid = torch.zeros(b, h, n, dtype=torch.bool)
    # positions: increasing over real tokens (as after compaction), shuffled start offsets
    offset = torch.randint(0, 3, (b, 1 if same_layout else h, 1), generator=g)
    positions = valid.long().cumsum(-1) - 1 + offset * valid.long()
    positions = positions.masked_fill(~valid, -1)
    most_valid = int(valid.sum(-1).max())
    edge = edge or most_valid < 2
    n_keep = draw(st.integers(0, n) if edge else st.integers(1, most_valid - 1))  # a real choice unless `edge`
    sinks = draw(st.integers(0, 6))
    protect = draw(st.integers(min(sinks, n_keep), max(n_keep, min(sinks, n_keep))))
    temperature = draw(st.sampled_from([0.5, 1.0, 2.0]))
    smooth = draw(st.sampled_from([1, 3, 5, 7]))  # odd: the average pool is centred on each candidate
    return PolicyCase(keys, values, queries, positions, valid, n_keep, protect, sinks, temperature, smooth, seed)


@dataclass
class CacheCase:
    batch: int
    kv_heads: int
    groups: int
    head_dim: int
    budget: int
    window: int
    protect: int
    sinks: int
    prompt_lengths: list[int]
    decode_steps: int
    value_kind: str
    seed: int
    sample: bool
    policy: str
    prefill: str  # "compress" (default), "keep" or "pin"
    chunk: int | None  # prefill chunk size (None: the whole prompt in one step); compress only


def policy_options(name: str, case: PolicyCase, layers: int = 1) -> dict:
    """The options policy `name` needs for `case` beyond the common ones: a statistics file of the case's
    shapes (`layers` layers) for a policy with a `stats` option (`tests.query_stats_files`), none for any other."""
    _, q_heads, _, head_dim = case.queries.shape
    kv_heads = case.keys.shape[1]
    return options_for(name, layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)


def cache_policy_options(name: str, case: CacheCase) -> dict:
    """`policy_options` for a one-layer cache of `case`'s shapes (as `policy_options` for a policy case)."""
    q_heads = case.kv_heads * case.groups
    return options_for(name, layers=1, q_heads=q_heads, kv_heads=case.kv_heads, head_dim=case.head_dim)


def evicting_policies() -> list[str]:
    """Every registered policy (all of them evict: never evicting is the cache's `full` mode)."""
    from vasepatch import policies

    return policies.available()


@st.composite
def cache_cases(draw, max_budget: int = 24) -> CacheCase:
    budget = draw(st.integers(3, max_budget))
    window = draw(st.integers(1, budget - 1))
    sinks = draw(st.integers(0, min(4, budget - window)))
    protect = draw(st.integers(sinks, budget - window))
    batch = draw(st.integers(1, 3))
    width = draw(st.integers(1, 2 * budget + 2 * window))  # up to twice the buffer
    prompt_lengths = [width] + [draw(st.integers(1, width)) for _ in range(batch - 1)]
    return CacheCase(
        batch=batch,
        kv_heads=draw(st.integers(1, 2)),
        groups=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([1, 4, 8])),
        budget=budget,
        window=window,
        protect=protect,
        sinks=sinks,
        prompt_lengths=draw(st.permutations(prompt_lengths)),
        decode_steps=draw(
            st.integers(0, 3 * budget)  # a tenth: any length, no eviction included
            if draw(st.integers(0, 9)) == 0
            else st.integers(budget + 2 * window, 3 * budget + 2 * window)  # evicts at least twice
        ),
        value_kind=draw(st.sampled_from(VALUE_KINDS)),
        seed=draw(st.integers(0, 2**31 - 1)),
        sample=draw(st.booleans()),
        policy=draw(st.sampled_from(evicting_policies())),
        prefill=(prefill := draw(st.sampled_from(["compress", "keep", "pin"]))),
        chunk=None if prefill != "compress" else draw(st.none() | st.integers(1, width)),
    )
