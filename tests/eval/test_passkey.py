"""`vasepatch eval task --task passkey`: prompts generated from a seed (the key at the asked
depth, the length close to the target), exact-match grading, and the command end to end on
a tiny model with an offline character tokenizer (seconds)."""

from __future__ import annotations

import json
import re

import pytest

from tests.tiny_models import VOCAB, tiny_config
from tests.tiny_tokenizer import tiny_tokenizer
from vasepatch import VaSEConfig
from vasepatch.eval import answers, grading, haystack, passkey
from vasepatch.eval.task_settings import TaskSettings
from vasepatch.tools import cli

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_CFG = tiny_config("qwen3")
PER_SLOT = 2 * _CFG.num_hidden_layers * _CFG.num_key_value_heads * _CFG.head_dim * 4  # K+V bytes, fp32


@pytest.fixture
def model_dir(tmp_path, make_model):
    """A tiny Qwen3 model with the offline character tokenizer, saved as an HF directory."""
    model = make_model("qwen3")
    model.generation_config.eos_token_id = 1
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(128)


def test_keys_come_from_the_seed():
    keys = [haystack.pass_key(0, 1024, i) for i in range(50)]
    assert keys == [haystack.pass_key(0, 1024, i) for i in range(50)]
    assert all(re.fullmatch(r"[1-9][0-9]{4}", k) for k in keys)
    assert len(set(keys)) > 45  # the samples differ
    assert keys != [haystack.pass_key(1, 1024, i) for i in range(50)]
    assert keys != [haystack.pass_key(0, 2048, i) for i in range(50)]


def test_generation_is_deterministic(tok):
    settings = TaskSettings(task="passkey", context_lengths=[400], samples=6)
    first = [(i.ident, i.prompt, i.fields) for _, b in passkey.batches(settings, tok) for i in b]
    again = [(i.ident, i.prompt, i.fields) for _, b in passkey.batches(settings, tok) for i in b]
    assert first == again
    other_seed = TaskSettings(task="passkey", context_lengths=[400], samples=6, config=VaSEConfig(256, 64, seed=1))
    assert [i.prompt for _, b in passkey.batches(other_seed, tok) for i in b] != [p for _, p, _ in first]
    # the samples are spread evenly over the depths, each with its own key
    fields = [f for _, _, f in first]
    assert [f["depth"] for f in fields] == [0.0, 0.25, 0.5, 0.75, 1.0, 0.0]
    assert all(f"The pass key is {f['key']}." in p for _, p, f in first)


def _filler_before_needle(message: str, key: str) -> tuple[int, int]:
    """Characters of filler before the key's sentence, and in all."""
    body = message.split("\n\n")[1]
    needle = haystack.NEEDLE.format(key=key)
    before, after = body.split(needle)
    return len(before.strip()), len(before.strip()) + len(after.strip())


@pytest.mark.parametrize("length", [300, 1000, 3000])
@pytest.mark.parametrize("depth", DEPTHS)
def test_key_at_the_requested_depth_and_length_close_to_the_target(tok, length, depth):
    hay = haystack.build(tok, length, depth, "31415")
    # the length is what the tokenizer counts, within half of the longest filler sentence
    assert hay.n_tokens == len(tok(hay.prompt, add_special_tokens=False)["input_ids"])
    assert abs(hay.n_tokens - length) <= max(len(s) + 1 for s in haystack.FILLER) / 2
    # the key sits after the asked fraction of the filler (to one sentence)
    assert hay.prompt.count("31415") == 2 and hay.prompt.rstrip().endswith("<|assistant|>")
    before, total = _filler_before_needle(hay.prompt, "31415")
    assert abs(before / total - depth) <= 25 / total
    assert hay.needle_at == round(depth * hay.n_filler)
    if depth == 0:
        assert before == 0
    if depth == 1:
        assert before == total
        assert hay.prompt.index("31415 is the pass key.") > hay.prompt.rindex(haystack.FILLER[0])


def test_target_shorter_than_the_bare_prompt_is_an_error(tok):
    with pytest.raises(ValueError, match="shorter than the prompt without filler"):
        haystack.build(tok, 50, 0.5, "12345")
    with pytest.raises(ValueError, match="depth must be in"):
        haystack.build(tok, 500, 1.5, "12345")


@pytest.mark.parametrize(
    ("output", "extracted", "correct"),
    [
        ("The pass key is 12345.", "12345", True),
        ("12345", "12345", True),
        ("  12345 is the pass key. 54321", "12345", True),
        ("The pass key is 54321. No, it is 12345.", "54321", False),  # the first one counts
        ("The pass key is 123456.", None, False),  # part of a longer number
        ("112345", None, False),
        ("The pass key is 1234.", None, False),
        ("The pass key is 12,345.", None, False),
        ("The pass key is 1 2 3 4 5.", None, False),
        ("key: 99999 then 12345", "99999", False),
        ("It is 12345th", "12345", True),
        ("", None, False),
        ("١٢٣٤٥", None, False),  # only ASCII digits
    ],
)
def test_passkey_grading(output, extracted, correct):
    assert grading.grade_passkey(output, "12345") == (extracted, correct)
    assert grading.grade("passkey", output, "12345") == (extracted, correct)


def test_passkey_cli_end_to_end_and_resume(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "passkey"
    args = ["eval", "task", "--task", "passkey", "--model", str(model_dir), "--context-lengths", "300,450",
            "--depths", "0,0.5,1", "--samples", "4", "--policies", "full,vase,streaming", "--budget", "32",
            "--window", "8", "--max-new-tokens", "6", "--batch-size", "5", "--out", str(out)]  # fmt: skip
    assert cli.run(args) == 0
    result = json.loads((out / "passkey.json").read_text())
    header, rows = result["config"], result["results"]
    assert header["sample_temperature"] == 0.0 and header["max_new_tokens"] == 6 and header["protect"] == 8
    assert header["batch_size"] == 4  # what ran: a batch holds the 4 prompts of one length, not the 5 asked
    printed = capsys.readouterr()
    assert "Pass-key retrieval accuracy" in printed.out and printed.out.count("| streaming ") == 2
    assert "vase · passkey" in printed.err and "tok/s" in printed.err
    assert re.search(r"prompt/s|s/prompt", printed.err)
    assert header["context_lengths"] == [300, 450] and header["depths"] == [0.0, 0.5, 1.0]
    assert [(r["policy"], r["context_length"]) for r in rows] == [
        (p, n) for p in ("full", "vase", "streaming") for n in (300, 450)
    ]
    for r in rows:
        assert r["n"] == 4 and 0 <= r["accuracy"] <= 1 and abs(r["prompt_tokens"] - r["context_length"]) <= 11
    sizes = {(r["policy"], r["context_length"]): r["kv_bytes"] for r in rows}
    assert sizes[("vase", 300)] == sizes[("vase", 450)] == (32 + 8) * PER_SLOT  # compressed at prefill
    assert sizes[("full", 450)] > sizes[("full", 300)] > 280 * PER_SLOT  # the whole prompt
    by_depth = result["by_depth"]
    assert len(by_depth) == 3 * 2 * 3 and {r["n"] for r in by_depth} == {1, 2}  # 4 samples over 3 depths
    records = [json.loads(x) for x in (out / "passkey-vase.jsonl").read_text().splitlines()]
    assert sorted((r["context_length"], r["index"]) for r in records) == [(n, i) for n in (300, 450) for i in range(4)]
    for r in records:
        assert r["depth"] == (0.0, 0.5, 1.0)[r["index"] % 3] and r["key"] == haystack.pass_key(
            0, r["context_length"], r["index"]
        )
        assert (r["extracted"], r["correct"]) == grading.grade_passkey(r["output"], r["key"])
        assert 1 <= r["n_tokens"] <= 6
    assert "by_depth" in (out / "passkey.md").read_text() and (out / "passkey.png").stat().st_size > 0

    def fail(*a, **k):
        raise AssertionError("resumed run generated again")

    monkeypatch.setattr(answers, "generate", fail)
    assert cli.run(args) == 0  # everything is there
    assert json.loads((out / "passkey.json").read_text())["results"] == rows
    assert cli.run([*args, "--context-lengths", "450"]) == 0  # a subset of the lengths: nothing to generate
    with pytest.raises(ValueError, match="other settings"):
        cli.run([*args, "--depths", "0,1"])


def test_fewer_samples_than_depths_leave_no_nan_in_the_summary():
    """With 4 samples over 5 depths one depth gets none: it gets no row, not a NaN."""
    settings = TaskSettings(task="passkey", context_lengths=[300], samples=4, depths=[0, 0.25, 0.5, 0.75, 1])
    records = [
        {"context_length": 300, "depth": d, "correct": i % 2 == 0, "prompt_tokens": 300, "kv_bytes": 1.0}
        for i, d in enumerate([0, 0.25, 0.5, 0.75])
    ]
    rows, by_depth = passkey.summarise("vase", records, settings)
    assert rows[0]["n"] == 4 and rows[0]["accuracy"] == 0.5
    assert [r["depth"] for r in by_depth] == [0, 0.25, 0.5, 0.75]
    assert "NaN" not in json.dumps([*rows, *by_depth])


def test_a_context_longer_than_the_model_takes_is_refused_before_the_weights_load(monkeypatch, capsys):
    """`--context-lengths 100000` on SmolLM2 (8,192 positions) would prefill for minutes: it is refused from the
    model's config.json, before the weights load."""
    from vasepatch import models

    try:
        models.smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the weights loaded"))
    argv = ["eval", "task", "--task", "passkey", "--model", "smollm2-135m", "--context-lengths", "1024,100000"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--out", "never-written"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "vasepatch: error: --context-lengths 100000 with --max-new-tokens 12 needs 100012 positions, more than the "
        "8192 that smollm2-135m takes (its max_position_embeddings); lower it to fit\n"
    )


def test_the_prompt_actually_built_is_checked_against_the_loaded_model(model_dir, tmp_path):
    """A prompt whose tokens (plus the answer) overrun the positions is refused before any prefill, also when
    the model is given (no config to read first)."""
    from vasepatch import models

    model, tok = models.load(str(model_dir))
    model.config.max_position_embeddings = 300
    settings = TaskSettings(task="passkey", context_lengths=[300], samples=1, out=str(tmp_path / "o"))
    message = r"pass-key prompt \(\d+ tokens\) with --max-new-tokens 12 needs \d+ positions, more than the 300 "
    with pytest.raises(ValueError, match=message):
        passkey.run(settings, answers.TransformersAnswers(model, tok))
    assert not (tmp_path / "o").exists()
