"""The contracts against the real vLLM 0.32.0, without an engine: every one holds, every wrapped function has one,
a faked signature change on vLLM's own class is named, and `patches.install` on a faked 0.32.1 wraps all thirteen
functions where the contracts hold and none where one breaks. The checker on fakes: `test_plugin_contracts.py`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402

from tests.vllm.engines import ROOT  # noqa: E402
from vasepatch.vllm import contracts, patches  # noqa: E402


def test_every_contract_holds_on_the_vllm_written_for():
    assert contracts.exact(vllm.__version__), vllm.__version__
    assert [str(m) for m in contracts.check()] == []


@pytest.fixture
def clean_patches():
    """No patches installed during the test; what was installed before it is put back after it."""
    had = bool(patches._INSTALLED)
    patches.uninstall()
    yield
    patches.uninstall()
    if had:
        patches.install()


def _wrapped() -> set[str]:
    return {f"{owner.__name__}.{name}" for owner, name, _ in patches._INSTALLED}


def test_every_wrapped_function_has_a_contract_and_every_contracts_function_is_wrapped(clean_patches):
    """Not merely some: a wrap that silently finds nothing to wrap (vLLM moved the function, or the owner is
    wrong) is a missing patch, and a wrap without a contract is unchecked at install."""
    patches.install()
    assert _wrapped() == {c.function for c in contracts.CONTRACTS}


def _new_parameter(self, request, max_cache_hit_length=None):  # vLLM 0.33's get_computed_blocks
    return None


def test_a_changed_signature_on_vllms_own_class_is_named(monkeypatch):
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", _new_parameter)
    assert [str(m) for m in contracts.check()] == [
        "KVCacheManager.get_computed_blocks: KVCacheManager.get_computed_blocks's parameters changed: written for "
        "(self, request), found (self, request, max_cache_hit_length=): new max_cache_hit_length"
    ]


def _install(monkeypatch, caplog, version: str) -> list[str]:
    monkeypatch.setattr(vllm, "__version__", version)
    with caplog.at_level(logging.WARNING, logger="vllm.vasepatch"):
        patches.install()
    return [r.getMessage() for r in caplog.records if r.name == "vllm.vasepatch"]


def test_a_patch_release_is_accepted_with_its_contracts_checked(clean_patches, monkeypatch, caplog):
    lines = _install(monkeypatch, caplog, "0.32.1")
    assert len(_wrapped()) >= 13 and _wrapped() <= {c.function for c in contracts.CONTRACTS}
    assert len(lines) == 1 and "active on vLLM 0.32.1" in lines[0] and contracts.summary() in lines[0]


def test_a_patch_release_with_a_broken_contract_is_inert(clean_patches, monkeypatch, caplog):
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", _new_parameter)
    lines = _install(monkeypatch, caplog, "0.32.1")
    assert _wrapped() == {"EngineArgs.create_engine_config", "InputProcessor._validate_params"}
    assert len(lines) == 2
    assert "does not hold: KVCacheManager.get_computed_blocks:" in lines[0] and "new max_cache_hit_length" in lines[0]
    assert "inactive: vLLM 0.32.1 breaks 1 of the contracts it was written for" in lines[1]


def test_the_contracts_command_prints_each_contract_and_the_verdict():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "vasepatch.vllm.contracts"], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert sum(line.startswith("OK ") for line in lines) == len(contracts.CONTRACTS)
    assert lines[-1] == "verdict at install: active: every contract holds"
