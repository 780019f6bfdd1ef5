"""`benchmarks/vllm_soak.py` without vLLM: the plan of requests and which of the server's log lines count as a
failure of the engine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SERVING = "(APIServer pid=1) INFO 12-06 01:09:14 [loggers.py:335] Engine 000: Running: 1 reqs\n"
DIED = "(EngineCore pid=2) ERROR 12-06 01:09:15 [core.py:1] EngineCore encountered a fatal error.\n"
SHUTDOWN = (
    "(APIServer pid=1) INFO 12-06 01:09:24 [launcher.py:254] [shutdown] API server: shutdown triggered\n"
    "(APIServer pid=1) ERROR 12-06 01:09:24 [async_llm.py:906] Traceback (most recent call last):\n"
    "(APIServer pid=1) ERROR 12-06 01:09:24 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: x\n"
)


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("vllm_soak", ROOT / "benchmarks" / "vllm_soak.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["vllm_soak"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("vllm_soak", None)
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_servers_own_shutdown_noise_is_not_a_failure(soak, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(SERVING + SHUTDOWN)
    assert soak.fatal_lines(log, len(SERVING.encode())) == []


def test_a_fatal_line_while_serving_is_a_failure(soak, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(SERVING + DIED + SHUTDOWN)
    assert soak.fatal_lines(log, len((SERVING + DIED).encode())) == [DIED.strip()]


def test_the_plan_is_the_same_on_every_run_and_refuses_compress_with_prefix_caching(soak):
    args = soak.parse_args(["--quick"])
    first, again = soak.plan(args, 300), soak.plan(args, 300)
    assert [a.body for a in first] == [a.body for a in again]
    compress = [a for a in first if a.body.get("vllm_xargs", {}).get("vasepatch_prefill") == "compress"]
    assert compress and all(a.behaviour == "refused" for a in compress)
    off = soak.plan(soak.parse_args(["--quick", "--prefix-caching", "off"]), 300)
    assert any(
        a.behaviour != "refused" and a.body["vllm_xargs"].get("vasepatch_prefill") == "compress"
        for a in off
        if "vllm_xargs" in a.body
    )
