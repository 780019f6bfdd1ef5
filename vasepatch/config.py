"""`VaSEConfig`: every setting of a patch, validated before anything is touched.

A leaf module: it imports nothing from vasepatch. Names that live elsewhere (the
policy registry, the attention backends) are checked where they live, by `patch`,
before the model is touched.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FULL = "full"  # the never-evicting reference: a mode of the cache, not a policy
PREFILL_MODES = ("compress", "keep", "pin")
# Slots per row and KV head: the varlen attention kernels index the packed buffer with int32 offsets.
MAX_SLOTS = 2**31 - 1
# Below this the scaled attention logits q.k / (sqrt(D) * temperature) can overflow float32; the
# softmax then turns to NaN, read as zero attention: a silently uniform eviction. At 1e-6 any
# |q.k| < 2.7e33 is safe, and the softmax is already one-hot on each query's argmax (the T -> 0 limit).
MIN_TEMPERATURE = 1e-6
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


NUMERIC_FIELDS = ("budget", "window", "protect", "sinks", "temperature", "smooth", "seed")
BOOL_FIELDS = ("check_policy_output", "shared_heads")


def plain(value: Any) -> Any:
    """The Python `bool`, `int` or `float` that a numpy scalar or a 0-d tensor (or 0-d array) holds;
    any other value unchanged. So `np.int64(5)`, `np.float32(0.3)`, `np.bool_(True)` and `torch.tensor(5)`
    are checked as `5`, `0.3...`, `True`, `5` (a bool stays a bool: it never passes as an int); a tensor of
    several elements, a complex number or a string stays what it is, and is refused by the checks."""
    if type(value) in (bool, int, float) or value is None or isinstance(value, str):
        return value
    if getattr(value, "shape", None) != () or not callable(getattr(value, "item", None)):
        return value.__float__() if isinstance(value, float) else value  # a float subclass: its value
    try:
        item = value.item()
    except Exception:  # a meta tensor, an item() of another meaning: not a scalar
        return value
    return item if type(item) in (bool, int, float) else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real number that converts to a float (not a bool; an int of 400 digits overflows a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


@dataclass(frozen=True)
class VaSEConfig:
    """Settings of a VaSE-patched model.

    Numbers may be numpy scalars or 0-d tensors (`np.int64(5)`, `np.float32(0.3)`, `torch.tensor(4)`):
    the config holds their plain Python value. A bool is never taken for an int or a number.

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
        temperature: softmax temperature of the attention scores (finite, >= `MIN_TEMPERATURE`
            = 1e-6: smaller ones overflow the float32 logits).
        smooth: width of the 1-D average pool applied to attention scores, centred on each candidate: an
            odd int (1 = off; at most `2 * budget - 1`, from which on all `budget` candidates of a decode
            eviction score alike). SnapKV and the VaSE paper use odd widths (5, 7).
        seed: keys the eviction randomness of each generation (an int in `[-2**63, 2**64 - 1]`):
            the draws of an eviction are a function of the seed, the layer, the eviction round,
            the row, the global KV head and the slot, so they do not depend on how tensor
            parallelism shards the heads. `None`: the key's seed is drawn from torch's global
            generator at the first eviction of each generation (reproducible under
            `torch.manual_seed`, and the same on every rank only if every rank seeds torch alike).
        policy_options: extra keyword options for the policy (e.g. `score="l2"`), checked against
            the options it declares at `patch` time; must be empty for `"full"`.
        attn_backend: attention kernels: `"flash_attn"`, `"torch_varlen"` (FlashAttention-2
            varlen kernels, CUDA, fp16/bf16), `"sdpa"`, `"eager"`, or `None`/`"auto"`: the
            first of these the model's device and dtype allow (`"eager"` for a model loaded
            with `attn_implementation="eager"`). Checked against the model at `patch` time.
        prefill: what happens to a prompt longer than `budget`. `"compress"` (default): the
            buffer has exactly `budget + window` slots per row and KV head whatever the prompt;
            the prefill attends to the whole prompt, then keeps its last `window` tokens plus
            `budget - window` older ones chosen by the policy (scored by the last `window`
            prompt queries). `"keep"`: the whole prompt is kept and the buffer has
            `max(prompt, budget) + window` slots (the paper's setting; later evictions may take
            prompt tokens). `"pin"`: the prompt is never evicted nor moved, and `budget` counts the
            generated tokens only: the buffer has `prompt + budget + window` slots (the mode of
            vLLM's prefix caching; a sliding-window layer with a policy keeps its prompt whole at
            prefill, as with `"keep"`, without pinning it).
        check_policy_output: check the policy's picks at every eviction (range, duplicates,
            padding kept over real tokens); `False` skips these data-dependent checks, for speed
            (their cost: docs/reliability.md). Shape and dtype are checked either way.
        shared_heads: every layer keeps one set of token positions for all its KV heads (the
            layout a paged serving engine needs): the heads' priorities are combined, tokens that
            any head protects (sinks, largest-range values) first, then the largest priority over
            the heads (`vasepatch.policies.shared`). Under tensor parallelism the heads combined are
            those of the rank. `False` (default): each KV head chooses its own.
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
    check_policy_output: bool = True
    shared_heads: bool = False

    def __post_init__(self) -> None:
        for name in (*NUMERIC_FIELDS, *BOOL_FIELDS):  # numpy scalars and 0-d tensors hold plain values
            object.__setattr__(self, name, plain(getattr(self, name)))
        self.validate()
        object.__setattr__(self, "policy_options", dict(self.policy_options))  # the config's own copy

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
        self._validate_sizes()
        self._validate_protect()
        self._validate_scoring()
        self._validate_modes()

    def check_fits(self, bytes_per_slot: int, available: int, where: str = "the device") -> None:
        """Raise `ValueError` naming `budget` when one row's buffers (`budget + window` slots of
        `bytes_per_slot` bytes: 2 x layers x KV heads x head_dim x dtype bytes) exceed `available`.
        With `prefill="keep"` or `"pin"` the prompt adds to that at the first step, which this
        check (made before any prompt is seen) cannot count."""
        need = (self.budget + self.window) * bytes_per_slot
        if need > available:
            raise ValueError(
                f"budget={self.budget} needs {need / 2**30:.1f} GiB of KV buffers per sequence ((budget + window) "
                f"x {bytes_per_slot} bytes per slot), more than the {available / 2**30:.1f} GiB of {where}; "
                "lower budget"
            )

    def _validate_sizes(self) -> None:
        if not _is_int(self.budget) or self.budget < 2:
            raise ValueError(f"budget must be an int >= 2, got {self.budget!r}")
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be a positive int, got {self.window!r}")
        if self.window >= self.budget:
            # the hint must be followable: the sinks need slots of their own besides the window
            sinks = self.sinks if _is_int(self.sinks) and self.sinks >= 1 else 1
            hint = (
                f"allowed: 1 <= window <= budget - max(sinks, 1) = {self.budget - sinks}"
                if self.budget - sinks >= 1
                else f"budget={self.budget} leaves no room for a window besides sinks={self.sinks}; raise budget"
            )
            raise ValueError(
                f"window must be smaller than budget: got window={self.window}, budget={self.budget} ({hint})"
            )
        if self.budget + self.window > MAX_SLOTS:
            raise ValueError(
                f"budget + window must be at most 2**31 - 1 = {MAX_SLOTS} slots (the attention kernels index "
                f"the buffer with int32 offsets), got budget={self.budget}, window={self.window}"
            )
        if not _is_int(self.sinks) or self.sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {self.sinks!r}")
        if self.budget - self.window < self.sinks:
            raise ValueError(
                f"budget={self.budget} is too small for window={self.window} and sinks={self.sinks}: the window "
                f"takes {self.window} of the {self.budget} slots, leaving {self.budget - self.window} for the "
                f"{self.sinks} sinks; need budget >= window + sinks = {self.window + self.sinks} "
                "(or a smaller window, or fewer sinks)"
            )

    def _validate_protect(self) -> None:
        if self.protect is not None and not _is_int(self.protect):
            raise ValueError(f"protect must be an int or None, got {self.protect!r}")
        lo, hi, p = self.sinks, self.budget - self.window, self.n_protect
        if lo <= p <= hi:
            return
        if self.protect is None:
            side = f"fewer than sinks={lo}" if p < lo else f"more than the {hi} slots left after the window"
            fix = "fewer sinks" if p < lo else "a smaller window"
            raise ValueError(
                f"protect defaults to budget // 4 = {p}, {side}; pass protect in [{lo}, {hi}] "
                f"(sinks <= protect <= budget - window) or {fix}"
            )
        raise ValueError(
            f"protect must satisfy sinks <= protect <= budget - window: got protect={p}, allowed range "
            f"[{lo}, {hi}] for sinks={self.sinks}, budget={self.budget}, window={self.window}"
        )

    def _validate_scoring(self) -> None:
        t = self.temperature
        if not is_number(t) or not MIN_TEMPERATURE <= t < float("inf"):
            raise ValueError(
                f"temperature must be a finite number >= {MIN_TEMPERATURE:g} (smaller ones overflow the float32 "
                f"attention logits, making every score 0), got {t!r}"
            )
        s, top = self.smooth, 2 * self.budget - 1
        if not _is_int(s) or not 1 <= s <= top or s % 2 == 0:
            raise ValueError(
                f"smooth must be an odd int in [1, {top}] (the width of a centred average pool over the candidates' "
                "attention: an even width has no centre slot; from 2 x budget - 1 on, every candidate of a decode "
                f"eviction scores alike; 1 = no smoothing), got {s!r}"
            )
        lo, hi = SEED_RANGE
        if self.seed is not None and (not _is_int(self.seed) or not lo <= self.seed <= hi):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")

    def _validate_modes(self) -> None:
        if not isinstance(self.policy, str):
            raise ValueError(f"policy must be a registered policy name, got {self.policy!r}")
        if self.attn_backend is not None and not isinstance(self.attn_backend, str):
            raise ValueError(f"attn_backend must be None or a backend name, got {self.attn_backend!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(map(repr, PREFILL_MODES))}; got {self.prefill!r}")
        if not isinstance(self.check_policy_output, bool):
            raise ValueError(f"check_policy_output must be a bool, got {self.check_policy_output!r}")
        if not isinstance(self.shared_heads, bool):
            raise ValueError(
                f"shared_heads must be a bool (True: all KV heads keep the same tokens), got {self.shared_heads!r}"
            )
        if not isinstance(self.policy_options, Mapping):
            raise ValueError(
                f"policy_options must be a mapping (a dict) of option names to values, got "
                f"{type(self.policy_options).__name__} {self.policy_options!r} "
                "(e.g. policy_options={'sample': False})"
            )
        for key in self.policy_options:
            if not isinstance(key, str):
                raise ValueError(f"policy_options keys must be option names (strings), got {key!r}")
        if self.policy == FULL and self.policy_options:
            raise ValueError(
                f"policy_options must be empty for policy='full' (the never-evicting mode has no policy), "
                f"got {dict(self.policy_options)!r}"
            )


def cache_dir() -> Path:
    """Where converted models are cached: `$VASEPATCH_CACHE_DIR`, else `$XDG_CACHE_HOME/vasepatch`, else
    `~/.cache/vasepatch`, as the Hugging Face hub, pip and torch place theirs. An empty variable counts as
    unset, and so does a relative `XDG_CACHE_HOME`, which the XDG base directory spec says to ignore."""
    own = os.environ.get("VASEPATCH_CACHE_DIR")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "vasepatch"
