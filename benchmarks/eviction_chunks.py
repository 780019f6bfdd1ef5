"""What an eviction adds to a real decode step, with the window attention chunked or in one product.

`scoring.window_attention` computes the `[G * W, N]` logits of a few (row, KV head) pairs at a
time (`scoring.CHUNK_BYTES`, 2 MiB on a CPU) instead of all of them in one batched product. This
decodes SmolLM2-135M patched with VaSE (fp32, CPU, budget 512, window 64 unless given), one token
a step, and for every eviction cycle (`window` steps, the last of which evicts) records the
evicting step's time minus the median plain step of its cycle: what the eviction of all 30 layers
adds. The cycles alternate between the two settings in one process (`chunked`: the library's;
`one product`: `CHUNK_BYTES` set past any size), so slow drifts of the machine hit both alike.
The share is `extra / (window * plain step + extra)`, the bench's eviction share for one cycle.

    python benchmarks/eviction_chunks.py --batch 1,8 --cycles 6 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import vasepatch
from vasepatch import models
from vasepatch.bench.methods import cache_keyword
from vasepatch.policies import scoring

SETTINGS = {"chunked": scoring.CHUNK_BYTES["cpu"], "one product": 2**62}


def decode_step(model, cache, keyword: str, ids: torch.Tensor) -> torch.Tensor:
    """One greedy step of `model` over `cache` (`keyword`: `cache_keyword(model)`); `[B, 1]` next tokens."""
    return model(input_ids=ids, use_cache=True, **{keyword: cache}).logits[:, -1:].argmax(-1)


def eviction_cycle(model, cache, keyword: str, ids: torch.Tensor) -> tuple[float, list[float], torch.Tensor]:
    """Decode up to and including the step at which the cache's layers evict: (that step's seconds,
    the plain steps' seconds, the last tokens). Every layer evicts at the same step."""
    layer, plain = cache.layers[0], []
    before = layer.counters.evictions
    while True:
        start = time.perf_counter()
        ids = decode_step(model, cache, keyword, ids)
        seconds = time.perf_counter() - start
        if layer.counters.evictions != before:
            return seconds, plain, ids
        plain.append(seconds)


def measure(model, args, batch: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per setting: (evicting step's extra, plain step median) of each cycle, in seconds."""
    handle = vasepatch.patch(model, budget=args.budget, window=args.window, policy=args.policy, seed=0)
    cache, keyword = handle.new_cache(), cache_keyword(model)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 128), generator=torch.Generator().manual_seed(0))
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in SETTINGS}
    try:
        with torch.inference_mode():
            _, _, ids = eviction_cycle(model, cache, keyword, prompt)  # up to the first eviction, untimed
            for cycle in range(args.cycles * len(SETTINGS)):
                name = list(SETTINGS)[cycle % len(SETTINGS)]
                scoring.CHUNK_BYTES["cpu"] = SETTINGS[name]
                seconds, plain, ids = eviction_cycle(model, cache, keyword, ids)
                typical = statistics.median(plain)
                results[name][0].append(seconds - typical)
                results[name][1].append(typical)
    finally:
        scoring.CHUNK_BYTES["cpu"] = SETTINGS["chunked"]
        vasepatch.unpatch(model)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--cycles", type=int, default=6, help="eviction cycles per setting")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--policy", default="vase")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = models.load("smollm2-135m")
    print(f"smollm2-135m fp32, {args.policy}, budget {args.budget}, window {args.window}, {args.threads} threads, "
          f"{args.cycles} cycles per setting, alternating; medians [min-max]")  # fmt: skip
    for batch in (int(x) for x in args.batch.split(",")):
        results = measure(model, args, batch)
        for name, (extra, plain) in results.items():
            e, p = statistics.median(extra), statistics.median(plain)
            share = e / (args.window * p + e)
            print(f"batch {batch}  {name:12s} eviction adds {e * 1e3:6.1f} ms [{min(extra) * 1e3:.1f}-"
                  f"{max(extra) * 1e3:.1f}] to a {p * 1e3:.1f} ms step: share {share:.2%}")  # fmt: skip


if __name__ == "__main__":
    main()
