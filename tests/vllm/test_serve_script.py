"""`benchmarks/vllm_serve.py` without vLLM: the server it starts (pool fixed by vLLM's own override, the plugin's
engine setting), what each method's requests carry, the methods' rotation, and the table's ratios."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serve():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its neighbour vllm_throughput
    try:
        spec = importlib.util.spec_from_file_location("vllm_serve", ROOT / "benchmarks" / "vllm_serve.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_machine_line_names_the_model_dtype_cpu_and_vllm(serve, tmp_path):
    line = serve.machine(serve.parse_args(["--out", str(tmp_path)]), "/models/SmolLM2-135M-hf")
    assert line.startswith("SmolLM2-135M-hf, bfloat16, ") and "CPUs), vLLM " in line


def test_the_server_has_the_pool_and_settings_asked_for(serve, tmp_path):
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = serve.parse_args(["--out", str(tmp_path), "--evictions-per-step", "4", "--requests", "48"])
    blocks = serve.pool_blocks(args, 2)
    assert blocks == 2 * 12 + 1  # two requests of 128 + 256 tokens in blocks of 32, and vLLM's null block
    cmd = serve.server_command(args, str(tmp_path), blocks, 8123)
    flag = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
    assert flag["--num-gpu-blocks-override"] == "25" and flag["--host"] == "127.0.0.1"
    assert int(flag["--kv-cache-memory-bytes"]) == 25 * 30 * 3 * 64 * 2 * 2 * 32  # bf16 K and V of every layer
    assert flag["--max-model-len"] == "384" and flag["--max-num-seqs"] == "48"
    assert json.loads(flag["--additional-config"]) == {"vasepatch": {"evictions_per_step": 4}}
    assert "--no-enable-prefix-caching" in cmd and "--enforce-eager" in cmd


def test_each_method_sends_its_settings_and_the_order_rotates(serve, tmp_path):
    args = serve.parse_args(["--out", str(tmp_path), "--budget", "128", "--window", "16"])
    assert serve.settings_of(args, "full") == {}
    asks = {"vasepatch_policy": "snapkv", "vasepatch_budget": 128, "vasepatch_window": 16}
    assert serve.settings_of(args, "snapkv") == {"vllm_xargs": asks}
    methods = ["full", "vase", "snapkv"]
    assert [serve.rotated(methods, k) for k in range(3)] == [methods, ["vase", "snapkv", "full"],
                                                             ["snapkv", "full", "vase"]]  # fmt: skip


def test_ratios_are_to_the_full_cache_at_the_same_pool_and_rate(serve, tmp_path):
    args = serve.parse_args(["--out", str(tmp_path)])
    figures = {f"p{p}_{m}_ms": 1.0 for p in ("50", "99") for m in serve.METRICS}
    rows = [
        {"pool_fits": 2, "pool_blocks": 25, "rate": r, "method": m, "output_throughput": t,
         "max_concurrent_requests": 8, **figures}
        for r, m, t in [("inf", "full", 50.0), ("inf", "vase", 120.0), ("2", "vase", 90.0), ("2", "full", 60.0)]
    ]  # fmt: skip
    serve.save(args, ["--out", "X"], rows, "SmolLM2, bfloat16, a CPU (2 CPUs), vLLM 0.32.0")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["machine"] == "SmolLM2, bfloat16, a CPU (2 CPUs), vLLM 0.32.0"
    assert "\nSmolLM2, bfloat16, a CPU (2 CPUs), vLLM 0.32.0\n" in (tmp_path / "results.md").read_text()
    assert [r["vs_full"] for r in saved["runs"]] == [1.0, 2.4, 1.5, 1.0]
    assert saved["command"] == "python benchmarks/vllm_serve.py --out X"
    assert "| 2 full (25 blocks) | inf | vase | 120.0 | 2.40x |  | — | 8 |" in (tmp_path / "results.md").read_text()


def test_ratios_to_streaming_and_the_itl_growth_table(serve, tmp_path):
    args = serve.parse_args(["--out", str(tmp_path), "--itl-segments", "2"])
    figures = {f"p{p}_{m}_ms": 1.0 for p in ("50", "99") for m in serve.METRICS}
    rows = [
        {"pool_fits": 2, "pool_blocks": 265, "rate": "inf", "method": m, "output_throughput": t,
         "max_concurrent_requests": 6, "itl_by_position_ms": g, **figures}
        for m, t, g in [("full", 40.0, [20.0, 50.0]), ("vase", 97.0, [30.0, 30.0]), ("streaming", 100.0, [28.0, 29.0])]
    ]  # fmt: skip
    serve.save(args, ["--out", "X"], rows, "")
    saved = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["vs_streaming"] for r in saved] == [0.4, 0.97, 1.0]
    text = (tmp_path / "results.md").read_text()
    assert "| 2 full (265 blocks) | inf | vase | 97.0 | 2.42x | 0.97x | — | 6 |" in text
    assert "| 2 full | inf | full | 20 | 50 | 2.50x |" in text and "| 2 full | inf | vase | 30 | 30 | 1.00x |" in text


def test_the_itl_of_each_stretch_is_the_median_over_every_requests_tokens_there(serve):
    itls = [[0.010, 0.020, 0.030, 0.040], [0.012, 0.100]]  # seconds; the second request stopped early
    assert serve.itl_by_position(itls, 2) == pytest.approx([16.0, 35.0])  # ms: of 10, 12, 20, 100; of 30, 40
    assert serve.itl_by_position(itls, 4) == pytest.approx([11.0, 60.0, 30.0, 40.0])
    assert serve.itl_by_position([[0.01]], 3) == [10.0, None, None]


def test_the_figure_groups_runs_by_workload_pool_and_rate(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_vllm_serve", ROOT / "benchmarks" / "plot_vllm_serve.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    for name, pool in (("a", 2), ("b", 4)):
        runs = [
            {"pool_fits": pool, "pool_blocks": 10 * pool, "rate": rate, "method": method, "output_throughput": tok,
             "vs_full": tok / 50, "p50_itl_ms": 40.0, "p99_itl_ms": 90.0}
            for rate in ("inf", "1.0") for method, tok in (("full", 50.0), ("vase", 120.0))
        ]  # fmt: skip
        runs.append({"pool_fits": pool, "pool_blocks": 10 * pool, "rate": "inf", "method": "snapkv", "error": "x"})
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"command": "c", "runs": runs}))
    found = plot.groups([tmp_path / "a", tmp_path / "b"], ["W1", "W2"])
    assert [title for title, _ in found] == [
        "W1, pool 2 full (20 blocks), rate inf", "W1, pool 2 full (20 blocks), rate 1.0",
        "W2, pool 4 full (40 blocks), rate inf", "W2, pool 4 full (40 blocks), rate 1.0",
    ]  # fmt: skip
    assert [[r["method"] for r in runs] for _, runs in found] == [["full", "vase"]] * 4  # the failed run left out
    out = plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "W1,W2", "--out", str(tmp_path / "f.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "a"), "--labels", "W1,W2", "--out", str(tmp_path / "g.png")])


def test_the_offline_benchmark_rotates_its_methods_and_takes_ratios_within_a_repeat():
    spec = importlib.util.spec_from_file_location("vllm_throughput", ROOT / "benchmarks" / "vllm_throughput.py")
    offline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offline)
    methods = ["full", "vase", "snapkv", "streaming"]
    orders = [offline.rotated(methods, r) for r in range(5)]
    assert [o[0] for o in orders] == ["full", "vase", "snapkv", "streaming", "full"]
    assert all(sorted(o) == sorted(methods) for o in orders)
    runs = [
        {"pool": "2x", "pool_blocks": 25, "method": m, "tok_s": tok, "repeat": r}
        for r, pairs in enumerate(([("full", 50.0), ("vase", 120.0)], [("vase", 100.0), ("full", 40.0)],
                                   [("full", 45.0), ("vase", 130.0)]))
        for m, tok in pairs
    ]  # fmt: skip
    runs.append({"pool": "2x", "pool_blocks": 25, "method": "vase", "error": "boom", "repeat": 2})
    offline.with_ratios(runs)
    assert [r.get("vs_full") for r in runs if r["method"] == "vase" and "tok_s" in r] == [2.4, 2.5, 130 / 45]
    median = {r["method"]: (r["tok_s"], r["repeat"]) for r in offline.medians(runs)}
    assert median == {"full": (45.0, 2), "vase": (120.0, 0)}  # the failed run is left out
    args = offline.parse_args(["--model", "/models/m", "--repeats", "3", "--warmups", "0"])  # no model is resolved
    assert (args.repeats, args.warmups) == (3, 0)
    assert offline.parse_args(["--model", "/models/m"]).warmups == 2


def test_the_steady_state_reads_the_servers_stat_lines_while_requests_wait(serve, tmp_path):
    line = (
        "(APIServer pid=1) INFO 12-02 17:{m:02d}:{s:02d} [loggers.py:335] Engine 000: Avg prompt throughput: 0.0 "
        "tokens/s, Avg generation throughput: {tok} tokens/s, Running: {run} reqs, Waiting: {wait} reqs, CPU KV cache "
        "usage: 90.0%"
    )
    stats = [(0, 0, 100.0, 4, 20), (0, 10, 120.0, 6, 10), (0, 20, 80.0, 5, 0), (1, 0, 999.0, 9, 9)]
    log = tmp_path / "server.log"
    log.write_text("noise\n" + "\n".join(line.format(m=m, s=s, tok=t, run=r, wait=w) for m, s, t, r, w in stats))
    import datetime

    start = datetime.datetime(2026, 12, 2, 17, 0, 0).timestamp()
    got = serve.steady(log, start, start + 30)  # the last wave (nothing waiting) and a later run left out
    assert got == {"steady_tok_s": 110.0, "steady_running": 5.0, "steady_s": 20}
    assert serve.steady(log, start + 100, start + 200)["steady_tok_s"] is None
    rows = [
        {"pool_fits": 2, "pool_blocks": 9, "rate": "inf", "method": m, "output_throughput": t, "steady_tok_s": st,
         "steady_running": 3.0, "max_concurrent_requests": 8, **{f"p{p}_{k}_ms": 1.0 for p in (50, 99)
                                                                  for k in serve.METRICS}}
        for m, t, st in (("full", 50.0, 60.0), ("vase", 100.0, 180.0))
    ]  # fmt: skip
    args = serve.parse_args(["--out", str(tmp_path)])
    serve.save(args, ["--out", "x"], rows)
    assert [r["steady_vs_full"] for r in rows] == [1.0, 3.0]
    assert "| 180.0 (3.00x; 3.0) |" in (tmp_path / "results.md").read_text()


def test_the_commands_the_docs_give_parse(serve):
    """Every `vllm_serve.py` command block in docs/vllm.md (continuation lines joined) is one the script takes."""
    import shlex

    text = (ROOT / "docs" / "vllm.md").read_text().replace("\\\n", " ")
    commands = [line for line in text.splitlines() if line.startswith(".venv-vllm/bin/python benchmarks/vllm_serve.py")]
    assert len(commands) >= 2
    for line in commands:
        words = shlex.split(line[line.index("benchmarks/vllm_serve.py") :])[1:]
        args = serve.parse_args(words)
        methods = args.methods.split(",")
        assert methods and set(methods) <= {"full", "vase", "snapkv", "streaming"}
        assert args.rates in ("inf", "0.1", "0.03")


def test_repeats_take_ratios_within_each_repeat_and_report_medians(serve, tmp_path):
    args = serve.parse_args(["--out", str(tmp_path), "--repeats", "3"])
    rows = []
    for repeat, (full, vase, stream) in enumerate([(50.0, 120.0, 125.0), (40.0, 110.0, 100.0), (45.0, 99.0, 110.0)]):
        for method, tok_s, p99 in [("full", full, 100.0), ("vase", vase, 140.0 + repeat), ("streaming", stream, 120.0)]:
            figures = {f"p{p}_{m}_ms": 1.0 for p in ("50", "99") for m in serve.METRICS} | {"p99_itl_ms": p99}
            rows.append({"pool_fits": 2, "pool_blocks": 25, "rate": "inf", "method": method, "repeat": repeat,
                         "output_throughput": tok_s, "max_concurrent_requests": 8, **figures})  # fmt: skip
    serve.save(args, ["--out", "X"], rows, "")
    saved = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [round(r["vs_full"], 3) for r in saved if r["method"] == "vase"] == [2.4, 2.75, 2.2]
    assert [round(r["vs_streaming"], 3) for r in saved if r["method"] == "vase"] == [0.96, 1.1, 0.9]
    text = (tmp_path / "results.md").read_text()
    assert "| 2 full (25 blocks) | inf | vase #2 | 110.0 | 2.75x | 1.10x |" in text
    assert "| 2 full | inf | vase | 3 | 110.00 | 2.40 | 0.96 | 141.00 | 1.41 |" in text
    assert [serve.rotated(["full", "vase", "streaming"], k)[0] for k in range(3)] == ["full", "vase", "streaming"]
