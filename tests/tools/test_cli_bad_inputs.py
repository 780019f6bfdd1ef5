"""Every bad input of every command: a one-line `vasepatch: error: ...` on stderr, exit status 2, before
any work (no model loads, no benchmark starts, no output folder is made).

`BAD_INPUTS` is a plain list of `(argv, expected message regex)` so that it can be rendered into
docs/reliability.md. In argv, `<file>` is an existing regular file, `<dir>` an existing empty folder,
`<missing>` a path that does not exist, `<not-json>` a file that is not JSON and `<tiny-model>` a saved tiny
Llama (1,024 max positions). `\\udcff` is how Python holds the byte 0xff of an argument that is not UTF-8.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vasepatch.tools.cli import main

BIG = str(2**40)
NOT_UTF8 = "caf\udcff"  # the argument b"caf\xff"

GENERATE: list[tuple[list[str], str]] = [
    (["generate", "--device", "banana", "hi"], r"argument --device: unknown device 'banana'; available here: cpu"),
    (["generate", "--device", "cuda:99", "hi"], r"argument --device: 'cuda:99' .*available here: cpu"),
    (["generate", "--sample-temperature", "nan", "hi"], r"--sample-temperature: must be a finite number >= 0 .*nan"),
    (["generate", "--temperature", "inf", "hi"], r"--temperature.*: must be a finite number >= 0 .*got inf"),
    (["generate", "--temperature", "-1", "hi"], r"must be a finite number >= 0 .*got -1"),
    (["generate", "--top-p", "0", "hi"], r"argument --top-p: must be a finite number in \(0, 1\], got 0"),
    (["generate", "--top-p", "nan", "hi"], r"argument --top-p: must be a finite number in \(0, 1\], got nan"),
    (["generate", "--repetition-penalty", "0", "hi"], r"--repetition-penalty: must be a finite number > 0"),
    (["generate", "--repetition-penalty=-inf", "hi"], r"--repetition-penalty: must be a finite number > 0"),
    (["generate", "--budget", "x", "hi"], r"argument --budget: must be an int in \[2, 2147483647\], got 'x'"),
    (["generate", "--budget", "1", "hi"], r"argument --budget: must be an int in \[2, 2147483647\], got 1"),
    (["generate", "--budget", BIG, "hi"], r"argument --budget: must be an int in \[2, 2147483647\], got 1099511627776"),
    (["generate", "--window", "0", "hi"], r"argument --window: must be an int in \[1, 2147483647\], got 0"),
    (["generate", "--sinks", "-1", "hi"], r"argument --sinks: must be an int in \[0, 2147483647\], got -1"),
    (["generate", "--protect", "-1", "hi"], r"argument --protect: must be an int in \[0, 2147483647\], got -1"),
    (["generate", "--seed", str(2**64), "hi"], r"argument --seed: must be an int in \[-9223372036854775808, "),
    (["generate", "--seed", "1.5", "hi"], r"argument --seed: must be an int .*got '1.5'"),
    (["generate", "--max-new-tokens", "0", "hi"], r"argument --max-new-tokens: must be an int in \[1, 2147483647\]"),
    (["generate", "--max-new-tokens", "1e9", "hi"], r"argument --max-new-tokens: must be an int .*got '1e9'"),
    (["generate", "--max-new-tokens", BIG, "hi"], r"argument --max-new-tokens: must be an int in \[1, 2147483647\]"),
    (["generate", "--prefill", "all", "hi"], r"argument --prefill: invalid choice: 'all'"),
    (["generate", "--dtype", "float8", "hi"], r"argument --dtype: invalid choice: 'float8'"),
    (["generate", "--threads", "0", "hi"], r"argument --threads: must be an int >= 1 and <= 1024, got 0"),
    (["generate", "--threads", "100000", "hi"], r"argument --threads: must be an int >= 1 and <= 1024, got 100000"),
    (["generate", NOT_UTF8], r"argument 2 \('caf\\xff'\) is not UTF-8 text: byte 0xff at offset 3"),
    (["generate", "--model", NOT_UTF8, "hi"], r"argument 3 .* is not UTF-8 text: byte 0xff at offset 3"),
    (["generate", "  "], r"prompt is empty"),
    (["generate", "--model", "<missing>", "hi"], r"model '.*missing' is neither a registered name"),
    (
        ["generate", "--model", "<tiny-model>", "--max-new-tokens", "2000", "hi"],
        r"--max-new-tokens needs 2000 positions, more than the 1024",
    ),
    (["generate", "--budget", "8", "--window", "8", "hi"], r"window must be smaller than budget"),
    (["generate", "--policy", "nope", "hi"], r"'nope'"),
    (["generate"], r"the following arguments are required: prompt"),
    (["generate", "--nope", "hi"], r"unrecognized arguments: --nope"),
]
DEMO: list[tuple[list[str], str]] = [
    (["demo", "--max-new-tokens", "0"], r"argument --max-new-tokens: must be an int in \[1, 2147483647\], got 0"),
    (["demo", "--budget", "nan"], r"argument --budget: must be an int in \[2, 2147483647\], got 'nan'"),
    (["demo", "--window", "-1"], r"argument --window: must be an int in \[1, 2147483647\], got -1"),
    (["demo", "--seed", "x"], r"argument --seed: must be an int"),
    (["demo", "--prompt", NOT_UTF8], r"argument 3 \('caf\\xff'\) is not UTF-8 text: byte 0xff at offset 3"),
    (["demo", "--policy", "nope"], r"'nope'"),
]
FIDELITY: list[tuple[list[str], str]] = [
    (
        ["eval", "fidelity", "--out", "/proc/vasepatch-never"],
        r"argument --out: /proc/vasepatch-never cannot be written",
    ),
    (["eval", "fidelity", "--tokens", "1"], r"argument --tokens: must be an int in \[2, 2147483647\], got 1"),
    (["eval", "fidelity", "--tokens", BIG], r"argument --tokens: must be an int in \[2, 2147483647\]"),
    (["eval", "fidelity", "--sample-temperature", "0"], r"--reference-temperature: must be a finite number > 0"),
    (["eval", "fidelity", "--sample-temperature", "nan"], r"--reference-temperature: must be .* got nan"),
    (["eval", "fidelity", "--temperature", "0"], r"argument --temperature/--score-temperature: .* >= 1e-06, got 0"),
    (["eval", "fidelity", "--temperature", "inf"], r"argument --temperature/--score-temperature: must be a finite"),
    (["eval", "fidelity", "--smooth", "0"], r"argument --smooth: must be an odd int in \[1, 2147483647\] .*got 0"),
    (["eval", "task", "--smooth", "4"], r"argument --smooth: must be an odd int in \[1, 2147483647\] .*got 4"),
    (["eval", "fidelity", "--seeds", "0"], r"argument --seeds: must be an int in \[1, 2147483647\], got 0"),
    (["eval", "fidelity", "--batch-size", "-4"], r"argument --batch-size: must be an int in \[1, 2147483647\]"),
    (["eval", "fidelity", "--shared-heads", "maybe"], r"argument --shared-heads: invalid choice: 'maybe'"),
    (["eval", "fidelity", "--policies", "vase,nope"], r"unknown policies \['nope'\]"),
    (["eval", "fidelity", "--probe", "<missing>"], r"probe file .*: no such file"),
    (["eval", "fidelity", "--probe", "<dir>"], r"probe file .*: is a folder, not a file"),
    (["eval", "fidelity", "--probe", "<not-json>"], r"probe file .*: not valid JSON"),
    (["eval", "fidelity", "--prompts", "<dir>"], r"prompts '.*': .* is a folder; expected a .jsonl file"),
    (["eval", "fidelity", "--prompts", "<missing>"], r"prompts '.*': expected gsm8k/math500/aime25\[:N\] or an exi"),
    (["eval", "fidelity", "--prompts", "<not-json>"], r"not.json:1: invalid JSON at column 2"),
    (["eval", "fidelity", "--prompts", "gsm8k:0"], r"prompt count must be a positive int, got 'gsm8k:0'"),
    (["eval", "fidelity", "--data-dir", "<file>"], r"data folder .* \(from --data-dir\) is a file, not a folder"),
    (["eval", "fidelity", "--data-dir", "<missing>"], r"data folder .* \(from --data-dir\) does not exist"),
    (["eval", "fidelity", "--out", "<file>"], r"argument --out: .* is a file, not a folder"),
    (["eval", "fidelity", "--out", "<file>/sub"], r"argument --out: .*/sub cannot be created: .* is a file"),
    (
        ["eval", "fidelity", "--model", "<tiny-model>", "--tokens", "5000"],
        r"--tokens 5000 needs 5001 positions, "
        r"more than the 1024 that .* takes \(its max_position_embeddings\)",
    ),
    (["eval", "fidelity", "--model", "<missing>"], r"model '.*' is neither a registered name"),
]
TASK: list[tuple[list[str], str]] = [
    (["eval", "task", "--out", "/proc/vasepatch-never"], r"argument --out: /proc/vasepatch-never cannot be written"),
    (["eval", "task", "--task", "nope"], r"argument --task: invalid choice: 'nope'"),
    (["eval", "task", "--limit", "0"], r"argument --limit: must be an int in \[1, 2147483647\], got 0"),
    (["eval", "task", "--samples", "0"], r"argument --samples: must be an int in \[1, 2147483647\], got 0"),
    (["eval", "task", "--sample-temperature", "nan"], r"argument --sample-temperature: must be a finite number >= 0"),
    (["eval", "task", "--sample-temperature", "-0.5"], r"argument --sample-temperature: must be a finite number >= 0"),
    (["eval", "task", "--top-p", "1.5"], r"argument --top-p: must be a finite number in \(0, 1\], got 1.5"),
    (["eval", "task", "--max-new-tokens", "0"], r"argument --max-new-tokens: must be an int in \[1, 2147483647\]"),
    (["eval", "task", "--batch-size", "0"], r"argument --batch-size: must be an int in \[1, 2147483647\], got 0"),
    (["eval", "task", "--budget", "-1"], r"argument --budget: must be an int in \[2, 2147483647\], got -1"),
    (["eval", "task", "--seed", str(-(2**63) - 1)], r"argument --seed: must be an int in \[-9223372036854775808, "),
    (
        ["eval", "task", "--context-lengths", "0"],
        r"argument --context-lengths: each of the comma-separated values "
        r"must be an int in \[1, 2147483647\], got 0",
    ),
    (["eval", "task", "--context-lengths", "1k"], r"argument --context-lengths: .*must be an int .*got '1k'"),
    (["eval", "task", "--context-lengths", ","], r"argument --context-lengths: expected comma-separated ints"),
    (["eval", "task", "--depths", "0.5,nan"], r"argument --depths: .*must be a finite number in \[0, 1\], got nan"),
    (["eval", "task", "--depths", "1.5"], r"argument --depths: .*must be a finite number in \[0, 1\], got 1.5"),
    (["eval", "task", "--out", "<file>"], r"argument --out: .* is a file, not a folder"),
    (["eval", "task", "--data-dir", "<file>"], r"data folder .* \(from --data-dir\) is a file, not a folder"),
    (["eval", "task", "--data-dir", "<dir>"], r"gsm8k/test.jsonl: no such file \(a data folder holds"),
    (
        ["eval", "task", "--task", "passkey", "--model", "<tiny-model>", "--context-lengths", "1000,5000"],
        r"--context-lengths 5000 with --max-new-tokens 12 needs 5012 positions, more than the 1024 that .* takes",
    ),
    (
        ["eval", "task", "--model", "<tiny-model>", "--max-new-tokens", "4096"],
        r"--max-new-tokens 4096 needs 4096 positions, more than the 1024",
    ),
    (["eval", "task", "--policies", ""], r"policies must name at least one policy"),
]
BENCH: list[tuple[list[str], str]] = [
    (["bench", "--model", "<missing>"], r"model '.*missing' is neither a registered name"),
    (["bench", "--out", "/proc/vasepatch-never"], r"argument --out: /proc/vasepatch-never cannot be written"),
    (["bench", "--tokens", "0,64"], r"argument --tokens: each of the comma-separated values must be an int in \[1, "),
    (["bench", "--tokens", "64,abc"], r"argument --tokens: .*must be an int .*got 'abc'"),
    (["bench", "--batch", "0"], r"argument --batch: each of the comma-separated values must be an int in \[1, "),
    (["bench", "--batch", BIG], r"argument --batch: .*got 1099511627776"),
    (["bench", "--budget", "nan"], r"argument --budget: must be an int in \[2, 2147483647\], got 'nan'"),
    (["bench", "--window", "0"], r"argument --window: must be an int in \[1, 2147483647\], got 0"),
    (["bench", "--prompt-len", "-1"], r"argument --prompt-len: must be an int in \[1, 2147483647\], got -1"),
    (["bench", "--repeats", "0"], r"argument --repeats: must be an int in \[1, 2147483647\], got 0"),
    (["bench", "--steps", "0"], r"argument --steps: must be an int in \[1, 2147483647\], got 0"),
    (["bench", "--seed", "x"], r"argument --seed: must be an int"),
    (["bench", "--device", "banana"], r"argument --device: unknown device 'banana'; available here: cpu"),
    (["bench", "--device", "cuda:99"], r"argument --device: 'cuda:99' .*available here: cpu"),
    (["bench", "--dtype", "float8"], r"argument --dtype: invalid choice: 'float8'"),
    (["bench", "--isolate", "thread"], r"argument --isolate: invalid choice: 'thread'"),
    (["bench", "--mask", "x"], r"argument --mask: invalid choice: 'x'"),
    (["bench", "--methods", "dense,nope"], r"methods: unknown method 'nope'"),
    (["bench", "--methods", "dense,dense"], r"methods: duplicate names"),
    (["bench", "--model", "shape:nope"], r"model: unknown shape 'shape:nope'"),
    (["bench", "--skip", "dense"], r"skip: 'dense' is not method@batch"),
    (["bench", "--budget", "64", "--window", "64"], r"window must be smaller than budget"),
    (["bench", "--out", "<file>"], r"argument --out: .* is a file, not a folder"),
    (["bench", "--resume", "<missing>"], r"resume: .* does not exist; --resume takes the folder of a bench run"),
    (["bench", "--resume", "<file>"], r"resume: .* is a file; --resume takes the folder of a bench run"),
    (["bench", "--resume", "<dir>"], r"resume: .*bench.json does not exist; --resume takes the folder"),
    (["bench", "--resume", "<dir>", "--out", "<missing>"], r"resume: the output goes to .*; drop --out"),
]
CALIBRATE: list[tuple[list[str], str]] = [
    (["calibrate", "<tiny-model>", "--tokens", "0"], r"argument --tokens: must be an int in \[1, 2147483647\], got 0"),
    (["calibrate", "<missing>"], r"model '.*missing' is neither a registered name"),
    (["calibrate", "<tiny-model>", "--text", "<missing>"], r"--text .*missing: no such file"),
    (["calibrate", "<tiny-model>", "--text", "<dir>"], r"--text .*: is a folder, not a file"),
    (["calibrate", "<tiny-model>", "--out", "<dir>"], r"argument --out: .* is a folder; expected a file path"),
    (["calibrate", "<tiny-model>", "--tokens", "10000000"], r"--tokens 10000000 is more than MATH-500 .* has"),
    (["calibrate"], r"the following arguments are required: model"),
]
SERVE: list[tuple[list[str], str]] = [
    (["serve", "<tiny-model>", "--budget", "1"], r"argument --budget: must be an int in \[2, 2147483647\], got 1"),
    (["serve", "<tiny-model>", "--budget", "8", "--window", "8"], r"window must be smaller than budget"),
    (["serve", "<tiny-model>", "--policy", "nope"], r"'nope'"),
    (["serve", "<tiny-model>", "--prefill", "all"], r"argument --prefill: invalid choice: 'all'"),
    (["serve", "<tiny-model>", "--port", "8000"], r"unrecognized arguments: --port 8000 \(another program's options"),
    (["serve"], r"the following arguments are required: model"),
]
TOP: list[tuple[list[str], str]] = [
    ([], r"the following arguments are required: command"),
    (["nope"], r"argument command: invalid choice: 'nope'"),
    (["eval"], r"the following arguments are required: evaluation"),
]

BAD_INPUTS: list[tuple[list[str], str]] = TOP + GENERATE + DEMO + FIDELITY + TASK + BENCH + CALIBRATE + SERVE
"""Every bad input of the command line and the one-line error it gets (a regex of it)."""


def save_tiny_model(path: Path) -> Path:
    """The `<tiny-model>` of the table: a tiny Llama and its tokenizer saved to `path`."""
    from tests.tiny_models import VOCAB, tiny_model
    from tests.tiny_tokenizer import tiny_tokenizer

    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer(VOCAB).save_pretrained(path)
    return path


def placeholder_paths(root: Path, model_dir: Path) -> dict[str, str]:
    """The table's placeholders, made under `root` (an empty folder)."""
    (root / "file.txt").write_text("not a folder\n")
    (root / "dir").mkdir()
    (root / "not.json").write_text("{oops\n")
    return {
        "<file>": str(root / "file.txt"),
        "<dir>": str(root / "dir"),
        "<missing>": str(root / "missing"),
        "<not-json>": str(root / "not.json"),
        "<tiny-model>": str(model_dir),
    }


def command_line(argv: list[str], paths: dict[str, str], never: Path) -> list[str]:
    """A row's argv as run: placeholders filled, `--out never` for a command that writes results (it must
    never be made), `--threads 1` where the command takes it."""
    filled = []
    for word in argv:
        for placeholder, path in paths.items():
            word = word.replace(placeholder, path)
        filled.append(word)
    leaf = filled[:2] in (["eval", "task"], ["eval", "fidelity"]) or filled[:1] == ["bench"]
    if leaf and "--out" not in filled and "--resume" not in filled:
        filled = [*filled, "--out", str(never)]
    return [*filled, "--threads", "1"] if filled[:1] in (["generate"], ["demo"], ["bench"]) else filled


def run_cli(argv: list[str]) -> tuple[int | str | None, str]:
    """`vasepatch argv` in this process: its exit code (None: it returned) and what it wrote to stderr."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exit_info:
            return exit_info.code, err.getvalue()
    return None, err.getvalue()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def paths(tmp_path, tiny_model_dir):
    return placeholder_paths(tmp_path, tiny_model_dir)


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a model loads or a benchmark starts."""
    import transformers

    import vasepatch.bench.runner
    import vasepatch.models
    import vasepatch.tools.serve

    def fail(*args, **kwargs):
        pytest.fail("work started: the bad input was not refused first")

    monkeypatch.setattr(vasepatch.models, "load", fail)
    monkeypatch.setattr(vasepatch.bench.runner, "run_benchmark", fail)
    monkeypatch.setattr(vasepatch.tools.serve, "launch", fail)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)


def test_the_table_covers_every_command():
    from vasepatch.tools.cli import commands

    covered = {" ".join(argv[:2]) if argv[:1] == ["eval"] else argv[0] for argv, _ in BAD_INPUTS if argv}
    assert {name for name, _ in commands()} <= covered
    assert len(BAD_INPUTS) >= 100


@pytest.mark.parametrize(("argv", "expected"), BAD_INPUTS, ids=[" ".join(a)[:60] or "(none)" for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2_before_any_work(argv, expected, paths, no_work, tmp_path):
    code, err = run_cli(command_line(argv, paths, tmp_path / "never"))
    assert code == 2
    assert err.startswith("vasepatch: error: ") and err.count("\n") == 1, err
    assert err.endswith("\n") and "Traceback" not in err
    assert re.search(expected, err) is not None, f"{expected!r} not in {err!r}"
    assert not (tmp_path / "never").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
@pytest.mark.parametrize("command", [["generate", "hi"], ["bench"]])
def test_cuda_on_a_cpu_only_torch_is_a_usage_error(command, no_work, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--device", "cuda"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "argument --device: 'cuda' is not available (this torch build has no CUDA); available here: cpu" in err


def test_stdin_that_is_not_utf8_is_refused_with_the_byte_and_its_offset(monkeypatch, no_work, capsys):
    import io

    stdin = io.TextIOWrapper(io.BytesIO(b"ok \xff\xfe hello"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--raw", "-", "--threads", "1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "vasepatch: error: the prompt on stdin is not UTF-8 text: byte 0xff at offset 3; "
        "pass UTF-8 (e.g. convert it with iconv -t UTF-8)\n"
    )


def test_utf8_stdin_is_read_as_bytes(monkeypatch):
    import io

    from vasepatch.tools import generate

    stdin = io.TextIOWrapper(io.BytesIO("café ☕".encode()), encoding="latin-1")  # a wrong locale is not used
    assert generate.read_prompt("-", stdin) == "café ☕"


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root may write anywhere")
def test_an_out_folder_that_cannot_be_written_is_refused(tmp_path, no_work, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "task", "--out", str(locked / "results")])
    assert exit_info.value.code == 2
    assert "cannot be written: no write permission on" in capsys.readouterr().err


def test_bytes_that_are_not_utf8_from_a_real_shell(tmp_path):
    """`printf '\\xff\\xfe hello' | vasepatch generate --raw -` from a real shell is a one-line error before the
    model loads, not a crash after it (`TypeError: TextEncodeInput must be ...`); the same bytes as an argument too."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "vasepatch.tools.cli", "generate", "--threads", "1"]
    piped = subprocess.run([*command, "--raw", "-"], input=b"\xff\xfe hello", capture_output=True, timeout=300, env=env)
    assert piped.returncode == 2 and b"loading" not in piped.stderr
    assert piped.stderr == (
        b"vasepatch: error: the prompt on stdin is not UTF-8 text: byte 0xff at offset 0; "
        b"pass UTF-8 (e.g. convert it with iconv -t UTF-8)\n"
    )
    argument = subprocess.run([*command, b"caf\xff"], capture_output=True, timeout=300, env=env, cwd=tmp_path)
    assert argument.returncode == 2 and argument.stderr == (
        b"vasepatch: error: argument 4 ('caf\\xff') is not UTF-8 text: byte 0xff at offset 3; "
        b"pass UTF-8 (e.g. convert it with iconv -t UTF-8)\n"
    )


def test_bench_says_when_its_lengths_go_past_the_model_positions(tiny_model_dir, capsys):
    """A benchmark may time past the positions a model takes (the default 8K lengths on SmolLM2): one note,
    not a refusal."""
    from vasepatch.bench.cli import _note_positions
    from vasepatch.bench.settings import BenchSettings

    _note_positions(BenchSettings(model=str(tiny_model_dir), tokens=[64, 1024], prompt_len=16, steps=8, repeats=2))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the longest sequence, 1056 tokens" in err and "past the 1024 positions" in err
    _note_positions(BenchSettings(model=str(tiny_model_dir), tokens=[64, 512], prompt_len=16, steps=8, repeats=2))
    assert capsys.readouterr().err == ""
