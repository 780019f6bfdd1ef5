"""`--threads`: how many torch threads a command uses, by default one per physical core.

torch defaults to one thread per *logical* CPU and spins its threads while waiting for
work. Two such processes on the same cores (or one on hyper-threaded siblings) fight for
them and can run many times slower than one thread each, so every command takes
`--threads`, defaulting to `$OMP_NUM_THREADS` when it is set and to the physical cores
this process may run on otherwise. The default does not adapt to other processes' load: where the
1-minute load average shows other runnable processes on those cores, the command says so on stderr
(`busy_warning`) and names a `--threads` to pick, unless `--threads` or `$OMP_NUM_THREADS` was given.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

_SYS_CPU = Path("/sys/devices/system/cpu")


def _allowed_cpus() -> set[int] | None:
    """The logical CPUs this process may run on (None where the OS cannot say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def physical_cores(sys_cpu: Path = _SYS_CPU) -> int:
    """Physical cores among the CPUs this process may use: logical CPUs that share a core
    (hyper-threads, listed in `topology/thread_siblings_list`) count once. Falls back to
    `os.cpu_count()` where the Linux topology files are absent (macOS, Windows)."""
    allowed = _allowed_cpus()
    cores: set[str] = set()
    for cpu in sorted(sys_cpu.glob("cpu[0-9]*")):
        index = int(cpu.name[3:])
        if allowed is not None and index not in allowed:
            continue
        try:
            cores.add((cpu / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            continue
    if cores:
        return len(cores)
    return len(allowed) if allowed else (os.cpu_count() or 1)


def _omp_num_threads() -> int | None:
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else None


def default_threads() -> int:
    """`$OMP_NUM_THREADS` if it is a positive int, else `physical_cores()`."""
    return _omp_num_threads() or physical_cores()


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, with an error that names the allowed range."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


MAX_THREADS = 1024
"""The most `--threads` takes: more only adds oversubscription (and past 2**31 - 1 torch overflows)."""


def thread_count(text: str) -> int:
    """argparse type of `--threads`: an int in [1, `MAX_THREADS`]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 and <= {MAX_THREADS}, got {text!r}") from None
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 and <= {MAX_THREADS}, got {value}")
    return value


BUSY_LOAD = 1.0
"""The 1-minute load average from which other processes count as busy (below it, a shell or an editor)."""


def busy_warning(load: float, cores: int, threads: int, explicit: bool) -> str | None:
    """The one-line warning for a command about to run `threads` torch threads on `cores` physical cores
    while the 1-minute load average (other runnable processes) is `load`; None when the thread count was
    given explicitly, is already 1, or fits beside the load (`threads <= cores - load + 0.5`)."""
    if explicit or threads <= 1 or load < BUSY_LOAD or threads <= cores - load + 0.5:
        return None
    suggested = max(1, min(threads - 1, int(cores - load + 0.5)))
    return (
        f"vasepatch: the 1-minute load average is {load:.1f} on {cores} core{'s' * (cores != 1)}: other processes "
        f"are running; --threads {suggested} may be much faster than the default {threads} "
        "(see docs/performance.md#threads)"
    )


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none, e.g. Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def warn_if_busy(args: argparse.Namespace, stream: TextIO | None = None) -> str | None:
    """Print `busy_warning` for the machine now to `stream` (stderr) and return it: a command calls this
    once, when its checks have passed and its work starts. `args` is its parsed command line:
    `args.threads`, and `args.threads_given` (`--threads` was passed; `$OMP_NUM_THREADS` set to a
    positive int counts as given). A namespace without `threads` (not from the CLI) gets no warning."""
    count = getattr(args, "threads", None)
    load = load_average()
    if not isinstance(count, int) or load is None:
        return None
    given = bool(getattr(args, "threads_given", True)) or _omp_num_threads() is not None
    line = busy_warning(load, physical_cores(), count, given)
    if line:
        print(line, file=stream or sys.stderr, flush=True)
    return line


class _ThreadsAction(argparse.Action):
    """Stores `--threads N` and records that it was given (`namespace.threads_given`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.threads_given = True


def add_option(parser: argparse.ArgumentParser) -> None:
    """Add `--threads N` (default `default_threads()`, shown in `--help`); `args.threads_given` says
    whether it was on the command line."""
    n = default_threads()
    source = "$OMP_NUM_THREADS" if _omp_num_threads() else "the physical cores this process may use"
    parser.add_argument(
        "--threads",
        type=thread_count,
        action=_ThreadsAction,
        default=n,
        metavar="N",
        help=f"torch CPU threads (default: {n}, {source}; not lowered when other processes keep the cores "
        "busy, where fewer is faster and a warning names a number: see docs/performance.md#threads)",
    )
    parser.set_defaults(threads_given=False)
