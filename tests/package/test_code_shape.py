"""The shape of the code: size limits, and imports that point one way.

The folders of `vasepatch/` are the layers: `policies` <- `cache` <- `integration` (transformers
patching) <- tools (`tools/`: the CLI, generate, demo; `eval/`, `bench/`, `reporting/`, `models`);
`kernels` (attention kernels, pure tensor code) sits beside the policies, used by `integration`;
`vllm` (the vLLM plugin) uses `cache` and `policies` and nothing of `integration`. `config` and
`errors` are leaves that anything may import. Among the tools, `vasepatch.eval` and
`vasepatch.bench` import neither each other (what both need is in `vasepatch.reporting`),
and no tool module imports one that imports it back, directly or round a longer loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "vasepatch"
FILES = sorted(ROOT.rglob("*.py"))
MAX_FUNCTION, MAX_CLASS = 60, 250

# each layer may import itself, the leaves and the layers listed after it
LAYERS = {
    "config": (),
    "errors": (),
    "policies": ("config",),
    "kernels": ("config", "errors"),
    "cache": ("config", "policies"),
    "integration": ("config", "errors", "policies", "cache", "kernels"),
    "vllm": ("config", "errors", "policies", "cache"),
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


MODULES = {_module_name(path) for path in FILES}
APART = ("vasepatch.eval", "vasepatch.bench")  # tools that share code only through vasepatch.reporting


def _imports(path: Path) -> set[str]:
    """The vasepatch modules `path` imports, anywhere in it (lazily inside a function and under
    `TYPE_CHECKING` too): `from vasepatch.eval import data` imports `vasepatch.eval.data`,
    `from vasepatch.eval.data import Example` imports `vasepatch.eval.data`."""
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "vasepatch" or m.startswith("vasepatch.")}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


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
    assert _imports(bad) == {"vasepatch.integration.attention"}
    assert _layer("vasepatch.integration.attention") not in {"cache", *LAYERS["cache"]}


def _crossing(module: str, imported: set[str]) -> list[str]:
    """The imports of `module` that go from `vasepatch.eval` to `vasepatch.bench` or back."""
    for mine, theirs in (APART, APART[::-1]):
        if _within(module, mine):
            return sorted(m for m in imported if _within(m, theirs))
    return []


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A chain of imports `start -> ... -> start` in `graph` (module -> the modules it imports), or None."""
    stack, seen = [[start]], set()
    while stack:
        chain = stack.pop()
        for imported in sorted(graph.get(chain[-1], ())):
            if imported == start:
                return [*chain, start]
            if imported not in seen:
                seen.add(imported)
                stack.append([*chain, imported])
    return None


def _tool_graph() -> dict[str, set[str]]:
    """Each tool module -> the tool modules it imports (a module importing itself is not a loop)."""
    tools = {_module_name(path): path for path in FILES if _layer(_module_name(path)) == "tools"}
    return {m: {i for i in _imports(path) if i in tools and i != m} for m, path in tools.items()}


def test_eval_and_bench_do_not_import_each_other():
    wrong = {_module_name(p): _crossing(_module_name(p), _imports(p)) for p in FILES}
    wrong = {module: imported for module, imported in wrong.items() if imported}
    assert not wrong, f"imports between vasepatch.eval and vasepatch.bench (share through vasepatch.reporting): {wrong}"


def test_no_import_cycles_among_the_tools():
    graph = _tool_graph()
    assert "vasepatch.eval.fidelity" in graph and "vasepatch.bench.report" in graph
    cycles = {frozenset(chain): " -> ".join(chain) for m in sorted(graph) if (chain := _cycle_through(graph, m))}
    assert not cycles, f"import cycles: {sorted(cycles.values())}"


def test_the_tool_rules_catch_a_crossing_and_a_cycle():
    assert _crossing("vasepatch.eval.replot", {"vasepatch.bench.report", "vasepatch.reporting.style"}) == [
        "vasepatch.bench.report"
    ]
    assert _crossing("vasepatch.bench.report", {"vasepatch.eval"}) == ["vasepatch.eval"]
    assert _crossing("vasepatch.evaluation", {"vasepatch.bench"}) == []  # a prefix is not the package
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"] and _cycle_through(graph, "d") is None


def _private_writes(tree: ast.Module) -> list[str]:
    """`obj._name = ...` (or `+=`, or `del`) where `obj` is not `self` or `cls`: one object writing
    another's private attribute."""
    found = []
    for node in ast.walk(tree):
        targets = {
            ast.Assign: lambda n: n.targets,
            ast.AugAssign: lambda n: [n.target],
            ast.Delete: lambda n: n.targets,
        }
        for kind, get in targets.items():
            if not isinstance(node, kind):
                continue
            for target in get(node):
                for t in ast.walk(target):
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr.startswith("_")
                        and not t.attr.startswith("__")
                        and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
                    ):
                        found.append(f"line {t.lineno}: {ast.unparse(t)}")
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_writes_another_objects_private_attributes(path):
    assert _private_writes(_tree(path)) == []


def test_the_private_write_rule_catches_one():
    tree = ast.parse("def f(layer, x):\n    layer._pending = x\n    self._ok = 1\n    layer.ring._p += 1\n")
    assert _private_writes(tree) == ["line 2: layer._pending", "line 4: layer.ring._p"]


# the modules that tell a compiled step from an eager one: the cache layer (step now, settle later), the
# patch's wrappers (transformers' call context, which dynamo cannot trace), and the keyed noise (a policy
# compiles on its own; eagerly its index hashes are cached)
COMPILE_AWARE = {"vasepatch.cache.layer", "vasepatch.integration.wrappers", "vasepatch.policies.keyed"}


def test_is_compiling_is_read_in_few_modules():
    readers = {_module_name(p) for p in FILES if "is_compiling()" in p.read_text()}
    assert readers == COMPILE_AWARE
