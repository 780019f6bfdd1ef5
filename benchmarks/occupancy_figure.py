"""The cache over a real generation: occupancy and KV memory per generated token.

    python benchmarks/occupancy_figure.py [--out docs/img/occupancy.png] [--tokens 384]
        [--budget 128] [--window 32] [--policy vase] [--threads 1]

SmolLM2-135M-Instruct (`vasepatch.models.load("smollm2-135m")`), patched with the demo's
settings, answers the demo's prompt greedily (repetition penalty 1.1, as `vasepatch demo`).
After every decode step a logits processor reads the patch's counters: the slots that step
attended (`occupancy` after the step plus the slots evicted at its end, so an evicting
step shows the `budget + window` it reached before dropping back to `budget`) and the KV
bytes of the buffers. The full cache's KV bytes for the same tokens are
`2 x layers x kv_heads x head_dim x tokens x dtype bytes`, checked at the end against an
unpatched generation of the same prompt. Writes the PNG and `<out>.json` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import vasepatch
from vasepatch import models
from vasepatch.cache import footprint
from vasepatch.reporting import style

PROMPT = (
    "A bakery sells croissants for $2.50 and muffins for $3.25. On Monday it sold 48 croissants and 36 muffins. "
    "On Tuesday it sold 25% more croissants and 8 fewer muffins. How much money did it take in over the two days? "
    "Reason step by step."
)  # the demo's prompt
MIB = 2**20


class Recorder:
    """A logits processor (runs after each forward, so after the cache's bookkeeping):
    per step, the slots attended, whether it evicted, and the KV bytes of the patch."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.attended: list[int] = []
        self.evicted: list[bool] = []
        self.kv_bytes: list[int] = []
        self._dropped = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.handle.stats()
        dropped, self._dropped = s["evicted_tokens"] - self._dropped, s["evicted_tokens"]
        self.attended.append(s["occupancy"] + dropped)
        self.evicted.append(dropped > 0)
        self.kv_bytes.append(s["kv_bytes"])
        return scores


def bytes_per_token(model) -> int:
    """K and V bytes of one token across all layers, in the weights' dtype (`footprint`'s count)."""
    return footprint.model_bytes_per_token(model.config, next(model.parameters()).element_size())


def _generate(model, inputs, n: int, processors=None):
    from transformers import LogitsProcessorList

    with torch.no_grad():
        return model.generate(
            **inputs,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            repetition_penalty=1.1,
            logits_processor=LogitsProcessorList(processors or []),
            return_dict_in_generate=True,
        )


def measure(args: argparse.Namespace) -> dict:
    """Generate patched (recording every step), then unpatched (for the full cache's final size)."""
    model, tok = models.load("smollm2-135m")
    messages = [{"role": "user", "content": PROMPT}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = inputs["input_ids"].shape[1]
    with vasepatch.patched(model, budget=args.budget, window=args.window, policy=args.policy, seed=0) as h:
        rec = Recorder(h)
        _generate(model, inputs, args.tokens, [rec])
        stats = h.stats()
    full = _generate(model, inputs, args.tokens)
    cache = full.get("cache") or full.past_key_values
    measured = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    per_token = bytes_per_token(model)
    # the i-th generated token (from 0) is chosen after a forward over prompt + i tokens; the
    # last one is never fed back, so the full cache ends with prompt + tokens - 1
    full_bytes = [per_token * (prompt + i) for i in range(args.tokens)]
    if measured != full_bytes[-1]:
        raise RuntimeError(f"full cache holds {measured} bytes, the shape formula says {full_bytes[-1]}")
    return {
        "model": "smollm2-135m",
        "budget": args.budget,
        "window": args.window,
        "policy": args.policy,
        "prompt_tokens": prompt,
        "generated": args.tokens,
        "attended": rec.attended,
        "evicted": rec.evicted,
        "kv_bytes": rec.kv_bytes,
        "full_kv_bytes": full_bytes,
        "kv_bytes_per_token": per_token,
        "evictions": stats["evictions"],
        "capacity": stats["capacity"],
    }


def _sawtooth(attended: list[int], evicted: list[bool], budget: int) -> tuple[list[float], list[int]]:
    """Points of the occupancy line: an evicting step drops straight down to `budget`."""
    xs: list[float] = []
    ys: list[int] = []
    for i, (n, ev) in enumerate(zip(attended, evicted, strict=True)):
        xs.append(i + 1)
        ys.append(n)
        if ev:
            xs.append(i + 1)
            ys.append(budget)
    return xs, ys


def figure(r: dict):
    """Top: slots attended per step (saw-tooth between budget and budget + window). Bottom: KV MiB."""
    b, w, n = r["budget"], r["window"], r["generated"]
    fig, axes = style.subplots(2, 1, panel=(8, 3.0), sharex=True)
    occ, mem = axes[0][0], axes[1][0]
    xs, ys = _sawtooth(r["attended"], r["evicted"], b)
    occ.plot(xs, ys, label=f"vasepatch ({r['policy']})", **{**style.series(0), "marker": None})
    occ.axhline(b, color="0.4", linestyle="--", linewidth=1, label=f"budget {b}")
    occ.axhline(b + w, color="0.4", linestyle=":", linewidth=1, label=f"budget + window {b + w}")
    occ.set(ylabel="slots in use", ylim=(0, (b + w) * 1.15))
    occ.legend(fontsize=7, loc="lower right")
    occ.grid(alpha=0.3)
    steps = list(range(1, n + 1))
    every = max(1, n // 24)
    curves = [
        ("full cache (transformers' DynamicCache)", steps, [v / MIB for v in r["full_kv_bytes"]]),
        (f"vasepatch ({b + w} slots allocated)", steps, [v / MIB for v in r["kv_bytes"]]),
    ]
    for i, (label, x, y) in enumerate(curves):
        mem.plot(x, y, label=label, markevery=every, **style.series(i + 1))
    style.memory_axis(mem, "KV MiB")
    mem.set(xlabel="generated tokens")
    mem.legend(fontsize=7, loc="upper left")
    mem.grid(alpha=0.3)
    total = r["prompt_tokens"] + n
    what = f"The cache over a {n}-token greedy generation ({r['prompt_tokens']}-token prompt)"
    return style.finish(fig, style.title(what, "SmolLM2-135M-Instruct", b, w, total))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/img/occupancy.png")
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--policy", default="vase")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    style.use_agg()
    start = time.perf_counter()
    result = measure(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result) + "\n")
    style.save(figure(result), out)
    last = result["full_kv_bytes"][-1] / MIB, result["kv_bytes"][-1] / MIB
    print(f"wrote {out} and {out.with_suffix('.json')} in {time.perf_counter() - start:.0f} s")
    print(f"evictions {result['evictions']}, slots attended {min(result['attended'])}-{max(result['attended'])}")
    print(f"KV at the last token: full {last[0]:.2f} MiB, vasepatch {last[1]:.2f} MiB ({last[0] / last[1]:.2f}x)")


if __name__ == "__main__":
    main()
