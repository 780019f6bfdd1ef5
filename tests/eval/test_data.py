"""The benchmark data: the packaged sets, the overrides, and one-line errors for bad folders and files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import vasepatch
from vasepatch.eval import data

SIZES = {"gsm8k": 1319, "math500": 500, "aime25": 30}


def _write_set(root: Path, name: str, lines: list[str] | bytes) -> Path:
    path = root / name / "test.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lines if isinstance(lines, bytes) else "\n".join(lines).encode())
    return path


def _message(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and isinstance(excinfo.value, ValueError)
    return message


def test_packaged_data_needs_no_flag_and_no_env_var(monkeypatch):
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    root = data.data_dir()
    assert root == data.packaged_data_dir() == Path(vasepatch.__file__).parent / "data"
    for name, size in SIZES.items():
        assert (root / name / "LICENSE").read_text().startswith("MIT License")
        examples = data.load_examples(name)
        assert len(examples) == size and all(e.question.strip() and e.answer for e in examples)
    first = data.load_examples("gsm8k:2")
    assert len(first) == 2 and first[0].question.startswith("Janet") and first[0].answer == "18"
    assert data.load_examples("aime25:1")[0].answer == "70"


def test_env_var_overrides_packaged_data_and_explicit_dir_overrides_both(tmp_path, monkeypatch):
    _write_set(tmp_path / "env", "gsm8k", [json.dumps({"question": "env q", "answer": "x #### 1"})])
    _write_set(tmp_path / "flag", "gsm8k", [json.dumps({"question": "flag q", "answer": "#### 2"})])
    monkeypatch.setenv(data.ENV_VAR, str(tmp_path / "env"))
    assert data.load_examples("gsm8k") == [data.Example("0", "env q", "1")]
    assert data.load_examples("gsm8k", tmp_path / "flag") == [data.Example("0", "flag q", "2")]
    monkeypatch.setenv(data.ENV_VAR, "")  # set but empty: as if unset
    assert len(data.load_examples("gsm8k")) == SIZES["gsm8k"]


@pytest.mark.parametrize("origin", ["--data-dir", "$VASEPATCH_DATA_DIR"])
def test_a_missing_folder_is_an_error_not_a_fallback(tmp_path, monkeypatch, origin):
    missing = tmp_path / "nowhere"
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    if origin == "--data-dir":
        call = lambda: data.load_examples("gsm8k:1", missing)  # noqa: E731
    else:
        monkeypatch.setenv(data.ENV_VAR, str(missing))
        call = lambda: data.load_examples("gsm8k:1")  # noqa: E731
    with pytest.raises(data.DataError) as excinfo:
        call()
    assert isinstance(excinfo.value, FileNotFoundError)
    assert _message(excinfo) == f"data folder {missing} (from {origin}) does not exist"


def test_a_folder_without_the_set_names_the_missing_file(tmp_path):
    _write_set(tmp_path, "gsm8k", [json.dumps({"question": "q"})])
    with pytest.raises(data.DataError) as excinfo:
        data.load_examples("math500", tmp_path)
    message = _message(excinfo)
    assert message.startswith(f"{tmp_path / 'math500' / 'test.jsonl'}: no such file")
    assert "gsm8k/test.jsonl" in message  # says what a data folder holds


MALFORMED = {
    "invalid JSON": (
        [json.dumps({"question": "ok"}), "", '{"question": "cut'],
        r":3: invalid JSON at column 14 \(Unterminated string starting\)",
    ),
    "no question": ([json.dumps({"question": "ok"}), json.dumps({"answer": "3"})], r":2: no question"),
    "empty question": ([json.dumps({"problem": "  "})], r":1: no question"),
    "question not a string": ([json.dumps({"question": 5})], r":1: no question"),
    "not an object": ([json.dumps(["question", "q"])], r":1: expected a JSON object, got list"),
    "no lines": (["", "  "], r": no examples"),
    "not UTF-8": (b'{"question": "caf\xe9"}\n', r": not UTF-8 text"),
}


@pytest.mark.parametrize("lines, pattern", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_file_gets_one_line_naming_file_and_line(tmp_path, lines, pattern):
    path = _write_set(tmp_path, "gsm8k", lines)
    with pytest.raises(data.DataError) as excinfo:
        data.load_examples("gsm8k:1", tmp_path)  # checked past the first example: caught before a model loads
    assert re.fullmatch(re.escape(str(path)) + pattern + ".*", _message(excinfo))


def test_an_own_file_is_checked_the_same_way(tmp_path):
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"problem": "p", "answer": 7}) + "\nnot json\n")
    with pytest.raises(data.DataError, match=re.escape(f"{own}:2: invalid JSON at column 1 (Expecting value)")):
        data.load_examples(str(own))
    with pytest.raises(data.DataError, match="expected gsm8k/math500/aime25"):
        data.load_examples(str(tmp_path / "absent.jsonl"))
    with pytest.raises(data.DataError, match="positive int"):
        data.load_examples("gsm8k:0")


def test_lines_split_only_at_newlines_and_ids_count_every_line(tmp_path):
    path = _write_set(tmp_path, "aime25", ["", json.dumps({"problem": "a\u2028b", "answer": 1}, ensure_ascii=False)])
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert data.load_examples("aime25", tmp_path) == [data.Example("1", "a\u2028b", "1")]
