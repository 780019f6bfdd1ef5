"""A soak of the vasepatch plugin in vLLM's OpenAI server: mixed traffic for a long time, then what it left behind.

    .venv-vllm/bin/python benchmarks/vllm_soak.py --minutes 30 --requests 2000 --out docs/results/vllm-soak
    .venv-vllm/bin/python benchmarks/vllm_soak.py --quick --out /tmp/soak     # a few minutes (CI's vLLM pass)

One server (`python -m vllm.entrypoints.openai.api_server`, bound to 127.0.0.1, float32, prefix caching on
unless `--prefix-caching off`) with a pool of `--pool-fits` full requests' worth of blocks, so that requests get
preempted. Against it, a seeded plan of requests (`plan`) arrives as a Poisson process at `--rate` per second (at
most `--open` requests open at once: an arrival waits for a free place), until at least `--minutes` have passed
and `--requests` have been sent. The mix: the full cache, `vase` and `snapkv`; `prefill` pin and compress (with
prefix caching on, a compress request is refused by design, HTTP 400 naming `prefill`, so they are 10% of the
evicting ones there and half of them with it off); `n` of 1 and 2; seeded and unseeded; stop strings; prompts
that share a prefix; streaming clients that disconnect early, and streaming clients that drop the connection
after the request has begun to evict (vLLM aborts a request whose client went away); and requests with a bad
budget, which the server must refuse (HTTP 400 naming `budget`).

After the last request the engine drains, and the soak asserts (exit status 1 and the failed checks listed
when any fails):
- at least one request was preempted (the pool was tight enough);
- leaked blocks 0: the block pool's free count (from `vllm:kv_cache_usage_perc` and the pool's size) is
  back to its value at the start;
- the plugin's query rings hold 0 bytes (`vllm:vasepatch_query_ring_bytes`) and no evicting request runs;
- the engine never restarted (the engine-core process is the one that started) and logged no fatal error while
  it served (the log up to the drain's last read: stopping the server makes vLLM log an `EngineDeadError` of
  its own, which is not a finding);
  every request completed, but those refused by design and those whose client left;
- the resident memory of the server and its processes after the drain is within `--rss-growth` (5%) of its
  value after the warm-up (the first tenth of the requests);
- `--seeded` seeded requests of the soak give the same text when sent again one at a time to a fresh server.

Writes `soak.json` and `soak.md` to `--out`. Requires the vLLM venv (docs/vllm.md, Install).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = {"full": 0.3, "vase": 0.5, "snapkv": 0.2}  # share of the traffic
BEHAVIOURS = {"plain": 0.55, "stream": 0.15, "disconnect": 0.1, "abort": 0.15, "refused": 0.05}
STOPS = (["\n\n"], ["."], ["Answer:"])
PREFIXES = (
    "You are a careful assistant. Think step by step, write each step on its own line, and end with the answer.",
    "The following is a conversation between a teacher and a student about arithmetic, history and science.",
    "Read the passage and answer the question. The passage: a river runs from the mountains to the sea,",
)
TOPICS = ("rivers", "bread", "prime numbers", "the moon", "a chess opening", "volcanoes", "trains", "music")
RING_SERIES = "vllm:vasepatch_query_ring_bytes"
EVICTING_SERIES = "vllm:vasepatch_num_requests_evicting"
FATAL = re.compile(r"EngineDeadError|EngineCore encountered a fatal error|died unexpectedly|Traceback \(most recent")


@dataclass
class Ask:
    """One request of the plan: its body and how its client behaves."""

    index: int
    body: dict[str, Any]
    behaviour: str
    leave_after: int = 0  # chunks read before a disconnecting client leaves
    refused_for: str = ""  # the setting a refusal by design names


@dataclass
class Tally:
    """What happened to the requests, and the texts of the seeded ones kept for the replay."""

    sent: int = 0
    completed: int = 0
    refused: int = 0
    disconnected: int = 0
    aborted: int = 0
    failed: list[str] = field(default_factory=list)
    seeded: list[tuple[dict[str, Any], str]] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/results/vllm-soak"))
    p.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct, vasepatch.models)")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--requests", type=int, default=2000, help="at least this many requests")
    p.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals per second")
    p.add_argument("--open", type=int, default=24, help="the most requests open at once")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=112, help="the longest answer asked for")
    p.add_argument("--block-size", type=int, default=32, help="a multiple of 32 (vLLM's CPU attention)")
    p.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="on",
        help="on: prompts share cached blocks, requests pin them and `compress` ones are refused (400)",
    )
    p.add_argument("--pool-fits", type=int, default=2, help="the pool: this many full requests at their longest")
    p.add_argument("--seeded", type=int, default=20, help="seeded requests replayed alone on a fresh server")
    p.add_argument("--rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI's: 2 minutes, 100 requests, 5 replays, pool of 1")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.requests, args.seeded, args.pool_fits = 2.0, 100, 5, 1
    return args


def plan(args: argparse.Namespace, count: int) -> list[Ask]:
    """`count` requests drawn from the mix with `args.seed`: the same plan on every run."""
    rng = random.Random(args.seed)
    return [_ask(args, rng, i) for i in range(count)]


def _pick(rng: random.Random, shares: dict[str, float]) -> str:
    return rng.choices(list(shares), weights=list(shares.values()))[0]


def _ask(args: argparse.Namespace, rng: random.Random, i: int) -> Ask:
    method, behaviour = _pick(rng, METHODS), _pick(rng, BEHAVIOURS)
    question = f"Tell me about {rng.choice(TOPICS)} (note {rng.randrange(10**6)})."
    prompt = f"{rng.choice(PREFIXES)}\n\n{question}" if rng.random() < 0.6 else question
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": rng.randint(24, args.max_tokens), "temperature": 0.8}
    body["n"] = 2 if rng.random() < 0.15 and behaviour in ("plain", "refused") else 1
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.25:
        body["stop"] = rng.choice(STOPS)
    xargs: dict[str, Any] = {}
    if method != "full":
        xargs = {"vasepatch_policy": method, "vasepatch_budget": args.budget, "vasepatch_window": args.window}
        compress = 0.1 if args.prefix_caching == "on" else 0.5  # on: a compress request is refused by design
        xargs["vasepatch_prefill"] = "compress" if rng.random() < compress else "pin"
    refused_for = ""
    if behaviour == "refused":
        xargs, refused_for = {**xargs, "vasepatch_budget": 0}, "budget"  # below the smallest budget: a 400
    elif xargs.get("vasepatch_prefill") == "compress" and args.prefix_caching == "on":
        behaviour, refused_for = "refused", "prefill"  # compaction would rewrite shared prompt blocks: a 400
    if xargs:
        body["vllm_xargs"] = xargs
    evicts = args.budget + args.window  # tokens generated before a pinned request's first eviction
    leave = rng.randint(1, 12) if behaviour == "disconnect" else rng.randint(evicts + 4, evicts + 24)
    if behaviour == "abort":
        body["max_tokens"] = max(body["max_tokens"], leave + 16)
    return Ask(i, body, behaviour, leave, refused_for)


async def send(client: Any, model: str, ask: Ask, tally: Tally) -> None:
    """One request, as its client behaves; its outcome counted in `tally`."""
    body = {**ask.body, "model": model, "stream": ask.behaviour in ("stream", "disconnect", "abort")}
    tally.sent += 1
    try:
        if body["stream"]:
            await _stream(client, body, ask, tally)
        else:
            await _plain(client, body, ask, tally)
    except Exception as exc:  # every failure is a finding of the soak, named in the report
        tally.failed.append(f"request {ask.index} ({ask.behaviour}): {type(exc).__name__}: {exc}")


async def _plain(client: Any, body: dict[str, Any], ask: Ask, tally: Tally) -> None:
    response = await client.post("/v1/completions", json=body)
    if ask.behaviour == "refused":
        if response.status_code == 400 and ask.refused_for in response.text:
            tally.refused += 1
            return
        raise RuntimeError(f"a bad setting got HTTP {response.status_code}: {response.text[:200]}")
    response.raise_for_status()
    choices = response.json()["choices"]
    if len(choices) != body["n"] or any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        raise RuntimeError(f"unfinished answer: {choices}")
    tally.completed += 1
    if "seed" in body and body["n"] == 1:
        tally.seeded.append((ask.body, choices[0]["text"]))


async def _stream(client: Any, body: dict[str, Any], ask: Ask, tally: Tally) -> None:
    chunks, finished = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            event = json.loads(line[6:])
            if "choices" not in event:
                raise RuntimeError(f"an error event after {chunks} chunks: {line[:300]}")
            finished = event["choices"][0].get("finish_reason") or finished
            if ask.behaviour != "stream" and chunks >= ask.leave_after and finished is None:
                break  # leaving the block closes the connection: vLLM aborts the request
    if ask.behaviour == "stream" or finished is not None:
        if finished not in ("stop", "length"):
            raise RuntimeError(f"a stream ended without a finish reason after {chunks} chunks")
        tally.completed += 1
    elif ask.behaviour == "disconnect":
        tally.disconnected += 1
    else:
        tally.aborted += 1


async def traffic(args: argparse.Namespace, url: str, model: str, on_warm: Any) -> Tally:
    """Poisson arrivals of the plan until both `--minutes` and `--requests` are reached; then the last answers."""
    import httpx

    tally, rng = Tally(), random.Random(args.seed + 1)
    places = asyncio.Semaphore(args.open)
    asks = iter(plan(args, 10 * args.requests + 10_000))
    end = time.monotonic() + 60 * args.minutes
    pending: set[asyncio.Task] = set()

    async def one(ask: Ask) -> None:
        try:
            await send(client, model, ask, tally)
        finally:
            places.release()

    limits = httpx.Limits(max_connections=args.open + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        while time.monotonic() < end or tally.sent < args.requests:
            await asyncio.sleep(rng.expovariate(args.rate))
            await places.acquire()
            pending.add(asyncio.create_task(one(next(asks))))
            pending = {t for t in pending if not t.done()}
            if tally.sent == max(1, args.requests // 10):
                on_warm()
        await asyncio.gather(*pending)
    return tally


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus series, summed over their labels, by name."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def free_blocks(values: dict[str, float], usable: int) -> int:
    """The pool's free blocks: vLLM's usage gauge is `1 - free / usable` (the null block not counted)."""
    return round((1.0 - values["vllm:kv_cache_usage_perc"]) * usable)


def drained(url: str, seconds: float = 300) -> dict[str, float]:
    """The series once nothing runs or waits (polled up to `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        values = metrics(url)
        idle = values.get("vllm:num_requests_running", 0) == 0 and values.get("vllm:num_requests_waiting", 0) == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(1)


def rss_bytes(pid: int) -> int:
    """Resident bytes of the server process and every process under it."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def engine_pids(pid: int) -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


def server_command(args: argparse.Namespace, model: str, port: int) -> list[str]:
    """The server: float32 (batch-invariant on the CPU, so a replay alone gives the same text), prefix caching
    on, a pool of `--pool-fits` full requests, and up to `--open` requests running at once."""
    from vasepatch.cache import footprint

    longest = 256 + args.max_tokens  # the longest prompt of the plan is well under 256 tokens
    blocks = footprint.pool_blocks(args.pool_fits, longest, args.block_size)
    config = json.loads((Path(model) / "config.json").read_text())
    pool_bytes = footprint.block_bytes(
        blocks * args.block_size, args.block_size, footprint.model_bytes_per_token(config, 4)
    )
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--block-size", str(args.block_size)]
    cmd += ["--max-model-len", str(longest), "--max-num-seqs", str(args.open)]
    cmd += ["--enable-prefix-caching" if args.prefix_caching == "on" else "--no-enable-prefix-caching"]
    cmd += [
        "--num-gpu-blocks-override",
        str(blocks),
        "--kv-cache-memory-bytes",
        str(pool_bytes),
        "--seed",
        str(args.seed),
    ]
    return cmd


def usable_blocks(args: argparse.Namespace) -> int:
    """The pool's blocks that requests can hold (vLLM's null block aside)."""
    from vasepatch.cache import footprint

    return footprint.pool_blocks(args.pool_fits, 256 + args.max_tokens, args.block_size) - footprint.NULL_BLOCKS


def soak(args: argparse.Namespace, model: str) -> tuple[dict[str, Any], Tally]:
    """Run the traffic against one server; the figures of what it left behind after the drain."""
    import vllm_serve  # this folder's server helpers: start, health, stop by process group

    port = vllm_serve.free_port()
    log = args.out / "server.log"
    figures: dict[str, Any] = {"machine": vllm_serve.machine(argparse.Namespace(dtype="float32"), model)}
    with vllm_serve.server_process(server_command(args, model, port), port, log) as (url, proc):
        pid = proc.pid
        engines = engine_pids(pid)
        figures["free_blocks_start"] = free_blocks(metrics(url), usable_blocks(args))
        started = time.monotonic()

        def on_warm() -> None:
            figures["rss_after_warmup"] = rss_bytes(pid)

        tally = asyncio.run(traffic(args, url, model, on_warm))
        figures["traffic_s"] = round(time.monotonic() - started, 1)
        after = drained(url)
        time.sleep(2)  # the last stat step reaches the API server's loggers
        after = metrics(url)
        figures["free_blocks_end"] = free_blocks(after, usable_blocks(args))
        figures["ring_bytes_after"] = after.get(RING_SERIES)
        figures["evicting_after"] = after.get(EVICTING_SERIES)
        shown = ("vasepatch", "preemptions")
        figures["series"] = {k: v for k, v in after.items() if any(w in k for w in shown) and "_created" not in k}
        figures["rss_after_drain"] = rss_bytes(pid)
        figures["engine_restarted"] = not engines or not engines <= engine_pids(pid)
        served = log.stat().st_size  # what the server logged before it was told to stop
    figures["fatal_log_lines"] = fatal_lines(log, served)
    return figures, tally


def fatal_lines(log: Path, served: int) -> list[str]:
    """The fatal lines among the first `served` bytes of the server's log: those it wrote while it served.
    Stopping the server (SIGINT, then its engine killed) makes vLLM's output handler log an `EngineDeadError`
    traceback on some runs; that noise comes after `served` and is not scanned."""
    with log.open("rb") as f:
        text = f.read(served).decode(errors="replace")
    return [line for line in text.splitlines() if FATAL.search(line)][:10]


def replay(args: argparse.Namespace, model: str, seeded: list[tuple[dict[str, Any], str]]) -> list[bool]:
    """Each seeded request again, one at a time, on a fresh server: whether its text is the soak's."""
    import httpx
    import vllm_serve

    port = vllm_serve.free_port()
    same = []
    command = server_command(args, model, port)
    with vllm_serve.server(command, port, args.out / "replay.log") as url, httpx.Client(base_url=url, timeout=600) as c:
        for body, text in seeded:
            response = c.post("/v1/completions", json={**body, "model": model})
            response.raise_for_status()
            same.append(response.json()["choices"][0]["text"] == text)
    return same


def checks(args: argparse.Namespace, figures: dict[str, Any], tally: Tally, same: list[bool]) -> list[str]:
    """The failed checks, each in one line; none when the soak passed."""
    failed = []
    leaked = figures["free_blocks_start"] - figures["free_blocks_end"]
    if leaked != 0:
        failed.append(f"leaked blocks: {leaked} (free {figures['free_blocks_start']} -> {figures['free_blocks_end']})")
    if figures["ring_bytes_after"] != 0 or figures["evicting_after"] != 0:
        failed.append(
            f"after the drain: ring bytes {figures['ring_bytes_after']}, evicting {figures['evicting_after']}"
        )
    if not figures["series"].get("vllm:num_preemptions_total"):
        failed.append("no request was preempted: the pool was not tight enough")
    if figures["engine_restarted"] or figures["fatal_log_lines"]:
        failed.append(f"the engine restarted or failed: {figures['fatal_log_lines']}")
    if tally.failed:
        failed.append(f"{len(tally.failed)} requests failed, first: {tally.failed[:3]}")
    growth = figures["rss_after_drain"] / figures["rss_after_warmup"] - 1
    if growth > args.rss_growth:
        failed.append(f"resident memory grew {growth:.1%} after the warm-up (at most {args.rss_growth:.0%})")
    if len(same) < args.seeded or not all(same):
        failed.append(f"seeded replays alone: {sum(same)} of {len(same)} the same (of {args.seeded} asked)")
    return failed


def report(args: argparse.Namespace, argv: list[str], figures: dict[str, Any], tally: Tally, same: list[bool]):
    """`soak.json` and `soak.md` under `--out`; the failed checks."""
    failed = checks(args, figures, tally, same)
    counts = {k: v for k, v in asdict(tally).items() if k != "seeded"}
    counts["failed"] = len(tally.failed)
    record = {
        "command": "python benchmarks/vllm_soak.py " + " ".join(argv),
        "machine": figures.get("machine", ""),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "requests": tally.sent,
        **{k: v for k, v in counts.items() if k != "sent"},
        "leaked_blocks": figures["free_blocks_start"] - figures["free_blocks_end"],
        **figures,
        "rss_growth": figures["rss_after_drain"] / figures["rss_after_warmup"] - 1,
        "seeded_replays_same": f"{sum(same)}/{len(same)}",
        "failures": tally.failed[:50],
        "failed_checks": failed,
    }
    (args.out / "soak.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "soak.md").write_text(markdown(record))
    return failed


def markdown(r: dict[str, Any]) -> str:
    mib = 2**20
    rows = [
        ("requests sent", r["requests"]),
        ("completed / refused by design / disconnected / aborted while evicting / failed",
         f"{r['completed']} / {r['refused']} / {r['disconnected']} / {r['aborted']} / {r['failed']}"),
        ("traffic (s)", r["traffic_s"]),
        ("leaked blocks (free at start -> after the drain)",
         f"{r['leaked_blocks']} ({r['free_blocks_start']} -> {r['free_blocks_end']})"),
        ("query-ring bytes after the drain; evicting requests running",
         f"{r['ring_bytes_after']}; {r['evicting_after']}"),
        ("engine restarted; fatal log lines", f"{r['engine_restarted']}; {len(r['fatal_log_lines'])}"),
        ("resident MiB after warm-up -> after the drain (growth)",
         f"{r['rss_after_warmup'] / mib:.0f} -> {r['rss_after_drain'] / mib:.0f} ({r['rss_growth']:+.1%})"),
        ("seeded requests replayed alone on a fresh server, same text", r["seeded_replays_same"]),
    ]  # fmt: skip
    lines = [
        f"`{r['command']}`",
        "",
        *([r["machine"], ""] if r.get("machine") else []),
        "| | |",
        "|---|---|",
        *(f"| {a} | {b} |" for a, b in rows),
        "",
    ]
    lines += ["Series after the drain:", "", *(f"- `{k}` {v:g}" for k, v in sorted(r["series"].items())), ""]
    verdict = "passed" if not r["failed_checks"] else "FAILED: " + "; ".join(r["failed_checks"])
    return "\n".join([*lines, f"Soak {verdict}.", ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from vasepatch import models

    model = args.model or str(models.resolve("smollm2-135m"))
    args.out.mkdir(parents=True, exist_ok=True)
    figures, tally = soak(args, model)
    same = replay(args, model, tally.seeded[: args.seeded])
    failed = report(args, argv, figures, tally, same)
    print((args.out / "soak.md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
