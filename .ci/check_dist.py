"""Check the built wheel and sdist: the data sets with their licenses and `py.typed` ship, tests do not.

    python .ci/check_dist.py DIST_DIR     (DIST_DIR holds one .whl and one .tar.gz from `python -m build`)

The wheel must hold every module of the source tree, the three benchmark data sets byte-identical to
`vasepatch/data/`, each with its LICENSE, and `vasepatch/py.typed`; no `tests/`, `property_tests/`,
`benchmarks/` or `docs/` file, and no bytecode. Its version must be `vasepatch.__version__`. The sdist must
hold the README, the changelog, pyproject.toml, the data with their licenses and any top-level license file.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ("gsm8k", "math500", "aime25")
NOT_IN_WHEEL = ("tests/", "property_tests/", "benchmarks/", "docs/")


def source_version(root: Path = ROOT) -> str:
    """`__version__` as written in vasepatch/__init__.py (read without importing torch)."""
    for node in ast.parse((root / "vasepatch" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("vasepatch/__init__.py sets no __version__")


def data_files(root: Path = ROOT) -> dict[str, str]:
    """`vasepatch/data/<set>/<file>` -> sha256 of the source tree's copy."""
    return {
        f"vasepatch/data/{name}/{file}": hashlib.sha256(
            (root / "vasepatch" / "data" / name / file).read_bytes()
        ).hexdigest()
        for name in DATASETS
        for file in ("test.jsonl", "LICENSE")
    }


def check_wheel(members: dict[str, bytes], root: Path = ROOT) -> list[str]:
    """Problems with a wheel given as {path: bytes}; empty when it is right."""
    problems = [f"wheel lacks {p}" for p in ("vasepatch/py.typed",) if p not in members]
    for path, digest in data_files(root).items():
        if path not in members:
            problems.append(f"wheel lacks {path}")
        elif hashlib.sha256(members[path]).hexdigest() != digest:
            problems.append(f"wheel's {path} differs from the source tree's")
    modules = {
        p.relative_to(root).as_posix() for p in (root / "vasepatch").rglob("*.py") if "__pycache__" not in p.parts
    }
    problems += [f"wheel lacks module {m}" for m in sorted(modules - set(members))]
    problems += [f"wheel holds {p}" for p in members if p.startswith(NOT_IN_WHEEL) or p.endswith((".pyc", ".pyo"))]
    version = source_version(root)
    metadata = next((v for p, v in members.items() if p.endswith(".dist-info/METADATA")), b"").decode()
    if f"\nVersion: {version}\n" not in metadata:
        problems.append(f"wheel METADATA does not say Version: {version} (vasepatch.__version__)")
    return problems


def sdist_needs(root: Path = ROOT) -> set[str]:
    """What an sdist must hold: README, changelog, build config, the data with their licenses, license files."""
    needed = {"README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO", "vasepatch/py.typed", *data_files(root)}
    licenses = ("LICENSE", "LICENCE", "COPYING", "NOTICE")
    return needed | {p.name for p in root.iterdir() if p.is_file() and p.name.upper().startswith(licenses)}


def check_sdist(members: set[str], root: Path = ROOT) -> list[str]:
    """Problems with an sdist given as its member paths without the `name-version/` prefix."""
    return [f"sdist lacks {p}" for p in sorted(sdist_needs(root) - members)]


def read_wheel(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {name: z.read(name) for name in z.namelist() if not name.endswith("/")}


def read_sdist(path: Path) -> set[str]:
    with tarfile.open(path) as t:
        return {m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile() and "/" in m.name}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    dist = Path(argv[0])
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"check_dist: expected one .whl and one .tar.gz in {dist}, found {wheels + sdists}", file=sys.stderr)
        return 1
    problems = check_wheel(read_wheel(wheels[0])) + check_sdist(read_sdist(sdists[0]))
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if not problems:
        for path in (wheels[0], sdists[0]):
            print(f"{path.name}: {path.stat().st_size / 2**20:.2f} MiB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
