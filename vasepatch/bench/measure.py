"""Timing and memory of one method: `MethodRunner` runs its warm-up and timed segments.

A segment fast-forwards the sequence to the target generated length (untimed),
then times `steps` single-token decode steps one by one (`time.perf_counter`;
CUDA events between steps on CUDA, with one synchronisation per segment). A step
is *evicting* when the method's eviction counter changes during it. Memory: the
cache's K/V bytes at the end of the segment, and the peak during the timed steps
(the process's peak RSS on CPU, reset before the steps; the CUDA allocator's peak
on CUDA).
"""

from __future__ import annotations

import contextlib
import ctypes
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from vasepatch.bench.methods import Method, build_method, share_weights
from vasepatch.bench.settings import BenchSettings, MethodSpec
from vasepatch.bench.shapes import load_model

MIB = 2**20


def _proc_status(field: str) -> int | None:
    """A `kB` field of `/proc/self/status` in bytes (Linux), else `None`."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def max_rss() -> int:
    """The process's lifetime peak RSS in bytes (`ru_maxrss`)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_rss() -> int | None:
    """The process's resident set size in bytes now (Linux)."""
    return _proc_status("VmRSS")


def reset_peak_rss() -> bool:
    """Return freed heap memory to the OS and reset the peak RSS (`VmHWM`); Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Peak memory over a stretch of work: CUDA allocator peak, or the process's peak RSS.

    `isolated`: the process runs this method alone, so the process peak is the method's.
    Otherwise the peak counts the weights, the method's own cache at the start and what
    the stretch allocated on top (other methods' caches in the same process are left out).
    """

    def __init__(self, device: torch.device, isolated: bool, weight_bytes: int) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.isolated = isolated and not self.cuda
        self.weight_bytes = weight_bytes
        self.kind = "cuda allocator" if self.cuda else "process RSS"

    def start(self, kv_bytes: int) -> None:
        self.kv_start = kv_bytes
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.resettable = reset_peak_rss()
            self.base = current_rss() or 0

    def stop(self) -> dict[str, Any]:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            out = {"allocated": torch.cuda.memory_allocated(self.device)}
        else:
            peak = (_proc_status("VmHWM") if self.resettable else None) or max_rss()
            out = {"rss": current_rss(), "max_rss": max_rss()}
        if self.isolated:
            out["peak"] = peak
        else:
            out["peak"] = self.weight_bytes + self.kv_start + max(0, peak - self.base)
        return out


def time_steps(method: Method, steps: int) -> tuple[list[float], list[bool], float]:
    """Run `steps` decode steps: per-step seconds, whether each evicted, and the total seconds.
    The eviction counter is read once per step, after it."""
    evicting: list[bool] = []
    count = method.evictions()

    def record_eviction() -> None:
        nonlocal count
        before, count = count, method.evictions()
        evicting.append(before is not None and count != before)

    if method.device.type == "cuda":
        times, total = _cuda_step_times(method, steps, record_eviction)
        return times, evicting, total
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        method.step()
        times.append(time.perf_counter() - t0)
        record_eviction()
    return times, evicting, sum(times)


def _cuda_step_times(method: Method, steps: int, after_step: Callable[[], None]) -> tuple[list[float], float]:
    """Per-step seconds from CUDA events between the steps, and the wall seconds of all of them
    (one synchronisation at each end)."""
    torch.cuda.synchronize(method.device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    t0 = time.perf_counter()
    events[0].record()
    for i in range(steps):
        method.step()
        events[i + 1].record()
        after_step()
    torch.cuda.synchronize(method.device)
    total = time.perf_counter() - t0
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)], total


def eviction_share(times: list[float], evicting: list[bool]) -> float | None:
    """Share of the decode time spent evicting: (mean evicting step - mean plain step)
    x evicting steps / total time. `None` when it cannot be told (no plain step)."""
    ev = [t for t, e in zip(times, evicting, strict=True) if e]
    plain = [t for t, e in zip(times, evicting, strict=True) if not e]
    if not ev:
        return 0.0
    if not plain:
        return None
    return max(0.0, (statistics.fmean(ev) - statistics.fmean(plain)) * len(ev) / sum(times))


def step_summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    return {
        "mean": statistics.fmean(ms),
        "median": statistics.median(ms),
        "min": ms[0],
        "max": ms[-1],
        "p90": ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))],
    }


def _compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return 0


def sequence_inputs(settings: BenchSettings, batch: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded random prompt `[B, prompt_len]` and fast-forward tokens `[B, max_generated]`
    of one batch size: the same for every method."""
    g = torch.Generator().manual_seed(settings.cache.seed * 1009 + batch)
    prompt = torch.randint(vocab, (batch, settings.prompt_len), generator=g)
    stream = torch.randint(vocab, (batch, settings.max_generated), generator=g)
    return prompt, stream


class MethodRunner:
    """One method through the benchmark: `start(batch)`, `warmup()`, then `segment(length)`s.

    Every call returns a plain dict (it may cross a process boundary). With
    `model`, the method works on a weight-sharing copy of it; else it loads its own.
    """

    def __init__(self, settings: BenchSettings, spec: MethodSpec, model: torch.nn.Module | None = None) -> None:
        torch.set_num_threads(settings.threads)
        t0 = time.perf_counter()
        isolated = model is None
        if model is None:
            model = load_model(settings.model, getattr(torch, settings.dtype), settings.device, settings.cache.seed)
        self.weight_bytes = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
        self.settings = settings
        self.vocab = model.config.vocab_size
        self.method = build_method(spec, model if isolated else share_weights(model), settings)
        self.memory = MemoryProbe(self.method.device, isolated, self.weight_bytes)
        self.load_s = time.perf_counter() - t0

    def info(self) -> dict[str, Any]:
        return {"load_s": self.load_s, "weight_bytes": self.weight_bytes, "memory": self.memory.kind}

    def start(self, batch: int) -> dict[str, Any]:
        """A fresh cache for `batch` rows, prefilled with the prompt."""
        t0 = time.perf_counter()
        prompt, stream = sequence_inputs(self.settings, batch, self.vocab)
        self.stream = stream.to(self.method.device)
        self.batch = batch
        self.method.start(prompt.to(self.method.device), self.settings.max_generated)
        return {"prefill_s": time.perf_counter() - t0}

    def warmup(self) -> dict[str, Any]:
        """`steps` untimed decode steps right after the prefill (compilation happens here)."""
        graphs = _compiled_graphs()
        t0 = time.perf_counter()
        _, _, total = time_steps(self.method, self.settings.steps)
        return {"warmup_s": time.perf_counter() - t0, "steps_s": total, "graphs": _compiled_graphs() - graphs}

    def segment(self, length: int) -> dict[str, Any]:
        """Fast-forward to `length` generated tokens (if not there yet), then time `steps` decode steps."""
        m, steps = self.method, self.settings.steps
        t0 = time.perf_counter()
        m.advance_to(length, self.stream)
        m.before_segment()
        forward_s = time.perf_counter() - t0
        start = m.generated
        graphs = _compiled_graphs()
        self.memory.start(m.kv_bytes())
        times, evicting, total = time_steps(m, steps)
        memory = self.memory.stop()
        return {
            "start": start,
            "seconds": total,
            "tok_s": self.batch * steps / total,
            "step_ms": step_summary(times),
            "step_times_ms": [round(t * 1e3, 4) for t in times],
            "evicting_steps": sum(evicting),
            "eviction_share": eviction_share(times, evicting) if m.evictions() is not None else None,
            "kv_bytes": m.kv_bytes(),
            "peak_bytes": memory.pop("peak"),
            "memory": memory,
            "graphs": _compiled_graphs() - graphs,
            "fast_forward_s": forward_s,
        }

    def close(self) -> dict[str, Any]:
        self.method.close()
        return {}
