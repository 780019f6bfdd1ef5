"""`VaSEConfig`: every setting of a patch, validated before anything is touched.

A leaf module: it imports nothing from vasepatch. Names that live elsewhere (the
policy registry, the attention backends) are checked where they live, by `patch`,
before the model is touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FULL = "full"  # the never-evicting reference: a mode of the cache, not a policy
PREFILL_MODES = ("compress", "keep")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class VaSEConfig:
    """Settings of a VaSE-patched model.

    Attributes:
        budget: KV pairs kept per layer, row and KV head after each eviction.
        window: recent tokens never evicted; their queries score the others, and
            eviction runs once every `window` decode steps.
        protect: slots reserved for sinks and the largest-range value vectors;
            `None` means `budget // 4` (the paper's setting).
        sinks: tokens at absolute positions `< sinks` that are always kept.
        policy: name of a registered selection policy (`vasepatch.policies.available()`), or
            `"full"`: never evict (the uncompressed reference; its buffer grows with the
            sequence, `window` slots past the need at a time, so `budget` only sizes its first
            allocation).
        temperature: softmax temperature of the attention scores (> 0).
        smooth: width of the 1-D average pool applied to attention scores (1 = off).
        seed: seeds the sampling generator of each generation; `None` uses torch's
            global generator.
        policy_options: extra keyword options for the policy factory (e.g. `score="l2"`).
        attn_backend: attention kernels: `"flash_attn"`, `"torch_varlen"` (FlashAttention-2
            varlen kernels, CUDA, fp16/bf16), `"sdpa"`, `"eager"`, or `None`/`"auto"`: the
            first of these the model's device and dtype allow (`"eager"` for a model loaded
            with `attn_implementation="eager"`). Checked against the model at `patch` time.
        prefill: what happens to a prompt longer than `budget`. `"compress"` (default): the
            buffer has exactly `budget + window` slots per row and KV head whatever the prompt;
            the prefill attends to the whole prompt, then keeps its last `window` tokens plus
            `budget - window` older ones chosen by the policy (scored by the last `window`
            prompt queries). `"keep"`: the whole prompt is kept and the buffer has
            `max(prompt, budget) + window` slots (the paper's setting).
    """

    budget: int
    window: int = 64
    protect: int | None = None
    sinks: int = 4
    policy: str = "vase"
    temperature: float = 1.0
    smooth: int = 5
    seed: int | None = None
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    attn_backend: str | None = None
    prefill: str = "compress"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def n_protect(self) -> int:
        """Protected slots per eviction (`protect`, or `budget // 4` when unset)."""
        return self.budget // 4 if self.protect is None else self.protect

    @property
    def evicts(self) -> bool:
        """False for the never-evicting `"full"` reference mode."""
        return self.policy != FULL

    def replace(self, **changes: Any) -> VaSEConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raise `ValueError` naming the parameter, the value and the allowed range."""
        if not _is_int(self.budget) or self.budget < 2:
            raise ValueError(f"budget must be an int >= 2, got {self.budget!r}")
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be a positive int, got {self.window!r}")
        if self.window >= self.budget:
            raise ValueError(
                f"window must be smaller than budget: got window={self.window}, budget={self.budget} "
                f"(allowed: 1 <= window <= {self.budget - 1})"
            )
        if not _is_int(self.sinks) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {self.sinks!r}")
        if self.protect is not None and not _is_int(self.protect):
            raise ValueError(f"protect must be an int or None, got {self.protect!r}")
        hi = self.budget - self.window
        if not self.sinks <= self.n_protect <= hi:
            given = "protect" if self.protect is not None else f"protect (budget // 4 = {self.n_protect})"
            raise ValueError(
                f"{given} must satisfy sinks <= protect <= budget - window: got protect={self.n_protect}, "
                f"allowed range [{self.sinks}, {hi}] for sinks={self.sinks}, budget={self.budget}, "
                f"window={self.window}"
            )
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}")
        if not self.temperature > 0 or self.temperature != self.temperature or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not _is_int(self.smooth) or self.smooth < 1:
            raise ValueError(f"smooth must be an int >= 1 (1 = no smoothing), got {self.smooth!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.policy, str):
            raise ValueError(f"policy must be a registered policy name, got {self.policy!r}")
        if self.attn_backend is not None and not isinstance(self.attn_backend, str):
            raise ValueError(f"attn_backend must be None or a backend name, got {self.attn_backend!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(map(repr, PREFILL_MODES))}; got {self.prefill!r}")
        if not isinstance(self.policy_options, Mapping):
            raise ValueError(f"policy_options must be a mapping, got {type(self.policy_options).__name__}")
