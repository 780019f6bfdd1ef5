"""One eviction of one vLLM request: score, choose, gather to the front of its own blocks (pure tensors).

The request holds `n` slots in every layer; all layers keep the same count (`budget`: vLLM gives a
request one length), each layer and KV head its own tokens. With `prefill="pin"` the prompt's `pinned`
slots are left out: the candidates are the slots after them, and the kept ones are gathered to just after
them. The choice is `vasepatch.policies.base.kept_slots`, the
one the transformers cache makes: the last `window` slots are kept, `budget - window`
of the older ones are chosen by the policy from the window's queries, and the kept slots are gathered
in sequence order to slots `pinned..pinned+budget-1`.

`compact_stacked` evicts several requests that are due at one step in one policy call: every (request,
layer) is a row of one stacked batch, with its own key (`StackedKeyedGenerator`), read and written with
one `index_select` and one `index_copy_` per layer. It keeps exactly what `compact` keeps for each
request (the plugin's tests compare the bytes for every policy); requests stack when `stack_key` says
they can, in `chunks` of at most `STACK_BYTES` read.

The randomness is the transformers cache's: a `KeyedGenerator` of `(seed, layer, eviction round)` and
the global KV head, the request being row 0, so a request evicts exactly as `vasepatch.patch` evicts a
batch of one with the same seed, and its kept sets depend on nothing else: not on the other requests
in vLLM's batch, nor on how tensor parallelism shards the heads.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from vasepatch.cache.paged_positions import candidate_positions as candidate_positions  # the plugin names it here
from vasepatch.cache.slots import gather_slots
from vasepatch.config import VaSEConfig
from vasepatch.policies import Policy
from vasepatch.policies.base import head_ids, kept_slots
from vasepatch.policies.keyed import KeyedGenerator, StackedKeyedGenerator, marked_keyed
from vasepatch.vllm import paged_layout

STACK_BYTES = 64 * 2**20  # keys and values one stacked call reads, at most (a larger group is chunked)


def compact(
    caches: Sequence[torch.Tensor],
    blocks: torch.Tensor,
    n: int,
    queries: torch.Tensor,
    positions: torch.Tensor,
    config: VaSEConfig,
    policy: Policy,
    rounds: int,
    head_offset: int = 0,
    pinned: int = 0,
    isa: str = "vec",
    kv_heads: int = 0,
) -> torch.Tensor:
    """Evict one request down to `pinned + config.budget` slots in every layer (its eviction round `rounds`,
    0-based); returns the kept positions `[layers, kv_heads, budget]`.

    `caches`: the layers' paged caches (`paged_layout`); `blocks`: the request's block ids (int64,
    at least `ceil(n / block_size)`); `queries`: `[layers, q_heads, window, head_size]`, the last
    `window` queries of each layer after RoPE (any order: the scores average over them); `positions`:
    `[layers, kv_heads, n - pinned]` (`candidate_positions`); `head_offset`: the global index of this rank's
    first KV head; `pinned`: leading slots that stay as they are (a pinned prompt). No block that holds
    only pinned slots is read or written: the prompt's full blocks may be the prefix cache's, shared by
    other requests. The pinned slots of the block where the candidates start are written back unchanged.
    `isa`: the caches' layout (`paged_layout.SUPPORTED_ISAS`); `kv_heads`: the model's KV heads per layer over
    all ranks, for the policies' `head_ids` (0: this rank's, all of them without tensor parallelism)."""
    block_size = caches[0].shape[2]
    first = pinned // block_size  # the first block compaction writes
    fixed = pinned - first * block_size  # pinned slots in it, written back as they were
    tail = blocks[first:]
    kept_positions = []
    for layer, cache in enumerate(caches):
        keys, values = (t.unsqueeze(0) for t in paged_layout.read_slots(cache, tail, n - first * block_size, isa))
        valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        where = positions[layer : layer + 1].to(keys.device)
        generator = KeyedGenerator(config.seed, layer, rounds, head_offset, keys.device)
        ids = _head_ids(policy, torch.tensor([layer], device=keys.device), keys.shape[1], head_offset, kv_heads)
        kept = kept_slots(
            policy, *(t[:, :, fixed:] for t in (keys, values)), where, valid[:, :, fixed:],
            queries[layer : layer + 1], n - pinned, config.budget, config.window, generator, ids,
        )  # fmt: skip
        order = torch.cat([torch.arange(fixed, device=kept.device).expand(*kept.shape[:2], fixed), kept + fixed], -1)
        paged_layout.write_slots(cache, tail, gather_slots(keys, order)[0], gather_slots(values, order)[0], isa)
        kept_positions.append(where.gather(-1, kept)[0])
    return torch.stack(kept_positions)


def _head_ids(policy: Policy, layers: torch.Tensor, heads: int, head_offset: int, kv_heads: int) -> torch.Tensor | None:
    """The `head_ids` of rows of `layers` for a policy that reads them (`policies.base.head_ids`), else None."""
    return head_ids(layers, heads, head_offset, kv_heads) if "head_ids" in policy.inputs else None


@dataclass(frozen=True)
class Due:
    """One request's part of a stacked eviction: its block ids, its slot count `n`, its `pinned` slots, its
    eviction round and seed, its window's queries `[layers, q_heads, window, head_size]`, and its candidates'
    positions `[layers, kv_heads, n - pinned]` (`candidate_positions`)."""

    blocks: torch.Tensor
    n: int
    pinned: int
    round: int
    seed: int
    queries: torch.Tensor
    positions: torch.Tensor


def stack_key(config: VaSEConfig, policy: Policy, due: Due, block_size: int) -> Hashable | None:
    """Requests with equal keys can be evicted by one `compact_stacked` call: the same policy (function and
    options) and pick checks, budget and window, candidate count, and pinned slots in their first written
    block. None: this one evicts alone (`compact`): a priority function that is not vasepatch's own (a user's
    policy keeps the `KeyedGenerator` it was written for), that draws from a `torch.Generator` of its own, or a
    `Policy` subclass with a `select` of its own (it may not treat the rows of a batch independently)."""
    draws_own = "generator" in policy.inputs and not marked_keyed(policy.priority)
    ours = getattr(policy.priority, "__module__", "").startswith("vasepatch.policies.")
    if draws_own or not ours or type(policy).select is not Policy.select:
        return None
    shape = (config.budget, config.window, due.n - due.pinned, due.pinned % block_size)
    return (repr(policy), id(policy.priority), policy.check_output, *shape)


def read_bytes(due: Due, caches: Sequence[torch.Tensor]) -> int:
    """The keys and values a stacked call reads for `due`: every layer's slots from its first written block on."""
    heads, block_size, two_d = caches[0].shape[1:]
    m = due.pinned % block_size + due.n - due.pinned
    return len(caches) * heads * m * two_d * caches[0].element_size()


def chunks(dues: Sequence[Due], caches: Sequence[torch.Tensor]) -> list[list[Due]]:
    """`dues` (of one `stack_key`) in runs of at most `STACK_BYTES` of keys and values read (at least one
    request each), so that a stacked call's temporaries stay bounded however many requests are due at once.
    Rows are independent: a chunk keeps what the whole group would. A request that reads more than
    `STACK_BYTES` alone is a chunk of its own, which the worker evicts a layer at a time (`compact`)."""
    size = max(1, STACK_BYTES // read_bytes(dues[0], caches))
    return [list(dues[i : i + size]) for i in range(0, len(dues), size)]


def compact_stacked(
    caches: Sequence[torch.Tensor],
    dues: Sequence[Due],
    config: VaSEConfig,
    policy: Policy,
    head_offset: int = 0,
    isa: str = "vec",
    kv_heads: int = 0,
) -> list[torch.Tensor]:
    """Evict every request of `dues` (equal `stack_key`s; `config`'s budget and window, `policy`) as `compact`
    would, in one policy call over all layers and requests; returns each one's kept positions."""
    block_size, layers, count = caches[0].shape[2], len(caches), len(dues)
    fixed, candidates = dues[0].pinned % block_size, dues[0].n - dues[0].pinned
    m = fixed + candidates  # the slots read from each request's first written block on
    nb = -(-m // block_size)
    blocks = torch.stack([d.blocks[d.pinned // block_size :][:nb] for d in dues])  # [R, nb]
    read = [paged_layout.read_slots(cache, blocks, m, isa) for cache in caches]  # per layer: [R, H, m, D] twice
    keys, values = (torch.cat([r[i] for r in read]) for i in (0, 1))  # rows (layer, request)
    where = torch.stack([d.positions for d in dues], 1).flatten(0, 1).to(keys.device)
    queries = torch.stack([d.queries for d in dues], 1).flatten(0, 1)
    generator = StackedKeyedGenerator(
        [(d.seed, layer, d.round) for layer in range(layers) for d in dues], head_offset, keys.device
    )
    valid = torch.ones(where.shape, dtype=torch.bool, device=keys.device)
    rows_layer = torch.arange(layers, device=keys.device).repeat_interleave(count)  # rows (layer, request)
    ids = _head_ids(policy, rows_layer, keys.shape[1], head_offset, kv_heads)
    kept = kept_slots(
        policy, keys[:, :, fixed:], values[:, :, fixed:], where, valid, queries,
        candidates, config.budget, config.window, generator, ids,
    )  # fmt: skip
    order = torch.cat([torch.arange(fixed, device=kept.device).expand(*kept.shape[:2], fixed), kept + fixed], -1)
    keys, values = gather_slots(keys, order), gather_slots(values, order)
    for layer, cache in enumerate(caches):
        rows = slice(layer * count, (layer + 1) * count)
        paged_layout.write_slots(cache, blocks, keys[rows], values[rows], isa)
    positions = where.gather(-1, kept).unflatten(0, (layers, count))
    return [positions[:, i] for i in range(count)]
