"""Where one eviction's time goes, against what a 2% eviction share allows (issue 22, item 4).

Decodes SmolLM2-135M patched with VaSE (`vase`, fp32, CPU, budget 512, window 64), one token a step,
from a random prompt of 512 tokens, and records per eviction cycle the plain step (median) and what the
evicting step adds. A 2% share of decode time allows `0.02 / 0.98 * 64 * step` per eviction of all 30
layers. Then, on 30 layers of SmolLM2's shapes holding random tokens (`eviction_batching.py`'s
`filled_layers`: the costs depend on the shapes, not the numbers), it times these parts in interleaved
repeats (ms for all 30 layers, median [min-max]):

- `eviction alone`: `VaSELayer._compact`, the library's eviction out of the decode (scores, noise,
  top-k, checks, ordering, gathers), on the same layers every repeat (each keeps `budget` of the same
  number of slots, so the cost is the same);
- `window attention`: `scoring.window_attention` alone, as `vase` calls it;
- `products fp32`: only its `q k^T` products, one batched product per layer: the arithmetic that any
  exact (float32) window attention must do;
- `products bf16`: the same products in bfloat16, the casts included (the lower-precision option,
  which would change the picks);
- `gathers`: moving the kept keys and values (`slots.gather_slots`), which every policy needs.

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
from eviction_chunks import eviction_cycle

import vasepatch
from vasepatch import models
from vasepatch.bench.methods import cache_keyword
from vasepatch.cache.slots import gather_slots
from vasepatch.policies import scoring

SHARE = 0.02  # the target
POLICY, BUDGET, WINDOW = "vase", 512, 64  # what `filled_layers` builds


def decode_cycles(model, batch: int, cycles: int) -> tuple[float, list[float]]:
    """(median plain step, the extra of each evicting step), in seconds, over `cycles` eviction cycles."""
    handle = vasepatch.patch(model, budget=BUDGET, window=WINDOW, policy=POLICY, seed=0)
    cache, keyword = handle.new_cache(), cache_keyword(model)
    ids = torch.randint(0, model.config.vocab_size, (batch, BUDGET), generator=torch.Generator().manual_seed(0))
    plain, extra = [], []
    try:
        with torch.inference_mode():
            for cycle in range(cycles + 1):  # the first cycle warms up
                seconds, steps, ids = eviction_cycle(model, cache, keyword, ids)
                if cycle:
                    plain += steps
                    extra.append(seconds - statistics.median(steps))
    finally:
        vasepatch.unpatch(model)
    return statistics.median(plain), extra


def _eviction(layers, kept) -> None:
    per_layer(layers)


def _window_attention(layers, kept) -> None:
    for layer in layers:
        n, opts = layer.capacity - WINDOW, layer.policy.options
        keys, valid = layer.keys[:, :, :n], layer.valid[:, :, :n]
        scoring.window_attention(keys, layer.ring.read(), valid, opts["temperature"], opts["smooth"])


def _products(layers, kept, dtype: torch.dtype) -> None:
    for layer in layers:
        n, h = layer.capacity - WINDOW, layer.keys.shape[1]
        q = layer.ring.read().to(dtype).unflatten(1, (h, -1)).flatten(2, 3)  # [B, Hkv, G * W, D], as window_attention
        torch.matmul(q, layer.keys[:, :, :n].to(dtype).transpose(-1, -2))


def _gathers(layers, kept) -> None:
    for layer, slots in zip(layers, kept, strict=True):
        gather_slots(layer.keys, slots)
        gather_slots(layer.values, slots)


PARTS = {
    "eviction alone": _eviction,
    "window attention": _window_attention,
    "products fp32": lambda layers, kept: _products(layers, kept, torch.float32),
    "products bf16": lambda layers, kept: _products(layers, kept, torch.bfloat16),
    "gathers": _gathers,
}


def kept_slots_for_gathers(layers) -> list[torch.Tensor]:
    """Per layer `[B, Hkv, budget]`: `budget` distinct slots per (row, head), in order (which ones does not
    change the gather's cost)."""
    g = torch.Generator().manual_seed(1)
    b, h, capacity = layers[0].keys.shape[:3]

    def one() -> torch.Tensor:
        return torch.randperm(capacity, generator=g)[:BUDGET].sort().values

    return [torch.stack([one() for _ in range(b * h)]).view(b, h, BUDGET) for _ in layers]


def time_parts(batch: int, repeats: int) -> dict[str, list[float]]:
    """Per part, its time (s) for all layers in each of `repeats` interleaved rounds, after one warm-up round."""
    layers = filled_layers(batch, POLICY)
    kept = kept_slots_for_gathers(layers)
    times: dict[str, list[float]] = {name: [] for name in PARTS}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for name, run in PARTS.items():
                start = time.perf_counter()
                run(layers, kept)
                if repeat:
                    times[name].append(time.perf_counter() - start)
    return times


def _batches(text: str) -> list[int]:
    try:
        batches = [int(x) for x in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"expected batch sizes >= 1 separated by commas, got {text!r}")
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=_batches, default=[8, 1], help="batch sizes, e.g. 8,1 (default: 8,1)")
    parser.add_argument("--cycles", type=int, default=4, help="timed eviction cycles of the decode (default: 4)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats of the parts (default: 9)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    for name in ("cycles", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    model, _ = models.load("smollm2-135m")
    print(f"smollm2-135m fp32, {POLICY}, budget {BUDGET}, window {WINDOW}, {args.threads} threads; parts: "
          f"{LAYERS} layers of SmolLM2's shapes, random tokens, ms for all layers, median [min-max] of "
          f"{args.repeats} interleaved repeats")  # fmt: skip
    for batch in args.batch:
        step, extra = decode_cycles(model, batch, args.cycles)
        allowed = SHARE / (1 - SHARE) * WINDOW * step
        e = statistics.median(extra)
        share = e / (WINDOW * step + e)
        print(f"batch {batch}: plain step {step * 1e3:.1f} ms; a {SHARE:.0%} share allows {allowed * 1e3:.0f} ms "
              f"per eviction of all {LAYERS} layers; in the decode an eviction adds {e * 1e3:.0f} ms "
              f"[{min(extra) * 1e3:.0f}-{max(extra) * 1e3:.0f}], a share of {share:.2%}")  # fmt: skip
        for name, t in time_parts(batch, args.repeats).items():
            med = statistics.median(t)
            print(f"  {name:17s} {med * 1e3:7.1f} ms [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]  "
                  f"{med / allowed:5.0%} of the allowance")  # fmt: skip


if __name__ == "__main__":
    main()
