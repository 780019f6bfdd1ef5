"""`run_benchmark(settings)`: every method, interleaved, each in its own worker process (CPU)
or all in this process (CUDA), with a per-method error instead of a crash.

Order: for each batch size, every method prefills and runs its warm-up segment;
then for each generated length, for each repeat, every method runs one timed
segment, the method order rotating by one at each repeat. Only one method
computes at any moment (the parent waits on each worker in turn).
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any

import torch

from vasepatch.bench.methods import kvpress_module
from vasepatch.bench.settings import Settings
from vasepatch.bench.shapes import load_model
from vasepatch.bench.summary import summarise
from vasepatch.bench.workers import MethodError, Proxy, open_proxy


def run_benchmark(settings: Settings, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Run the benchmark; returns `{"settings", "environment", "methods", "warmups",
    "segments", "results", "errors", "wall_s"}` (see `summarise` for `results`).

    `model` (in-process runs only) skips loading `settings.model`.
    """
    if model is not None and settings.isolate != "none":
        raise ValueError("run_benchmark(model=...) needs isolate='none' (worker processes load their own model)")
    t_start = time.perf_counter()
    bench = Benchmark(settings)
    bench.run(model)
    return {
        "settings": settings.to_dict(),
        "environment": environment(settings),
        "methods": bench.methods,
        "warmups": bench.warmups,
        "segments": bench.segments,
        "results": summarise(settings, bench.segments),
        "errors": bench.errors,
        "wall_s": time.perf_counter() - t_start,
    }


class Benchmark:
    """One run of every method: their proxies, the progress bar and what they measured.

    `run` starts the methods, then for each batch size warms them up and times their
    segments; a method that fails gets an entry in `errors` and skips the rest of that
    batch size (or of the run, if it failed to load), while the others go on.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.per_batch = 1 + len(settings.tokens) * settings.repeats  # progress units of one method and batch
        self.bar = progress_bar(len(settings.batch) * len(settings.specs) * self.per_batch, settings.progress)
        self.proxies: dict[str, Proxy] = {}
        self.methods: dict[str, dict[str, Any]] = {}
        self.warmups: list[dict[str, Any]] = []
        self.segments: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    def run(self, model: torch.nn.Module | None) -> None:
        try:
            self.start_methods(shared_model(self.settings, model))
            for batch in self.settings.batch:
                active = self.warm_up(batch)
                self.time_lengths(batch, active)
        finally:
            for proxy in self.proxies.values():
                proxy.close()
            if self.bar is not None:
                self.bar.close()

    def start_methods(self, shared: torch.nn.Module | None) -> None:
        """Start every method (worker processes load their models concurrently), then wait for each."""
        starting: dict[str, Proxy] = {}
        for spec in self.settings.specs:
            try:
                starting[spec.name] = open_proxy(self.settings, spec, shared)
            except MethodError as err:
                self.fail(spec.name, None, "load", err)
        for name, proxy in starting.items():
            try:
                self.methods[name] = proxy.ready()
                self.proxies[name] = proxy
            except MethodError as err:
                self.fail(name, None, "load", err)
                proxy.close()
        self.advance((len(self.settings.specs) - len(self.proxies)) * len(self.settings.batch) * self.per_batch)

    def warm_up(self, batch: int) -> list[str]:
        """Prefill and warm up every method at `batch` rows; returns the names of those that succeeded."""
        active = []
        for name, proxy in self.proxies.items():
            try:
                prefill = proxy.call("start", batch)
                warm = proxy.call("warmup")
                self.warmups.append({"method": name, "batch": batch, **prefill, **warm})
                active.append(name)
            except MethodError as err:
                self.fail(name, batch, "warm-up", err)
                self.advance(self.per_batch - 1)  # the segments it will not run
            self.advance(1)
        return active

    def time_lengths(self, batch: int, active: list[str]) -> None:
        """The timed segments of every length and repeat, the method order rotating by one per repeat."""
        repeats = self.settings.repeats
        for li, length in enumerate(self.settings.tokens):
            for repeat in range(repeats):
                k = (li * repeats + repeat) % max(1, len(active))
                for name in active[k:] + active[:k]:
                    if not self.time_segment(name, batch, length, repeat):
                        active.remove(name)
                        self.advance((len(self.settings.tokens) - li) * repeats - repeat - 1)
                    self.advance(1)

    def time_segment(self, name: str, batch: int, length: int, repeat: int) -> bool:
        """One timed segment of `name`; False (and an error entry) if it failed."""
        if self.bar is not None:
            self.bar.set_postfix_str(f"batch={batch} length={length} {name}")
        try:
            seg = self.proxies[name].call("segment", length)
        except MethodError as err:
            self.fail(name, batch, f"segment at {length}", err)
            return False
        self.segments.append({"method": name, "batch": batch, "length": length, "repeat": repeat, **seg})
        return True

    def fail(self, name: str, batch: int | None, stage: str, err: MethodError) -> None:
        self.errors.append(
            {"method": name, "batch": batch, "stage": stage, "error": str(err), "traceback": err.details}
        )
        if self.bar is not None:
            self.bar.write(f"{name} (batch {batch}, {stage}) failed: {err}")

    def advance(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.update(n)


def shared_model(settings: Settings, model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The model that in-process methods share (`model`, or `settings.model` loaded here);
    `None` when each method runs in its own worker process."""
    if settings.isolate != "none":
        return None
    if any(spec.base == "kvpress" for spec in settings.specs):
        # importing kvpress wraps every attention function registered so far; vasepatch's
        # (registered again at each patch) must come after it, unwrapped
        with contextlib.suppress(RuntimeError):
            kvpress_module()
    if model is not None:
        return model
    return load_model(settings.model, getattr(torch, settings.dtype), settings.device, settings.cache.seed)


def progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar of `total` segments, or `None` (disabled, or tqdm missing)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the `eval` extra brings it
        return None

    return tqdm(total=total, desc="bench", unit="segment", dynamic_ncols=True)


def environment(settings: Settings) -> dict[str, Any]:
    """Versions, device and threads of this run."""
    import transformers

    import vasepatch

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vasepatch": vasepatch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": settings.device,
        "device_name": _device_name(settings.device),
        "cpu_count": os.cpu_count(),
        "threads": settings.threads,
        "isolation": settings.isolate,
        "kvpress": _kvpress_version(),
    }


def _kvpress_version() -> str:
    try:
        kvpress_module()
    except RuntimeError:
        return "not importable"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpress")
    except PackageNotFoundError:
        return "importable"


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
