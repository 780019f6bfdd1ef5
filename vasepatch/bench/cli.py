"""`vasepatch bench`: decode throughput and memory of dense, static and vasepatch caches."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vasepatch.bench.settings import DEFAULT_METHODS, DTYPES, ISOLATION, MASKS, Settings
from vasepatch.config import VaSEConfig

# `--quick`: a smoke run of about a minute on 2 CPU cores (SmolLM2-135M); explicit options win.
QUICK: dict[str, Any] = {"tokens": [256, 512], "budget": 128, "window": 32, "batch": [1], "repeats": 1}
CACHE_OPTIONS = ("budget", "window")  # options that live in `Settings.cache`


def _int_list(name: str, text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated ints, got {text!r}") from None


def _csv(values: list[int]) -> str:
    return ",".join(map(str, values))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--model", default=d.model, help="registered name, HF directory, .gguf file or shape:NAME")
    p.add_argument("--tokens", default=None, help=f"generated lengths to time at (default {_csv(d.tokens)})")
    p.add_argument("--budget", type=int, default=None, help=f"vasepatch/kvpress budget (default {d.cache.budget})")
    p.add_argument("--window", type=int, default=None, help=f"eviction window (default {d.cache.window})")
    p.add_argument("--batch", default=None, help=f"batch sizes (default {_csv(d.batch)})")
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="dense, static, kvpress or policy names, each optionally +compile",
    )
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="random prompt tokens (prefill, untimed)")
    p.add_argument("--repeats", type=int, default=None, help=f"timed segments per length (default {d.repeats})")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per segment (default: window)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", default=d.device, help="cpu or cuda[:N]")
    p.add_argument(
        "--seed",
        type=int,
        default=d.cache.seed,
        help="seeds the random prompts, shape: weights and VaSE sampling (default 0)",
    )
    p.add_argument("--isolate", choices=ISOLATION, default=d.isolate, help="worker process per method (CPU default)")
    p.add_argument("--mask", choices=MASKS, default=d.mask, help="attention mask of ones: auto = eager methods only")
    quick = " ".join(f"--{k} {_csv(v) if isinstance(v, list) else v}" for k, v in QUICK.items())
    p.add_argument("--quick", action="store_true", help=f"smoke run (about a minute): {quick}, unless given")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=d.out)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validated `Settings` from the parsed options (`ValueError` names the bad one)."""
    d = Settings()

    def pick(name: str, given: Any) -> Any:
        if given is not None:
            return given
        if args.quick and name in QUICK:
            return QUICK[name]
        return getattr(d.cache if name in CACHE_OPTIONS else d, name)

    cache = VaSEConfig(budget=pick("budget", args.budget), window=pick("window", args.window), seed=args.seed)
    return Settings(
        model=args.model,
        cache=cache,
        tokens=pick("tokens", None if args.tokens is None else _int_list("tokens", args.tokens)),
        batch=pick("batch", None if args.batch is None else _int_list("batch", args.batch)),
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        prompt_len=args.prompt_len,
        repeats=pick("repeats", args.repeats),
        steps=args.steps,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,  # the shared --threads option (vasepatch.cli): torch threads per method
        isolate=args.isolate,
        mask=args.mask,
        out=args.out,
        progress=not args.no_progress,
    )


def main(args: argparse.Namespace) -> None:
    from vasepatch.bench import report
    from vasepatch.bench.runner import run_benchmark

    try:
        settings = settings_from_args(args)
    except ValueError as err:
        raise SystemExit(f"vasepatch bench: error: {err}") from None
    result = run_benchmark(settings)
    paths = report.write(result, Path(settings.out))
    print(report.markdown(result))
    for path in paths:
        print(path)
