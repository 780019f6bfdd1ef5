"""`run_benchmark(settings)`: every method, interleaved, each in its own worker process (CPU)
or all in this process (CUDA), with a per-method error instead of a crash.

Order: for each batch size, every method prefills and runs its warm-up segment;
then for each generated length, for each repeat, every method runs one timed
segment, the method order rotating by one at each repeat. Only one method
computes at any moment (the parent waits on each worker in turn).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import statistics
import time
import traceback
from collections import defaultdict
from multiprocessing.connection import Connection
from typing import Any

import torch

from vasepatch.bench.measure import MIB, MethodRunner
from vasepatch.bench.methods import kvpress_module
from vasepatch.bench.settings import MethodSpec, Settings
from vasepatch.bench.shapes import load_model


class MethodError(RuntimeError):
    """A method failed (in its worker or here); the message says how, `details` where."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def describe(err: BaseException, limit: int = 600) -> str:
    """`Type: message`, shortened to `limit` characters."""
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _worker(conn: Connection, settings: Settings, spec: MethodSpec) -> None:
    """Worker process: build the runner, then answer `(command, args)` until `close`."""
    try:
        runner = MethodRunner(settings, spec)
        conn.send(("ok", runner.info()))
    except Exception as err:
        conn.send(("error", describe(err), traceback.format_exc()))
        return
    while True:
        command, args = conn.recv()
        try:
            conn.send(("ok", getattr(runner, command)(*args)))
        except Exception as err:
            conn.send(("error", describe(err), traceback.format_exc()))
        if command == "close":
            return


class WorkerProxy:
    """A method in a spawned process, driven over a pipe. The process starts (and loads
    the model) at once; `ready()` waits for it."""

    def __init__(self, settings: Settings, spec: MethodSpec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, settings, spec), daemon=True)
        self.process.start()
        child.close()

    def ready(self) -> dict[str, Any]:
        self.info = self._receive()
        return self.info

    def _receive(self) -> dict[str, Any]:
        try:
            reply = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise MethodError(f"worker process died (exit code {self.process.exitcode})") from None
        if reply[0] == "error":
            raise MethodError(reply[1], reply[2])
        return reply[1]

    def call(self, command: str, *args: Any) -> dict[str, Any]:
        self.conn.send((command, args))
        return self._receive()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(MethodError, OSError):
                self.call("close")
            self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


class LocalProxy:
    """A method in this process, on a weight-sharing copy of `model`."""

    def __init__(self, settings: Settings, spec: MethodSpec, model: torch.nn.Module) -> None:
        try:
            self.runner = MethodRunner(settings, spec, model)
        except Exception as err:
            raise MethodError(describe(err), traceback.format_exc()) from err

    def ready(self) -> dict[str, Any]:
        return self.runner.info()

    def call(self, command: str, *args: Any) -> dict[str, Any]:
        try:
            return getattr(self.runner, command)(*args)
        except Exception as err:
            raise MethodError(describe(err), traceback.format_exc()) from err

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.runner.close()


def environment(settings: Settings) -> dict[str, Any]:
    """Versions, device and threads of this run."""
    import transformers

    import vasepatch

    env: dict[str, Any] = {
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
    }
    try:
        kvpress_module()
        from importlib.metadata import PackageNotFoundError, version

        try:
            env["kvpress"] = version("kvpress")
        except PackageNotFoundError:
            env["kvpress"] = "importable"
    except RuntimeError:
        env["kvpress"] = "not importable"
    return env


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


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the `eval` extra brings it
        return None

    return tqdm(total=total, desc="bench", unit="segment", dynamic_ncols=True)


def run_benchmark(settings: Settings, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Run the benchmark; returns `{"settings", "environment", "methods", "warmups",
    "segments", "results", "errors", "wall_s"}` (see `summarise` for `results`).

    `model` (in-process runs only) skips loading `settings.model`.
    """
    if model is not None and settings.isolate != "none":
        raise ValueError("run_benchmark(model=...) needs isolate='none' (worker processes load their own model)")
    t_start = time.perf_counter()
    specs = settings.specs
    errors: list[dict[str, Any]] = []
    proxies: dict[str, WorkerProxy | LocalProxy] = {}
    methods: dict[str, dict[str, Any]] = {}
    warmups: list[dict[str, Any]] = []
    segments: list[dict[str, Any]] = []
    per_batch = 1 + len(settings.tokens) * settings.repeats
    bar = _progress(len(settings.batch) * len(specs) * per_batch, settings.progress)

    def fail(name: str, batch: int | None, stage: str, err: MethodError) -> None:
        errors.append({"method": name, "batch": batch, "stage": stage, "error": str(err), "traceback": err.details})
        if bar is not None:
            bar.write(f"{name} (batch {batch}, {stage}) failed: {err}")

    try:
        shared = None
        if settings.isolate == "none":
            if any(spec.base == "kvpress" for spec in specs):
                # importing kvpress wraps every attention function registered so far; vasepatch's
                # (registered again at each patch) must come after it, unwrapped
                with contextlib.suppress(RuntimeError):
                    kvpress_module()
            dtype = getattr(torch, settings.dtype)
            shared = model if model is not None else load_model(settings.model, dtype, settings.device, settings.seed)
        starting: dict[str, WorkerProxy | LocalProxy] = {}
        for spec in specs:  # worker processes load their models concurrently
            try:
                starting[spec.name] = (
                    WorkerProxy(settings, spec) if shared is None else LocalProxy(settings, spec, shared)
                )
            except MethodError as err:
                fail(spec.name, None, "load", err)
        for name, proxy in starting.items():
            try:
                methods[name] = proxy.ready()
                proxies[name] = proxy
            except MethodError as err:
                fail(name, None, "load", err)
                proxy.close()
        if bar is not None:
            bar.update((len(specs) - len(proxies)) * len(settings.batch) * per_batch)
        for batch in settings.batch:
            active: list[str] = []
            for name, proxy in proxies.items():
                try:
                    prefill = proxy.call("start", batch)
                    warm = proxy.call("warmup")
                    warmups.append({"method": name, "batch": batch, **prefill, **warm})
                    active.append(name)
                except MethodError as err:
                    fail(name, batch, "warm-up", err)
                    if bar is not None:
                        bar.update(per_batch - 1)
                if bar is not None:
                    bar.update(1)
            for li, length in enumerate(settings.tokens):
                for repeat in range(settings.repeats):
                    k = (li * settings.repeats + repeat) % max(1, len(active))
                    for name in active[k:] + active[:k]:
                        if bar is not None:
                            bar.set_postfix_str(f"batch={batch} length={length} {name}")
                        try:
                            seg = proxies[name].call("segment", length)
                            segments.append({"method": name, "batch": batch, "length": length, "repeat": repeat, **seg})
                        except MethodError as err:
                            fail(name, batch, f"segment at {length}", err)
                            active.remove(name)
                            if bar is not None:  # the segments it will not run
                                bar.update((len(settings.tokens) - li) * settings.repeats - repeat - 1)
                        if bar is not None:
                            bar.update(1)
    finally:
        for proxy in proxies.values():
            proxy.close()
        if bar is not None:
            bar.close()
    return {
        "settings": settings.to_dict(),
        "environment": environment(settings),
        "methods": methods,
        "warmups": warmups,
        "segments": segments,
        "results": summarise(settings, segments),
        "errors": errors,
        "wall_s": time.perf_counter() - t_start,
    }


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(settings: Settings, segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method, batch and length: decode tok/s median and min/max over repeats,
    the median per-repeat ratio to `dense` (and to the eager method, for `+compile`),
    KV MiB, peak MiB and the eviction share (medians over repeats)."""
    by_key: dict[tuple[str, int, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for seg in segments:
        by_key[seg["method"], seg["batch"], seg["length"]][seg["repeat"]] = seg

    def ratio(segs: dict[int, dict[str, Any]], other: str, batch: int, length: int) -> float | None:
        ref = by_key.get((other, batch, length), {})
        return _median([s["tok_s"] / ref[r]["tok_s"] for r, s in segs.items() if r in ref])

    rows = []
    for spec in settings.specs:
        for batch in settings.batch:
            for length in settings.tokens:
                segs = by_key.get((spec.name, batch, length))
                if not segs:
                    continue
                tok_s = [s["tok_s"] for s in segs.values()]
                rows.append(
                    {
                        "method": spec.name,
                        "batch": batch,
                        "length": length,
                        "tok_s": statistics.median(tok_s),
                        "tok_s_min": min(tok_s),
                        "tok_s_max": max(tok_s),
                        "ratio_to_dense": ratio(segs, "dense", batch, length) if spec.name != "dense" else 1.0,
                        "compile_speedup": ratio(segs, spec.base, batch, length) if spec.compile else None,
                        "kv_mib": _median([s["kv_bytes"] / MIB for s in segs.values()]),
                        "peak_mib": _median([s["peak_bytes"] / MIB for s in segs.values()]),
                        "eviction_share": _median([s["eviction_share"] for s in segs.values()]),
                        "evicting_steps": sum(s["evicting_steps"] for s in segs.values()),
                        "repeats": len(segs),
                    }
                )
    return rows
