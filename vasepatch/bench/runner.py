"""`run_benchmark(settings)`: every method, interleaved, each in its own worker process (CPU)
or all in this process (CUDA), with a per-method error instead of a crash.

Order: for each batch size, every method (with segments left to run there) prefills and runs its warm-up segment;
then for each generated length, for each repeat, every method runs one timed
segment, the method order rotating by one at each repeat. Only one method
computes at any moment (the parent waits on each worker in turn).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from vasepatch.bench.methods import kvpress_module
from vasepatch.bench.settings import BenchSettings
from vasepatch.bench.shapes import load_model
from vasepatch.bench.summary import summarise
from vasepatch.bench.workers import MethodError, Proxy, open_proxy


def run_benchmark(
    settings: BenchSettings,
    model: torch.nn.Module | None = None,
    *,
    previous: dict[str, Any] | None = None,
    save: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns `{"settings", "environment", "methods", "warmups",
    "segments", "results", "errors", "wall_s", "complete", "resumed"}` (see `summarise` for
    `results`; `started`: when the first session started, `resumed`: when each later one did;
    `complete`: False while it runs).

    `model` (in-process runs only) skips loading `settings.model`. `previous` (a `bench.json`
    of the same settings) resumes it: its segments and warm-ups are kept and not run again.
    `save(result)` is called with the result so far after every warm-up and timed segment; the
    complete result is returned (the caller writes it: `vasepatch bench` through `report.write`).
    """
    if model is not None and settings.isolate != "none":
        raise ValueError("run_benchmark(model=...) needs isolate='none' (worker processes load their own model)")
    bench = Benchmark(settings, previous, save)
    bench.run(model)
    return bench.result(complete=True)


class Benchmark:
    """One run of every method: their proxies, the progress bar and what they measured.

    `run` starts the methods, then for each batch size warms them up and times their
    segments; a method that fails gets an entry in `errors` and skips the rest of that
    batch size (or of the run, if it failed to load), while the others go on. Segments
    already in `previous` and `--skip`ped ones are not run; a method is started (and warmed
    up) at a batch size only if it has a segment left to run there.
    """

    def __init__(self, settings: BenchSettings, previous: dict[str, Any] | None, save: Callable | None) -> None:
        self.settings, self.save = settings, save
        self.t_start, now = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc).isoformat()
        self.started: str = (previous or {}).get("started", now)  # the first session
        self.resumed: list[str] = [*previous.get("resumed", []), now] if previous else []  # each later one
        previous = previous or {}
        self.methods: dict[str, dict[str, Any]] = dict(previous.get("methods", {}))
        self.warmups: list[dict[str, Any]] = list(previous.get("warmups", []))
        self.segments: list[dict[str, Any]] = list(previous.get("segments", []))
        self.errors: list[dict[str, Any]] = list(previous.get("errors", []))
        self.wall_before = float(previous.get("wall_s", 0.0))
        self.done = {(s["method"], s["batch"], s["length"], s["repeat"]) for s in self.segments}
        self.warmed = {(w["method"], w["batch"]) for w in self.warmups}
        units = sum(1 + len(t) for t in (self.todo(n, b) for n in settings.methods for b in settings.batch) if t)
        self.bar = progress_bar(units, settings.progress)
        self.proxies: dict[str, Proxy] = {}

    def todo(self, name: str, batch: int) -> list[tuple[int, int]]:
        """The (length, repeat) segments of `name` at `batch` still to run."""
        s = self.settings
        return [
            (length, r)
            for length in s.tokens
            for r in range(s.repeats)
            if (name, batch, length, r) not in self.done and not s.is_skipped(name, batch, length)
        ]

    def result(self, complete: bool) -> dict[str, Any]:
        """Everything measured so far (a complete, loadable `bench.json`)."""
        return {
            "settings": self.settings.to_dict(),
            "environment": environment(self.settings, check_kvpress=complete),
            "methods": self.methods,
            "warmups": self.warmups,
            "segments": self.segments,
            "results": summarise(self.settings, self.segments),
            "errors": self.errors,
            "wall_s": self.wall_before + time.perf_counter() - self.t_start,
            "complete": complete,
            "started": self.started,
            "resumed": self.resumed,
        }

    def checkpoint(self) -> None:
        if self.save is not None:
            self.save(self.result(complete=False))

    def run(self, model: torch.nn.Module | None) -> None:
        try:
            names = [n for n in self.settings.methods if any(self.todo(n, b) for b in self.settings.batch)]
            if names:
                self.start_methods(names, shared_model(self.settings, model))
            for batch in self.settings.batch:
                active = self.warm_up(batch)
                self.time_lengths(batch, active)
        finally:
            for proxy in self.proxies.values():
                proxy.close()
            if self.bar is not None:
                self.bar.close()

    def start_methods(self, names: list[str], shared: torch.nn.Module | None) -> None:
        """Start the methods `names` (worker processes load their models concurrently), then wait for each."""
        starting: dict[str, Proxy] = {}
        specs = {spec.name: spec for spec in self.settings.specs}
        for name in names:
            try:
                starting[name] = open_proxy(self.settings, specs[name], shared)
            except MethodError as err:
                self.fail(name, None, "load", err)
        for name, proxy in starting.items():
            try:
                self.methods[name] = proxy.ready()
                self.proxies[name] = proxy
            except MethodError as err:
                self.fail(name, None, "load", err)
                proxy.close()
        for name in set(names) - set(self.proxies):
            self.advance(sum(1 + len(t) for t in (self.todo(name, b) for b in self.settings.batch) if t))

    def warm_up(self, batch: int) -> list[str]:
        """Prefill and warm up every method with segments left at `batch` rows; returns those that succeeded.
        A warm-up already recorded (a resumed run) is run again (the sequence is rebuilt) but not recorded twice."""
        active = []
        for name, proxy in self.proxies.items():
            todo = self.todo(name, batch)
            if not todo:
                continue
            try:
                prefill = proxy.call("start", batch)
                warm = proxy.call("warmup")
                if (name, batch) not in self.warmed:
                    self.warmups.append({"method": name, "batch": batch, **prefill, **warm})
                    self.warmed.add((name, batch))
                active.append(name)
            except MethodError as err:
                self.fail(name, batch, "warm-up", err)
                self.advance(len(todo))  # the segments it will not run
            self.advance(1)
            self.checkpoint()
        return active

    def time_lengths(self, batch: int, active: list[str]) -> None:
        """The timed segments of every length and repeat, the method order rotating by one per repeat."""
        repeats = self.settings.repeats
        for li, length in enumerate(self.settings.tokens):
            for repeat in range(repeats):
                k = (li * repeats + repeat) % max(1, len(active))
                for name in active[k:] + active[:k]:
                    if (length, repeat) not in self.todo(name, batch):
                        continue
                    if not self.time_segment(name, batch, length, repeat):
                        active.remove(name)
                        self.advance(len(self.todo(name, batch)) - 1)
                    self.advance(1)
                    self.checkpoint()

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
        self.done.add((name, batch, length, repeat))
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


def shared_model(settings: BenchSettings, model: torch.nn.Module | None) -> torch.nn.Module | None:
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


def environment(settings: BenchSettings, check_kvpress: bool = True) -> dict[str, Any]:
    """Versions, device and threads of this run. `check_kvpress=False` (results saved while
    the run goes on) reads kvpress's installed version without importing it: importing it
    wraps the attention functions of this process, the in-process methods' included."""
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
        "kvpress": _kvpress_version() if check_kvpress else _installed("kvpress"),
    }


def _installed(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{version(package)} (import not checked yet)"
    except PackageNotFoundError:
        return "not installed"


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
