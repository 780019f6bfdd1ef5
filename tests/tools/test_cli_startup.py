"""The CLI starts without torch (`--version`, `--help`, usage errors answer in well under a second),
names every policy in its help and errors, and warns on a busy machine when the thread count was not given."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vasepatch.tools import cli_args, threads
from vasepatch.tools.cli import COMMANDS, main

HEAVY = ("torch", "transformers")

PROBE = """
import json, sys
import vasepatch.tools.cli as cli
for argv in json.loads(sys.argv[1]):
    try:
        cli.build_parser().parse_args(argv)
    except SystemExit:
        pass
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def heavy_imports(*argvs: list[str]) -> list[str]:
    """Which of torch, transformers a fresh interpreter imports to parse the command lines `argvs` (each a
    `--help` or a usage error)."""
    code = PROBE.format(heavy=HEAVY)
    command = [sys.executable, "-c", code, json.dumps(argvs)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _help_and_error(words: tuple[str, ...]) -> list[list[str]]:
    return [[*words, "--help"], [*words, "--threads", "0"]]


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["--help"],
        [],
        ["nope"],
        ["eval", "--help"],
        ["generate", "--budget", "x", "hi"],
        ["generate", "--policy", "nope", "hi"],
        ["generate", "--device", "cpu", "--window", "0", "hi"],
        ["demo", "--policy", "nope"],
        ["eval", "task", "--budget", "x"],
        ["eval", "task", "--task", "nope"],
        ["eval", "fidelity", "--tokens", "abc"],
        ["eval", "fidelity", "--shared-heads", "maybe"],
        ["bench", "--tokens", "abc"],
        ["bench", "--dtype", "float8"],
        *(argv for words in COMMANDS for argv in _help_and_error(words)),
    ],
    ids=" ".join,
)
def test_parsing_imports_neither_torch_nor_transformers(argv):
    assert heavy_imports(argv) == []


def test_the_bench_package_is_light_and_its_names_still_import():
    """`vasepatch.bench` imports `run_benchmark` and `summarise` (torch) on first use; the names work as before."""
    code = (
        "import json, sys\n"
        "import vasepatch.bench as bench, vasepatch.eval.fidelity, vasepatch.eval.task\n"
        "light = not any(m in sys.modules for m in ('torch', 'transformers'))\n"
        "listed = set(bench.__all__) <= set(dir(bench))\n"
        "from vasepatch.bench import BenchSettings, MethodSpec, run_benchmark, summarise\n"
        "from vasepatch.bench.runner import run_benchmark as real\n"
        "from vasepatch.bench.summary import summarise as real_summarise\n"
        "same = bench.run_benchmark is real is run_benchmark and summarise is real_summarise\n"
        "ns = {}\n"
        "exec('from vasepatch.bench import *', ns)\n"
        "star = set(bench.__all__) <= set(ns)\n"
        "print(json.dumps({'light': light, 'dir': listed, 'same': same, 'star': star}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"light": True, "dir": True, "same": True, "star": True}
    import vasepatch.bench

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vasepatch.bench.nope  # noqa: B018


@pytest.fixture(scope="module")
def fresh_package() -> dict:
    """What a fresh interpreter finds: `import vasepatch` imports neither torch nor transformers, every public
    name still imports (`from vasepatch import patch`, `*`), and the policy registry's names."""
    code = (
        "import json, sys, vasepatch\n"
        "from vasepatch import VaSEConfig, UnsupportedModelError\n"
        "light = not any(m in sys.modules for m in ('torch', 'transformers'))\n"
        "listed = set(vasepatch.__all__) <= set(dir(vasepatch))\n"
        "from vasepatch import patch, patched, unpatch, is_patched, PatchHandle, VaSECache, VaSELayer\n"
        "from vasepatch import PolicyOutputError, policies\n"
        "from vasepatch.integration.patching import patch as real\n"
        "assert vasepatch.patch is real is patch and vasepatch.policies is policies\n"
        "assert vasepatch.VaSECache.__module__ == 'vasepatch.cache.cache'\n"
        "ns = {}\n"
        "exec('from vasepatch import *', ns)\n"
        "star = set(vasepatch.__all__) <= set(ns)\n"
        "print(json.dumps({'light': light, 'dir': listed, 'star': star, 'registry': policies.config_names()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_package_is_light_and_its_names_still_work(fresh_package):
    assert fresh_package["light"] and fresh_package["dir"] and fresh_package["star"]
    import vasepatch

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vasepatch.nope  # noqa: B018


def test_version_answers_fast_in_a_fresh_process():
    """`vasepatch --version` took ~10 s (torch and transformers first). The bound is loose for a loaded 2-core
    machine; unloaded it answers in about 0.3 s."""
    script = Path(sys.executable).with_name("vasepatch")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "vasepatch.tools.cli"]
    start = time.perf_counter()
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    assert done.returncode == 0 and done.stdout.startswith("vasepatch "), done.stderr
    assert seconds < 5, f"vasepatch --version took {seconds:.1f} s"


# --- policy names ---


def test_the_builtin_policy_names_are_the_registry_of_a_fresh_process(fresh_package):
    assert ["full", *cli_args.BUILTIN_POLICIES] == fresh_package["registry"], "update cli_args.BUILTIN_POLICIES"


def test_policy_names_follow_the_registry_once_it_is_imported(monkeypatch):
    from vasepatch import policies

    monkeypatch.setitem(policies._REGISTRY, "mine", policies._REGISTRY["vase"])
    assert cli_args.policy_name(" mine ") == "mine"
    assert cli_args.policy_names() == policies.config_names()
    assert cli_args.policy_names_text().startswith("full, cur, ")
    assert "mine" in cli_args.policy_names_text()


@pytest.mark.parametrize("command", [["generate", "hi"], ["demo"]])
def test_help_and_errors_name_every_policy_full_included(command, capsys):
    names = cli_args.policy_names_text()
    assert names.startswith("full, ") and "vase-topk" in names
    with pytest.raises(SystemExit) as exit_info:
        main([command[0], "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"selection policy: {names} (full never evicts)" in help_text
    with pytest.raises(SystemExit) as exit_info:
        main([command[0], "--policy", "nope", *command[1:]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument --policy: unknown policy 'nope'; choose one of: {names} " in err


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["eval", "fidelity"], "--policies POLICIES comma-separated policy names ({names}), or 'all' (full first)"),
        (["eval", "task"], "--policies POLICIES comma-separated policy names ({names}), or 'all' (full first)"),
        (["bench"], "dense, static, floor, kvpress or policy names ({names}), each optionally +compile"),
    ],
)
def test_eval_and_bench_help_name_every_policy(command, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert expected.format(names=cli_args.policy_names_text()) in help_text


# --- threads on a busy machine ---


def test_busy_warning_as_a_function_of_load_cores_and_the_flag():
    line = threads.busy_warning(3.1, 2, 2, explicit=False)
    assert line == (
        "vasepatch: the 1-minute load average is 3.1 on 2 cores: other processes are running; --threads 1 may be "
        "much faster than the default 2 (see docs/performance.md#threads)"
    )
    assert threads.busy_warning(3.1, 2, 2, explicit=True) is None  # --threads or $OMP_NUM_THREADS given
    assert threads.busy_warning(3.1, 1, 1, explicit=False) is None  # one thread: nothing fewer to pick
    assert threads.busy_warning(0.9, 2, 2, explicit=False) is None  # a shell, an editor: not busy
    assert "--threads 1 " in threads.busy_warning(1.0, 2, 2, explicit=False)  # one busy process beside 2 threads
    assert "--threads 15 " in threads.busy_warning(1.2, 16, 16, explicit=False)
    assert threads.busy_warning(4.0, 16, 8, explicit=False) is None  # 8 threads fit beside a load of 4
    assert "--threads 6 " in threads.busy_warning(10.0, 16, 8, explicit=False)
    assert "--threads 1 " in threads.busy_warning(40.0, 16, 16, explicit=False)


def test_the_threads_help_says_what_the_default_is(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    n = threads.default_threads()
    assert f"torch CPU threads (default: {n}, the physical cores this process may use; not lowered when" in text
    assert "fewer when other processes share the cores" not in text


@pytest.fixture
def busy(monkeypatch):
    """A machine with 2 cores and a 1-minute load average of 3.1; loading a model (or starting the benchmark)
    stops the command."""
    import vasepatch.bench.runner
    from vasepatch import models

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "physical_cores", lambda *a: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (3.1, 2.5, 2.0))

    def stop(*args, **kwargs):
        raise FileNotFoundError("stopped where the model loads")

    monkeypatch.setattr(models, "load", stop)
    monkeypatch.setattr(vasepatch.bench.runner, "run_benchmark", stop)
    return monkeypatch


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "hi"],
        ["demo"],
        ["eval", "fidelity", "--out", "{out}"],
        ["eval", "task", "--model", "smollm2-135m", "--out", "{out}"],
        ["bench", "--quick", "--out", "{out}"],
    ],
    ids=lambda c: c[0] if c[0] != "eval" else f"eval {c[1]}",
)
def test_a_busy_machine_gets_one_warning_line_unless_threads_were_given(command, busy, capsys, tmp_path):
    command = [word.format(out=tmp_path) for word in command]
    if command[0] != "demo":  # their checks resolve the model (SmolLM2) before the warning
        from vasepatch import models

        try:
            models.smollm2_gguf()
        except FileNotFoundError as err:
            pytest.skip(str(err))

    def stderr_of(argv: list[str]) -> list[str]:
        with pytest.raises(SystemExit):
            main(argv)
        return capsys.readouterr().err.splitlines()

    err = stderr_of(command)
    warnings = [line for line in err if "load average" in line]
    assert warnings == [threads.busy_warning(3.1, 2, 2, explicit=False)]
    assert err[-1] == "vasepatch: error: stopped where the model loads"
    assert not any("load average" in line for line in stderr_of([*command, "--threads", "2"]))
    busy.setenv("OMP_NUM_THREADS", "2")
    assert not any("load average" in line for line in stderr_of(command))


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--budget", "8", "--window", "8", "hi"],
        ["eval", "fidelity", "--policies", "nope"],
        ["eval", "task", "--policies", "full,nope"],
        ["bench", "--methods", "nope"],
        ["bench", "--tokens", "8", "--steps", "16"],
    ],
    ids=" ".join,
)
def test_a_usage_error_on_a_busy_machine_stays_one_line(argv, busy, capsys):
    """A setting refused after parsing stops the command before the warning (which comes right before the work)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_threads_given_is_recorded():
    from vasepatch.tools.cli import build_parser

    assert build_parser().parse_args(["generate", "hi"]).threads_given is False
    assert build_parser().parse_args(["generate", "hi", "--threads", "1"]).threads_given is True
    assert threads.warn_if_busy(__import__("argparse").Namespace()) is None  # not from the CLI
