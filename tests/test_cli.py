"""The `vasepatch demo` command end to end (small settings), and the version guard."""

from __future__ import annotations

import re

import pytest

from vasepatch.cli import main
from vasepatch.integration.compat import check_transformers


@pytest.mark.slow
def test_demo_prints_text_stats_and_memory(smollm2, capsys):
    assert main(["demo", "--max-new-tokens", "48", "--budget", "32", "--window", "8"]) == 0
    out = capsys.readouterr().out
    assert "--- VaSE (budget=32, window=8" in out
    evictions = int(re.search(r"evictions: (\d+)", out).group(1))
    assert evictions >= 1
    patched = float(re.search(r"vasepatch:\s+([\d.]+) MiB", out).group(1))
    full = float(re.search(r"full cache:\s+([\d.]+) MiB", out).group(1))
    assert 0 < patched < full


def test_cli_requires_a_command(capsys):
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.parametrize("version", ["4.57.1", "5.0.0rc1", "6.0.0"])
def test_transformers_outside_the_tested_range_is_refused(version):
    with pytest.raises(RuntimeError, match=r"transformers >=5\.0\.0,<6\.0\.0; found"):
        check_transformers(version)


def test_transformers_in_range_is_accepted():
    check_transformers("5.0.0")
    check_transformers("5.24.0")
