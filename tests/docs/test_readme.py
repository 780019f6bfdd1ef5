"""The README stays short, its links resolve, and every command it gives is one the tests cover.

The README's ```python blocks run in `tests/docs/test_docs_code.py`. Its shell commands are checked here:
each one is a command this file knows how CI covers (the pins `.ci/run` installs, a `vasepatch`
command line the CLI parses, a pytest run `.ci/run` makes, `.ci/run` itself). A new command fails
`test_every_readme_command_is_covered` until a check for it is added here.
"""

from __future__ import annotations

import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest

from vasepatch.tools import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def readme_commands() -> list[list[str]]:
    """Every command of the README's ```bash blocks, split at `&&`, as argv lists."""
    commands = []
    for block in BASH_BLOCK.findall(README):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                if part.strip():
                    commands.append(shlex.split(part, comments=True))
    return commands


def _extras() -> set[str]:
    return set(metadata.metadata("vasepatch").get_all("Provides-Extra") or [])


def _ci_pytest_runs() -> list[list[str]]:
    """The arguments of every pytest run `.ci/run` makes."""
    runs = []
    for line in CI.splitlines():
        if " -m pytest" in line and not line.lstrip().startswith("#"):
            words = shlex.split(line)
            runs.append(words[words.index("pytest") + 1 :])
    return runs


def _contains(words: list[str], part: list[str]) -> bool:
    return any(words[i : i + len(part)] == part for i in range(len(words) - len(part) + 1))


def _covered(argv: list[str]) -> str | None:
    """Why `argv` is covered, or None if this file has no check for it."""
    if argv == ["python3", "-m", "venv", ".venv"] and 'python3 -m venv "$venv"' in CI:
        return "CI makes the same venv"
    if argv == [".", ".venv/bin/activate"]:
        return "activates the venv just made"
    if argv[:2] == ["pip", "install"]:
        for word in argv[2:]:
            extras = re.fullmatch(r"\.\[([\w,]+)\]", word)
            if re.fullmatch(r"[\w.-]+==[\w.+-]+", word):
                assert f'"{word}"' in CI, f"the README pins {word}; .ci/run installs another version"
            elif extras:
                assert set(extras[1].split(",")) <= _extras(), f"{word}: no such extra in pyproject.toml"
            elif word not in ("-e", "--no-deps"):
                return None  # an unpinned package, or an option this file does not know
        return "the pins .ci/run installs, extras that exist"
    if argv[0] == "vasepatch":
        cli.build_parser().parse_args(argv[1:])  # exits on a command line the CLI does not take
        return "the CLI parses it; tests/tools/test_cli.py and tests/tools/test_generate_cli.py run the commands"
    if argv[:3] == ["python", "-m", "pytest"]:
        runs = _ci_pytest_runs()
        assert any(_contains(run, argv[3:]) for run in runs), f"{shlex.join(argv)}: not a .ci/run pytest run"
        return ".ci/run makes the same pytest run"
    if argv == ["bash", ".ci/run"]:
        assert (ROOT / ".ci" / "run").is_file()
        return "the CI script"
    return None


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert ["bash", ".ci/run"] in commands and ["vasepatch", "demo"] in commands  # the two commands
    uncovered = [shlex.join(argv) for argv in commands if _covered(argv) is None]
    assert not uncovered, f"README commands no check here covers: {uncovered}"


def test_the_command_checks_can_fail():
    """A pin .ci/run does not install, a command line the CLI refuses, an unpinned package, an unknown command."""
    with pytest.raises(AssertionError, match="installs another version"):
        _covered(["pip", "install", "torch==0.0.1"])
    with pytest.raises(SystemExit):
        _covered(["vasepatch", "demo", "--no-such-option"])
    assert _covered(["pip", "install", "torch"]) is None
    assert _covered(["rm", "-rf", "build"]) is None


def _anchors(page: Path) -> set[str]:
    """The heading ids python-markdown's toc gives the headings of `page`."""
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.M):
        text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        ids.add(re.sub(r"[-\s]+", "-", text))
    return ids


def test_the_readme_reads_in_two_minutes_and_its_links_resolve():
    assert len(README.splitlines()) <= 100
    links = [link for link in LINK.findall(README) if "://" not in link]
    assert len(links) >= 10
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}: no such file"
        assert not anchor or anchor in _anchors(target), f"README links to {link}: no such heading"
