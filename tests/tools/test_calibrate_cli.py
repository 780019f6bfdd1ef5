"""`vasepatch calibrate` on a tiny saved model: the file it writes (MATH-500 or a --text file, --out or the
cache), what it prints, and its bad inputs (one line, exit status 2, before the weights load)."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tests.tiny_models import COMMON, VOCAB, tiny_model
from tests.tiny_tokenizer import tiny_tokenizer
from tests.tools.test_cli_startup import heavy_imports
from vasepatch.integration import calibration
from vasepatch.policies.query_stats import load_stats, read_metadata
from vasepatch.tools import calibrate
from vasepatch.tools.cli import main


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if the weights load."""
    import vasepatch.models

    monkeypatch.setattr(vasepatch.models, "load", lambda *a, **k: pytest.fail("the weights loaded"))


def _calibrate(*argv: str) -> list[str]:
    return ["calibrate", *argv, "--threads", "1"]


def test_math500_calibration_writes_the_stats_and_says_so(model_dir, tmp_path, capsys):
    out = tmp_path / "stats" / "tiny.safetensors"
    assert main(_calibrate(str(model_dir), "--tokens", "1500", "--out", str(out))) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(out)
    assert re.fullmatch(r"1500 tokens of MATH-500 \(problems and solutions\) in [\d.]+ s; [\d.]+ KiB", printed[1])
    assert load_stats(out).q_mean.shape == (2 * 2, 2, 8, 2)
    meta = read_metadata(out)
    pieces = calibrate.math500_pieces()
    first, second = next(pieces), next(pieces)
    assert len(first) < 1500 <= len(first + second)  # the tiny tokenizer reads one character a token
    text = first + second
    assert meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert meta["tokens"] == "1500" and meta["text_source"] == "vasepatch/data/math500"
    assert meta["model"] == meta["model_argument"] == str(model_dir)
    assert meta["chunk"] == "1024"  # at most max_position_embeddings


def test_a_text_file_and_the_default_path_in_the_cache(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("The cat sat.\n\nOn the mat, it sat again.\n", encoding="utf-8")
    assert main(_calibrate(str(model_dir), "--tokens", "20", "--text", str(text))) == 0
    path = capsys.readouterr().out.splitlines()[0]
    key = calibration.model_key(tiny_model("llama"))
    assert path == str(tmp_path / "cache" / "triattention" / f"{key}.safetensors")
    meta = read_metadata(path)
    assert meta["text_source"] == str(text) and meta["tokens"] == "20"
    assert meta["text_sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()  # both paragraphs were read
    ids = torch.tensor([tiny_tokenizer(VOCAB)(text.read_text(), add_special_tokens=False)["input_ids"][:20]])
    expected = calibration.collect(tiny_model("llama"), ids)
    torch.testing.assert_close(load_stats(path).q_abs[:2], expected["q_abs"][0].reshape(2, 2, 8))


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vasepatch: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def bad_paths(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    (tmp_path / "short.txt").write_text("just eleven", encoding="utf-8")
    (tmp_path / "folder").mkdir()
    CONFIG_MAPPING["gpt2"](**COMMON).save_pretrained(tmp_path / "gpt2")
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    CONFIG_MAPPING["llama"](**COMMON, rope_parameters=dynamic).save_pretrained(tmp_path / "dynamic")
    return tmp_path


BAD = [
    (["<model>", "--tokens", "0"], r"argument --tokens: must be an int in \[1, 2147483647\], got 0"),
    (["<model>", "--tokens", "x"], r"argument --tokens: must be an int in \[1, 2147483647\], got 'x'"),
    (["<tmp>/nope"], r"model '.*nope' is neither a registered name"),
    (["<model>", "--text", "<tmp>/missing.txt"], r"--text .*missing.txt: no such file"),
    (["<model>", "--text", "<tmp>/folder"], r"--text .*folder: is a folder, not a file"),
    (["<model>", "--text", "<tmp>/empty.txt"], r"--text .*empty.txt: the file is empty"),
    (["<model>", "--text", "<tmp>/latin1.txt"], r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
    (["<model>", "--text", "<tmp>/short.txt", "--tokens", "12"], r"--tokens 12 is more than --text .* has: 11 tokens"),
    (["<model>", "--tokens", "10000000"], r"--tokens 10000000 is more than MATH-500 .* has: \d+ tokens"),
    (["<model>", "--out", "<tmp>/folder"], r"argument --out: .*folder is a folder; expected a file path"),
    (["<model>", "--out", "<tmp>/short.txt/x.safetensors"], r"argument --out: .*is a file, not a folder"),
    (["<tmp>/gpt2"], r"triattention cannot calibrate .*gpt2.*no rotary position embedding"),
    (["<tmp>/dynamic"], r"triattention cannot calibrate .*rope type 'dynamic'"),
    ([], r"the following arguments are required: model"),
]


@pytest.mark.parametrize(("argv", "expected"), BAD, ids=[" ".join(a)[:50] or "(none)" for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2_before_the_weights_load(
    argv, expected, model_dir, bad_paths, no_load, capsys
):
    filled = [w.replace("<model>", str(model_dir)).replace("<tmp>", str(bad_paths)) for w in argv]
    assert re.search(expected, _error(_calibrate(*filled), capsys))


def test_parsing_imports_neither_torch_nor_transformers():
    assert heavy_imports(["calibrate", "--help"], ["calibrate", "m", "--tokens", "0"]) == []
