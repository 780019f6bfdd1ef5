"""What `vasepatch bench` runs: method names and the validated settings (without importing torch, so that
`vasepatch bench --help` and its usage errors answer at once)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vasepatch.config import VaSEConfig
from vasepatch.tools.cli_args import policy_names
from vasepatch.tools.threads import default_threads

BASELINES = ("dense", "static", "kvpress", "floor")
COMPILE_SUFFIX = "+compile"
DEFAULT_METHODS = ("dense", "static", "floor", "vase", "vase-dkv", "snapkv")
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
        """Whether the method is a vasepatch cache (its base is the `VaSEConfig.policy`)."""
        return self.base not in BASELINES

    @classmethod
    def parse(cls, name: str) -> MethodSpec:
        """`"vase+compile"` -> `MethodSpec("vase+compile", "vase", True)`; unknown bases are an error."""
        base = name.removesuffix(COMPILE_SUFFIX)
        known = [*BASELINES, *policy_names()]  # the policy registry's names (`full` first)
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


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _default_cache() -> VaSEConfig:
    return VaSEConfig(budget=512, window=64, seed=0)


@dataclass
class BenchSettings:
    """The `vasepatch bench` options, validated at construction (before any work).

    `cache` holds the vasepatch cache settings shared by every method: each vasepatch
    method runs `cache.replace(policy=<its name>)` (so `cache.policy` itself is not
    used); kvpress compresses to `cache.budget` every `cache.window` decode steps; and
    `cache.seed` also seeds the random prompts and `shape:` weights (`None` becomes 0).
    The other fields are the bench's own. `tokens` are the generated lengths at which
    the decode speed is timed (sorted); `steps` is the number of timed decode steps per
    segment (`None`: `cache.window`, one eviction cycle); `dtype=None` means float32 on
    CPU and bfloat16 on CUDA; `threads=None` means `vasepatch.tools.threads.default_threads()`
    ($OMP_NUM_THREADS, else the physical cores); `isolate="auto"` runs each
    method in its own worker process on CPU (per-method peak RSS) and all in this process
    on CUDA; `mask="auto"` passes an attention mask of ones to eager methods and none to
    compiled ones (static shapes).
    """

    model: str = "smollm2-135m"
    cache: VaSEConfig = field(default_factory=_default_cache)
    tokens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    batch: list[int] = field(default_factory=lambda: [1, 8])
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    prompt_len: int = 128
    repeats: int = 3
    steps: int | None = None
    dtype: str | None = None
    device: str = "cpu"
    threads: int | None = None
    isolate: str = "auto"
    mask: str = "auto"
    skip: list[str] = field(default_factory=list)
    out: str = "bench-results"
    progress: bool = True

    def __post_init__(self) -> None:
        self._check_cache()
        self._check_lengths()
        self._check_methods()
        self._check_device()
        self._check_execution()
        self._check_model()
        self._check_skip()

    def _check_cache(self) -> None:
        if not isinstance(self.cache, VaSEConfig):
            raise ValueError(f"cache must be a vasepatch.VaSEConfig, got {type(self.cache).__name__}")
        if self.cache.seed is None:  # a benchmark draws its prompts from a seed
            self.cache = self.cache.replace(seed=0)

    def _check_lengths(self) -> None:
        self.tokens = _positive_ints("tokens", list(self.tokens))
        self.batch = _positive_ints("batch", list(self.batch))
        for name in ("prompt_len", "repeats"):
            _positive_ints(name, [getattr(self, name)])
        if self.steps is None:
            self.steps = self.cache.window
        _positive_ints("steps", [self.steps])
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

    def _check_methods(self) -> None:
        if not self.methods:
            raise ValueError("methods must list at least one method")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods: duplicate names in {self.methods}")
        self.specs = [MethodSpec.parse(m) for m in self.methods]

    def _check_device(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} requested but torch.cuda.is_available() is False")
        if self.dtype is None:
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        _one_of("dtype", self.dtype, DTYPES)

    def _check_execution(self) -> None:
        if self.threads is None:
            self.threads = default_threads()
        _positive_ints("threads", [self.threads])
        _one_of("isolate", self.isolate, ISOLATION)
        if self.isolate == "auto":
            self.isolate = "process" if self.device == "cpu" else "none"
        _one_of("mask", self.mask, MASKS)

    def _check_model(self) -> None:
        if self.model.startswith("shape:"):
            from vasepatch.bench.shapes import SHAPES

            if self.model.removeprefix("shape:") not in SHAPES:
                raise ValueError(f"model: unknown shape {self.model!r}; known: {', '.join(SHAPES)}")

    def _check_skip(self) -> None:
        """`skip` entries `method@batch` or `method@batch:length` -> `self.skipped` (method, batch, length|None)."""
        self.skip = [str(e).strip() for e in self.skip if str(e).strip()]
        self.skipped: set[tuple[str, int, int | None]] = set()
        for entry in self.skip:
            name, _, where = entry.partition("@")
            batch, _, length = where.partition(":")
            try:
                key = (name, int(batch), int(length) if length else None)
            except ValueError:
                raise ValueError(f"skip: {entry!r} is not method@batch or method@batch:length") from None
            if key[0] not in self.methods or key[1] not in self.batch or key[2] not in (None, *self.tokens):
                raise ValueError(
                    f"skip: {entry!r} names a method, batch or length not in this run "
                    f"(methods {self.methods}, batch {self.batch}, tokens {self.tokens})"
                )
            self.skipped.add(key)

    def is_skipped(self, method: str, batch: int, length: int | None = None) -> bool:
        """Whether `--skip` leaves out `method` at `batch` and `length` (`None`: at every length)."""
        if (method, batch, None) in self.skipped:
            return True
        return length is not None and (method, batch, length) in self.skipped

    @property
    def floor_generated(self) -> int:
        """Decode slots the floor's cache holds after its `budget`-token prompt (warm-up and one segment)."""
        return max(self.steps, self.cache.window) + 1

    @property
    def max_generated(self) -> int:
        """Generated tokens at the end of the last timed segment."""
        return self.tokens[-1] + self.steps * self.repeats

    def cache_config(self, spec: MethodSpec) -> VaSEConfig:
        """The `VaSEConfig` of the vasepatch method `spec`: `cache` with `spec`'s policy."""
        return self.cache.replace(policy=spec.base)

    def mask_for(self, spec: MethodSpec) -> bool:
        """Whether `spec`'s forward gets an attention mask of ones (else `None`)."""
        if spec.base == "kvpress":
            return False  # its cache holds fewer slots than the sequence has tokens
        if self.mask == "auto":
            return not spec.compile
        return self.mask == "ones"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchSettings:
        """The settings that `to_dict` wrote (e.g. the `settings` of a `bench.json`)."""
        d, base = dict(d), _default_cache()
        budget, window, seed = (d.pop(k, getattr(base, k)) for k in ("budget", "window", "seed"))
        cache = VaSEConfig(budget=budget, window=window, seed=seed)
        return cls(cache=cache, **d)

    def to_dict(self) -> dict[str, Any]:
        """The settings as written to `bench.json` (the cache's budget, window and seed as top-level keys)."""
        c = self.cache
        return {
            "model": self.model,
            "tokens": list(self.tokens),
            "budget": c.budget,
            "window": c.window,
            "batch": list(self.batch),
            "methods": list(self.methods),
            "prompt_len": self.prompt_len,
            "repeats": self.repeats,
            "steps": self.steps,
            "dtype": self.dtype,
            "device": self.device,
            "seed": c.seed,
            "threads": self.threads,
            "isolate": self.isolate,
            "mask": self.mask,
            "skip": list(self.skip),
            "out": self.out,
        }
