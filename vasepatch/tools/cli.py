"""The `vasepatch` command line.

Every command takes `--threads` (torch CPU threads, default one per physical core, see
`vasepatch.tools.threads`) and `--debug`. A user error (a bad flag or value, an argument that is not
UTF-8, a missing or unwritable file) ends the command with one line, `vasepatch: error: <message>`,
and exit status 2, before any work (before the model loads); `--debug` or `VASEPATCH_DEBUG=1` shows
the traceback of the errors found after parsing instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterator

from vasepatch import __version__
from vasepatch.tools import cli_args, threads

USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
"""What a command raises for bad input. `vasepatch.errors.UnsupportedModelError` and the data
errors are `ValueError`s; a path that cannot be read or written raises one of the `OSError`s."""

COMMANDS = {
    ("demo",): ("vasepatch.tools.demo", "run", "generate with VaSE on SmolLM2 and compare with the full cache"),
    ("generate",): ("vasepatch.tools.generate", "run", "stream a model's answer through the VaSE cache"),
    ("serve",): ("vasepatch.tools.serve", "run", "transformers serve --continuous-batching on a patched model"),
    ("calibrate",): ("vasepatch.tools.calibrate", "run", "query statistics for the triattention policy"),
    ("eval", "fidelity"): ("vasepatch.eval.fidelity", "main", "KL / top-1 agreement / loops vs full cache"),
    ("eval", "task"): ("vasepatch.eval.task", "main", "accuracy on GSM8K / MATH-500 / AIME25, or pass-key"),
    ("bench",): ("vasepatch.bench.cli", "main", "decode throughput and memory: dense, static, vasepatch"),
}
"""Every runnable command: its words, the module with its `add_arguments(parser)`, its entry point
(called with the parsed arguments) and its one-line help. A command's module is imported only when
that command is parsed, so `vasepatch --version`, `--help` and the other commands' errors import
neither it nor torch."""


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose usage errors are one line on stderr, exit status 2:
    `vasepatch: error: argument --budget: must be an int in [2, 2147483647], got 0 (see vasepatch generate --help)`."""

    def error(self, message: str):
        message = " ".join(line.strip() for line in message.splitlines() if line.strip())
        self.exit(2, f"vasepatch: error: {message} (see {self.prog} --help)\n")


class CommandParser(Parser):
    """The parser of one command, whose arguments are added (its module imported) the first time it
    parses or formats its help: `load()`."""

    def __init__(self, *args, module: str = "", entry: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.module, self.entry, self.loaded = module, entry, not module
        self.passthrough: str | None = None  # a command's attribute for the words after `--`, passed on unparsed

    def load(self) -> CommandParser:
        """Add the command's arguments (`add_arguments` of its module) and its entry point, once."""
        if not self.loaded:
            self.loaded = True
            module = importlib.import_module(self.module)
            module.add_arguments(self)
            self.set_defaults(run=_entry(self.module, self.entry))
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        if self.passthrough is None or args is None:
            return super().parse_known_args(args, namespace)
        cut = args.index("--") if "--" in args else len(args)  # then another program's command line
        namespace, extras = super().parse_known_args(args[:cut], namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)} (another program's options go after --)")
        setattr(namespace, self.passthrough, list(args[cut + 1 :]))
        return namespace, extras

    def format_help(self) -> str:
        self.load()
        return super().format_help()

    def format_usage(self) -> str:
        self.load()
        return super().format_usage()


def _entry(module: str, name: str) -> Callable[[argparse.Namespace], object]:
    """Calls `module.name(args)`, looked up at call time (so that a test may replace it)."""

    def run(args: argparse.Namespace) -> object:
        return getattr(importlib.import_module(module), name)(args)

    return run


def _common_options() -> argparse.ArgumentParser:
    """Options every command takes (an argparse parent parser)."""
    common = Parser(add_help=False)
    threads.add_option(common)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return common


def build_parser() -> argparse.ArgumentParser:
    """The `vasepatch` parser. Each command's own arguments are added when it is parsed (`CommandParser`)."""
    parser = Parser(prog="vasepatch", description="Fixed-size KV cache with VaSE eviction")
    parser.add_argument("--version", action="version", version=f"vasepatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    common = [_common_options()]
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, (module, entry, help) in COMMANDS.items():
        group = sub
        if len(words) == 2:  # eval fidelity, eval task
            if words[0] not in groups:
                parent = sub.add_parser(words[0], help="compare policies: fidelity to the full cache, task accuracy")
                groups[words[0]] = parent.add_subparsers(dest="evaluation", required=True)
            group = groups[words[0]]
        group.add_parser(words[-1], help=help, description=help, parents=common, module=module, entry=entry)
    return parser


def commands(parser: argparse.ArgumentParser | None = None) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`("eval task", parser)` for every runnable command (the leaves of the subcommand tree)."""
    parser = parser or build_parser()
    if isinstance(parser, CommandParser):
        parser.load()
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
    import torch  # after parsing: --help, --version and usage errors never wait for it

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
