"""The shape of the code: size limits, and imports that point one way.

policies <- cache <- integration <- tools (CLI, eval, bench, demo, models); `config`
and `errors` are leaves that anything may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vasepatch"
FILES = sorted(ROOT.rglob("*.py"))
MAX_FUNCTION, MAX_CLASS = 60, 250

# each layer may import itself, the leaves and the layers listed after it
LAYERS = {
    "config": (),
    "errors": (),
    "policies": ("config",),
    "cache": ("config", "policies"),
    "integration": ("config", "errors", "policies", "cache"),
}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _layer(module: str) -> str:
    """`vasepatch.cache.layer` -> `cache`; tools (everything else) -> `tools`."""
    part = module.split(".")[1] if "." in module else ""
    return part if part in LAYERS else "tools"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module == "vasepatch" and node.level == 0:
            found.update(f"vasepatch.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "vasepatch" or m.startswith("vasepatch.")}


def test_the_checks_see_the_package():
    assert len(FILES) > 30 and ROOT / "cache" / "layer.py" in FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_over_60_lines_and_no_class_over_250(path):
    long = []
    for node in ast.walk(_tree(path)):
        n = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and n > MAX_FUNCTION:
            long.append(f"function {node.name} ({n} lines)")
        elif isinstance(node, ast.ClassDef) and n > MAX_CLASS:
            long.append(f"class {node.name} ({n} lines)")
    assert not long, f"{path.name}: {long}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_one_way(path):
    own = _layer(_module_name(path))
    if own == "tools":
        return
    allowed = {own, *LAYERS[own]}
    wrong = sorted(m for m in _imports(path) if _layer(m) not in allowed)
    assert not wrong, f"{own} module {path.name} imports {wrong} (allowed: {sorted(allowed)})"


def test_the_layer_rule_catches_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from vasepatch.integration import attention\n")
    assert _imports(bad) == {"vasepatch.integration"} and _layer("vasepatch.integration") == "integration"
    assert _layer("vasepatch.integration") not in {"cache", *LAYERS["cache"]}
