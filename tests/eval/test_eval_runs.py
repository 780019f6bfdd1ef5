"""The runs of `vasepatch eval task`: a policy at a budget of its own (`vase@64`), the paired statistics of the
report (Wilson intervals, exact McNemar, paired differences), and the parts of the vLLM engine's path that
need no vLLM (requests, seeds, settings, KV bytes, the refusal when vLLM is missing)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.tiny_models import VOCAB
from tests.tiny_tokenizer import tiny_tokenizer
from vasepatch import VaSEConfig, models
from vasepatch.eval import answers, cli_options, paired, vllm_answers
from vasepatch.eval.task_settings import TaskSettings
from vasepatch.tools import cli

# --- a policy at its own budget


def test_a_run_name_may_carry_its_own_budget():
    config = VaSEConfig(budget=128, window=32, seed=0)
    assert cli_options.split_budget("vase@64") == ("vase", 64) and cli_options.split_budget("vase") == ("vase", None)
    assert cli_options.base_name("vase+shared@64") == "vase"
    at64 = cli_options.run_config(config, "vase@64")
    assert (at64.policy, at64.budget, at64.window, at64.n_protect) == ("vase", 64, 32, 16)
    assert cli_options.run_config(config, "snapkv") == config.replace(policy="snapkv")
    settings = TaskSettings(config=config, policies=["full", "vase", "vase@64"])
    assert settings.run_key("vase@64", "X")["budget"] == 64 and settings.run_key("vase", "X")["budget"] == 128
    assert settings.policy_run("vase@64", "X", None, None).path.name == "gsm8k-vase@64.jsonl"


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        ("vase@0", "the budget after '@' must be a positive int"),
        ("vase@x", "the budget after '@' must be a positive int"),
        ("full@64", "full keeps every token, so it takes no budget"),
        ("vase@16", "policy vase@16: window must be smaller than budget"),
        ("vase,vase", "must not repeat a run"),
        ("nope@64", "unknown policies"),
    ],
)
def test_bad_run_names_are_refused_before_the_model_loads(policies, message):
    with pytest.raises(ValueError, match=message):
        cli.run(["eval", "task", "--budget", "128", "--window", "32", "--policies", policies, "--model", "/no"])


def test_a_run_at_its_own_budget_answers_with_that_budget_and_is_paired(tmp_path, make_model, monkeypatch):
    """A tiny model answers with `full`, `vase` and `vase@16`: `vase@16` holds 16 + 4 slots where `vase` holds
    20 + 4, and the report pairs every run with `full` and with `vase`."""
    model = make_model("qwen3")
    model.generation_config.eos_token_id = 1
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "model")
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    problems = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(3)]
    (tmp_path / "data" / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps(p) for p in problems))
    out = tmp_path / "out"
    args = ["eval", "task", "--model", str(tmp_path / "model"), "--limit", "3", "--policies", "full,vase,vase@16",
            "--budget", "20", "--window", "4", "--max-new-tokens", "8", "--data-dir", str(tmp_path / "data"),
            "--out", str(out)]  # fmt: skip
    assert cli.run(args) == 0
    result = json.loads((out / "gsm8k.json").read_text())
    rows = {r["policy"]: r for r in result["results"]}
    assert rows["vase@16"]["kv_bytes"] * 24 == rows["vase"]["kv_bytes"] * 20
    for row in rows.values():
        low, high = row["ci95"]
        assert 0 <= low <= row["accuracy"] <= high <= 1
    pairs = {(r["run"], r["against"]) for r in result["paired"]}
    assert pairs == {("vase", "full"), ("vase@16", "full"), ("full", "vase"), ("vase@16", "vase")}
    assert all(r["n"] == 3 and r["mcnemar_p"] == paired.mcnemar(r["b"], r["c"]) for r in result["paired"])
    assert "\n**paired**\n" in (out / "gsm8k.md").read_text() and "| mcnemar_p |" in (out / "gsm8k.md").read_text()


# --- paired statistics


def test_exact_mcnemar_and_wilson_against_values_worked_by_hand():
    assert paired.mcnemar(0, 0) == 1.0
    assert paired.mcnemar(10, 0) == 2 / 2**10
    assert paired.mcnemar(3, 7) == 2 * (1 + 10 + 45 + 120) / 2**10  # 0.34375
    assert paired.mcnemar(5, 5) == 1.0
    low, high = paired.wilson(20, 100)
    assert math.isclose(low, 0.13337, abs_tol=1e-4) and math.isclose(high, 0.28883, abs_tol=1e-4)
    assert paired.wilson(0, 10)[0] == 0 and math.isclose(paired.wilson(0, 10)[1], 0.27753, abs_tol=1e-4)
    assert paired.wilson(0, 0) == (0.0, 1.0)


@given(st.integers(0, 60), st.integers(0, 60))
def test_mcnemar_is_a_symmetric_probability_that_falls_as_the_split_grows(b, c):
    p = paired.mcnemar(b, c)
    assert 0 < p <= 1 and p == paired.mcnemar(c, b)
    if b > c:
        assert paired.mcnemar(b + 1, c) <= p


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=80))
def test_the_paired_difference_is_the_difference_of_accuracies_inside_its_interval(pairs):
    run, reference = [a for a, _ in pairs], [b for _, b in pairs]
    found = paired.difference(run, reference)
    assert math.isclose(found["difference"], found["accuracy"] - found["reference_accuracy"], abs_tol=1e-12)
    low, high = found["ci95"]
    assert low <= found["difference"] <= high
    assert found["b"] == sum(a and not b for a, b in pairs) and found["c"] == sum(b and not a for a, b in pairs)
    low, high = paired.wilson(sum(run), len(run))
    assert low <= found["accuracy"] <= high


def test_paired_rows_pair_answers_by_problem_and_sample():
    full = [{"id": str(i), "sample": 0, "correct": i < 6} for i in range(10)]
    vase = [{"id": str(i), "sample": 0, "correct": i < 2 or i == 9} for i in reversed(range(10))]
    (row,) = [r for r in paired.rows(["full", "vase"], [full, vase]) if r["run"] == "vase"]
    assert (row["n"], row["b"], row["c"], row["mcnemar_p"]) == (10, 1, 4, paired.mcnemar(1, 4))
    assert paired.tables(["snapkv"], [full]) == {}
    with pytest.raises(ValueError, match="as many answers"):
        paired.difference([True], [True, False])


def test_each_run_is_paired_with_the_reference_at_its_own_budget():
    ran = ["full", "vase", "snapkv", "rkv", "triattention", "vase@64", "snapkv@64", "triattention@64"]
    assert paired.reference_of("triattention@64", "vase", ran) == "vase@64"
    assert paired.reference_of("triattention@64", "snapkv", ran) == "snapkv@64"
    assert paired.reference_of("triattention@64", "rkv", ran) is None  # rkv@64 did not run: no cross-budget pair
    assert paired.reference_of("triattention@64", "full", ran) == "full"
    assert paired.reference_of("vase@64", "vase", ran) == "vase"  # the policy at the default budget: the cost of 64
    assert paired.reference_of("triattention", "rkv", ran) == "rkv"
    assert paired.reference_of("vase", "vase", ran) is None and paired.reference_of("full", "full", ran) is None
    records = [[{"id": "0", "sample": 0, "correct": i % 2 == 0}] for i in range(len(ran))]
    found = {(r["run"], r["against"]) for r in paired.rows(ran, records, against=["snapkv"])}
    assert found == {("full", "snapkv"), ("vase", "snapkv"), ("rkv", "snapkv"), ("triattention", "snapkv"),
                     ("vase@64", "snapkv@64"), ("triattention@64", "snapkv@64"), ("snapkv@64", "snapkv")}  # fmt: skip


def test_the_paired_references_are_checked_by_name():
    with pytest.raises(ValueError, match=r"against: unknown policies \['nope'\]"):
        TaskSettings(config=VaSEConfig(budget=64, window=16, seed=0), against=["full", "nope"])
    with pytest.raises(ValueError, match="against: unknown policies"):
        TaskSettings(config=VaSEConfig(budget=64, window=16, seed=0), against=[])


# --- the vLLM engine's path, its parts that need no vLLM


def test_request_seeds_are_fixed_by_the_problem_and_shared_by_every_run():
    assert vllm_answers.request_seed(0, ["q1", 0]) == 645627754193308223  # the same in every process and version
    seeds = {vllm_answers.request_seed(s, [i, k]) for s in (0, 1) for i in ("q1", "q2") for k in (0, 1)}
    assert len(seeds) == 8 and all(0 <= x < 2**63 for x in seeds)


def test_request_settings_of_a_run():
    config = VaSEConfig(budget=128, window=32, seed=0)
    assert vllm_answers.request_args(config.replace(policy="full"), 7) == {"vasepatch_policy": "full"}
    args = vllm_answers.request_args(cli_options.run_config(config, "vase@64"), 7)
    assert args["vasepatch_policy"] == "vase" and args["vasepatch_budget"] == 64 and args["vasepatch_protect"] == 16
    assert args["vasepatch_seed"] == 7 and args["vasepatch_window"] == 32 and args["vasepatch_prefill"] == "compress"


def test_requests_go_problem_by_problem_and_skip_what_a_file_holds(tmp_path):
    config = VaSEConfig(budget=64, window=16, seed=3)
    settings = TaskSettings(config=config, policies=["full", "vase"], out=str(tmp_path))
    runs = [settings.policy_run(name, "X", None, lambda r: (r["id"], r["sample"])) for name in settings.policies]
    work = [(answers.Item((str(i), 0), f"p{i}"), [1] * (10 + i)) for i in range(3)]
    done = {"id": "1", "sample": 0, "correct": True, "run": json.dumps(runs[1].key)}
    runs[1].path.write_text(json.dumps(done) + "\n")
    todo, found = vllm_answers.requests(runs, work, settings.config.seed)
    assert [(r.item.ident[0], r.run) for r in todo] == [("0", 0), ("0", 1), ("1", 0), ("2", 0), ("2", 1)]
    assert todo[0].seed == todo[1].seed == vllm_answers.request_seed(3, ["0", 0]) != todo[2].seed
    assert list(found[1]) == [("1", 0)] and found[0] == {}
    wide = TaskSettings(config=config, policies=["full", "vase", "snapkv@1024"])
    assert vllm_answers.limits(wide) == {"vasepatch": {"max_request_budget": 1024, "max_request_window": 16}}
    assert vllm_answers.limits(wide, "s.safetensors")["vasepatch"]["stats"] == "s.safetensors"


def test_a_run_that_reads_statistics_names_the_models_own_file_to_the_engine(tmp_path, monkeypatch):
    """`triattention` on vLLM: the engine gets the model's own statistics, found as `patch` finds them (a missing
    file is the error naming the command), and no file when no run reads one."""
    from tests.tiny_models import tiny_model
    from vasepatch.integration import calibration

    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    config = VaSEConfig(budget=64, window=16, seed=0)
    folder = str(tmp_path / "model")
    assert vllm_answers.stats_file(TaskSettings(config=config, policies=["full", "vase@32"]), folder) is None
    reading = TaskSettings(config=config, policies=["full", "triattention@32"])
    with pytest.raises(ValueError, match="run `vasepatch calibrate"):
        vllm_answers.stats_file(reading, folder)
    written = calibration.calibrate(model, torch.randint(0, VOCAB, (1, 32)))
    assert vllm_answers.stats_file(reading, folder) == str(written)


def test_the_vllm_engine_changes_the_run_key_and_checks_its_settings():
    base = TaskSettings(config=VaSEConfig(budget=64, window=16, seed=0))
    engine = TaskSettings(config=base.config, engine="vllm", dtype="bfloat16")
    key, old = engine.run_key("vase", "X"), base.run_key("vase", "X")
    assert {k: v for k, v in key.items() if k not in ("engine", "dtype", "batch_size")} == {
        k: v for k, v in old.items() if k != "batch_size"
    }
    assert (key["engine"], key["dtype"], key["batch_size"]) == ("vllm", "bfloat16", None) and "engine" not in old
    with pytest.raises(ValueError, match="dtype 'bfloat16' needs engine='vllm'"):
        TaskSettings(dtype="bfloat16")
    with pytest.raises(ValueError, match="prefill 'keep' is not available with engine='vllm'"):
        TaskSettings(engine="vllm", config=VaSEConfig(budget=64, window=16, seed=0, prefill="keep"))
    with pytest.raises(ValueError, match="engine must be one of transformers, vllm"):
        TaskSettings(engine="sglang")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_engine_is_refused_in_one_line_before_anything_loads(tmp_path, monkeypatch, capsys):
    def fail(*a, **k):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(models, "load", fail)
    monkeypatch.setattr(models, "load_tokenizer", fail)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "task", "--engine", "vllm", "--limit", "2", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vasepatch: error: --engine vllm needs vLLM, not installed here: in a venv of its own, pip")
    assert "[vllm]" in err and "docs/vllm.md" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_the_tokenizer_alone_ends_answers_where_the_loaded_model_does(tmp_path, make_model):
    model = make_model("qwen3")
    model.generation_config.eos_token_id = [1, 2]
    model.generation_config.repetition_penalty = 1.1
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "model")
    tokenizer, generation = models.load_tokenizer(tmp_path / "model")
    loaded, loaded_tokenizer = models.load(tmp_path / "model")
    assert generation.eos_token_id == [1, 2] == loaded.generation_config.eos_token_id
    assert generation.repetition_penalty == 1.1
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == loaded_tokenizer.pad_token_id
    (tmp_path / "model" / "generation_config.json").unlink()  # the model config's defaults then
    assert models.load_tokenizer(tmp_path / "model")[1].eos_token_id == loaded.config.eos_token_id


def test_another_vllm_version_is_refused_naming_the_supported_one(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda dist: "0.33.0")
    with pytest.raises(ValueError, match=r"needs vLLM 0\.32\.0, the version the plugin supports; found 0\.33\.0"):
        vllm_answers.require_vllm()


def test_an_answer_after_a_line_cut_by_an_interruption_gets_a_line_of_its_own(tmp_path):
    path = tmp_path / "a.jsonl"
    answers.append(path, {"n": 1})
    path.write_text(path.read_text() + '{"n": 2, "cut')
    answers.append(path, {"n": 3})
    assert path.read_text().splitlines() == ['{"n": 1}', '{"n": 2, "cut', '{"n": 3}']
