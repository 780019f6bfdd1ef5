"""Teacher forcing through several caches at once, in chunks aligned with evictions.

A cache only evicts after the step that reaches its trigger, so feeding the
tokens between two triggers as one multi-token step computes the same logits as
feeding them one decode step at a time (up to float rounding), in a fraction of
the time. All evicting caches of one budget and window share their trigger
points, so they can be driven in lockstep with a never-evicting `full` cache
that provides the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vasepatch.cache import VaSECache


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded prompt, as `generate()` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


@torch.no_grad()
def teacher_force(
    model: torch.nn.Module,
    cache_keyword: str,
    caches: dict[str, VaSECache],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    continuation: torch.Tensor,
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Feed the prompt, then `continuation[:, :-1]`, through every cache.

    Yields `(start, {name: logits [B, q, V]})` where the logits predict
    `continuation[:, start:start+q]`; the first yield comes from the prefill
    (`q = 1`). Chunks end exactly where the caches evict, so every cache sees
    what one-token decode steps would show it.
    """
    if continuation.shape[0] != input_ids.shape[0]:
        raise ValueError("continuation and input_ids need the same batch size")
    b, total = continuation.shape
    n_real = attention_mask.long().sum(-1, keepdim=True)
    mask = attention_mask
    pos = prompt_positions(attention_mask)
    logits = {}
    for name, cache in caches.items():
        out = model(
            input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_keyword: cache}
        )
        logits[name] = out.logits[:, -1:]
    yield 0, logits
    done = 1
    while done < total:
        q = min(total - done, *(c.tokens_until_eviction() for c in caches.values()))
        chunk = continuation[:, done - 1 : done - 1 + q]
        mask = torch.cat([mask, mask.new_ones((b, q))], dim=-1)
        pos = n_real + torch.arange(done - 1, done - 1 + q, device=n_real.device)
        logits = {}
        for name, cache in caches.items():
            out = model(
                input_ids=chunk, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_keyword: cache}
            )
            logits[name] = out.logits
        yield done, logits
        done += q
