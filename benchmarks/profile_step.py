"""Where one eager decode step and one eviction spend their time: torch.profiler's top ops.

    python benchmarks/profile_step.py [--model smollm2-135m] [--budget 512] [--window 64] [--batch 1] [--top 12]

Three profiles of SmolLM2-135M (fp32, CPU, `--threads` threads), each printed as a markdown
table of the top ops by self CPU time per step, with the step's wall time:

- `floor`: the unpatched model (transformers' `DynamicCache`) decoding after a prompt of
  `budget` tokens: the cost of an ideal fixed-size cache;
- `vase decode`: the patched model (`policy="vase"`) decoding with `budget + 1 ... budget +
  window - 1` tokens held, no eviction among the profiled steps;
- `vase eviction`: the one decode step that ends with an eviction, minus nothing: the
  eviction's own ops (the policy's scores, the sort, the gathers) are the rows that the
  decode profile lacks.

Run it from a checkout to profile that checkout (it imports the `vasepatch` beside it).
Profiler overhead inflates every op a little; compare rows within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

import vasepatch
from vasepatch.bench.methods import cache_keyword, share_weights
from vasepatch.bench.shapes import load_model
from vasepatch.tools import threads


@torch.no_grad()
def forward(model: torch.nn.Module, ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs).logits[:, -1].argmax(-1, keepdim=True)


def table(prof: profile, steps: int, wall_ms: float, title: str, top: int) -> str:
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    lines = [f"**{title}**: {wall_ms:.1f} ms wall per step, {total:.1f} ms self CPU per step (profiled)", ""]
    lines += ["| op | calls per step | self CPU ms per step | share |", "|---|---|---|---|"]
    for e in events[:top]:
        ms = e.self_cpu_time_total / steps / 1e3
        lines.append(f"| `{e.key}` | {e.count / steps:.0f} | {ms:.2f} | {100 * ms / total:.1f}% |")
    return "\n".join(lines)


def profiled(run, steps: int) -> tuple[profile, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        wall = (time.perf_counter() - t0) / steps * 1e3
    return prof, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32, help="profiled decode steps (fewer than --window)")
    threads.add_option(p)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if not 0 < args.steps < args.window:
        p.error(f"--steps must be in [1, {args.window - 1}] (fewer than --window: no eviction), got {args.steps}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dense = load_model(args.model, torch.float32, "cpu")
    vocab, b = dense.config.vocab_size, args.batch

    from transformers import DynamicCache

    floor_kwargs = {cache_keyword(dense): DynamicCache(config=dense.config)}
    token = forward(dense, torch.randint(vocab, (b, args.budget), generator=g), floor_kwargs)

    def floor_step() -> None:
        nonlocal token
        token = forward(dense, token, floor_kwargs)

    floor_step()
    prof, wall = profiled(floor_step, args.steps)
    print(table(prof, args.steps, wall, f"floor (dense, prompt {args.budget}, batch {b})", args.top), "\n")

    patched = share_weights(dense)
    handle = vasepatch.patch(patched, budget=args.budget, window=args.window, seed=0)
    cache = handle.new_cache()
    vkw = {handle.cache_keyword: cache}
    vtoken = forward(patched, torch.randint(vocab, (b, 2 * args.budget), generator=g), vkw)

    def vase_step() -> None:
        nonlocal vtoken
        vtoken = forward(patched, vtoken, vkw)

    while cache.tokens_until_eviction() != args.window:  # right after an eviction
        vase_step()
    vase_step()
    prof, wall = profiled(vase_step, args.steps)
    title = f"vase decode (budget {args.budget}, window {args.window}, batch {b})"
    print(table(prof, args.steps, wall, title, args.top))
    print()
    while cache.tokens_until_eviction() != 1:
        vase_step()
    prof, wall = profiled(vase_step, 1)
    print(table(prof, 1, wall, "vase eviction step (one decode step that ends with an eviction)", args.top))


if __name__ == "__main__":
    main()
