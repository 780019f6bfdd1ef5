"""transformers' continuous batching with and without eviction, side by side in one run: `generate_batch` on
SmolLM2-135M-Instruct with a fixed number of KV blocks, first unpatched (the full cache), then patched.

    python benchmarks/continuous_batching/bench.py                    # 32 requests of 128 + 512 tokens
    python benchmarks/continuous_batching/bench.py --requests 8 --new 64 --blocks 40    # a quick look

Every request has a prompt of `--prompt` random tokens and generates exactly `--new` tokens (greedy, no EOS).
The paged cache holds `--blocks` blocks of `--page` tokens: the full cache needs `ceil((prompt + new) / page)`
per request at its end, so with few blocks its requests queue, or are offloaded and started over when the
blocks run out (transformers' soft reset: no CPU offload space on this machine); an evicting request holds at
most `ceil((budget + window) / page)` after its first eviction.

Per arm: wall time, generated tokens per second (the requests' `--new` tokens each, over the wall time), the
most KV blocks in use at a step (every request's block table, counted when the scheduler has allocated the
step's blocks), the most requests running at a step, and the offloads. The ratios compare the two arms of this
run; the machine, the threads and the load are the same for both. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import offloading_manager, scheduler

import vasepatch
from vasepatch import models


class Probe:
    """What the scheduler and the offloading manager do during one arm: the peaks at each step, the offloads."""

    def __init__(self) -> None:
        self.blocks = self.running = self.offloads = 0
        self._schedule = scheduler.FIFOScheduler.schedule_batch
        self._offload = offloading_manager.OffloadingManager.offload_requests

    def __enter__(self) -> Probe:
        probe, schedule, offload = self, self._schedule, self._offload

        def scheduled(sched, *args, **kwargs):
            out = schedule(sched, *args, **kwargs)
            tables = [t for a in sched.cache.cache_allocators.values() for t in a.block_table.values()]
            probe.blocks = max(probe.blocks, sum(len(t) for t in tables))
            probe.running = max(probe.running, len(sched.active_requests))
            return out

        def offloaded(manager, *args, **kwargs):
            done = offload(manager, *args, **kwargs)
            probe.offloads += bool(done)
            return done

        scheduler.FIFOScheduler.schedule_batch = scheduled
        offloading_manager.OffloadingManager.offload_requests = offloaded
        return self

    def __exit__(self, *exc) -> None:
        scheduler.FIFOScheduler.schedule_batch = self._schedule
        offloading_manager.OffloadingManager.offload_requests = self._offload


def arm(model, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """One `generate_batch` of every prompt, measured (see the module's docstring)."""
    generation = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=args.page, num_blocks=args.blocks, max_batch_tokens=args.batch_tokens)
    with Probe() as probe:
        start = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb)
        wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"wall_s": wall, "tok_s": tokens / wall, "tokens": tokens, "peak_blocks": probe.blocks,
            "peak_running": probe.running, "offloads": probe.offloads}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--blocks", type=int, default=160, help="KV blocks of the paged cache (default: 8 full requests)")
    p.add_argument("--batch-tokens", type=int, default=1024, help="max_batch_tokens of a step")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the numbers here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = models.load("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, tokenizer.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.requests)
    ]
    full = arm(model, prompts, args)
    with vasepatch.patched(model, budget=args.budget, window=args.window, seed=0) as handle:
        vase = arm(model, prompts, args)
        vase["evictions"] = handle.batching_stats()["evictions"]
    bound = math.ceil((args.budget + args.window) / args.page)
    print(f"{args.requests} requests of {args.prompt} + {args.new} tokens, {args.blocks} blocks of {args.page}, "
          f"torch threads {args.threads}; vase at budget {args.budget} + window {args.window} "
          f"(at most {bound} blocks per request after its first eviction)")  # fmt: skip
    print("| arm | wall s | tok/s | peak blocks in use | peak requests running | offloads |")
    print("|---|---|---|---|---|---|")
    for name, r in (("full", full), ("vase", vase)):
        print(f"| {name} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {r['peak_blocks']} | {r['peak_running']} | "
              f"{r['offloads']} |")  # fmt: skip
    speed, blocks = vase["tok_s"] / full["tok_s"], vase["peak_blocks"] / full["peak_blocks"]
    print(f"vase/full: tok/s {speed:.2f}x, peak blocks in use {blocks:.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "full": full, "vase": vase}, indent=1)
        )


if __name__ == "__main__":
    main()
