"""What `vasepatch bench` runs: method names and the validated settings."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from vasepatch import policies
from vasepatch.config import VaSEConfig

BASELINES = ("dense", "static", "kvpress")
COMPILE_SUFFIX = "+compile"
DEFAULT_METHODS = ("dense", "static", "vase", "vase-dkv", "snapkv")
DTYPES = ("float32", "bfloat16", "float16")
MASKS = ("auto", "ones", "none")
ISOLATION = ("auto", "process", "none")


@dataclass(frozen=True)
class MethodSpec:
    """A method name split into its base (`dense`, `static`, `kvpress` or a policy) and `+compile`."""

    name: str
    base: str
    compile: bool

    @property
    def is_policy(self) -> bool:
        """Whether the method is a vasepatch policy (a `VaSECache`)."""
        return self.base not in BASELINES

    @classmethod
    def parse(cls, name: str) -> MethodSpec:
        """`"vase+compile"` -> `MethodSpec("vase+compile", "vase", True)`; unknown bases are an error."""
        base = name.removesuffix(COMPILE_SUFFIX)
        known = [*BASELINES, *policies.available()]
        if base not in known:
            raise ValueError(
                f"methods: unknown method {name!r}; known: {', '.join(known)} (each optionally with {COMPILE_SUFFIX})"
            )
        return cls(name, base, name.endswith(COMPILE_SUFFIX))


def _positive_ints(name: str, values: list[int]) -> list[int]:
    if not values:
        raise ValueError(f"{name} must list at least one value")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ValueError(f"{name} must be positive ints, got {bad}")
    return sorted(set(values))


@dataclass
class Settings:
    """The `vasepatch bench` options, validated at construction (before any work).

    `tokens` are the generated lengths at which the decode speed is timed (sorted);
    `steps` is the number of timed decode steps per segment (`None`: `window`, one
    eviction cycle); `dtype=None` means float32 on CPU and bfloat16 on CUDA;
    `threads=None` means every core; `isolate="auto"` runs each method in its own
    worker process on CPU (per-method peak RSS) and all in this process on CUDA;
    `mask="auto"` passes an attention mask of ones to eager methods and none to
    compiled ones (static shapes).
    """

    model: str = "smollm2-135m"
    tokens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    budget: int = 512
    window: int = 64
    batch: list[int] = field(default_factory=lambda: [1, 8])
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    prompt_len: int = 128
    repeats: int = 3
    steps: int | None = None
    dtype: str | None = None
    device: str = "cpu"
    seed: int = 0
    threads: int | None = None
    isolate: str = "auto"
    mask: str = "auto"
    out: str = "bench-results"
    progress: bool = True

    def __post_init__(self) -> None:
        self.tokens = _positive_ints("tokens", list(self.tokens))
        self.batch = _positive_ints("batch", list(self.batch))
        for name in ("prompt_len", "repeats"):
            _positive_ints(name, [getattr(self, name)])
        if self.steps is None:
            self.steps = self.window
        _positive_ints("steps", [self.steps])
        if not self.methods:
            raise ValueError("methods must list at least one method")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: duplicate names in {self.methods}")
        self.specs = [MethodSpec.parse(m) for m in self.methods]
        VaSEConfig(budget=self.budget, window=self.window, seed=self.seed)  # names budget/window on error
        if self.tokens[0] < self.steps:
            raise ValueError(
                f"tokens: the shortest length ({self.tokens[0]}) must be >= steps ({self.steps}): "
                "the warm-up segment decodes `steps` tokens first"
            )
        span = self.steps * self.repeats
        gaps = [b - a for a, b in zip(self.tokens, self.tokens[1:], strict=False)]
        if gaps and min(gaps) < span:
            raise ValueError(
                f"tokens: consecutive lengths must be >= steps * repeats = {span} apart (the timed segments of one "
                f"length continue the sequence), got {self.tokens}"
            )
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} requested but torch.cuda.is_available() is False")
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads is None:
            self.threads = os.cpu_count() or 1
        _positive_ints("threads", [self.threads])
        if self.isolate not in ISOLATION:
            raise ValueError(f"isolate must be one of {', '.join(ISOLATION)}, got {self.isolate!r}")
        if self.isolate == "auto":
            self.isolate = "process" if self.device == "cpu" else "none"
        if self.mask not in MASKS:
            raise ValueError(f"mask must be one of {', '.join(MASKS)}, got {self.mask!r}")
        if self.model.startswith("shape:"):
            from vasepatch.bench.shapes import SHAPES

            if self.model.removeprefix("shape:") not in SHAPES:
                raise ValueError(f"model: unknown shape {self.model!r}; known: {', '.join(SHAPES)}")

    @property
    def max_generated(self) -> int:
        """Generated tokens at the end of the last timed segment."""
        return self.tokens[-1] + self.steps * self.repeats

    def mask_for(self, spec: MethodSpec) -> bool:
        """Whether `spec`'s forward gets an attention mask of ones (else `None`)."""
        if spec.base == "kvpress":
            return False  # its cache holds fewer slots than the sequence has tokens
        if self.mask == "auto":
            return not spec.compile
        return self.mask == "ones"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("progress")
        return d
