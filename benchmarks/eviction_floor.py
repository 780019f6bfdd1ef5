"""Where one eviction's time goes, against what a 2% eviction share allows (issue 22, item 4).

Decodes SmolLM2-135M patched with VaSE (fp32, CPU, budget 512, window 64 unless given), one token a
step, from a prompt of `budget` tokens, and records per eviction cycle the plain step (median) and what
the evicting step adds: a 2% share of decode time allows `0.02 / 0.98 * window * step` per eviction of
all 30 layers. Then, on 30 layers of SmolLM2's shapes holding random tokens (`eviction_batching.py`'s
`filled_layers`), it times in interleaved repeats (ms for all 30 layers, medians):

- `eviction`: `VaSELayer._compact`, the library's eviction (scores, noise, top-k, checks, ordering,
  gathers);
- `window attention`: `scoring.window_attention` alone, as the policy calls it;
- `products fp32`: only its `q k^T` products, one batched product per layer: the arithmetic that any
  exact (float32) window attention must do;
- `products bf16`: the same products in bfloat16, the casts included (the lower-precision option,
  which would change the picks);
- `gathers`: moving the kept keys and values (`eviction.gather_slots`), which every policy needs.

    python benchmarks/eviction_floor.py --batch 8,1 --threads 2
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
from eviction_batching import LAYERS, filled_layers, per_layer

import vasepatch
from vasepatch import models
from vasepatch.bench.methods import cache_keyword
from vasepatch.cache import eviction
from vasepatch.policies import scoring

SHARE = 0.02  # the target


def decode_cycles(model, args, batch: int) -> tuple[float, list[float]]:
    """(median plain step, the extra of each evicting step), in seconds, over `args.cycles` cycles."""
    handle = vasepatch.patch(model, budget=args.budget, window=args.window, policy=args.policy, seed=0)
    cache, keyword = handle.new_cache(), cache_keyword(model)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    token = torch.randint(0, model.config.vocab_size, (batch, args.budget), generator=g)
    plain, extra = [], []
    try:
        with torch.inference_mode():
            for cycle in range(args.cycles + 1):  # the first cycle warms up
                steps, before = [], layer.counters.evictions
                while layer.counters.evictions == before:
                    start = time.perf_counter()
                    token = model(input_ids=token, use_cache=True, **{keyword: cache}).logits[:, -1:].argmax(-1)
                    steps.append(time.perf_counter() - start)
                if cycle:
                    plain += steps[:-1]
                    extra.append(steps[-1] - statistics.median(steps[:-1]))
    finally:
        vasepatch.unpatch(model)
    return statistics.median(plain), extra


def _eviction(layers, kept) -> None:
    per_layer(layers)


def _window_attention(layers, kept) -> None:
    for layer in layers:
        n, opts = layer.capacity - layer.config.window, layer.policy.options
        temperature, smooth = opts.get("temperature", 1.0), opts.get("smooth", 1)
        scoring.window_attention(layer.keys[:, :, :n], layer.ring.read(), layer.valid[:, :, :n], temperature, smooth)


def _products(layers, kept, dtype: torch.dtype) -> None:
    for layer in layers:
        n, h = layer.capacity - layer.config.window, layer.keys.shape[1]
        q = layer.ring.read().to(dtype).unflatten(1, (h, -1)).flatten(2, 3)  # [B, Hkv, G * W, D]
        torch.matmul(q, layer.keys[:, :, :n].to(dtype).transpose(-1, -2))


def _gathers(layers, kept) -> None:
    for layer, slots in zip(layers, kept, strict=True):
        eviction.gather_slots(layer.keys, slots), eviction.gather_slots(layer.values, slots)


PARTS = {
    "eviction": _eviction,
    "window attention": _window_attention,
    "products fp32": lambda layers, kept: _products(layers, kept, torch.float32),
    "products bf16": lambda layers, kept: _products(layers, kept, torch.bfloat16),
    "gathers": _gathers,
}


def time_parts(batch: int, policy: str, repeats: int) -> dict[str, list[float]]:
    layers = filled_layers(batch, policy)
    g, (b, h, cap), budget = torch.Generator().manual_seed(1), layers[0].keys.shape[:3], layers[0].budget
    # the gathers' kept slots: any `budget` distinct slots per (row, head), in order (the cost does not depend on which)
    kept = [
        torch.stack([torch.randperm(cap, generator=g)[:budget].sort().values for _ in range(b * h)]).view(b, h, -1)
        for _ in layers
    ]
    times: dict[str, list[float]] = {name: [] for name in PARTS}
    with torch.inference_mode():
        for repeat in range(repeats + 1):  # the first round warms up
            for name, run in PARTS.items():
                start = time.perf_counter()
                run(layers, kept)
                if repeat:
                    times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="8,1")
    parser.add_argument("--cycles", type=int, default=4, help="timed eviction cycles of the decode")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats of the parts")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--policy", default="vase")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if (args.budget, args.window) != (512, 64):
        parser.error("the parts are timed at budget 512, window 64 (filled_layers): keep --budget and --window")
    torch.set_num_threads(args.threads)
    model, _ = models.load("smollm2-135m")
    print(f"smollm2-135m fp32, {args.policy}, budget {args.budget}, window {args.window}, {args.threads} threads")
    for batch in (int(x) for x in args.batch.split(",")):
        step, extra = decode_cycles(model, args, batch)
        allowed = SHARE / (1 - SHARE) * args.window * step
        e = statistics.median(extra)
        share = e / (args.window * step + e)
        print(f"batch {batch}: plain step {step * 1e3:.1f} ms; a {SHARE:.0%} share allows {allowed * 1e3:.0f} ms "
              f"per eviction of all {LAYERS} layers; in decode an eviction adds {e * 1e3:.0f} ms "
              f"[{min(extra) * 1e3:.0f}-{max(extra) * 1e3:.0f}], a share of {share:.2%}")  # fmt: skip
        for name, t in time_parts(batch, args.policy, args.repeats).items():
            med = statistics.median(t)
            print(f"  {name:17s} {med * 1e3:7.1f} ms [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]  "
                  f"{med / allowed:5.0%} of the allowance")  # fmt: skip


if __name__ == "__main__":
    main()
