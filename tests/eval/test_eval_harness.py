"""The eval harness on tiny random models: chunked teacher forcing, data loading, and both
`vasepatch eval` commands end to end (seconds, no real model)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import vasepatch
from tests.conftest import ragged_batch
from tests.tiny_models import VOCAB, tiny_config
from tests.tiny_tokenizer import tiny_tokenizer
from vasepatch import VaSEConfig, policies
from vasepatch.eval import answers, cli_options, data, fidelity, grading, progress, task
from vasepatch.eval.forcing import prompt_positions, teacher_force
from vasepatch.eval.task_settings import TaskSettings
from vasepatch.tools import cli
from vasepatch.tools.cli_args import install_hint

# K and V bytes per slot (row, all layers and KV heads) of the tiny fp32 Qwen3 the CLI tests save
_CFG = tiny_config("qwen3")
PER_SLOT = 2 * _CFG.num_hidden_layers * _CFG.num_key_value_heads * _CFG.head_dim * 4
STOCHASTIC_AND_NOT = ["full", "vase", "vase-dkv", "rkv", "snapkv", "evict-large", "random"]


def _stepwise(model, handle, config, ids, mask, continuation):
    cache, kw = handle.new_cache(config), handle.cache_keyword
    out = model(input_ids=ids, attention_mask=mask, position_ids=prompt_positions(mask), **{kw: cache})
    logits, n_real = [out.logits[:, -1:]], mask.sum(-1, keepdim=True)
    for i in range(continuation.shape[1] - 1):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], -1)
        out = model(input_ids=continuation[:, i : i + 1], attention_mask=mask, position_ids=n_real + i, **{kw: cache})
        logits.append(out.logits)
    return torch.cat(logits, 1), cache.stats()


def _distinct_token_batch(lengths, steps, seed=0):
    """Left-padded prompts and continuations in which no row repeats a token: layer-0 values
    depend on the token id only, so repeated ids would tie exactly in value range, and a tie
    may be broken differently by the rounding of two equally valid computations."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    continuation = torch.zeros((len(lengths), steps), dtype=torch.long)
    for row, n in enumerate(lengths):
        perm = torch.randperm(VOCAB - 1, generator=g)[: n + steps] + 1
        ids[row, width - n :], mask[row, width - n :] = perm[:n], 1
        continuation[row] = perm[n:]
    return ids, mask, continuation


def test_chunked_teacher_forcing_equals_one_token_steps(make_model):
    """Chunks end where the caches evict, so every policy (seeded) sees exactly what decode
    steps would show it: same logits (float rounding aside) and the same evictions."""
    model = make_model("qwen3")
    steps = 100
    ids, mask, continuation = _distinct_token_batch((12, 7, 3), steps)
    configs = {n: VaSEConfig(budget=32, window=8, policy=n, seed=0) for n in STOCHASTIC_AND_NOT}  # full grows
    with torch.no_grad(), vasepatch.patched(model, budget=32, window=8) as handle:
        caches = {n: handle.new_cache(c) for n, c in configs.items()}
        chunks = list(teacher_force(model, handle.cache_keyword, caches, ids, mask, continuation))
        assert len(chunks) < steps // 4  # chunked, not one token at a time
        for name, config in configs.items():
            chunked = torch.cat([c[1][name] for c in chunks], 1)
            stepwise, stats = _stepwise(model, handle, config, ids, mask, continuation)
            assert chunked.shape == stepwise.shape == (3, steps, VOCAB)
            assert (chunked - stepwise).abs().max().item() < 1e-5, name
            # 99 tokens fed after a 12-token prompt: first eviction at 40 slots, then every 8 tokens
            assert caches[name].stats()["evictions"] == stats["evictions"] == (0 if name == "full" else 9)


def test_tokens_until_eviction_lands_on_the_trigger(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(10,))
    with torch.no_grad(), vasepatch.patched(model, budget=16, window=4) as handle:
        cache = handle.new_cache()
        model(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: cache})
        assert cache.tokens_until_eviction() == 10  # occupancy 10 -> 20 = budget + window
        cache.layers[0].counters.occupancy = 17
        assert cache.layers[0].tokens_until_eviction() == 3


def test_load_examples(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    lines = [{"question": f"q{i}", "answer": f"work\n#### {i}"} for i in range(5)]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    monkeypatch.setenv("VASEPATCH_DATA_DIR", str(tmp_path))
    ex = data.load_examples("gsm8k:3")
    assert [(e.question, e.answer) for e in ex] == [("q0", "0"), ("q1", "1"), ("q2", "2")]
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"problem": "p", "answer": 7}) + "\n")
    assert data.load_examples(f"{own}")[0] == data.Example("0", "p", "7")
    with pytest.raises(ValueError, match="expected gsm8k/math500/aime25"):
        data.load_examples("nope:3")
    monkeypatch.setenv("VASEPATCH_DATA_DIR", str(tmp_path / "missing"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="VASEPATCH_DATA_DIR"):
        data.load_examples("gsm8k:1")


@pytest.fixture
def tiny_dir(tmp_path, make_model):
    """A tiny Qwen3 model with an offline character tokenizer, saved as an HF directory."""
    model = make_model("qwen3")
    model.generation_config.eos_token_id = 1
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "model")
    data_dir = tmp_path / "data" / "gsm8k"
    data_dir.mkdir(parents=True)
    problems = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(3)]
    (data_dir / "test.jsonl").write_text("\n".join(json.dumps(p) for p in problems))
    return tmp_path


def test_eval_fidelity_cli_end_to_end(tiny_dir, capsys):
    out = tiny_dir / "fid"
    args = ["eval", "fidelity", "--model", str(tiny_dir / "model"), "--prompts", "gsm8k:3", "--tokens", "40",
            "--budget", "16", "--window", "4", "--policies", "snapkv,full,vase,streaming", "--batch-size", "2",
            "--data-dir", str(tiny_dir / "data"), "--out", str(out)]  # fmt: skip
    assert cli.run(args) == 0
    result = json.loads((out / "fidelity.json").read_text())
    rows = {r["policy"]: r for r in result["results"]}
    assert list(rows) == ["full", "snapkv", "vase", "streaming"]  # the reference first, wherever it was asked
    assert result["config"]["compression"] > 1
    full = rows["full"]
    assert full["kl"] == 0 and full["top1_agreement"] == 1 and full["first_divergence"] == 40
    for r in rows.values():
        assert r["n_prompts"] == 3 and r["n_tokens"] == 3 * 40
        assert 0 <= r["top1_agreement"] <= 1 and r["kl"] >= 0 and 0 <= r["loop_rate"] <= 1
        assert 0 <= r["first_divergence"] <= 40
    assert any(rows[p]["kl"] > 0 for p in ("vase", "snapkv", "streaming"))  # evicting changes something
    assert all(rows[p]["kv_bytes"] == (16 + 4) * PER_SLOT for p in ("vase", "snapkv", "streaming"))
    assert rows["full"]["kv_bytes"] >= (89 + 39) * PER_SLOT  # every prompt (89 tokens) and reference token fed
    header = result["config"]
    assert header["sample_temperature"] == 0.8 and header["protect"] == 4 and header["policies"] == list(rows)
    assert header["batch_size"] == 2 and header["n_prompts"] == 3
    assert (out / "fidelity.md").read_text().count("\n|") >= 5 and (out / "fidelity.png").stat().st_size > 0
    printed = capsys.readouterr()
    # the results table at the end, one aligned row per policy, and the files written
    table = printed.out[printed.out.index("Fidelity to the full cache") :]
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:] == list(rows)
    assert "protect=4" in table and "protect=None" not in table and str(out / "fidelity.png") in table
    # the progress bar names the policy and the work, counts prompts and shows tok/s
    for label in ("full · reference", "4 policies · teacher forcing", "vase · free run", "streaming · free run"):
        assert label in printed.err
    assert re.search(r"prompt/s|s/prompt", printed.err) and "tok/s" in printed.err and "kv_mib" in table


def test_eval_probe_cli(tiny_dir):
    g = torch.Generator().manual_seed(0)
    probe = {
        "prompt_ids": torch.randint(6, VOCAB, (20,), generator=g).tolist(),
        "reference_tokens": torch.randint(6, VOCAB, (30,), generator=g).tolist(),
        "dense_predictions": [0] * 30,
        "anchor_results_top1_agreement": {"authors_snapkv_style_attn_smooth": 0.5},
    }
    path = tiny_dir / "probe.json"
    path.write_text(json.dumps(probe))
    out = tiny_dir / "probe-out"
    args = ["eval", "fidelity", "--model", str(tiny_dir / "model"), "--probe", str(path), "--budget", "16",
            "--window", "4", "--policies", "snapkv,vase", "--seeds", "2", "--out", str(out)]  # fmt: skip
    assert cli.run(args) == 0
    result = json.loads((out / "probe.json").read_text())
    rows = {r["policy"]: r for r in result["results"]}
    assert result["config"]["longest_sequence"] == 50 and result["config"]["compression"] == round(50 / 16, 2)
    assert rows["full"]["top1_agreement"] == 1
    assert rows["snapkv"]["reference_implementation"] == 0.5 and rows["vase"]["reference_implementation"] is None
    assert len(rows["vase"]["top1_seeds"]) == 2
    assert rows["snapkv"]["top1_seeds"][0] == rows["snapkv"]["top1_seeds"][1]  # deterministic


def test_eval_task_cli_end_to_end_and_resume(tiny_dir, monkeypatch, capsys):
    out = tiny_dir / "task"
    args = ["eval", "task", "--task", "gsm8k", "--model", str(tiny_dir / "model"), "--limit", "5", "--policies",
            "full,vase", "--budget", "16", "--window", "4", "--samples", "2", "--max-new-tokens", "24",
            "--batch-size", "8", "--data-dir", str(tiny_dir / "data"), "--out", str(out)]  # fmt: skip
    assert cli.run(args) == 0
    result = json.loads((out / "gsm8k.json").read_text())
    header, rows = result["config"], {r["policy"]: r for r in result["results"]}
    assert set(rows) == {"full", "vase"}
    for r in rows.values():
        assert r["n"] == 6 and 0 <= r["accuracy"] <= 1 and r["stderr"] >= 0 and 0 < r["mean_tokens"] <= 24
    # sizes come from the caches: vase holds budget + window slots (the prompts, 89 tokens, are
    # compressed at prefill), full holds every token it saw
    assert rows["vase"]["kv_bytes"] == (16 + 4) * PER_SLOT
    assert rows["full"]["kv_bytes"] >= 89 * PER_SLOT
    assert header["protect"] == 4 and header["sample_temperature"] == 0.6 and header["temperature"] == 1.0
    assert header["prefill"] == "compress" and "score_temperature" not in header
    # what was used, not the flags: 3 problems (of --limit 5), batches of 6 answers (of --batch-size 8)
    assert header["problems"] == 3 and header["batch_size"] == 6
    longest = max(r["prompt_tokens"] + r["n_tokens"] for p in ("full", "vase") for r in _records(out, p))
    assert header["longest_sequence"] == longest and header["compression"] == round(longest / 16, 2)
    printed = capsys.readouterr()
    assert "Accuracy on gsm8k" in printed.out and "| vase " in printed.out and "batch_size=6" in printed.out
    assert "full · gsm8k" in printed.err and "vase · gsm8k" in printed.err and "tok/s" in printed.err
    assert re.search(r"answer/s|s/answer", printed.err)
    records = _records(out, "vase")
    assert sorted((r["id"], r["sample"]) for r in records) == [(str(i), s) for i in range(3) for s in range(2)]
    assert all(r["answer"] == str(2 * int(r["id"])) for r in records)

    # a resumed run finds everything done and generates nothing
    def fail(*a, **k):
        raise AssertionError("resumed run generated again")

    monkeypatch.setattr(answers, "generate", fail)
    assert cli.run(args) == 0
    assert json.loads((out / "gsm8k.json").read_text())["results"] == result["results"]
    # other settings never mix with old records
    for other in (["--budget", "20"], ["--prefill", "keep"], ["--temperature", "0.5"], ["--sample-temperature", "0"]):
        with pytest.raises(ValueError, match="other settings"):
            cli.run([*args, *other])
    _resume_with_other_settings_is_refused_before_the_model_loads(args, out, monkeypatch, capsys)


def _resume_with_other_settings_is_refused_before_the_model_loads(args, out, monkeypatch, capsys):
    """Resuming with other settings is refused before the model loads and before any method (`full`
    included) resumes: one line of its own, not on the progress bar's, naming only the differing keys."""
    _missing_model_should_not_load(monkeypatch)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--budget", "20"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"vasepatch: error: {out / 'gsm8k-vase.jsonl'} holds answers of other settings: budget was 16, now 20; "
        "protect was 4, now 5 (resume only with the same settings, or choose another --out)\n"
    )
    with pytest.raises(SystemExit):
        cli.main([*args, "--window", "2", "--top-p", "0.5"])
    err = capsys.readouterr().err
    assert err.startswith(f"vasepatch: error: {out / 'gsm8k-full.jsonl'} holds answers of other settings: ")
    assert "top_p was 0.95, now 0.5" in err and "window" not in err and err.count("\n") == 1  # full has no window
    with pytest.raises(SystemExit):
        cli.main([*args, "--window", "2"])
    assert "gsm8k-vase.jsonl holds answers of other settings: window was 4, now 2 (resume" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # nothing touched


def _records(out, policy: str) -> list[dict]:
    return [json.loads(x) for x in (out / f"gsm8k-{policy}.jsonl").read_text().splitlines()]


def test_records_written_before_the_rename_still_resume(tmp_path):
    """Run keys of older files named the sampling temperature `temperature` and the policies'
    softmax temperature `score_temperature`, kept whole prompts and wrote `protect=None`."""
    old = {"policy": "vase", "model_class": "Qwen2ForCausalLM", "model": "qwen2.5-coder-0.5b", "task": "gsm8k",
           "samples": 1, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 512, "seed": 0, "batch_size": 50,
           "budget": 128, "window": 32, "protect": None, "sinks": 4, "score_temperature": 1.0, "smooth": 5}  # fmt: skip
    path = tmp_path / "gsm8k-vase.jsonl"
    path.write_text(json.dumps({"id": "0", "sample": 0, "correct": True, "run": json.dumps(old)}) + "\n")
    settings = TaskSettings(
        model="qwen2.5-coder-0.5b",
        config=VaSEConfig(budget=128, window=32, seed=0, prefill="keep"),
        samples=1,
        sample_temperature=0.6,
        max_new_tokens=512,
        batch_size=50,
    )
    key = settings.run_key("vase", "Qwen2ForCausalLM")
    assert list(answers.load(path, key, lambda r: (r["id"], r["sample"]))) == [("0", 0)]
    for changed in ({"config": settings.config.replace(prefill="compress")}, {"sample_temperature": 1.0}):
        other = TaskSettings(**{**vars(settings), **changed}).run_key("vase", "Qwen2ForCausalLM")
        with pytest.raises(ValueError, match="other settings"):
            answers.load(path, other, lambda r: (r["id"], r["sample"]))
    full = {k: v for k, v in old.items() if k in ("policy", "model_class", "model", "task", "samples", "temperature",
                                                   "top_p", "max_new_tokens", "seed", "batch_size")}  # fmt: skip
    path.write_text(json.dumps({"id": "0", "sample": 0, "run": json.dumps({**full, "policy": "full"})}) + "\n")
    assert len(answers.load(path, settings.run_key("full", "Qwen2ForCausalLM"), lambda r: (r["id"], r["sample"]))) == 1


def test_cache_flags_make_one_config_and_policy_names():
    parser = cli.build_parser()
    args = parser.parse_args(["eval", "task", "--budget", "64", "--window", "8", "--temperature", "0.5",
                              "--sample-temperature", "0.9", "--prefill", "keep", "--seed", "3"])  # fmt: skip
    assert cli_options.cache_config(args) == VaSEConfig(budget=64, window=8, temperature=0.5, prefill="keep", seed=3)
    assert args.sample_temperature == 0.9
    old_flags = parser.parse_args(["eval", "fidelity", "--score-temperature", "2", "--reference-temperature", "0.7"])
    assert cli_options.cache_config(old_flags).temperature == 2 and old_flags.sample_temperature == 0.7
    names = cli_options.parse_policies("all")
    assert names[0] == "full" and sorted(names[1:]) == sorted(set(policies.available()) - {"full"})
    assert cli_options.parse_policies(" vase, snapkv ,") == ["vase", "snapkv"]


def test_eval_rejects_bad_settings_before_loading(tiny_dir):
    with pytest.raises(ValueError, match="unknown policies"):
        cli.run(["eval", "task", "--policies", "vase,nope", "--model", "/nonexistent"])
    with pytest.raises(ValueError, match="window must be smaller than budget"):
        cli.run(["eval", "fidelity", "--budget", "8", "--window", "8", "--model", "/nonexistent"])
    with pytest.raises(ValueError, match="depths must lie in"):
        TaskSettings(task="passkey", depths=[0, 1.5])
    with pytest.raises(ValueError, match="sample_temperature >= 0"):
        TaskSettings(sample_temperature=float("nan"))
    with pytest.raises(ValueError, match="seeded config"):
        TaskSettings(config=VaSEConfig(budget=64, window=8))


@pytest.mark.parametrize("command", ["fidelity", "task"])
def test_help_shows_every_default(command):
    module = {"fidelity": fidelity, "task": task}[command]
    parser = argparse.ArgumentParser(prog=f"vasepatch eval {command}")  # no formatter: add_arguments sets it
    module.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.default is None or isinstance(action, argparse._HelpAction):
            continue
        shown = ",".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
        assert f"(default: {shown})" in text, action.dest
    assert "(default: budget // 4)" in text and "(default: None)" not in text


def _missing_model_should_not_load(monkeypatch):
    from vasepatch import models

    def fail(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(models, "load", fail)


def test_bad_data_fails_before_the_model_loads(tmp_path, monkeypatch):
    _missing_model_should_not_load(monkeypatch)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q"}\n{"question": \n')
    bad = str(tmp_path)
    with pytest.raises(data.DataError, match=r"test.jsonl:2"):
        cli.run(["eval", "task", "--task", "gsm8k", "--data-dir", bad, "--out", str(tmp_path / "o")])
    with pytest.raises(data.DataError, match=r"test.jsonl:2"):
        cli.run(["eval", "fidelity", "--prompts", "gsm8k:2", "--data-dir", bad, "--out", str(tmp_path / "o")])
    with pytest.raises(data.DataError, match="does not exist"):
        cli.run(["eval", "fidelity", "--data-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"prompt_ids": [1, 2], "reference_tokens": [3], "dense_predictions": []}))
    with pytest.raises(data.DataError, match="'dense_predictions' must be a non-empty list"):
        cli.run(["eval", "fidelity", "--probe", str(probe), "--out", str(tmp_path / "o")])
    with pytest.raises(data.DataNotFoundError, match="no such file"):
        cli.run(["eval", "fidelity", "--probe", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_missing_eval_extras_fail_before_the_model_loads(tmp_path, monkeypatch, capsys):
    _missing_model_should_not_load(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a))
    for command in (["fidelity"], ["task", "--task", "passkey"]):
        with pytest.raises(progress.MissingExtraError, match=r"tqdm, not installed: pip install "):
            cli.run(["eval", *command, "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exit_:  # the command line: one line, no traceback
        cli.main(["eval", "fidelity", "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2 and f"not installed: {install_hint('eval')}\n" in capsys.readouterr().err


def test_install_hint_says_editable_from_a_checkout_and_the_package_otherwise(tmp_path, monkeypatch):
    """From a checkout the hint installs the checkout (`pip install -e ".[eval]"`, or its path from elsewhere), not
    `vasepatch[eval]`, which is not on the index; from an installed package, `vasepatch[eval]`."""
    from vasepatch import errors

    checkout, wheel = tmp_path / "clone", tmp_path / "site-packages"
    for root in (checkout, wheel):
        (root / "vasepatch").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('[project]\nname = "vasepatch"\n')
    (wheel / "pyproject.toml").write_text('[project]\nname = "other"\n')  # another project's file
    monkeypatch.chdir(checkout)
    assert errors.install_hint("eval", checkout / "vasepatch") == 'pip install -e ".[eval]"'
    assert errors.install_hint("eval", wheel / "vasepatch") == 'pip install "vasepatch[eval]"'
    assert errors.install_hint("gpu", tmp_path / "x" / "vasepatch") == 'pip install "vasepatch[gpu]"'
    monkeypatch.chdir(tmp_path)
    assert errors.install_hint("eval", checkout / "vasepatch") == f'pip install -e "{checkout}[eval]"'
    # this copy runs from the repository: the hint every command prints is the editable one
    repository = Path(errors.__file__).resolve().parents[1]
    monkeypatch.chdir(repository)
    assert install_hint("eval") == 'pip install -e ".[eval]"'
    assert errors.source_tree() == repository


def test_math500_results_say_how_they_were_graded(tmp_path, make_model, monkeypatch, capsys):
    """Without math-verify, MATH-500 is graded by normalised string, and the results say so (never silently)."""
    model = make_model("qwen3")
    model.generation_config.eos_token_id = 1
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "model")
    (tmp_path / "data" / "math500").mkdir(parents=True)
    (tmp_path / "data" / "math500" / "test.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed
    assert grading.method("math500") == grading.STRING_ONLY and grading.method("gsm8k") == "numeric"
    out = tmp_path / "o"
    args = ["eval", "task", "--task", "math500", "--model", str(tmp_path / "model"), "--policies", "full",
            "--max-new-tokens", "4", "--data-dir", str(tmp_path / "data"), "--out", str(out)]  # fmt: skip
    assert cli.run(args) == 0
    printed = capsys.readouterr()
    assert "math-verify is not installed, so MATH-500 answers are graded by normalised string" in printed.err
    assert f"grading={grading.STRING_ONLY}" in printed.out
    assert json.loads((out / "math500.json").read_text())["config"]["grading"] == grading.STRING_ONLY
    assert f"grading={grading.STRING_ONLY}" in (out / "math500.md").read_text()
    assert _records_of(out / "math500-full.jsonl")[0]["grading"] == grading.STRING_ONLY
    monkeypatch.delitem(sys.modules, "math_verify")
    if grading.has_math_verify():  # resumed with math-verify installed: the answers say how they were graded
        assert cli.run(args) == 0
        assert json.loads((out / "math500.json").read_text())["config"]["grading"] == grading.STRING_ONLY
    assert grading.describe([grading.MATH_VERIFY, grading.STRING_ONLY, None]).startswith("mixed: 1 answers by")


def _records_of(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]
