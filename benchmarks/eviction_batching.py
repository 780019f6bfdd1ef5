"""One eviction of every layer: per layer (the library) vs the layers stacked along the batch axis.

Issue 22, item 4 asked whether evicting all the layers that are due at a step in one call
(their buffers stacked, one window attention, one keyed hash) would bring the eviction share
under 2%. This times, on SmolLM2-135M's shapes (30 layers, 3 KV heads, 9 query heads, head
size 64, float32), budget 512 and window 64, one eviction of all 30 layers (the policy's
choice and the compaction into each layer's buffer):

- `per-layer`: `VaSELayer._compact`, what the cache runs, one layer after the other;
- `stacked-K`: groups of K layers, their candidates concatenated along the batch axis, one
  `kept_slots` call with one keyed hash for the group (`keyed.StackedKeyedGenerator`), then each
  layer's kept slots moved into its buffer. Before timing, its buffers are checked to equal
  the per-layer ones bit for bit.

Repeats are interleaved (per-layer, stacked-5, stacked-30, per-layer, ...) and medians are
printed, with stacked / per-layer. Run from another checkout (`PYTHONPATH=that/checkout`) to
time its `per-layer`.

    python benchmarks/eviction_batching.py --batch 1,8 --threads 1 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vasepatch import VaSEConfig, policies
from vasepatch.cache import VaSELayer
from vasepatch.cache.plan import LayerPlan
from vasepatch.cache.slots import gather_slots
from vasepatch.policies import keyed
from vasepatch.policies.base import kept_slots

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64  # SmolLM2-135M


def filled_layers(batch: int, policy: str, seed: int = 0) -> list[VaSELayer]:
    """30 layers holding `budget + window` random tokens and a window of queries: due to evict."""
    config = VaSEConfig(budget=512, window=64, policy=policy, seed=seed)
    g = torch.Generator().manual_seed(seed)
    layers, n = [], config.budget + config.window
    for i in range(LAYERS):
        layer = VaSELayer(config, policies.for_config(config), plan=LayerPlan(i))
        k, v = (torch.randn(batch, KV_HEADS, n, HEAD_DIM, generator=g) for _ in range(2))
        layer.lazy_initialization(k, v)  # filled, not stepped: a step this long would evict at once
        step = layer.slots.append_real(k, v, 0, 0, first=True, sliding_window=None)
        layer.ring.write(torch.randn(batch, KV_HEADS * GROUP, n, HEAD_DIM, generator=g), step.new_valid)
        layers.append(layer)
    return layers


def per_layer(layers: list[VaSELayer]) -> None:
    for layer in layers:
        layer._compact(layer.keys, layer.values, layer.positions, layer.valid, layer.capacity)


def stacked(layers: list[VaSELayer], group: int) -> None:
    for start in range(0, len(layers), group):
        part = layers[start : start + group]
        first, n, b = part[0], part[0].capacity, part[0].batch_size
        keys, values, positions, valid = (torch.cat([getattr(x, a) for x in part]) for a in _BUFFERS)
        queries = torch.cat([x.ring.read() for x in part])
        gens = [x.rng.for_eviction(x.plan, x.counters.evictions, x.device) for x in part]
        kept = kept_slots(
            first.policy, keys, values, positions, valid, queries, n, first.budget, first.config.window,
            keyed.StackedKeyedGenerator([(g.seed, g.layer, g.eviction) for g in gens], first.plan.head_offset, rows=b),
        )  # fmt: skip
        rows = [(keys, values, positions, valid, kept)[i].split(b) for i in range(5)]
        for layer, k, v, p, m, idx in zip(part, *rows, strict=True):
            _write(layer, k, v, p, m, idx, n)


_BUFFERS = ("keys", "values", "positions", "valid")


def _write(layer, keys, values, positions, valid, kept, n) -> None:
    """What `VaSELayer._compact` writes once it has the kept slots."""
    b = layer.budget
    layer.keys[:, :, :b] = gather_slots(keys, kept)
    layer.values[:, :, :b] = gather_slots(values, kept)
    layer.valid[:, :, :b] = valid.gather(2, kept)
    layer.positions[:, :, :b] = positions.gather(2, kept).masked_fill_(~layer.valid[:, :, :b], -1)
    layer.valid[:, :, b:n] = False
    layer.positions[:, :, b:n] = -1
    layer.slots.fill.fill_(b)
    c = layer.counters
    c.occupancy, c.evictions, c.evicted = b, c.evictions + 1, c.evicted + n - b


def check_exact(batch: int, policy: str, group: int) -> None:
    ours, theirs = filled_layers(batch, policy), filled_layers(batch, policy)
    per_layer(ours)
    stacked(theirs, group)
    for a, b in zip(ours, theirs, strict=True):
        assert all(torch.equal(getattr(a, x), getattr(b, x)) for x in _BUFFERS), "stacked != per-layer"


def measure(batch: int, policy: str, repeats: int, groups: list[int]) -> dict[str, list[float]]:
    variants = {"per-layer": per_layer} | {f"stacked-{k}": (lambda ls, k=k: stacked(ls, k)) for k in groups}
    times: dict[str, list[float]] = {name: [] for name in variants}
    layers = {name: filled_layers(batch, policy) for name in variants}
    for _ in range(repeats + 1):  # the first round warms up
        for name, run in variants.items():
            start = time.perf_counter()
            run(layers[name])
            times[name].append(time.perf_counter() - start)
    return {name: t[1:] for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--policy", default="vase")
    parser.add_argument("--groups", default="5,30", help="layers per stacked call")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-check", action="store_true", help="time only (e.g. with another checkout)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    groups = [int(x) for x in args.groups.split(",") if x]
    print(f"policy {args.policy}, {LAYERS} layers, budget 512, window 64, {args.threads} thread(s), "
          f"{args.repeats} interleaved repeats; ms per eviction of all layers, median [min-max]")  # fmt: skip
    for batch in (int(x) for x in args.batch.split(",")):
        if not args.no_check:
            for k in groups:
                check_exact(batch, args.policy, k)
        times = measure(batch, args.policy, args.repeats, groups)
        base = statistics.median(times["per-layer"])
        for name, t in times.items():
            med = statistics.median(t)
            print(f"batch {batch}  {name:11s} {med * 1e3:8.1f} [{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]  "
                  f"x{med / base:.2f} of per-layer")  # fmt: skip


if __name__ == "__main__":
    main()
