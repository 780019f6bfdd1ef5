"""The public API stays where users find it, whatever the package's folders: the names of `vasepatch`,
`vasepatch.policies` and `vasepatch.models`, and the two entry points (the `vasepatch` command and the
vLLM plugin), resolved from `pyproject.toml` the way an installer resolves them."""

from __future__ import annotations

import importlib
from pathlib import Path

import tomllib

import vasepatch

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

PUBLIC = {
    "AlreadyPatchedError", "ModelInUseError", "NoEvictionWarning", "NotPatchedError", "PatchHandle",
    "PolicyOutputError", "UnsupportedModelError", "VaSECache", "VaSEConfig", "VaSELayer", "__version__",
    "is_patched", "patch", "patched", "policies", "unpatch",
}  # fmt: skip


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def test_the_top_level_names_are_the_public_api_and_all_resolve():
    assert set(vasepatch.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(vasepatch, name) is not None


def test_policies_and_models_are_importable_modules_with_their_entry_functions():
    from vasepatch import models, policies

    assert {"get", "register", "available", "Policy", "for_config"} <= set(dir(policies))
    assert callable(models.load) and callable(models.resolve) and callable(models.available)


def test_the_entry_points_resolve_to_the_command_and_the_plugin():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    command = _resolve(project["scripts"]["vasepatch"])
    plugin = _resolve(project["entry-points"]["vllm.general_plugins"]["vasepatch"])
    assert command.__name__ == "main" and callable(command)
    assert plugin.__name__ == "register" and callable(plugin)
