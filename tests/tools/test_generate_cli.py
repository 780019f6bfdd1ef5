"""`vasepatch generate` on a tiny saved model: prompt sources, chat template, streaming,
status and summary lines, --compare; and the live status line's terminal handling."""

from __future__ import annotations

import io
import re

import pytest
import torch

from tests.tiny_models import VOCAB
from tests.tiny_tokenizer import tiny_tokenizer
from vasepatch.tools import generate, streaming
from vasepatch.tools.cli import main

TOKENS = 24
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(text: str) -> float:
    """`10.00 KiB` -> 10240.0"""
    number, unit = text.split()
    return float(number) * UNITS[unit]


def _generate(model_dir, *extra: str) -> list[str]:
    return ["generate", "--model", str(model_dir), "--budget", "16", "--window", "4", "--threads", "1",
            "--max-new-tokens", str(TOKENS), *extra]  # fmt: skip


def test_generate_streams_the_text_and_ends_with_a_summary(model_dir, capsys):
    assert main(_generate(model_dir, "What is 2 + 3?")) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out.strip()) > 0  # stdout holds the text only
    summary = re.search(r"vasepatch: (\d+) tokens in [\d.]+ s .*?(\d+) evictions, KV ([\d.]+ \w+) vs ([\d.]+ \w+)", err)
    assert summary, err
    tokens, evictions, kv, full = int(summary[1]), int(summary[2]), _bytes(summary[3]), _bytes(summary[4])
    assert tokens == TOKENS and evictions >= 1 and 0 < kv < full
    assert "\r" not in err  # stderr is not a terminal: no live status line


def test_prompt_from_stdin_matches_the_argument(model_dir, capsys, monkeypatch):
    assert main(_generate(model_dir, "Count to five.")) == 0
    from_argument = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("Count to five."))
    assert main(_generate(model_dir, "-")) == 0
    assert capsys.readouterr().out == from_argument
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    with pytest.raises(SystemExit) as exit_info:
        main(_generate(model_dir, "-"))
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "vasepatch: error: prompt is empty (pass the text, or - and the text on stdin)"
    )


def test_raw_skips_the_chat_template():
    tok = tiny_tokenizer(VOCAB)
    templated = generate.encode(tok, "hi", raw=False, device="cpu")["input_ids"][0].tolist()
    raw = generate.encode(tok, "hi", raw=True, device="cpu")["input_ids"][0].tolist()
    assert raw == tok("hi")["input_ids"]
    assert templated != raw and tok.convert_tokens_to_ids("<|assistant|>") == templated[-1]


def test_raw_flag_reaches_the_encoder(model_dir, capsys, monkeypatch):
    seen = []
    encode = generate.encode
    monkeypatch.setattr(
        generate, "encode", lambda tok, prompt, raw, device: seen.append(raw) or encode(tok, prompt, raw, device)
    )
    assert main(_generate(model_dir, "--raw", "Hello")) == 0
    assert main(_generate(model_dir, "Hello")) == 0
    assert seen == [True, False]


def test_compare_prints_both_texts_speeds_and_memory(model_dir, capsys):
    assert main(_generate(model_dir, "--compare", "Tell a story.")) == 0
    out = capsys.readouterr().out
    assert "--- vasepatch (budget=16, window=4, policy=vase) ---" in out and "--- full cache (no eviction) ---" in out
    cell = r"([\d.]+(?: [KMG]?i?B)?)"
    rows = re.finditer(rf"^(KV memory|generated tokens|evictions)\s+{cell}\s+{cell}$", out, re.MULTILINE)
    table = {m[1]: m.groups()[1:] for m in rows}
    assert table["generated tokens"] == (str(TOKENS), str(TOKENS))
    assert _bytes(table["KV memory"][0]) < _bytes(table["KV memory"][1])
    assert int(table["evictions"][0]) >= 1 and table["evictions"][1] == "0"
    assert "The texts agree on the first" in out or "The two texts are identical" in out


def test_bad_budget_is_one_line_before_the_model_loads(capsys, monkeypatch):
    from vasepatch import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--budget", "8", "--window", "8", "hi"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vasepatch: error: window must be smaller than budget")
    with pytest.raises(SystemExit):
        main(["generate", "--policy", "nope", "hi"])
    err = capsys.readouterr().err
    assert err.startswith("vasepatch: error: ") and "'nope'" in err and err.count("\n") == 1


def test_debug_shows_the_original_exception():
    with pytest.raises(ValueError, match="window must be smaller than budget"):
        main(["generate", "--debug", "--budget", "8", "--window", "8", "hi"])


def test_first_difference():
    assert generate.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert generate.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert generate.first_difference([1, 2], [1, 2, 3]) == 2


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_lives_under_the_text_on_a_terminal(monkeypatch):
    monkeypatch.setattr(streaming.shutil, "get_terminal_size", lambda fallback: type("S", (), {"columns": 40})())
    term = _Terminal()
    live = streaming.LiveOutput(term, term)
    assert live.mode == streaming.INLINE
    live.text("Hello")
    live.status("3 tokens")
    live.text(" world")
    live.close()
    # the status goes one line down, is erased (\r, clear line), and the cursor returns to column 6 of the text
    assert term.getvalue() == "Hello\n3 tokens\r\x1b[K\x1b[A\x1b[6G world\n3 tokens\r\x1b[K\x1b[A\x1b[12G\n"


def test_status_line_alone_on_stderr_is_carriage_return_updated():
    out, err = io.StringIO(), _Terminal()
    live = streaming.LiveOutput(out, err)
    assert live.mode == streaming.SEPARATE
    live.status("a")
    live.text("text")
    live.status("b")
    live.close()
    assert err.getvalue() == "\ra\r\x1b[K\rb\r\x1b[K" and out.getvalue() == "text\n"  # text never touches it
    quiet = streaming.LiveOutput(io.StringIO(), io.StringIO())
    quiet.status("never shown")
    assert quiet.mode == streaming.OFF and quiet.err.getvalue() == ""


def test_status_line_reads_the_live_cache_stats(make_model):
    """The streamer sees the counters of the step that produced each token (no lag)."""
    import vasepatch

    model, tok = make_model("llama"), tiny_tokenizer(VOCAB)
    seen = []
    with vasepatch.patched(model, budget=16, window=4) as handle:

        def stats():
            seen.append(handle.stats()["tokens_seen"])
            return handle.stats()

        streamer = streaming.TokenStreamer(tok, streaming.LiveOutput(io.StringIO(), io.StringIO()), stats)
        ids = torch.tensor([tok("abcdefgh")["input_ids"]])
        model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, streamer=streamer, pad_token_id=0)
    assert streamer.tokens == 20
    assert seen[:2] == [8, 8]  # the first token comes from the prefill, which saw the 8 prompt tokens
    # occupancy reaches budget + window = 20 in the step that yields token 12 (8 prompt + 12 more tokens):
    # that step evicts after its attention, so token 13 is the first computed from an evicted cache
    assert streamer.first_evicted == 13
    line = streaming.status_line(10, 5.0, handle.stats())
    # 27 tokens appended (8 + 19 decode steps), evictions at occupancy 20 (twice): 16 kept + 3 since;
    # 2 layers x 2 KV heads x 16 dims x 4 bytes x (K, V) = 512 bytes per slot
    assert line == "10 tokens | 5.0 tok/s | occupancy 19/20 | 2 evictions | KV 10.00 KiB (full cache 13.50 KiB)"


def test_full_cache_estimate_is_bytes_per_slot_times_tokens():
    stats = {"kv_bytes": 1843200, "capacity": 40, "tokens_seen": 144}
    assert streaming.full_cache_bytes(stats) == 1843200 // 40 * 144  # the demo's 6.33 MiB for the full cache


@pytest.mark.slow
def test_generate_on_smollm2(smollm2, capsys):
    assert main(["generate", "--budget", "32", "--window", "8", "--max-new-tokens", "12", "--threads", "1",
                 "--compare", "What is the capital of France?"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    tokens = re.search(r"^generated tokens\s+(\d+)\s+(\d+)$", out, re.MULTILINE)
    assert tokens[1] == tokens[2] and 1 <= int(tokens[1]) <= 12  # stops at the end-of-turn token
    assert out.count("Paris") >= 2  # both texts answer


def test_status_line_drops_the_full_cache_figure_where_it_would_not_fit():
    stats = {"occupancy": 150, "capacity": 160, "evictions": 11, "kv_bytes": 7372800, "tokens_seen": 489}
    wide = streaming.status_line(384, 11.04, stats)
    assert wide == "384 tokens | 11.0 tok/s | occupancy 150/160 | 11 evictions | KV 7.03 MiB (full cache 21.49 MiB)"
    assert streaming.status_line(384, 11.04, stats, width=80) == wide.split(" (full")[0]
    assert streaming.status_line(1, None, None) == "1 token | - tok/s"


def test_memory_comparison_says_more_when_the_run_is_shorter_than_the_buffer():
    assert generate.compare_memory(100, 305) == "3.05x less"
    assert generate.compare_memory(800, 100).startswith("8.00x more: the buffer holds budget + window slots")
