"""One eviction of one vLLM request: score, choose, gather to the front of its own blocks (pure tensors).

The request holds `n` slots in every layer; all layers keep the same count (`budget`: vLLM gives a
request one length), each layer and KV head its own tokens. The choice is `vasepatch.cache.eviction
.kept_slots`, the one the transformers cache makes: the last `window` slots are kept, `budget - window`
of the older ones are chosen by the policy from the window's queries, and the kept slots are gathered
in sequence order to slots `0..budget-1`.

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


def candidate_positions(kept: torch.Tensor | None, layers: int, heads: int, n: int, dropped: int) -> torch.Tensor:
    """`[layers, heads, n]` int64: the sequence position of each slot. Slots past the last eviction's
    `budget` (or all, before the first) hold position `dropped + slot`; the first `budget` hold `kept`."""
    positions = torch.arange(dropped, dropped + n, dtype=torch.int64).expand(layers, heads, n).clone()
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
) -> torch.Tensor:
    """Evict one request down to `config.budget` slots in every layer (its eviction round `rounds`, 0-based);
    returns the kept positions `[layers, kv_heads, budget]`.

    `caches`: the layers' paged caches (`paged_layout`); `blocks`: the request's block ids (int64,
    at least `ceil(n / block_size)`); `queries`: `[layers, q_heads, window, head_size]`, the last
    `window` queries of each layer after RoPE (any order: the scores average over them); `positions`:
    `[layers, kv_heads, n]` (`candidate_positions`); `head_offset`: the global index of this rank's
    first KV head."""
    kept_positions = []
    for layer, cache in enumerate(caches):
        keys, values = (t.unsqueeze(0) for t in paged_layout.read_slots(cache, blocks, n))
        valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        where = positions[layer : layer + 1].to(keys.device)
        generator = KeyedGenerator(config.seed, layer, rounds, head_offset, keys.device)
        kept = kept_slots(
            policy, keys, values, where, valid, queries[layer : layer + 1], n, config.budget, config.window, generator
        )
        paged_layout.write_slots(cache, blocks, gather_slots(keys, kept)[0], gather_slots(values, kept)[0])
        kept_positions.append(where.gather(-1, kept)[0])
    return torch.stack(kept_positions)
