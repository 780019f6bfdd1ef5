"""Packaging: one source for the version, package-data that covers the data sets, the changelog, and the
wheel/sdist check that `.ci/run` runs on the built files (here on hand-made archives, so it must fail too)."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import vasepatch

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def check_dist():
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / ".ci" / "check_dist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_version_has_one_source(pyproject, check_dist):
    project = pyproject["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "vasepatch.__version__"}
    assert check_dist.source_version() == vasepatch.__version__
    installed = importlib.metadata.version("vasepatch")
    assert installed == vasepatch.__version__, "installed metadata is stale: pip install -e . again"


def test_package_data_covers_every_data_file(pyproject):
    globs = pyproject["tool"]["setuptools"]["package-data"]["vasepatch"]
    package = ROOT / "vasepatch"
    files = sorted(p.relative_to(package).as_posix() for p in (package / "data").rglob("*") if p.is_file())
    assert files == [
        f"data/{name}/{file}" for name in ("aime25", "gsm8k", "math500") for file in ("LICENSE", "test.jsonl")
    ]
    assert "py.typed" in globs
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []


def test_the_changelog_names_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    version = Version(vasepatch.__version__)
    assert version.is_devrelease or re.search(rf"^## \[{re.escape(str(version))}\] - \d{{4}}-\d\d-\d\d$", text, re.M)


def _good_wheel(check_dist) -> dict[str, bytes]:
    package = ROOT / "vasepatch"
    members = {p.relative_to(ROOT).as_posix(): b"" for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    members.update({path: (ROOT / path).read_bytes() for path in check_dist.data_files()})
    members["vasepatch/py.typed"] = b""
    members["vasepatch-x.dist-info/METADATA"] = f"Name: vasepatch\nVersion: {vasepatch.__version__}\n\n".encode()
    return members


def test_the_wheel_check_passes_a_right_wheel_and_names_each_fault(check_dist):
    good = _good_wheel(check_dist)
    assert check_dist.check_wheel(good) == []
    license = "vasepatch/data/gsm8k/LICENSE"
    faults = {
        "wheel lacks vasepatch/data/gsm8k/LICENSE": {k: v for k, v in good.items() if k != license},
        "wheel lacks vasepatch/py.typed": {k: v for k, v in good.items() if k != "vasepatch/py.typed"},
        "wheel lacks module vasepatch/eval/data.py": {k: v for k, v in good.items() if k != "vasepatch/eval/data.py"},
        "wheel's vasepatch/data/aime25/test.jsonl differs": {**good, "vasepatch/data/aime25/test.jsonl": b"{}\n"},
        "wheel holds tests/eval/test_data.py": {**good, "tests/eval/test_data.py": b""},
        "wheel holds property_tests/conftest.py": {**good, "property_tests/conftest.py": b""},
        "wheel METADATA does not say Version": {**good, "vasepatch-x.dist-info/METADATA": b"Version: 0.0.0\n"},
    }
    for expected, wheel in faults.items():
        problems = check_dist.check_wheel(wheel)
        assert len(problems) == 1 and problems[0].startswith(expected), (expected, problems)


def test_the_sdist_check_wants_readme_changelog_and_data_licenses(check_dist):
    good = check_dist.sdist_needs()
    assert {"README.md", "CHANGELOG.md", "vasepatch/py.typed", "vasepatch/data/gsm8k/LICENSE"} <= good
    assert check_dist.check_sdist(good | {"tests/conftest.py"}) == []
    for missing in ("README.md", "CHANGELOG.md", "vasepatch/data/math500/LICENSE"):
        assert check_dist.check_sdist(good - {missing}) == [f"sdist lacks {missing}"]


def test_a_folder_named_vasepatch_does_not_shadow_the_install(tmp_path):
    """A script run from the folder above a clone named `vasepatch` imports the package, not the clone's folder
    (issue 43: with setuptools' editable import hook, Python took the folder, which has no `__init__.py`, for a
    namespace package, and `vasepatch.patch` was an AttributeError). pyproject's `package-dir` makes
    `pip install -e .` a plain path entry, which wins over a namespace folder; a venv installed before it needs
    `pip install -e .` again."""
    (tmp_path / "vasepatch").mkdir()  # the clone's folder, seen from the folder above
    probe = "import vasepatch; print(getattr(vasepatch, '__file__', None)); print(hasattr(vasepatch, 'patch'))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    where, has_patch = done.stdout.split()
    assert where == str(Path(vasepatch.__file__)) and has_patch == "True", (
        f"from {tmp_path}, `import vasepatch` found {where}: reinstall with `pip install -e .`"
    )


def test_the_editable_install_is_a_path_entry(pyproject):
    assert pyproject["tool"]["setuptools"]["package-dir"] == {"": "."}
