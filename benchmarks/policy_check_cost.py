"""Cost of checking a policy's picks at each eviction (`VaSEConfig.check_policy_output`).

Times one eviction of every layer (`kept_slots`: the policy's pick, the check, the
ordering; then the gathers `VaSELayer._compact` does) with the check on and off, interleaved,
in SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads, head_dim 64, fp32) at budget 512 +
window 64, and prints the medians, the difference and its share of decode time.

    python benchmarks/policy_check_cost.py --batch 1,8 --repeats 30 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vasepatch import policies
from vasepatch.policies.base import kept_slots

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 3, 9, 64


def _inputs(batch: int, budget: int, window: int, g: torch.Generator):
    n = budget + window
    keys = torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g)
    values = torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g)
    valid = torch.ones(batch, KV_HEADS, n, dtype=torch.bool)
    valid[0, :, : n // 8] = False  # some left padding in row 0
    positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
    queries = torch.randn(batch, Q_HEADS, window, HEAD_DIM, generator=g)
    return keys, values, positions, valid, queries, n


def _evict_all_layers(policy, inputs, budget: int, window: int, generator: torch.Generator) -> float:
    """Seconds for one eviction of every layer (same inputs for each layer)."""
    keys, values, positions, valid, queries, n = inputs
    start = time.perf_counter()
    for _ in range(LAYERS):
        kept = kept_slots(policy, keys, values, positions, valid, queries, n, budget, window, generator)
        keys.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM))
        values.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM))
        positions.gather(2, kept)
        valid.gather(2, kept)
    return time.perf_counter() - start


def _check_all_layers(inputs, budget: int, window: int, idx: torch.Tensor) -> float:
    """Seconds for the data-dependent check alone (`check_picks`) of every layer."""
    valid = inputs[3][:, :, :-window]
    start = time.perf_counter()
    for _ in range(LAYERS):
        policies.check_picks("vase", idx, valid, budget - window, data=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--policy", default="vase")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ms-per-token", type=float, default=65.4, help="decode time per token to compare with")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"policy {args.policy}, {LAYERS} layers, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, budget {args.budget} "
          f"+ window {args.window}, {args.threads} thread(s), {args.repeats} interleaved repeats")  # fmt: skip
    print("| batch | eviction, check on (ms) | check off (ms) | difference (ms) | check alone (ms) | share of decode |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        inputs = _inputs(batch, args.budget, args.window, g)
        on = policies.get(args.policy, protect=args.budget // 4)
        off = policies.Policy(on.name, on.priority, on.options, check_output=False)
        cand = (inputs[0][:, :, : -args.window], inputs[1][:, :, : -args.window], inputs[4])
        idx = on.select(cand[0], cand[1], cand[2], inputs[2][:, :, : -args.window], inputs[3][:, :, : -args.window],
                        args.budget - args.window, torch.Generator().manual_seed(0))  # fmt: skip
        times: dict[str, list[float]] = {"on": [], "off": [], "check": []}
        for i in range(args.repeats + 2):
            for checked, policy in (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on)):
                t = _evict_all_layers(policy, inputs, args.budget, args.window, torch.Generator().manual_seed(i))
                if i >= 2:  # two warm-up rounds
                    times[checked].append(t)
            times["check"].append(_check_all_layers(inputs, args.budget, args.window, idx))
        t_on, t_off, t_check = (statistics.median(times[c]) * 1e3 for c in ("on", "off", "check"))
        cycle_ms = args.window * args.ms_per_token  # one eviction per `window` decode steps
        print(f"| {batch} | {t_on:.1f} | {t_off:.1f} | {t_on - t_off:.1f} | {t_check:.2f} | "
              f"{t_check / cycle_ms:.3%} of {cycle_ms:.0f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
