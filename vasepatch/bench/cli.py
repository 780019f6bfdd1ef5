"""`vasepatch bench`: decode throughput and memory of dense, static and vasepatch caches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vasepatch.bench import resume
from vasepatch.bench.settings import DTYPES, ISOLATION, MASKS, BenchSettings
from vasepatch.tools import threads
from vasepatch.tools.cli_args import (
    device,
    folder_problem,
    int_in,
    int_list,
    max_positions,
    output_dir,
    policy_names_text,
    seed,
)

# `--quick`: a smoke run of SmolLM2-135M, the default methods at 2 lengths, batch 1, 1 repeat; explicit options win.
# Measured with --threads 1: 365 s on a 2-core AMD EPYC VM busy with other runs (load 9-17), 114 s of CPU time
# (docs/performance.md, How long it takes).
QUICK: dict[str, Any] = {"tokens": [256, 512], "budget": 128, "window": 32, "batch": [1], "repeats": 1}


def _csv(values: list[int]) -> str:
    return ",".join(map(str, values))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchSettings()  # every option defaults to None: `--resume` tells given options from omitted ones
    p.add_argument("--model", default=None, help=f"registered name, HF directory, .gguf file or shape:NAME ({d.model})")
    p.add_argument(
        "--tokens", type=int_list(1), default=None, help=f"generated lengths to time at (default {_csv(d.tokens)})"
    )
    p.add_argument(
        "--budget", type=int_in(2), default=None, help=f"vasepatch/kvpress budget (default {d.cache.budget})"
    )
    p.add_argument("--window", type=int_in(1), default=None, help=f"eviction window (default {d.cache.window})")
    p.add_argument("--batch", type=int_list(1), default=None, help=f"batch sizes (default {_csv(d.batch)})")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated: dense, static, floor, kvpress or policy names ({policy_names_text()}), each "
        f"optionally +compile (default {','.join(d.methods)})",
    )
    p.add_argument("--prompt-len", type=int_in(1), default=None, help=f"random prompt tokens (default {d.prompt_len})")
    p.add_argument("--repeats", type=int_in(1), default=None, help=f"timed segments per length (default {d.repeats})")
    p.add_argument("--steps", type=int_in(1), default=None, help="timed decode steps per segment (default: window)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", type=device, default=None, help=f"cpu or cuda[:N] (default {d.device})")
    p.add_argument("--seed", type=seed, default=None, help="seeds the prompts, shape: weights, VaSE sampling (0)")
    p.add_argument("--isolate", choices=ISOLATION, default=None, help="worker process per method (CPU default)")
    p.add_argument("--mask", choices=MASKS, default=None, help="attention mask of ones: auto = eager methods only")
    p.add_argument("--skip", default=None, help="rows not to run: method@batch[:length], comma-separated")
    quick = " ".join(f"--{k} {_csv(v) if isinstance(v, list) else v}" for k, v in QUICK.items())
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {quick}, unless given (with --threads 1 on a busy 2-core VM: 365 s, 114 s of CPU time)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", type=output_dir, default=None, help=f"output folder (default {d.out})")
    p.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="finish the run in DIR/bench.json (its settings; other options must match them), writing to DIR",
    )


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the options give explicitly (`--quick`'s preset included), as `BenchSettings.to_dict` keys."""
    given: dict[str, Any] = {k: v for k, v in QUICK.items() if args.quick}
    lists = {"tokens": args.tokens, "batch": args.batch}
    given.update({k: v for k, v in lists.items() if v is not None})
    if args.methods is not None:
        given["methods"] = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.skip is not None:
        given["skip"] = [e.strip() for e in args.skip.split(",") if e.strip()]
    plain = ("model", "budget", "window", "prompt_len", "repeats", "steps", "dtype", "device", "seed", "isolate")
    plain += ("mask",)
    given.update({k: getattr(args, k) for k in plain if getattr(args, k) is not None})
    given["threads"] = args.threads  # the shared --threads option (vasepatch.tools.cli): torch threads per method
    return given


def load_resumed(directory: str, given: dict[str, Any]) -> dict[str, Any]:
    """`DIR/bench.json`, its structure checked (`vasepatch.bench.resume`) and its settings checked against the
    `given` ones: a one-line `ValueError` naming the file and what is wrong, or the setting that differs."""
    path, previous = resume.read(directory)
    stored = previous["settings"]
    differ = [key for key, value in given.items() if stored.get(key) != value]
    if differ:
        shown = "; ".join(f"{key!r}: stored {stored.get(key)!r}, given {given[key]!r}" for key in differ)
        raise ValueError(
            f"resume: setting {shown} differs from {path} (omit the option to keep the stored value)"
            if len(differ) == 1
            else f"resume: settings differ from {path}: {shown} (omit the options to keep the stored values)"
        )
    try:
        BenchSettings.from_dict({**stored, "out": directory, "progress": False})
    except ValueError as err:
        raise ValueError(f"resume: {path}: its settings are not valid: {err}") from None
    return previous


def settings_from_args(args: argparse.Namespace) -> tuple[BenchSettings, dict[str, Any] | None]:
    """Validated `BenchSettings` from the parsed options (`ValueError` names the bad one), and the
    result to resume (`--resume`), if any."""
    given = given_settings(args)
    previous = None
    if args.resume is not None:
        if args.out is not None and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ValueError(f"resume: the output goes to {args.resume}; drop --out {args.out}")
        previous = load_resumed(args.resume, given)
        given = {**previous["settings"], "out": args.resume}
    elif args.out is not None:
        given["out"] = args.out
    settings = BenchSettings.from_dict({**given, "progress": not args.no_progress})
    return settings, previous


def main(args: argparse.Namespace) -> None:
    from vasepatch.bench import report
    from vasepatch.bench.runner import run_benchmark

    settings, previous = settings_from_args(args)  # a ValueError: one line, exit status 2 (vasepatch.tools.cli)
    out = Path(settings.out)
    problem = folder_problem(str(out))  # the folder of a resumed run too
    if problem:
        raise ValueError(f"output folder: {problem}")
    _note_positions(settings)  # resolves the model first: a name or folder that is none stops here, exit 2
    threads.warn_if_busy(args)  # a busy machine: one line, once every check has passed
    result = run_benchmark(settings, previous=previous, save=lambda partial: report.save(partial, out))
    paths = report.write(result, out)
    print(report.markdown(result))
    for path in paths:
        print(path)


def _note_positions(settings: BenchSettings) -> None:
    """Resolve the model before any work (an unknown name or a missing folder is a usage error), and say in
    one line when the longest timed sequence goes past the positions it takes: a benchmark may time there on
    purpose (the default 8K lengths on SmolLM2), but its outputs are not meaningful."""
    limit = max_positions(settings.model)
    longest = settings.prompt_len + settings.tokens[-1] + settings.steps * settings.repeats
    if limit is not None and longest > limit:
        print(
            f"vasepatch: note: the longest sequence, {longest} tokens (--prompt-len, the longest --tokens and the "
            f"timed steps), is past the {limit} positions {settings.model} takes; its timings are real, its "
            "outputs are not meaningful",
            file=sys.stderr,
        )
