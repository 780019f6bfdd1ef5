"""docs/vllm.md's offline recipe runs as written, in the vLLM venv (the main venv's docs test skips it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

ROOT = Path(__file__).resolve().parents[2]


def saved_block(page: str, name: str) -> str:
    """The ```python block that the page tells the reader to save as `name`."""
    text = (ROOT / page).read_text()
    after = text[text.index(f"`{name}`") :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.mark.timeout(900)
def test_the_offline_recipe_runs_as_written(tmp_path, smollm2_path):
    script = tmp_path / "vllm_offline.py"
    script.write_text(saved_block("docs/vllm.md", "vllm_offline.py"))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=840, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-4000:]
    headers = re.findall(r"^--- (.+): (\d+) tokens$", run.stdout, re.M)
    assert [h for h, _ in headers] == ["engine defaults (budget 256)", "budget 128", "full cache"]
    assert all(int(n) > 0 for _, n in headers)
