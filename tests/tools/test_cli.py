"""The command line: `--version`, `--threads` on every command, one-line errors, the demo
end to end (small settings), and the version guard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import vasepatch
from vasepatch.integration.compat import check_transformers
from vasepatch.tools import cli, threads
from vasepatch.tools.cli import main

COMMANDS = {"demo", "generate", "eval fidelity", "eval task", "bench", "calibrate", "serve"}
REQUIRED = {"generate": ["hi"], "calibrate": ["m"], "serve": ["m"]}  # positional arguments a command needs to parse


@pytest.mark.slow
def test_demo_prints_text_stats_and_memory(smollm2, capsys):
    assert main(["demo", "--max-new-tokens", "48", "--budget", "32", "--window", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "--- VaSE (budget=32, window=8" in out
    evictions = int(re.search(r"evictions: (\d+)", out).group(1))
    assert evictions >= 1
    patched = float(re.search(r"vasepatch:\s+([\d.]+) MiB", out).group(1))
    full = float(re.search(r"full cache:\s+([\d.]+) MiB", out).group(1))
    assert 0 < patched < full
    occupancy = int(re.search(r"occupancy: (\d+)", out).group(1))
    assert f"occupancy {occupancy} of 40 slots: the cache holds at most budget + window = 32 + 8 = 40" in out
    assert f"It ends at {occupancy} = 32 + {occupancy - 32} tokens generated since the last eviction." in out
    assert "The texts agree on the first" in out or "The two texts are identical" in out
    assert "Loading weights" not in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"vasepatch {vasepatch.__version__}\n"


def test_every_command_takes_threads_and_debug():
    found = dict(cli.commands())
    assert set(found) == COMMANDS
    for name in COMMANDS:
        argv = [*name.split(), *REQUIRED.get(name, [])]
        args = cli.build_parser().parse_args([*argv, "--threads", "3"])
        assert args.threads == 3 and args.debug is False, name
        assert cli.build_parser().parse_args(argv).threads == threads.default_threads(), name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_threads_are_set_before_the_command_runs_and_restored(name, monkeypatch):
    """`run` sets torch's threads before the command and restores the caller's afterwards."""
    module = {"demo": "tools.demo", "generate": "tools.generate", "eval fidelity": "eval.fidelity",
              "eval task": "eval.task", "bench": "bench.cli", "calibrate": "tools.calibrate",
              "serve": "tools.serve"}[name]  # fmt: skip
    entry = "run" if name in ("demo", "generate", "calibrate", "serve") else "main"
    seen = []
    monkeypatch.setattr(f"vasepatch.{module}.{entry}", lambda args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    assert main([*name.split(), *REQUIRED.get(name, []), "--threads", str(wanted)]) == 0
    assert seen == [wanted] and torch.get_num_threads() == before


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_threads_is_refused_by_the_parser(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--threads", bad])
    assert exit_info.value.code == 2
    assert "argument --threads: must be an int >= 1" in capsys.readouterr().err


def test_physical_cores_counts_hyperthreads_once(tmp_path, monkeypatch):
    for cpu, siblings in enumerate(["0,4", "1,5", "2,6", "3,7", "0,4", "1,5", "2,6", "3,7"]):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    (tmp_path / "cpufreq").mkdir()  # not a CPU
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: None)
    assert threads.physical_cores(tmp_path) == 4
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: {0, 4, 1})  # affinity: two cores' threads
    assert threads.physical_cores(tmp_path) == 2
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 7)
    assert threads.physical_cores(tmp_path / "missing") == 3  # no topology: the allowed logical CPUs
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: None)
    assert threads.physical_cores(tmp_path / "missing") == 7
    assert threads.physical_cores(Path("/sys/devices/system/cpu")) >= 1


def test_omp_num_threads_sets_the_default(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert threads.default_threads() == threads.physical_cores()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.default_threads() == threads.physical_cores()


def test_user_errors_are_one_line_and_exit_2(capsys, monkeypatch):
    def missing(args):
        raise FileNotFoundError("benchmark data not found:\n  pass --data-dir")

    monkeypatch.setattr("vasepatch.eval.task.main", missing)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "task"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "vasepatch: error: benchmark data not found: pass --data-dir\n"
    monkeypatch.setenv("VASEPATCH_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(["eval", "task"])


def test_other_exceptions_keep_their_traceback(monkeypatch):
    def bug(args):
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr("vasepatch.tools.demo.run", bug)
    with pytest.raises(KeyError):
        main(["demo"])


def test_cli_requires_a_command(capsys):
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.parametrize("version", ["4.57.1", "5.0.0rc1", "6.0.0"])
def test_transformers_outside_the_tested_range_is_refused(version):
    with pytest.raises(RuntimeError, match=r"transformers >=5\.0\.0,<6\.0\.0; found"):
        check_transformers(version)


def test_transformers_in_range_is_accepted():
    check_transformers("5.0.0")
    check_transformers("5.24.0")
