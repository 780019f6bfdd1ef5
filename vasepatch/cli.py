"""The `vasepatch` command line.

Every command takes `--threads` (torch CPU threads, default one per physical core, see
`vasepatch.threads`) and `--debug`. A user error (a bad flag or value, an argument that is not
UTF-8, a missing or unwritable file) ends the command with one line, `vasepatch: error: <message>`,
and exit status 2, before any work (before the model loads); `--debug` or `VASEPATCH_DEBUG=1` shows
the traceback of the errors found after parsing instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator

import torch

from vasepatch import __version__, cli_args, demo, generate, threads
from vasepatch.bench import cli as bench
from vasepatch.eval import fidelity, task

USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
"""What a command raises for bad input. `vasepatch.errors.UnsupportedModelError` and the data
errors are `ValueError`s; a path that cannot be read or written raises one of the `OSError`s."""


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose usage errors are one line on stderr, exit status 2:
    `vasepatch: error: argument --budget: must be an int in [2, 2147483647], got 0 (see vasepatch generate --help)`."""

    def error(self, message: str):
        message = " ".join(line.strip() for line in message.splitlines() if line.strip())
        self.exit(2, f"vasepatch: error: {message} (see {self.prog} --help)\n")


def _common_options() -> argparse.ArgumentParser:
    """Options every command takes (an argparse parent parser)."""
    common = Parser(add_help=False)
    threads.add_option(common)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="vasepatch", description="Fixed-size KV cache with VaSE eviction")
    parser.add_argument("--version", action="version", version=f"vasepatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_common_options()]

    def command(group: argparse._SubParsersAction, name: str, add: Callable, run: Callable, help: str) -> None:
        p = group.add_parser(name, help=help, description=help, parents=common)
        add(p)
        p.set_defaults(run=run)

    command(sub, "demo", demo.add_arguments, demo.run, "generate with VaSE on SmolLM2 and compare with the full cache")
    command(sub, "generate", generate.add_arguments, generate.run, "stream a model's answer through the VaSE cache")
    eval_parser = sub.add_parser("eval", help="compare policies: fidelity to the full cache, task accuracy")
    eval_sub = eval_parser.add_subparsers(dest="evaluation", required=True)
    command(eval_sub, "fidelity", fidelity.add_arguments, fidelity.main, "KL / top-1 agreement / loops vs full cache")
    command(eval_sub, "task", task.add_arguments, task.main, "accuracy on GSM8K / MATH-500 / AIME25, or pass-key")
    command(sub, "bench", bench.add_arguments, bench.main, "decode throughput and memory: dense, static, vasepatch")
    return parser


def commands(parser: argparse.ArgumentParser | None = None) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`("eval task", parser)` for every runnable command (the leaves of the subcommand tree)."""
    parser = parser or build_parser()
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield parser.prog.split(" ", 1)[1] if " " in parser.prog else parser.prog, parser
    for group in groups:
        for sub in group.choices.values():
            yield from commands(sub)


def run(argv: list[str] | None = None) -> int:
    """Parse `argv`, set torch's threads and run the command; errors propagate (see `main`).
    The previous thread count is restored afterwards, so in-process callers keep theirs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    try:
        cli_args.check_utf8(words)
    except ValueError as err:
        parser.exit(2, f"vasepatch: error: {err}\n")
    args = parser.parse_args(argv)
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        args.run(args)
    finally:
        torch.set_num_threads(previous)
    return 0


def _debug(argv: list[str] | None) -> bool:
    words = sys.argv[1:] if argv is None else argv
    return "--debug" in words or os.environ.get("VASEPATCH_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """The console script: `run`, with user errors as one line on stderr and exit status 2."""
    try:
        return run(argv)
    except USER_ERRORS as err:
        if _debug(argv):
            raise
        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"vasepatch: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        if _debug(argv):
            raise
        print("\nvasepatch: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    sys.exit(main())
