"""When a layer evicts: pure functions of host-side ints.

No tensors and no device syncs: the number of tokens each step appends is known
from input shapes, so every decision here is made on the host, before or after
the step's kernels run, and never depends on data.

Terms (per row and KV head): `budget` slots survive an eviction; the last
`window` tokens are always kept and their queries score the others; `capacity`
is the number of slots allocated; `occupancy` the number in use.
"""

from __future__ import annotations

import sys

KEEP = "keep"  # prefill mode: the whole prompt stays in the buffer (the paper's setting)
PIN = "pin"  # prefill mode: the prompt stays where it is, never evicted; `budget` counts generated tokens only
SIZED_BY_PROMPT = (KEEP, PIN)  # the modes whose buffer the first step (the prompt) sizes
NEVER = sys.maxsize  # tokens until the next eviction of a cache that never evicts


def capacity(budget: int, window: int, prompt_len: int, prefill: str) -> int:
    """Slots to allocate at the first step: `budget + window`; with `prefill="keep"` room for
    the whole prompt plus one window, `max(prompt_len, budget) + window`; with `"pin"` the
    prompt plus `budget + window` generated tokens."""
    if prefill == KEEP:
        return max(prompt_len, budget) + window
    if prefill == PIN:
        return prompt_len + budget + window
    return budget + window


def pinned(prefill: str, prompt_len: int) -> int:
    """Leading slots that no eviction touches: the prompt with `prefill="pin"`, else none.
    The schedule of a pinned layer is the one below with `pinned + budget` as its budget."""
    return prompt_len if prefill == PIN else 0


def fits(capacity: int, occupancy: int, q_len: int) -> bool:
    """Whether a step of `q_len` tokens can be written into the buffer as it is."""
    return occupancy + q_len <= capacity


def evict_now(budget: int, window: int, capacity: int, occupancy: int, *, first_step: bool, prefill: str) -> bool:
    """Whether the step that just brought the layer to `occupancy` ends with an eviction.

    - Never at or under the budget.
    - After the first step (the prompt): with `prefill="compress"` a prompt over the
      budget is brought down to it at once; with `"keep"` it stays whole. (`"pin"` passes
      `pinned + budget` as the budget: its prompt is never over it.)
    - Otherwise once every `window` tokens past the budget, and whenever the buffer is full.
    """
    over = occupancy - budget
    if over <= 0:
        return False
    if first_step:
        return prefill != KEEP
    return over % window == 0 or occupancy >= capacity


def tokens_until_eviction(budget: int, window: int, capacity: int, occupancy: int) -> int:
    """How many tokens can be appended before the next eviction, counting the token whose
    step evicts. Feeding exactly this many in one step evicts at the same point as
    one-token decode steps do."""
    nxt = max(occupancy + 1, budget + 1)
    nxt += -(nxt - budget) % window  # the next multiple of `window` past the budget
    return min(nxt, capacity) - occupancy


def room(
    capacity: int, occupancy: int, q_len: int, window: int, *, evicts: bool, sized_by_prompt: bool, prompt_need: int
) -> tuple[int, bool]:
    """Before a step moves anything: the capacity the buffer needs for it (more than `capacity` to grow)
    and whether the step takes the overflow path (its tokens in temporaries, compacted at its end).

    - A prompt into a buffer sized by the prompt (`sized_by_prompt`, first step; `prompt_need` > 0):
      room for it plus one window (after a `reset` that may be more than the buffer holds).
    - A step that fits: as it is.
    - A never-evicting buffer grows `window` slots past the need: a reallocation every `window` tokens.
    - An evicting one overflows, unless it is sized by the prompt, which refuses (`keep_overflow_error`).
    """
    if prompt_need:
        return max(capacity, prompt_need), False
    if fits(capacity, occupancy, q_len):
        return capacity, False
    if not evicts:
        return occupancy + q_len + window, False
    if not sized_by_prompt:
        return capacity, True
    raise keep_overflow_error(occupancy, q_len, capacity)


def keep_overflow_error(occupancy: int, q_len: int, capacity: int) -> RuntimeError:
    """The error for a step that a `prefill="keep"` or `"pin"` buffer cannot hold."""
    return RuntimeError(
        f"vasepatch cache overflow: {occupancy} slots in use + {q_len} new tokens > capacity {capacity}. "
        "With prefill='keep' or 'pin' the buffer is sized by the first step; feed later multi-token steps at most "
        "tokens_until_eviction() tokens at a time, or use prefill='compress', which compresses any step "
        "that does not fit (e.g. prefill_chunk_size chunks)"
    )
