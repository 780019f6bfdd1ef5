"""Documented command samples equal what their commands print now.

A sample drawn once and pasted into a page goes stale silently when the code changes (the keyed eviction
randomness changed every seeded run's tokens). Each test here reads the command and its sample from the
page, runs the command, and compares the deterministic parts: tokens, text and counters, not timings.

Not tested here, because the run is long for CI: the `vasepatch eval fidelity` sample of
`docs/evaluation.md` (45 s of CPU time on SmolLM2, 141-210 s on the busy 2-core machine).
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from vasepatch import models
from vasepatch.tools.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"
TIMING_ROWS = ("time (s)", "decode tok/s")


def _indented_block_before(text: str, marker: str) -> list[str]:
    """The 4-space indented code block that ends right before the paragraph starting with `marker`,
    without its indentation (blank lines inside the block kept)."""
    lines = text[: text.index(marker)].rstrip("\n").split("\n")
    block: list[str] = []
    while lines and (lines[-1].startswith("    ") or (lines[-1] == "" and lines[-2].startswith("    "))):
        block.insert(0, lines.pop()[4:])
    return block


def _without_timings(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith(TIMING_ROWS)]


def test_the_compare_sample_of_getting_started_is_read_whole():
    """The parsing below finds the command and the whole sample (the slow test would pass vacuously on
    an empty one)."""
    page = (DOCS / "getting-started.md").read_text()
    command = re.search(r"\(The sample above: the end of what `(vasepatch generate [^`]+)`", page)
    assert command and "--compare" in command[1] and "--threads 1" in command[1]
    sample = _indented_block_before(page, "(The sample above:")
    assert sample[0].startswith("--- ") and sample[0].endswith(" vs the full cache ---")
    assert sample[-1].startswith("Here the prompt was longer than the budget")
    assert sum(line.startswith(TIMING_ROWS) for line in sample) == 2
    assert any(line.startswith("evictions ") for line in sample)


@pytest.mark.slow
def test_the_compare_sample_of_getting_started_is_what_the_command_prints(smollm2, capsys, monkeypatch):
    """`docs/getting-started.md`'s `--compare` sample: the prompt length, the table's token counts, KV memory and
    evictions, and where and why the two greedy texts part, exactly as the documented command prints them."""
    page = (DOCS / "getting-started.md").read_text()
    command = shlex.split(re.search(r"\(The sample above: the end of what `(vasepatch generate [^`]+)`", page)[1])
    sample = _indented_block_before(page, "(The sample above:")

    def load(name, **kwargs):  # the session's SmolLM2 (the same weights the command loads), not a second copy
        assert name == "smollm2-135m"
        return smollm2

    monkeypatch.setattr(models, "load", load)
    assert command[:2] == ["vasepatch", "generate"] and "--model" not in command  # the default model: SmolLM2
    assert main(command[1:]) == 0
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    start = next(i for i, line in enumerate(printed) if line.startswith("--- ") and "prompt tokens" in line)
    assert _without_timings(printed[start:]) == _without_timings(sample)


def _landing_example() -> tuple[str, dict[str, int]]:
    """The first ```python block of `docs/index.md` and the counters the paragraph after it says it prints."""
    page = (DOCS / "index.md").read_text()
    block = re.search(r"```python\n(.*?)```\n\n(It prints .*?)\n\n", page, re.DOTALL)
    assert block, "docs/index.md: the landing example and its 'It prints ...' paragraph"
    said = dict(re.findall(r"'(evictions|tokens_seen)': (\d+)", block[2]))
    said["capacity"] = re.search(r"`'capacity'` of (\d+) slots", block[2])[1]
    return block[1], {key: int(value) for key, value in said.items()}


def test_the_landing_example_says_it_evicts():
    code, said = _landing_example()
    assert "vasepatch.patch(" in code and "print(handle.stats())" in code
    assert said["evictions"] > 0 and said["tokens_seen"] > said["capacity"]


@pytest.mark.slow
def test_the_landing_example_prints_the_evictions_it_documents(smollm2, capsys, monkeypatch):
    """`docs/index.md`'s first example evicts (issue 43: it once stopped at EOS before the cache filled, and
    printed `'evictions': 0`), and prints the counters its paragraph quotes."""
    code, said = _landing_example()
    monkeypatch.setattr(models, "load", lambda name, **kwargs: smollm2)  # the session's SmolLM2, not a second copy
    exec(compile(code, "docs/index.md", "exec"), {"__name__": "__docs__"})
    stats = ast.literal_eval(capsys.readouterr().out.rstrip("\n").split("\n")[-1])
    assert {key: stats[key] for key in said} == said
    assert stats["capacity"] == stats["budget"] + stats["window"]
