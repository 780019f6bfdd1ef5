"""One eviction of one vLLM request: score, choose, gather to the front of its own blocks (pure tensors).

The request holds `n` slots in every layer; all layers keep the same count (`budget`: vLLM gives a
request one length), each layer and KV head its own tokens. With `prefill="pin"` the prompt's `pinned`
slots are left out: the candidates are the slots after them, and the kept ones are gathered to just after
them. The choice is `vasepatch.cache.eviction
.kept_slots`, the one the transformers cache makes: the last `window` slots are kept, `budget - window`
of the older ones are chosen by the policy from the window's queries, and the kept slots are gathered
in sequence order to slots `pinned..pinned+budget-1`.

The randomness is the transformers cache's: a `KeyedGenerator` of `(seed, layer, eviction round)` and
the global KV head, the request being row 0, so a request evicts exactly as `vasepatch.patch` evicts a
batch of one with the same seed, and its kept sets depend on nothing else: not on the other requests
in vLLM's batch, nor on how tensor parallelism shards the heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vasepatch.cache.eviction import gather_slots, kept_slots
from vasepatch.config import VaSEConfig
from vasepatch.integration.vllm import paged_layout
from vasepatch.policies import Policy
from vasepatch.policies.keyed import KeyedGenerator


def candidate_positions(
    kept: torch.Tensor | None, layers: int, heads: int, n: int, dropped: int, pinned: int = 0
) -> torch.Tensor:
    """`[layers, heads, n - pinned]` int64: the sequence position of each candidate slot `pinned..n-1`. Slots
    past the last eviction's kept ones (or all, before the first) hold position `dropped + slot`; the
    `budget` slots after the pinned ones hold `kept`."""
    positions = torch.arange(pinned + dropped, dropped + n, dtype=torch.int64).expand(layers, heads, n - pinned)
    positions = positions.clone()
    if kept is not None and dropped > 0:
        positions[:, :, : kept.shape[-1]] = kept
    return positions


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
) -> torch.Tensor:
    """Evict one request down to `pinned + config.budget` slots in every layer (its eviction round `rounds`,
    0-based); returns the kept positions `[layers, kv_heads, budget]`.

    `caches`: the layers' paged caches (`paged_layout`); `blocks`: the request's block ids (int64,
    at least `ceil(n / block_size)`); `queries`: `[layers, q_heads, window, head_size]`, the last
    `window` queries of each layer after RoPE (any order: the scores average over them); `positions`:
    `[layers, kv_heads, n - pinned]` (`candidate_positions`); `head_offset`: the global index of this rank's
    first KV head; `pinned`: leading slots that stay as they are (a pinned prompt). No block that holds
    only pinned slots is read or written: the prompt's full blocks may be the prefix cache's, shared by
    other requests. The pinned slots of the block where the candidates start are written back unchanged."""
    block_size = caches[0].shape[2]
    first = pinned // block_size  # the first block compaction writes
    fixed = pinned - first * block_size  # pinned slots in it, written back as they were
    tail = blocks[first:]
    kept_positions = []
    for layer, cache in enumerate(caches):
        keys, values = (t.unsqueeze(0) for t in paged_layout.read_slots(cache, tail, n - first * block_size))
        valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        where = positions[layer : layer + 1].to(keys.device)
        generator = KeyedGenerator(config.seed, layer, rounds, head_offset, keys.device)
        kept = kept_slots(
            policy, *(t[:, :, fixed:] for t in (keys, values)), where, valid[:, :, fixed:],
            queries[layer : layer + 1], n - pinned, config.budget, config.window, generator,
        )  # fmt: skip
        order = torch.cat([torch.arange(fixed, device=kept.device).expand(*kept.shape[:2], fixed), kept + fixed], -1)
        paged_layout.write_slots(cache, tail, gather_slots(keys, order)[0], gather_slots(values, order)[0])
        kept_positions.append(where.gather(-1, kept)[0])
    return torch.stack(kept_positions)
