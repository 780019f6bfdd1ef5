"""A layer's buffers across generations and failed steps: refit for a new input, undo a failed step.

(Buffers are allocated as normal tensors even under `torch.inference_mode()`:
`static.outside_inference_mode`.)

- `refit` / `check_input`: whether a step's keys fit the layer's buffers (batch, KV heads, head size,
  dtype, device); a layer reset since its last use re-allocates, a used one refuses, naming both.
- `undo_on_error` / `StepUndo`: what an eager step that fails (a `PolicyOutputError` at its eviction, an error
  in the kernel) puts back, so that the layer is as it was before the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _kind(t: torch.Tensor) -> str:
    return f"batch of {t.shape[0]}, {t.shape[1]} KV heads of size {t.shape[-1]}, {t.dtype} on {t.device}"


def check_input(keys: torch.Tensor, key_states: torch.Tensor, tokens_seen: int, index: int) -> bool:
    """Whether the buffers (`keys`, `[B, Hkv, S, D]`) must be re-allocated for a step's
    `key_states` (`[B, Hkv, Q, D]`): False if they fit; True if they do not and the layer holds
    nothing (`tokens_seen == 0`: fresh, or `reset`); a ValueError naming both if it is in use."""
    same = keys.shape[:2] == key_states.shape[:2] and keys.shape[-1] == key_states.shape[-1]
    if same and keys.dtype == key_states.dtype and keys.device == key_states.device:
        return False
    if tokens_seen == 0:
        return True
    raise ValueError(
        f"this VaSECache holds {tokens_seen} tokens of a previous generation ({_kind(keys)} in layer {index}), and "
        f"the model now gives a {_kind(key_states)}; call cache.reset() first (it then re-allocates for the new "
        "input) or make a new cache with handle.new_cache()"
    )


def refit(layer: Any, key_states: torch.Tensor) -> None:
    """Eagerly, before a step writes anything: a used layer refuses keys its buffers do not fit
    (`check_input`); a layer that holds nothing drops its buffers, which the step re-allocates.
    Nothing under compilation (the compiled decode step runs on the buffers the prefill made)."""
    if torch.compiler.is_compiling() or not layer.is_initialized:
        return
    if check_input(layer.keys, key_states, layer.counters.tokens_seen, layer.plan.index):
        layer.is_initialized = False
        layer.ring.release()


class StepUndo:
    """Puts a layer back as it was before an eager step whose attention, query recording or
    eviction failed: its device counters, the slots the step wrote, and the query ring (saved
    only for a step that evicts, since only those can fail after writing it)."""

    def __init__(self, layer: Any, step: Any, evicts: bool) -> None:
        self.layer, self.step = layer, step
        self.ring = layer.ring.save(step.q_len) if evicts else False

    def restore(self) -> None:
        layer, step = self.layer, self.step
        c = layer.counters  # the host counters change only once a step has succeeded
        layer.seen.fill_(c.tokens_seen)
        layer.fill.fill_(c.occupancy)
        layer.next_position.sub_(step.new_valid.sum(-1))
        if not step.overflow:  # the step's tokens were written after the occupied slots
            layer.valid[:, :, c.occupancy : c.occupancy + step.q_len] = False
            layer.positions[:, :, c.occupancy : c.occupancy + step.q_len] = -1
        if self.ring is not False:
            layer.ring.restore(self.ring)


@contextmanager
def undo_on_error(layer: Any, step: Any) -> Iterator[None]:
    """Around the rest of an eager step (attend, record the queries, evict): on an error, put
    the layer back as it was before the step (`StepUndo`), then raise it."""
    undo = StepUndo(layer, step, step.overflow or layer.due(step.q_len))
    try:
        yield
    except BaseException:
        undo.restore()
        raise
