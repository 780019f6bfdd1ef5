"""The `vasepatch` command line."""

from __future__ import annotations

import argparse
import os
import sys

from vasepatch import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vasepatch", description="Fixed-size KV cache with VaSE eviction")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser("demo", help="generate with VaSE on SmolLM2 and compare KV memory")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
