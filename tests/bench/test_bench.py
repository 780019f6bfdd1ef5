"""`vasepatch bench`: end to end on a tiny random model, fast-forward exactness, memory
accounting and option errors. Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from tests.bench_tiny import TINY, tiny_settings
from vasepatch import VaSEConfig
from vasepatch.bench import BenchSettings, MethodSpec, run_benchmark, summarise
from vasepatch.bench.measure import MIB, eviction_share, sequence_inputs
from vasepatch.bench.methods import build_method, kvpress_module, share_weights
from vasepatch.bench.report import markdown
from vasepatch.bench.shapes import SHAPES
from vasepatch.tools.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
COMMITTED = RESULTS / "bench-cpu" / "bench.json"
# every committed run: the full comparison, and the eviction-share rows before and after the cheaper eviction
COMMITTED_RUNS = [COMMITTED, *sorted(RESULTS.glob("bench-cpu-eviction/**/bench.json"))]


def test_cli_end_to_end_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "--model", TINY, "--tokens", "16,32", "--budget", "16", "--window", "4", "--batch", "1,2"]
    argv += ["--repeats", "1", "--prompt-len", "8", "--threads", "1", "--methods", "dense,vase,kvpress"]
    argv += ["--no-progress", "--out", str(out)]  # default isolation on CPU: one worker process per method
    assert main(argv) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["settings"]["isolate"] == "process"
    assert {"torch", "transformers", "device", "threads"} <= set(result["environment"])
    rows = {(r["method"], r["batch"], r["length"]) for r in result["results"]}
    assert rows >= {(m, b, n) for m in ("dense", "vase") for b in (1, 2) for n in (16, 32)}
    for seg in result["segments"]:
        assert len(seg["step_times_ms"]) == 4 and seg["peak_bytes"] > 0
    vase = [r for r in result["results"] if r["method"] == "vase"]
    assert all(r["evicting_steps"] == 1 and r["eviction_share"] is not None for r in vase)
    md = (out / "bench.md").read_text()
    assert "Batch 1:" in md and "Batch 2:" in md and "| vase | 32 |" in md
    assert (out / "throughput.png").stat().st_size > 0 and (out / "memory.png").stat().st_size > 0
    # kvpress is never imported in this process: importing it wraps transformers' attention functions process-wide
    if importlib.util.find_spec("kvpress") is None or result["errors"]:
        assert [e["method"] for e in result["errors"]] == ["kvpress"]
        assert "kvpress is not importable" in result["errors"][0]["error"]
        assert "kvpress" in md
    else:  # kvpress installed (its own venv: kvpress 0.5.5 needs transformers < 5.3); it ran in a worker process
        assert not result["errors"]
        kvpress = {(r["batch"], r["length"]): r for r in result["results"] if r["method"] == "kvpress"}
        dense = {(r["batch"], r["length"]): r for r in result["results"] if r["method"] == "dense"}
        assert set(kvpress) == {(b, n) for b in (1, 2) for n in (16, 32)}
        for key, row in kvpress.items():  # compressed to the budget: it evicts and holds less than dense
            assert row["evicting_steps"] >= 1 and row["tok_s"] > 0 and row["kv_mib"] <= dense[key]["kv_mib"]
        assert kvpress[(2, 32)]["kv_mib"] < dense[(2, 32)]["kv_mib"]
        assert "| kvpress | 32 |" in md


@pytest.mark.parametrize("policy", ["vase", "snapkv", "streaming"])
def test_fast_forward_leaves_the_cache_as_one_token_decoding_would(tiny, policy):
    settings = tiny_settings(methods=[policy], tokens=[20, 40, 61])
    spec = MethodSpec.parse(policy)
    chunked = build_method(spec, share_weights(tiny), settings)
    single = build_method(spec, share_weights(tiny), settings)
    single.chunk_limit = lambda: 1  # one token per forward: plain decoding of the same tokens
    prompt, stream = sequence_inputs(settings, 2, tiny.config.vocab_size)
    for m in (chunked, single):
        m.start(prompt, settings.max_generated)
    for target in settings.tokens:
        chunked.advance_to(target, stream)
        single.advance_to(target, stream)
        a, b = chunked.cache.stats(), single.cache.stats()
        assert a["evictions"] == b["evictions"] > 0
        for key in ("occupancy", "tokens_seen", "evicted_tokens"):
            assert a[key] == b[key], key
        occupied = a["occupancy"]
        for la, lb in zip(chunked.cache.layers, single.cache.layers, strict=True):
            assert torch.equal(la.valid[..., :occupied], lb.valid[..., :occupied])
    for m in (chunked, single):
        m.close()


def test_kvpress_fast_forward_compresses_where_one_token_decoding_would(tiny):
    try:
        kvpress_module()
    except RuntimeError as err:
        pytest.skip(str(err))
    settings = tiny_settings(methods=["kvpress"], tokens=[21, 43])
    spec = MethodSpec.parse("kvpress")
    chunked = build_method(spec, share_weights(tiny), settings)
    single = build_method(spec, share_weights(tiny), settings)
    single.chunk_limit = lambda: 1
    prompt, stream = sequence_inputs(settings, 2, tiny.config.vocab_size)
    for m in (chunked, single):
        m.start(prompt, settings.max_generated)
    for target in settings.tokens:
        chunked.advance_to(target, stream)
        single.advance_to(target, stream)
        assert chunked.evictions() == single.evictions() > 0
        assert chunked.cache.layers[0].keys.shape == single.cache.layers[0].keys.shape
        assert chunked.press.layer_step_counts[0] == single.press.layer_step_counts[0]
    for m in (chunked, single):
        m.close()


def test_dense_and_static_fast_forward_reach_the_length(tiny):
    settings = tiny_settings(methods=["dense", "static"])
    prompt, stream = sequence_inputs(settings, 2, tiny.config.vocab_size)
    for name in settings.methods:
        m = build_method(MethodSpec.parse(name), share_weights(tiny), settings)
        m.start(prompt, settings.max_generated)
        m.advance_to(23, stream)
        assert m.generated == 23 and m.next_token.shape == (2, 1)
        m.step()
        assert m.generated == 24
        if name == "dense":
            assert m.cache.get_seq_length() == settings.prompt_len + 24


def test_kv_bytes_constant_for_vasepatch_and_growing_for_dense_and_full(tiny):
    settings = tiny_settings(methods=["dense", "static", "vase", "full"], tokens=[16, 32, 64], batch=[2])
    result = run_benchmark(settings, model=tiny)
    assert result["errors"] == []
    kv = {}
    for r in result["results"]:
        kv.setdefault(r["method"], []).append(r["kv_mib"])
    assert kv["dense"] == sorted(kv["dense"]) and kv["dense"][0] < kv["dense"][-1]
    assert len(set(kv["vase"])) == 1 and len(set(kv["static"])) == 1
    # vase's K/V bytes (read from `cache.stats()`) are the fixed buffer: budget + window slots
    shape = SHAPES["tiny-qwen3"]
    slots = settings.cache.budget + settings.cache.window
    per_slot = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 4  # K+V, fp32
    assert kv["vase"][0] == 2 * slots * per_slot / MIB
    # `full` is the never-evicting mode: it grows with the sequence, like dense, and never evicts
    assert kv["full"] == sorted(kv["full"]) and kv["full"][0] < kv["full"][-1]
    full = [r for r in result["results"] if r["method"] == "full"]
    assert all(r["evicting_steps"] == 0 and r["eviction_share"] == 0.0 for r in full)
    assert all(r["ratio_to_dense"] is not None for r in result["results"])


def test_a_failing_method_is_reported_and_the_others_go_on(tiny, monkeypatch):
    from vasepatch.bench.methods import StaticMethod

    step = StaticMethod.step

    def failing_step(self):
        if self.generated >= 32:
            raise RuntimeError("injected failure")
        step(self)

    monkeypatch.setattr(StaticMethod, "step", failing_step)
    settings = tiny_settings(methods=["dense", "static", "vase"], tokens=[16, 32, 64], batch=[1, 2])
    result = run_benchmark(settings, model=tiny)
    errors = [(e["method"], e["batch"], e["stage"], e["error"]) for e in result["errors"]]
    assert errors == [("static", b, "segment at 32", "RuntimeError: injected failure") for b in (1, 2)]
    rows = {(r["method"], r["batch"], r["length"]) for r in result["results"]}
    assert rows == {(m, b, n) for m in ("dense", "vase") for b in (1, 2) for n in (16, 32, 64)} | {
        ("static", 1, 16),
        ("static", 2, 16),
    }


def test_settings_hold_a_vase_config_and_write_the_same_keys():
    settings = tiny_settings(cache=VaSEConfig(budget=16, window=4, sinks=2), steps=None)
    assert settings.cache.seed == 0 and settings.steps == 4  # an unseeded config gets seed 0; steps = window
    config = settings.cache_config(MethodSpec.parse("snapkv+compile"))
    assert (config.policy, config.budget, config.window, config.sinks) == ("snapkv", 16, 4, 2)
    assert settings.cache_config(MethodSpec.parse("full")).evicts is False
    with pytest.raises(ValueError, match=r"cache must be a vasepatch\.VaSEConfig"):
        tiny_settings(cache={"budget": 16, "window": 4})
    committed = json.loads(COMMITTED.read_text())
    written = settings.to_dict()
    assert list(written) == list(committed["settings"])
    assert BenchSettings.from_dict(committed["settings"]).to_dict() == committed["settings"]
    assert BenchSettings.from_dict(written).to_dict() == written


def test_the_eviction_share_runs_are_committed():
    named = {RESULTS / "bench-cpu-eviction" / "bench.json", RESULTS / "bench-cpu-eviction" / "before" / "bench.json"}
    assert named <= set(COMMITTED_RUNS)


@pytest.mark.parametrize("path", COMMITTED_RUNS, ids=lambda p: str(p.parent.relative_to(RESULTS)))
def test_committed_results_still_summarise_and_render(path):
    committed = json.loads(path.read_text())
    settings = BenchSettings.from_dict(committed["settings"])
    rows = summarise(settings, committed["segments"])
    assert rows == committed["results"]
    floors = {m for m in ("floor", "floor+compile") if m in settings.methods}
    assert floors and {r["method"] for r in rows if r["ratio_to_floor"] == 1.0} == floors
    md = markdown(committed)
    assert "budget=512, window=64" in md and "| vase | 8192 |" in md
    assert committed["complete"] is True
    if path == COMMITTED:
        assert "not run (--skip)" in md
    else:  # the markdown beside the JSON is what the JSON renders to
        assert (path.parent / "bench.md").read_text() == md


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--methods", "dense,nope"], "methods: unknown method 'nope'"),
        (["--budget", "64", "--window", "64"], "window must be smaller than budget"),
        (["--tokens", "0,64"], r"argument --tokens: each of the comma-separated values must be an int in \[1, "),
        (["--tokens", "64,abc"], "argument --tokens: .*got 'abc'"),
        (["--batch", "0"], r"argument --batch: each of the comma-separated values must be an int in \[1, "),
        (["--tokens", "100,120", "--window", "16", "--budget", "64"], "tokens: consecutive lengths"),
        (["--model", "shape:nope"], "model: unknown shape"),
    ],
)
def test_bad_options_fail_before_any_work(tmp_path, monkeypatch, capsys, options, message):
    import vasepatch.bench.runner as runner

    monkeypatch.setattr(runner, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark started"))
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *options, "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and re.search(message, err), err
    assert not out.exists()


def test_quick_preset_and_explicit_options():
    from vasepatch.bench.cli import settings_from_args
    from vasepatch.tools.cli import build_parser

    quick = settings_from_args(build_parser().parse_args(["bench", "--quick"]))[0]
    assert (quick.tokens, quick.batch, quick.repeats, quick.steps) == ([256, 512], [1], 1, 32)
    assert (quick.cache.budget, quick.cache.window, quick.cache.seed) == (128, 32, 0)
    argv = ["bench", "--quick", "--budget", "96", "--steps", "8", "--seed", "3"]
    mixed = settings_from_args(build_parser().parse_args(argv))[0]
    assert (mixed.cache.budget, mixed.steps, mixed.cache.window, mixed.cache.seed) == (96, 8, 32, 3)
    plain, previous = settings_from_args(build_parser().parse_args(["bench"]))
    assert plain.to_dict() == BenchSettings().to_dict() and previous is None


def test_method_names_and_eviction_share():
    spec = MethodSpec.parse("vase+compile")
    assert (spec.base, spec.compile, spec.is_policy) == ("vase", True, True)
    assert not MethodSpec.parse("static").is_policy
    assert eviction_share([1.0, 1.0, 3.0, 1.0], [False, False, True, False]) == pytest.approx(2 / 6)
    assert eviction_share([1.0, 1.0], [False, False]) == 0.0
