"""`vasepatch eval task --engine vllm` end to end on SmolLM2: every run's requests in one engine, each with its
own cache settings and the sampling seed its problem shares with the other runs, answers recorded as they
finish, a resumed run asking only for what is missing, and greedy full-cache answers that are the transformers
path's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vasepatch.eval import vllm_answers
from vasepatch.tools import cli

COMMON = ["eval", "task", "--task", "gsm8k", "--model", "smollm2-135m", "--budget", "48", "--window", "16",
          "--max-num-seqs", "8"]  # fmt: skip


def _records(out, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"gsm8k-{name}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
def test_a_tiny_study_in_one_engine_paired_and_resumed(smollm2_path, tmp_path, monkeypatch):
    out = tmp_path / "study"
    args = [*COMMON, "--limit", "4", "--max-new-tokens", "40", "--policies", "full,vase,snapkv@32", "--engine",
            "vllm", "--out", str(out)]  # fmt: skip
    assert cli.run(args) == 0
    result = json.loads((out / "gsm8k.json").read_text())
    header, rows = result["config"], {r["policy"]: r for r in result["results"]}
    assert set(rows) == {"full", "vase", "snapkv@32"} and all(r["n"] == 4 for r in rows.values())
    assert header["engine"] == "vllm" and header["vllm"] == "0.32.0" and header["batch_size"] is None
    assert header["max_num_seqs"] == 8 and header["pool_blocks"] > 8
    by_run = {name: {r["id"]: r for r in _records(out, name)} for name in rows}
    for problem, full in by_run["full"].items():
        vase, snap = by_run["vase"][problem], by_run["snapkv@32"][problem]
        assert full["seed"] == vase["seed"] == snap["seed"]  # paired by problem and seed
        assert full["prompt_tokens"] > 64  # so every evicting run compressed its prompt
        assert snap["kv_bytes"] <= vase["kv_bytes"] < full["kv_bytes"]  # 2 blocks (48 and 64 slots); the sequence
    assert len({r["seed"] for r in by_run["full"].values()}) == 4
    # the same seed samples the same tokens unless the cache differs (a sampled request gives the same tokens
    # alone and in a batch: tests/vllm/test_vllm_eviction.py), so answers that part show the settings applied
    for name in ("vase", "snapkv@32"):
        assert any(by_run[name][p]["text"] != full["text"] for p, full in by_run["full"].items()), name
    pairs = {(r["run"], r["against"]) for r in result["paired"]}
    assert pairs >= {("vase", "full"), ("snapkv@32", "full")}
    assert ("snapkv@32", "vase") not in pairs  # no vase@32 ran: no pair across budgets (`paired.reference_of`)

    # interrupted: two answers lost; the rerun asks for those two only
    for name in ("vase", "snapkv@32"):
        lines = (out / f"gsm8k-{name}.jsonl").read_text().splitlines()
        (out / f"gsm8k-{name}.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    asked = []
    generate = vllm_answers.VLLMAnswers._generate

    def counting(self, engine, runs, todo, done, bar):
        asked.extend((runs[r.run].path.name, r.item.ident) for r in todo)
        return generate(self, engine, runs, todo, done, bar)

    monkeypatch.setattr(vllm_answers.VLLMAnswers, "_generate", counting)
    assert cli.run(args) == 0
    assert sorted(name for name, _ in asked) == ["gsm8k-snapkv@32.jsonl", "gsm8k-vase.jsonl"]
    assert all(len(_records(out, name)) == 4 for name in rows)

    # complete: no engine starts at all
    def fail(*a, **k):
        raise AssertionError("a complete run started an engine")

    monkeypatch.setattr(vllm_answers, "open_engine", fail)
    assert cli.run(args) == 0


@pytest.mark.timeout(900)
def test_greedy_full_cache_answers_are_the_transformers_paths(smollm2_path, tmp_path):
    """With nothing evicted and float32 on both sides, the two engines give the same answers."""
    args = [*COMMON, "--limit", "3", "--max-new-tokens", "24", "--policies", "full", "--sample-temperature", "0"]
    assert cli.run([*args, "--engine", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    assert cli.run([*args, "--out", str(tmp_path / "hf")]) == 0
    ours, theirs = _records(tmp_path / "vllm", "full"), _records(tmp_path / "hf", "full")
    assert [r["id"] for r in ours] == [r["id"] for r in theirs]
    assert [r["text"] for r in ours] == [r["text"] for r in theirs]
    assert [r["prompt_tokens"] for r in ours] == [r["prompt_tokens"] for r in theirs]
