"""Which slots an eviction keeps, and in what order (a pure function of tensors)."""

from __future__ import annotations

import torch

from vasepatch.policies import base
from vasepatch.policies.base import Policy
from vasepatch.policies.keyed import KeyedGenerator


def kept_slots(
    policy: Policy,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    queries: torch.Tensor,
    n: int,
    budget: int,
    window: int,
    generator: torch.Generator | KeyedGenerator | None = None,
) -> torch.Tensor:
    """`[B, Hkv, budget]` indices into the first `n` slots: `budget - window` of the older
    `n - window` chosen by `policy` from the `queries` `[B, Hq, W, D]`, then the last
    `window` (always kept).

    Order: kept padding first, then real tokens in slot (= sequence) order, then the
    window, so that once gathered to the front each row's attendable slots form one
    contiguous range ending at the fill pointer.

    The picks are checked here, where every policy's pass (`base.check_picks`: shape, dtype,
    and unless `policy.check_output` is False, range, duplicates and padding kept over real
    tokens), before anything is written. Eviction runs eagerly, after a compiled forward
    (`VaSELayer.complete_step`), so the check's one host sync never enters a compiled graph;
    should this ever be traced, only the metadata checks run.
    """
    n_cand = n - window
    cand_valid = valid[:, :, :n_cand]
    idx = policy.select(
        keys[:, :, :n_cand],
        values[:, :, :n_cand],
        queries,
        positions[:, :, :n_cand],
        cand_valid,
        budget - window,
        generator=generator,
    )
    data = getattr(policy, "check_output", True) and not torch.compiler.is_compiling()
    base.check_picks(getattr(policy, "name", type(policy).__name__), idx, cand_valid, budget - window, data=data)
    kept_valid = cand_valid.gather(-1, idx)
    idx = idx.gather(-1, torch.argsort(idx + n_cand * kept_valid.long(), dim=-1))
    recent = torch.arange(n_cand, n, device=idx.device).expand(*idx.shape[:2], window)
    return torch.cat([idx, recent], dim=-1)


def write_kept(
    buffers: tuple[torch.Tensor, ...], sources: tuple[torch.Tensor, ...], kept: torch.Tensor, start: int, n: int
) -> int:
    """Gather the `kept` slots (`[B, H, K]`, indices into `sources`) of `sources` (keys, values, positions,
    valid) into slots `start..start+K-1` of `buffers` (the same four, may be the same tensors), and free slots
    `start+K..n-1` (invalid, position -1). Returns `start + K`, the new fill."""
    keys, values, positions, valid = buffers
    src_keys, src_values, src_positions, src_valid = sources
    end = start + kept.shape[-1]
    keys[:, :, start:end] = gather_slots(src_keys, kept)
    values[:, :, start:end] = gather_slots(src_values, kept)
    valid[:, :, start:end] = src_valid.gather(2, kept)
    positions[:, :, start:end] = src_positions.gather(2, kept).masked_fill_(~valid[:, :, start:end], -1)
    valid[:, :, end:n] = False
    positions[:, :, end:n] = -1
    return end


def gather_slots(src: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`[B, H, K, D]`: `src[b, h, kept[b, h, k]]` for `src` `[B, H, S, D]` and `kept` `[B, H, K]`, what
    `src.gather(2, kept[..., None].expand(..., D))` returns, as one `index_select` of whole rows of
    the flattened slots (no index per element: 3-6x faster on CPU)."""
    b, h, s, d = src.shape
    base = torch.arange(0, b * h * s, s, device=kept.device).view(b, h, 1)
    return src.reshape(b * h * s, d).index_select(0, (kept + base).view(-1)).view(b, h, -1, d)
