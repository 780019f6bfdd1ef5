"""The vLLM plugin's eviction step: one call per request (`compaction.compact`) against one stacked call for
every request due at the step (`compaction.compact_stacked`, what the worker runs).

On SmolLM2-135M's shapes (30 layers, 3 KV heads, 9 query heads, head size 64) in vLLM's CPU paged layout
(block size 32), `--requests` requests each holding `budget + window` slots are evicted down to `budget`, per
policy and dtype. Before timing, the two are checked to leave the same bytes in every block and the same kept
positions. Repeats are interleaved (one by one, stacked, one by one, ...), the first is a warm-up, medians are
printed with stacked / one by one. No vLLM needed.

    python benchmarks/vllm_stacked_eviction.py --requests 1,16 --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from vasepatch import VaSEConfig, policies
from vasepatch.vllm import compaction

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 32  # SmolLM2-135M, vLLM's CPU block


def due_requests(count: int, budget: int, window: int, dtype: torch.dtype):
    """Paged caches holding `count` requests of `budget + window` slots each, and their orders."""
    g = torch.Generator().manual_seed(0)
    n, per = budget + window, -(-(budget + window) // BLOCK)
    caches = [torch.randn(count * per + 1, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    dues = []
    for r in range(count):
        queries = torch.randn(LAYERS, Q_HEADS, window, HEAD_DIM, generator=g)
        positions = compaction.candidate_positions(None, LAYERS, KV_HEADS, n, 0)
        dues.append(compaction.Due(torch.arange(r * per, (r + 1) * per) + 1, n, 0, 1, r, queries, positions))
    return caches, dues


def one_by_one(caches, dues, config) -> list[torch.Tensor]:
    out = []
    for d in dues:
        config_r = dataclasses.replace(config, seed=d.seed)
        policy = policies.for_config(config_r)
        out.append(compaction.compact(caches, d.blocks, d.n, d.queries, d.positions, config_r, policy, d.round))
    return out


def stacked(caches, dues, config) -> list[torch.Tensor]:
    return compaction.compact_stacked(caches, dues, config, policies.for_config(config))


def check_exact(count: int, config: VaSEConfig, dtype: torch.dtype) -> None:
    a, dues = due_requests(count, config.budget, config.window, dtype)
    b = [c.clone() for c in a]
    kept_a, kept_b = one_by_one(a, dues, config), stacked(b, dues, config)
    same = all(torch.equal(x, y) for x, y in zip(a + kept_a, b + kept_b, strict=True))
    assert same, f"stacked != one by one ({config.policy}, {dtype})"


def measure(count: int, config: VaSEConfig, dtype: torch.dtype, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"one by one": [], "stacked": []}
    runs = {"one by one": one_by_one, "stacked": stacked}
    for _ in range(repeats + 1):  # the first round warms up
        for name, run in runs.items():
            caches, dues = due_requests(count, config.budget, config.window, dtype)
            start = time.perf_counter()
            run(caches, dues, config)
            times[name].append(time.perf_counter() - start)
    return {name: t[1:] for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,16")
    parser.add_argument("--policies", default="vase,snapkv,streaming")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{LAYERS} layers, budget {args.budget}, window {args.window}, {args.threads} thread(s), "
          f"{args.repeats} interleaved repeats; ms per step's eviction, median [min-max]")  # fmt: skip
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for policy in args.policies.split(","):
            config = VaSEConfig(budget=args.budget, window=args.window, policy=policy, seed=0)
            for count in (int(x) for x in args.requests.split(",")):
                check_exact(count, config, dtype)
                times = measure(count, config, dtype, args.repeats)
                base = statistics.median(times["one by one"])
                for name, t in times.items():
                    med = statistics.median(t)
                    print(f"{dtype_name:8s} {policy:9s} {count:3d} requests  {name:10s} {med * 1e3:7.1f} "
                          f"[{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]  x{med / base:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
