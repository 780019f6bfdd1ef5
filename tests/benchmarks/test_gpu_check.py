"""`benchmarks/gpu_check.py` on CPU: the eager runs really are eager (`disable_compile=True` reaches `generate`),
the compile check's pass rule, reports written after every part, the time budget of the default run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

import vasepatch
from tests.tiny_models import tiny_model

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module, imported from its path (no CUDA needed)."""
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


class _Spy:
    """A stand-in model whose `generate` records its keywords."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def generate(self, **kwargs):
        self.calls.append(kwargs)
        return torch.zeros(1, 1, dtype=torch.long)


def test_timed_generate_eager_passes_disable_compile(gpu_check):
    spy = _Spy()
    gpu_check.timed_generate(spy, {"max_new_tokens": 3}, False)
    assert spy.calls[-1]["disable_compile"] is True
    assert "compile_config" not in spy.calls[-1]
    config = CompileConfig(fullgraph=True)
    gpu_check.timed_generate(spy, {"max_new_tokens": 3}, False, config, output_logits=True)
    assert spy.calls[-1]["compile_config"] is config
    assert "disable_compile" not in spy.calls[-1]
    assert spy.calls[-1]["output_logits"] is True and spy.calls[-1]["max_new_tokens"] == 3


def test_eager_run_reaches_transformers_uncompiled(gpu_check):
    """Through a patched model's real `generate`: transformers sees `disable_compile=True` and declines to
    compile, where the same cache with compiling allowed (as on CUDA) would be compiled."""
    model = tiny_model("qwen3")
    model.generation_config.compile_config = CompileConfig(backend="eager")
    model.generation_config.compile_config._compile_all_devices = True  # CPU behaves as CUDA would
    seen: list[tuple[bool | None, bool, bool]] = []
    criteria = model._valid_auto_compile_criteria

    def spy(model_kwargs, generation_config):
        verdict = criteria(model_kwargs, generation_config)
        allowed = GenerationConfig(compile_config=model.generation_config.compile_config)
        seen.append((generation_config.disable_compile, verdict, criteria(model_kwargs, allowed)))
        return verdict

    model._valid_auto_compile_criteria = spy
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    with vasepatch.patched(model, budget=16, window=4, seed=0):
        out, seconds = gpu_check.timed_generate(model, kw, False)
    assert out.shape == (2, 9) and seconds > 0
    assert seen and all(flag is True and not verdict for flag, verdict, _ in seen)
    assert all(would for _, _, would in seen)  # without the flag this cache would be compiled


def _compile_row(**changes):
    row = dict(graphs=1, graph_breaks=0, cudagraph_skips=0, evictions=5, token_agreement=1.0, min_token_agreement=0.9)
    return {**row, **changes}


def test_compile_check_fails_on_skipped_cuda_graphs_or_disagreement(gpu_check):
    assert gpu_check.compile_ok(_compile_row())
    assert not gpu_check.compile_ok(_compile_row(cudagraph_skips=1))
    assert not gpu_check.compile_ok(_compile_row(token_agreement=0.5))
    assert not gpu_check.compile_ok(_compile_row(graphs=2))
    assert not gpu_check.compile_ok(_compile_row(evictions=3))
    assert gpu_check.MIN_AGREEMENT["cpu"] == 1.0


def test_reports_written_after_every_part(gpu_check, tmp_path, monkeypatch):
    """A run stopped during the throughput tables keeps the compile and device_map results on disk."""
    seen: list[dict] = []
    monkeypatch.setattr(gpu_check, "compile_check", lambda setup: {"ok": True, "error": "stub compile"})
    monkeypatch.setattr(gpu_check, "device_map_check", lambda setup: {"ok": False, "error": "stub device_map"})

    def plan(setup, model, tokens, methods):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text()))
        raise KeyboardInterrupt  # the run is stopped here

    monkeypatch.setattr(gpu_check, "throughput_plan", plan)
    setup = gpu_check.make_setup(torch.device("cpu"), 1)
    report = {"device": "cpu", "env": {}, "setup": {}, "checks": [], "unavailable": {}, "part2": None}
    monkeypatch.setattr(gpu_check, "markdown", lambda report: json.dumps(report["part2"]))
    with pytest.raises(KeyboardInterrupt):
        gpu_check.part2(setup, report, lambda: gpu_check.write_report(tmp_path, report), "default")
    assert seen[0]["part2"]["compile"]["error"] == "stub compile"
    assert seen[0]["part2"]["device_map"]["error"] == "stub device_map"
    assert "stub device_map" in (tmp_path / "gpu_check.md").read_text()


def test_default_run_fits_six_minutes(gpu_check):
    assert gpu_check.estimate_run_s("default") <= 6 * 60
    assert gpu_check.estimate_run_s("long") > gpu_check.estimate_run_s("default")
    dense = gpu_check.estimate_method_s("shape:qwen3-4b", [4096, 16384], "dense")
    assert gpu_check.estimate_method_s("shape:qwen3-4b", [4096, 16384], "vase") < dense  # bounded keys
    assert gpu_check.estimate_method_s("shape:qwen3-14b", [4096, 16384], "dense") > dense


def test_arguments(gpu_check):
    assert gpu_check.parse_args(["out"]).part2 == "default"
    assert gpu_check.parse_args(["out", "--long"]).part2 == "long"
    assert gpu_check.parse_args(["out", "--part2", "full"]).part2 == "long"
    assert gpu_check.parse_args(["out", "--part2", "skip"]).part2 == "skip"


def test_gpu_check_script_runs_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(PATH), str(tmp_path), "--allow-cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PATH.parents[1],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu"
    assert {r["backend"] for r in report["checks"]} >= {"torch_varlen", "flash_attn", "eager"}
    assert all(r["ok"] for r in report["checks"])
    assert "| backend |" in (tmp_path / "gpu_check.md").read_text()
