"""`vasepatch bench`: results written after every segment, `--resume`, `--skip`, and the
`floor` baselines (rewind exactness, ratio to the floor). Tiny random models; timings are
never asserted."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from tests.bench_tiny import TINY, tiny_settings
from vasepatch.bench import BenchSettings, MethodSpec, run_benchmark, summarise
from vasepatch.bench.measure import MethodRunner, sequence_inputs
from vasepatch.bench.methods import build_method, share_weights
from vasepatch.bench.report import markdown
from vasepatch.tools.cli import main

# 2 methods x 2 batch sizes x 2 lengths x 2 repeats = 16 segments, in this process
ARGV = ["bench", "--model", TINY, "--tokens", "16,32", "--budget", "16", "--window", "4", "--batch", "1,2"]
ARGV += ["--repeats", "2", "--prompt-len", "8", "--threads", "1", "--methods", "dense,vase", "--isolate", "none"]
ARGV += ["--no-progress"]


@pytest.fixture
def calls(monkeypatch):
    """Counts `MethodRunner` calls per (command, method); `calls.kill_after = n` interrupts the n+1-th segment."""
    counter: Counter = Counter()
    counter.kill_after = None
    for command in ("start", "warmup", "segment"):
        original = getattr(MethodRunner, command)

        def counted(self, *args, _original=original, _command=command):
            if _command == "segment" and counter.kill_after is not None and counter["segment"] >= counter.kill_after:
                raise KeyboardInterrupt  # what a killed run sees: nothing after this is written
            counter[_command] += 1
            counter[_command, self.method.spec.name] += 1
            return _original(self, *args)

        monkeypatch.setattr(MethodRunner, command, counted)
    return counter


def test_every_segment_is_saved_and_resume_runs_only_the_missing_ones(tmp_path, calls):
    out = tmp_path / "bench"
    calls.kill_after = 5
    with pytest.raises(SystemExit):  # the CLI turns the interrupt into exit status 130
        main([*ARGV, "--out", str(out)])
    partial = json.loads((out / "bench.json").read_text())
    assert partial["complete"] is False and partial["resumed"] == []
    assert len(partial["segments"]) == 5 and len(partial["results"]) == 3  # dense, vase at 16 and dense at 32
    assert {(w["method"], w["batch"]) for w in partial["warmups"]} == {("dense", 1), ("vase", 1)}
    assert BenchSettings.from_dict(partial["settings"]).to_dict() == partial["settings"]
    assert "Incomplete run" in (out / "bench.md").read_text()
    assert not list(out.glob(".*.tmp"))

    calls.clear()
    calls.kill_after = None
    assert main(["bench", "--resume", str(out), "--no-progress", "--threads", "1"]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert calls["segment"] == 16 - 5
    # every method is rebuilt at batch 1 (segments missing there) and at batch 2; warm-ups are not recorded twice
    assert calls["start"] == calls["warmup"] == 4
    assert len(result["warmups"]) == 4 and len({(w["method"], w["batch"]) for w in result["warmups"]}) == 4
    keys = [(s["method"], s["batch"], s["length"], s["repeat"]) for s in result["segments"]]
    assert len(keys) == len(set(keys)) == 16 and keys[:5] == [
        (s["method"], s["batch"], s["length"], s["repeat"]) for s in partial["segments"]
    ]
    assert result["complete"] is True and len(result["resumed"]) == 1 and result["started"] == partial["started"]
    assert len(result["results"]) == 8 and result["wall_s"] >= partial["wall_s"]
    assert "Incomplete run" not in (out / "bench.md").read_text()

    calls.clear()  # nothing left: nothing is loaded, started or run
    assert main(["bench", "--resume", str(out), "--no-progress", "--threads", "1"]) == 0
    assert sum(calls.values()) == 0 and len(json.loads((out / "bench.json").read_text())["resumed"]) == 2


def _exit_2(argv: list[str], capsys) -> str:
    """The one line `main(argv)` prints before it exits with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("vasepatch: error: ") and err.count("\n") == 1, err
    return err


def test_resume_refuses_changed_settings_and_reuses_the_stored_ones(tmp_path, capsys):
    from vasepatch.bench.cli import settings_from_args
    from vasepatch.tools.cli import build_parser

    out = tmp_path / "run"
    out.mkdir()
    stored = tiny_settings(skip=["dense@2"], out=str(out))
    (out / "bench.json").write_text(json.dumps({"settings": stored.to_dict(), "segments": []}))
    for option, value, key in [("--budget", "32", "budget"), ("--methods", "dense", "methods"), ("--skip", "", "skip")]:
        err = _exit_2(["bench", "--resume", str(out), option, value, "--threads", "1"], capsys)
        assert f"resume: setting '{key}': stored " in err and "differs from" in err
    err = _exit_2(["bench", "--resume", str(out), "--budget", "32", "--window", "8", "--threads", "1"], capsys)
    assert "resume: settings differ from" in err and "'budget': stored 16, given 32; 'window': stored 4, given 8" in err
    err = _exit_2(["bench", "--resume", str(tmp_path / "missing"), "--threads", "1"], capsys)
    assert "does not exist; --resume takes the folder of a bench run" in err
    args = build_parser().parse_args(["bench", "--resume", str(out), "--budget", "16", "--threads", "1"])
    settings, previous = settings_from_args(args)
    assert settings.to_dict() == stored.to_dict() and previous["segments"] == []


def floor_logits(method, steps: int) -> torch.Tensor:
    """The logits of `steps` greedy decode steps (the path `Method.step` takes)."""
    logits = []
    for _ in range(steps):
        out = method._forward(method.next_token, compiled=True, last_only=False)
        method.next_token = out.argmax(-1, keepdim=True)
        logits.append(out)
    return torch.stack(logits)


@pytest.mark.parametrize("name", ["floor", pytest.param("floor+compile", marks=pytest.mark.slow)])
def test_floor_rewind_equals_a_fresh_prefill(tiny, name):
    settings = tiny_settings(methods=[name], steps=4)
    spec = MethodSpec.parse(name)
    prompt, _ = sequence_inputs(settings, 2, tiny.config.vocab_size)
    rewound, fresh = (build_method(spec, share_weights(tiny), settings) for _ in range(2))
    for m in (rewound, fresh):
        m.start(prompt, settings.max_generated)
        assert m.prompt_len == settings.cache.budget and m.generated == 0
    first = floor_logits(rewound, 5)  # more than `steps`: the warm-up and one segment's worth
    for _ in range(2):
        rewound.advance_to(32, None)  # nothing to fast-forward to
        rewound.before_segment()
        assert rewound.generated == 0 and rewound.cache.get_seq_length() == settings.cache.budget
        again = floor_logits(rewound, 5)
        torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(floor_logits(fresh, 5), first, rtol=1e-5, atol=1e-5)


def test_floor_rows_skip_rows_and_ratio_to_floor(tiny, calls):
    skip = ["dense@2", "vase@1:32"]
    settings = tiny_settings(methods=["dense", "floor", "vase"], skip=skip, repeats=2)
    result = run_benchmark(settings, model=tiny)
    assert result["errors"] == [] and result["settings"]["skip"] == skip
    assert calls["start", "dense"] == 1 and calls["start", "floor"] == calls["start", "vase"] == 2
    assert calls["segment", "dense"] == 4 and calls["segment", "vase"] == 6 and calls["segment", "floor"] == 8
    rows = {(r["method"], r["batch"], r["length"]): r for r in result["results"]}
    skipped = {k for k, r in rows.items() if r.get("skipped")}
    assert skipped == {("dense", 2, 16), ("dense", 2, 32), ("vase", 1, 32)}
    assert all(rows[k]["tok_s"] is None for k in skipped)
    floor = [s for s in result["segments"] if s["method"] == "floor"]
    assert all(s["start"] == 0 and s["eviction_share"] is None for s in floor)
    assert len({s["kv_bytes"] for s in floor if s["batch"] == 2}) == 1  # rewound: the same size every segment
    measured = [row for key, row in rows.items() if key not in skipped]
    assert all(r["ratio_to_floor"] == 1.0 for r in measured if r["method"] == "floor")
    assert all(r["ratio_to_floor"] > 0 for r in measured)
    md = markdown(result)
    assert "| dense | 16 | not run (--skip) | — |" in md and "| vase | 32 | not run (--skip) |" in md
    assert "vs floor" in md and "*vs floor*" in md


def test_ratio_to_floor_picks_the_compiled_floor_for_compiled_methods():
    def seg(method, tok_s):
        return dict(method=method, batch=1, length=16, repeat=0, tok_s=tok_s, kv_bytes=0, peak_bytes=0)

    extra = dict(eviction_share=None, evicting_steps=0)
    speeds = {"floor": 100.0, "floor+compile": 400.0, "vase": 50.0, "vase+compile": 200.0, "dense": 25.0}
    methods = list(speeds)
    settings = tiny_settings(methods=methods, batch=[1], tokens=[16])
    rows = {r["method"]: r for r in summarise(settings, [{**seg(m, v), **extra} for m, v in speeds.items()])}
    assert rows["vase"]["ratio_to_floor"] == 0.5 and rows["dense"]["ratio_to_floor"] == 0.25
    assert rows["vase+compile"]["ratio_to_floor"] == 0.5  # against floor+compile
    assert rows["floor"]["ratio_to_floor"] == rows["floor+compile"]["ratio_to_floor"] == 1.0
    assert rows["floor+compile"]["compile_speedup"] == rows["vase+compile"]["compile_speedup"] == 4.0
    no_compiled_floor = [{**seg(m, v), **extra} for m, v in speeds.items() if m != "floor+compile"]
    rows = {r["method"]: r for r in summarise(settings, no_compiled_floor)}
    assert rows["vase+compile"]["ratio_to_floor"] == 2.0  # against eager floor
    no_floor = [{**seg(m, v), **extra} for m, v in speeds.items() if not m.startswith("floor")]
    assert all(r["ratio_to_floor"] is None for r in summarise(settings, no_floor))


@pytest.mark.parametrize(
    ("skip", "message"),
    [
        ("nope@1", "skip: 'nope@1' names a method"),
        ("dense@3", "skip: 'dense@3' names a method, batch"),
        ("dense@1:64", "skip: 'dense@1:64' names"),
        ("dense", "skip: 'dense' is not method@batch"),
        ("dense@1:x", "skip: 'dense@1:x' is not"),
    ],
)
def test_bad_skip_fails_before_any_work(tmp_path, skip, message, capsys):
    out = tmp_path / "never"
    argv = ["bench", "--methods", "dense,vase", "--batch", "1,2", "--tokens", "1024,2048", "--skip", skip]
    assert message in _exit_2([*argv, "--out", str(out)], capsys)
    assert not out.exists()


def _stored() -> dict:
    """A valid partial bench.json of the tiny settings: one warm-up, one segment, one error."""
    settings = tiny_settings().to_dict()
    segment = {"method": "dense", "batch": 1, "length": 16, "repeat": 0, "tok_s": 10.0, "kv_bytes": 1, "peak_bytes": 2,
               "eviction_share": None, "evicting_steps": 0, "graphs": 0}  # fmt: skip
    warmup = {"method": "dense", "batch": 1, "prefill_s": 0.1, "warmup_s": 0.2, "graphs": 0}
    error = {"method": "vase", "batch": None, "stage": "load", "error": "boom"}
    return {"settings": settings, "methods": {"dense": {}}, "warmups": [warmup], "segments": [segment],
            "errors": [error], "wall_s": 1.0, "complete": False, "started": "2026", "resumed": []}  # fmt: skip


def _broken(change) -> str:
    result = _stored()
    change(result)
    return json.dumps(result)


# A structurally corrupt bench.json: one line naming the file and the field, never a traceback or exit status 1
CORRUPT = [
    ("[1, 2]", r"the top level must be a JSON object, got a list"),
    ("{}", r'the top level lacks "settings"'),
    ('{"settings": "x"}', r'"settings" must be an object, got a string'),
    ("{oops", r"is not valid JSON \(line 1 column 2: Expecting property name"),
    (_broken(lambda r: r["settings"].update(methods=["vase", 5])), r"settings.methods\[1\] must be a string, got 5"),
    (_broken(lambda r: r["settings"].update(budget="16")), r"settings.budget must be an int, got a string"),
    (_broken(lambda r: r["settings"].update(tokens=16)), r"settings.tokens must be a list of ints, got 16"),
    (_broken(lambda r: r["settings"].update(colour="red")), r"settings has unknown key\(s\) 'colour'"),
    (_broken(lambda r: r["settings"].update(budget=1)), r"its settings are not valid: budget must be an int >= 2"),
    (_broken(lambda r: r.update(segments="x")), r'"segments" must be a list, got a string'),
    (_broken(lambda r: r.update(segments=[{}])), r"segments\[0\] lacks 'method', 'batch', 'length', 'repeat'"),
    (_broken(lambda r: r["segments"][0].update(tok_s=None)), r"segments\[0\].tok_s must be a number, got null"),
    (_broken(lambda r: r.update(warmups=None)), r'"warmups" must be a list, got null'),
    (_broken(lambda r: r.update(warmups=[{}])), r"warmups\[0\] lacks 'method', 'batch'"),
    (_broken(lambda r: r.update(errors=[5])), r"errors\[0\] must be an object, got 5"),
    (_broken(lambda r: r.update(methods=["vase"])), r'"methods" must be an object of method name -> object'),
    (_broken(lambda r: r.update(wall_s="1")), r'"wall_s" must be a number, got a string'),
    (_broken(lambda r: r.update(resumed=None)), r'"resumed" must be a list of strings, got null'),
]


@pytest.mark.parametrize(("text", "message"), CORRUPT, ids=[m[:40] for _, m in CORRUPT])
def test_a_corrupt_bench_json_is_refused_in_one_line_and_left_as_it_was(tmp_path, monkeypatch, capsys, text, message):
    import vasepatch.bench.runner as runner

    monkeypatch.setattr(runner, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark started"))
    (tmp_path / "bench.json").write_text(text)
    before = (tmp_path / "bench.json").stat().st_mtime_ns
    err = _exit_2(["bench", "--resume", str(tmp_path), "--threads", "1", "--no-progress"], capsys)
    assert err.startswith(f"vasepatch: error: resume: {tmp_path / 'bench.json'}") and re.search(message, err), err
    assert (tmp_path / "bench.json").read_text() == text and (tmp_path / "bench.json").stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_a_valid_stored_result_passes_the_checks(tmp_path):
    from vasepatch.bench import resume

    (tmp_path / "bench.json").write_text(json.dumps(_stored()))
    path, result = resume.read(str(tmp_path))
    assert path == tmp_path / "bench.json" and result["segments"] == _stored()["segments"]
