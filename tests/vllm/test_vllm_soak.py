"""CI's version of the soak (`benchmarks/vllm_soak.py --quick`): two minutes and at least 100 requests of mixed
traffic through the OpenAI server, then its checks (leaked blocks, query rings, engine restarts, failed requests,
resident memory, seeded replays on a fresh server). The script asserts; this test reads its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the plugin's tests run in the vLLM venv: .ci/run)")
pytest.importorskip("httpx", reason="httpx comes with vLLM's OpenAI server")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1500)
def test_quick_soak_loses_nothing(smollm2_path: str, tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vllm_soak.py"), "--quick", "--out", str(tmp_path)]
    cmd += ["--model", smollm2_path]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1400)
    report = tmp_path / "soak.json"
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(report.read_text())
    assert done.returncode == 0, r["failed_checks"]
    assert r["requests"] >= 100 and r["traffic_s"] >= 120
    assert r["leaked_blocks"] == 0 and r["ring_bytes_after"] == 0 and r["evicting_after"] == 0
    assert r["failed"] == 0 and not r["engine_restarted"] and not r["fatal_log_lines"]
    assert r["completed"] + r["refused"] + r["disconnected"] + r["aborted"] == r["requests"]
    assert r["refused"] > 0 and r["disconnected"] + r["aborted"] > 0  # the mix reached the server
    assert r["seeded_replays_same"] == "5/5"
