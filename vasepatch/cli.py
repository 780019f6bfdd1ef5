"""The `vasepatch` command line."""

from __future__ import annotations

import argparse
import os
import sys

from vasepatch import demo
from vasepatch.bench import cli as bench
from vasepatch.eval import fidelity, task


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vasepatch", description="Fixed-size KV cache with VaSE eviction")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser("demo", help="generate with VaSE on SmolLM2 and compare KV memory")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)

    eval_parser = sub.add_parser("eval", help="compare policies: fidelity to the full cache, task accuracy")
    eval_sub = eval_parser.add_subparsers(dest="evaluation", required=True)
    fid = eval_sub.add_parser("fidelity", help="KL / top-1 agreement / loops against the full cache")
    fidelity.add_arguments(fid)
    fid.set_defaults(run=fidelity.main)
    tsk = eval_sub.add_parser("task", help="accuracy on GSM8K / MATH-500 / AIME25, or pass-key retrieval")
    task.add_arguments(tsk)
    tsk.set_defaults(run=task.main)

    bench_parser = sub.add_parser("bench", help="decode throughput and memory: dense, static, vasepatch caches")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
