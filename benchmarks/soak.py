"""Soak: a long decode on a patched model, with memory, speed and evictions over time.

    python benchmarks/soak.py [OUT_DIR] [--steps 100000] [--every 1000] [--model tiny|smollm2]

Decodes `--steps` tokens one at a time (greedy) through the patched model's own forward and
a `handle.new_cache()` cache: exactly the step `generate` runs, without `generate`'s
`input_ids`/`attention_mask` tensors that grow by one column per token (they would add
their own 16 bytes per token to RSS). Every `--every` tokens it records RSS
(`/proc/self/status` VmRSS), the number of gc-tracked objects, the time since the last
record (ms per 1,000 tokens), evictions, occupancy, capacity and `kv_bytes`.

`--model tiny` (default): a random-weight Llama (2 layers, hidden 256, 8 query / 2 KV heads,
head_dim 32, vocab 1024), fast enough for 100,000 steps on 2 CPU cores. `--model smollm2`:
SmolLM2-135M-Instruct (about 60 ms per token on 2 cores: use `--steps 10000` or fewer).
Writes `soak.json` and `soak.md` to OUT_DIR (default: print only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20


def rss_bytes() -> int:
    """Resident set size now (VmRSS of /proc/self/status), in bytes."""
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def tiny_model(vocab: int = 1024):
    import torch
    import transformers

    from vasepatch.bench.shapes import TINY_CONFIG

    # the tests' tiny settings, wider: hidden 256 (8 query heads of 32, 2 KV heads), vocab 1024
    cfg = transformers.LlamaConfig(
        **{
            **TINY_CONFIG,
            "vocab_size": vocab,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
        }
    )
    torch.manual_seed(0)  # a script of its own: the global seed only fixes the random weights
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def load(name: str):
    if name == "tiny":
        return tiny_model()
    from vasepatch import models

    return models.load("smollm2-135m")[0]


def _record(done: int, cache, wall: float, cpu: float, every: int) -> dict:
    stats = cache.stats()
    record = {
        "tokens": done,
        "rss_bytes": rss_bytes(),
        "gc_objects": len(gc.get_objects()),
        "ms_per_1000_tokens": wall * 1000 * 1000 / every,
        "cpu_ms_per_1000_tokens": cpu * 1000 * 1000 / every,
        **{k: stats[k] for k in ("evictions", "evicted_tokens", "occupancy", "capacity", "kv_bytes")},
    }
    print(
        f"{done:>8} tokens  RSS {record['rss_bytes'] / MIB:.1f} MiB  {record['ms_per_1000_tokens']:.0f} ms/1k "
        f"(CPU {record['cpu_ms_per_1000_tokens']:.0f})  evictions {record['evictions']}",
        file=sys.stderr,
        flush=True,
    )
    return record


def soak(model, steps: int, every: int, budget: int, window: int, prompt: int) -> dict:
    """Decode `steps` tokens after a `prompt`-token prompt; one record every `every` tokens.
    SIGINT/SIGTERM stop it early: the records so far are kept (`completed_steps` says how far)."""
    import torch

    import vasepatch

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    records, done = [], 0
    with torch.no_grad(), vasepatch.patched(model, budget=budget, window=window, seed=0) as handle:
        cache = handle.new_cache()
        token = model(input_ids=ids, **{handle.cache_keyword: cache}).logits[:, -1:].argmax(-1)
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            for done in range(1, steps + 1):
                token = model(input_ids=token, **{handle.cache_keyword: cache}).logits[:, -1:].argmax(-1)
                if done % every == 0:
                    now, now_cpu = time.perf_counter(), time.process_time()
                    records.append(_record(done, cache, now - wall, now_cpu - cpu, every))
                    wall, cpu = time.perf_counter(), time.process_time()  # the record itself is not timed
        except KeyboardInterrupt:
            print(f"stopped after {done - 1} steps", file=sys.stderr)
    return {"records": records, "completed_steps": records[-1]["tokens"] if records else 0}


def summarize(records: list[dict]) -> dict:
    """First/last/max RSS, the spread of RSS over the second half, speed and evictions."""
    half = records[len(records) // 2 :]
    rss = [r["rss_bytes"] for r in records]
    speed = sorted(r["ms_per_1000_tokens"] for r in records)
    cpu = sorted(r["cpu_ms_per_1000_tokens"] for r in records)
    return {
        "rss_first_mib": rss[0] / MIB,
        "rss_last_mib": rss[-1] / MIB,
        "rss_max_mib": max(rss) / MIB,
        "rss_second_half_spread_mib": (max(r["rss_bytes"] for r in half) - min(r["rss_bytes"] for r in half)) / MIB,
        "gc_objects_first": records[0]["gc_objects"],
        "gc_objects_last": records[-1]["gc_objects"],
        "ms_per_1000_tokens_median": speed[len(speed) // 2],
        "ms_per_1000_tokens_min": speed[0],
        "ms_per_1000_tokens_max": speed[-1],
        "cpu_ms_per_1000_tokens_median": cpu[len(cpu) // 2],
        "evictions": records[-1]["evictions"],
        "evicted_tokens": records[-1]["evicted_tokens"],
        "capacity": sorted({r["capacity"] for r in records}),
        "kv_bytes": sorted({r["kv_bytes"] for r in records}),
    }


def report(summary: dict, records: list[dict], args: argparse.Namespace) -> str:
    s = summary
    done = s["completed_steps"]
    stopped = "" if done == args.steps else f" — stopped early, after {done:,} of {args.steps:,}"
    lines = [
        f"**Soak: {done:,} greedy decode steps{stopped}** (`python benchmarks/soak.py {' '.join(sys.argv[1:])}`; "
        f"`--model {args.model}`, fp32, CPU, {args.threads} threads; "
        f"{args.prompt}-token prompt, budget={args.budget}, window={args.window}, seed=0)\n",
        f"- RSS: {s['rss_first_mib']:.1f} MiB after {records[0]['tokens']:,} tokens, {s['rss_last_mib']:.1f} MiB "
        f"at the end (max {s['rss_max_mib']:.1f}); "
        f"spread over the second half {s['rss_second_half_spread_mib']:.2f} MiB",
        f"- gc-tracked objects: {s['gc_objects_first']:,} → {s['gc_objects_last']:,}",
        f"- capacity {s['capacity']} slots, kv_bytes {s['kv_bytes']} (constant if one value each)",
        f"- {s['evictions']:,} evictions, {s['evicted_tokens']:,} slots evicted per row and KV head",
        f"- ms per 1,000 tokens: median {s['ms_per_1000_tokens_median']:.0f} "
        f"(min {s['ms_per_1000_tokens_min']:.0f}, max {s['ms_per_1000_tokens_max']:.0f}); CPU time per 1,000 "
        f"tokens: median {s['cpu_ms_per_1000_tokens_median']:.0f} ms (wall time includes waiting for a shared CPU)\n",
        "| tokens | RSS MiB | gc objects | ms / 1,000 tokens | CPU ms / 1,000 tokens | evictions | occupancy |",
        "|---|---|---|---|---|---|---|",
    ]
    step = max(1, len(records) // 20)
    for r in records[::step] + ([records[-1]] if (len(records) - 1) % step else []):
        lines.append(
            f"| {r['tokens']:,} | {r['rss_bytes'] / MIB:.1f} | {r['gc_objects']:,} | "
            f"{r['ms_per_1000_tokens']:.0f} | {r['cpu_ms_per_1000_tokens']:.0f} | "
            f"{r['evictions']:,} | {r['occupancy']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", type=Path)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.steps < 2 * args.every:
        p.error(f"--steps must be at least 2 * --every ({2 * args.every}), got {args.steps}")
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = soak(load(args.model), args.steps, args.every, args.budget, args.window, args.prompt)
    records = result["records"]
    if len(records) < 2:
        sys.exit("stopped before two records: nothing to report")
    summary = {
        **summarize(records),
        "completed_steps": result["completed_steps"],
        "wall_s": time.perf_counter() - start,
    }
    text = report(summary, records, args)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"settings": vars(args), "command": " ".join(sys.argv), "summary": summary, "records": records}
        (args.out / "soak.json").write_text(json.dumps(payload, indent=2, default=str))
        (args.out / "soak.md").write_text(text)


if __name__ == "__main__":
    main()
