"""`--threads`: how many torch threads a command uses, by default one per physical core.

torch defaults to one thread per *logical* CPU and spins its threads while waiting for
work. Two such processes on the same cores (or one on hyper-threaded siblings) fight for
them and can run many times slower than one thread each, so every command takes
`--threads`, defaulting to `$OMP_NUM_THREADS` when it is set and to the physical cores
this process may run on otherwise.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

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


def add_option(parser: argparse.ArgumentParser) -> None:
    """Add `--threads N` (default `default_threads()`, shown in `--help`)."""
    n = default_threads()
    source = "$OMP_NUM_THREADS" if _omp_num_threads() else "physical cores"
    parser.add_argument(
        "--threads",
        type=thread_count,
        default=n,
        metavar="N",
        help=f"torch CPU threads (default: {n}, the {source}; fewer when other processes share the cores)",
    )
