"""Prefill time of the patched model against the unpatched one, side by side in one run.

    python benchmarks/prefill_speed.py [--model smollm2-135m] [--budget 512] [--repeats 7] [--threads N]

Cases (random token ids from a fixed seed, fp32, CPU):

- `unpadded P`: one prompt of P tokens, no padding: vasepatch's `is_causal` path
  (P below the budget) and its compress path (P above it: the whole prompt attended,
  then compressed to the budget);
- `ragged`: a batch of 4 prompts of 512, 384, 256 and 128 tokens, left-padded to 512:
  both sides build a mask (transformers a 4-D one, vasepatch its grouped slot mask).

Each repeat times one forward (`logits_to_keep=1`, a fresh cache) of every method in
turn, the order alternating, after one untimed warm-up of each; the table gives the
median milliseconds and `vase / dense` of the medians. The two models share their
weights (the patched one is a weight-sharing copy). Writes nothing; prints a markdown
table. Ratios from one run are comparable; absolute times depend on the machine.
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
from vasepatch.bench.methods import share_weights
from vasepatch.bench.shapes import load_model
from vasepatch.tools import threads


def cases(vocab: int, budget: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Name -> (input_ids `[B, P]`, attention_mask `[B, P]`)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for p in (budget // 2, budget, 4 * budget):
        ids = torch.randint(vocab, (1, p), generator=g)
        out[f"unpadded {p}"] = (ids, torch.ones_like(ids))
    lengths = (budget, 3 * budget // 4, budget // 2, budget // 4)
    ids = torch.randint(vocab, (len(lengths), budget), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, budget - n :] = 1
    out["ragged " + "/".join(map(str, lengths))] = (ids, mask)
    return out


@torch.no_grad()
def prefill_ms(model: torch.nn.Module, cache: dict, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Milliseconds of one prefill forward; `cache`: the cache keyword argument, or `{}` (a DynamicCache)."""
    kwargs = cache
    t0 = time.perf_counter()
    model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **kwargs)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    threads.add_option(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dense = load_model(args.model, torch.float32, "cpu")
    patched = share_weights(dense)
    handle = vasepatch.patch(patched, budget=args.budget, window=64, seed=0)
    methods = {"dense": (dense, dict), "vase": (patched, lambda: {handle.cache_keyword: handle.new_cache()})}
    rows = []
    for name, (ids, mask) in cases(dense.config.vocab_size, args.budget).items():
        times: dict[str, list[float]] = {m: [] for m in methods}
        for model, new_cache in methods.values():  # warm-up
            prefill_ms(model, new_cache(), ids, mask)
        for r in range(args.repeats):
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            for m in order:
                model, new_cache = methods[m]
                times[m].append(prefill_ms(model, new_cache(), ids, mask))
        med = {m: statistics.median(t) for m, t in times.items()}
        rows.append(f"| {name} | {med['dense']:.1f} | {med['vase']:.1f} | {med['vase'] / med['dense']:.3f} |")
    print(f"Prefill, {args.model}, budget {args.budget}, fp32, {args.threads} threads, median of {args.repeats}:\n")
    print("| prompt | dense ms | vase ms | vase / dense |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
