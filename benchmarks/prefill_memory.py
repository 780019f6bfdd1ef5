"""KV footprint, peak memory and prefill time of a long prompt, by prefill mode.

    python benchmarks/prefill_memory.py OUT_DIR [--prompt 4096] [--budget 256] [--new 64]

Each mode runs in its own process (SmolLM2-135M-Instruct, fp32, CPU), so that peak
RSS is that mode's alone:

- `dense`: the unpatched model (transformers' `DynamicCache`);
- `keep`: vasepatch with `prefill="keep"` (the whole prompt kept: the paper's setting);
- `compress`: vasepatch's default (the prompt compressed into budget + window slots);
- `chunked`: the default plus `generate(..., prefill_chunk_size=256)`;
- `short`: the default on a 100-token prompt, for the KV bytes a short prompt gets.

Peak RSS is Linux's high-water mark (VmHWM), reset after the model has loaded and
run once on 8 tokens (`/proc/self/clear_refs`), read at the end of the prefill and at the end of the
generation. glibc keeps freed heap memory for reuse, so the high-water mark also
counts transient allocations already freed; with `MALLOC_MMAP_THRESHOLD_=65536`
in the environment large blocks are returned at once and RSS follows live memory
(the setting is recorded in the JSON). The prompt is random token ids from a fixed
seed; decoding is greedy.
Writes `prefill-memory.json` and `prefill-memory.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("dense", "keep", "compress", "chunked", "short")
MIB = 2**20


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (`VmHWM`: peak RSS, `VmRSS`: RSS now), in bytes."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


class _PrefillWatch:
    """Forward hooks: the time and memory high-water mark at the end of the last forward
    that takes more than one token (the prefill, or its last chunk)."""

    def __init__(self, model):
        self.end_time = self.hwm = None
        self._multi = False
        self.hooks = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._multi = ids is not None and ids.shape[-1] > 1

    def _post(self, module, args, kwargs, output):
        if self._multi:
            self.end_time, self.hwm = time.perf_counter(), _status_bytes("VmHWM")


def _kv_bytes(out, handle) -> int:
    if handle is not None:
        return handle.stats()["kv_bytes"]
    cache = out.past_key_values
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def worker(mode: str, prompt: int, budget: int, window: int, new: int, threads: int) -> dict:
    import torch

    import vasepatch
    from vasepatch import models

    torch.set_num_threads(threads)
    model, _ = models.load("smollm2-135m")
    n = 100 if mode == "short" else prompt
    ids = torch.randint(1, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # touch every weight page once, so that RSS "loaded" holds the model
        model.generate(input_ids=ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
    handle = None
    if mode != "dense":
        prefill = "keep" if mode == "keep" else "compress"
        handle = vasepatch.patch(model, budget=budget, window=window, seed=0, prefill=prefill)
    extra = {"prefill_chunk_size": 256} if mode == "chunked" else {}
    watch = _PrefillWatch(model)
    rss_loaded = _status_bytes("VmRSS")
    _reset_hwm()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
        )
    total = time.perf_counter() - start
    stats = handle.stats() if handle is not None else {}
    return {
        "mode": mode,
        "prompt_tokens": n,
        "new_tokens": new,
        "kv_bytes": _kv_bytes(out, handle),
        "capacity": stats.get("capacity"),
        "evictions": stats.get("evictions"),
        "rss_loaded_bytes": rss_loaded,
        "peak_rss_prefill_bytes": watch.hwm,
        "peak_rss_overall_bytes": _status_bytes("VmHWM"),
        "prefill_s": watch.end_time - start,
        "total_s": total,
    }


def _row(r: dict) -> str:
    return (
        f"| {r['mode']} | {r['prompt_tokens']} | {r['kv_bytes'] / MIB:.2f} | {r['capacity'] or '—'} | "
        f"{r['evictions'] if r['evictions'] is not None else '—'} | {r['rss_loaded_bytes'] / MIB:.0f} | "
        f"{r['peak_rss_prefill_bytes'] / MIB:.0f} | {r['peak_rss_overall_bytes'] / MIB:.0f} | "
        f"{r['prefill_s']:.2f} | {r['total_s']:.2f} |"
    )


def report(results: list[dict], args: argparse.Namespace) -> str:
    head = (
        f"**Prefill of a {args.prompt}-token prompt** (SmolLM2-135M-Instruct, fp32, CPU, {args.threads} threads; "
        f"budget={args.budget}, window={args.window}, then {args.new} greedy tokens; each mode in its own process; "
        "peak RSS is the high-water mark since the model finished loading)\n\n"
        "| mode | prompt | KV MiB | capacity | evictions | RSS loaded MiB | peak RSS prefill MiB | "
        "peak RSS overall MiB | prefill s | total s |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(_row(r) for r in results) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", type=Path)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.prompt, args.budget, args.window, args.new, args.threads)))
        return
    results = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--worker", mode, *sys.argv[1:]]
        cmd = [c for c in cmd if c != str(args.out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(_row(results[-1]), flush=True)
    text = report(results, args)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        allocator = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
        payload = {"settings": vars(args), "allocator_env": allocator, "results": results}
        (args.out / "prefill-memory.json").write_text(json.dumps(payload, indent=2, default=str))
        (args.out / "prefill-memory.md").write_text(text)


if __name__ == "__main__":
    main()
