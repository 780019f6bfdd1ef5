"""Eager decode step time of `vase` against the floor, interleaved in one process.

    python benchmarks/decode_vs_floor.py [--batch 1] [--repeats 5] [--threads N]

The floor is the dense model (transformers' `DynamicCache`) decoding over a
512-token prompt, rewound to it before every segment; `vase` is the patched
model (budget 512, window 64) after 1,024 generated tokens, its segments
continuing the sequence (each 64-step segment holds one eviction). Both share
the weights of SmolLM2-135M (fp32, CPU); segments alternate floor, vase,
floor, ... and each prints its mean ms per step. The same measurement as
`vasepatch bench`'s `floor` and `vase` rows, in one process and without the
bench's machinery, so that it runs from an older checkout too: it imports the
`vasepatch` beside it (`python /path/to/checkout/benchmarks/decode_vs_floor.py`).
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

from vasepatch.bench.methods import build_method, share_weights
from vasepatch.bench.settings import BenchSettings, MethodSpec
from vasepatch.bench.shapes import load_model
from vasepatch.tools import threads

BUDGET, GENERATED, STEPS = 512, 1024, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    threads.add_option(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    settings = BenchSettings(tokens=[GENERATED], batch=[args.batch], methods=["dense", "vase"], isolate="none")
    model = load_model(settings.model, torch.float32, "cpu", 0)
    vocab, b = model.config.vocab_size, args.batch
    g = torch.Generator().manual_seed(0)
    floor = build_method(MethodSpec.parse("dense"), share_weights(model), settings)
    floor.start(torch.randint(vocab, (b, BUDGET), generator=g), 4 * GENERATED)
    vase = build_method(MethodSpec.parse("vase"), share_weights(model), settings)
    vase.start(torch.randint(vocab, (b, settings.prompt_len), generator=g), 4 * GENERATED)
    vase.advance_to(GENERATED, torch.randint(vocab, (b, 4 * GENERATED), generator=g))
    print(
        f"SmolLM2-135M, fp32, budget {BUDGET}, window 64, {GENERATED} generated tokens, batch {b}, "
        f"{args.threads} threads, {args.repeats} x {STEPS} steps each, floor and vase alternating:"
    )
    times: dict[str, list[float]] = {"floor": [], "vase": []}
    for _ in range(args.repeats):
        for name, method in (("floor", floor), ("vase", vase)):
            if name == "floor":
                floor.cache.crop(BUDGET - floor.seen)  # rewind to the prompt
                floor.seen = BUDGET
            steps = []
            for _ in range(STEPS):
                t0 = time.perf_counter()
                method.step()
                steps.append(time.perf_counter() - t0)
            times[name].append(statistics.fmean(steps) * 1e3)
    for name, ms in times.items():
        print(f"{name}: ms per step {[round(t, 1) for t in ms]}, median {statistics.median(ms):.2f}")
    ratio = statistics.median(times["vase"]) / statistics.median(times["floor"])
    print(f"time per step, vase / floor (medians; lower is faster): {ratio:.3f}")


if __name__ == "__main__":
    main()
