"""Render the table-driven cases of `tests/package/test_validation.py` and `tests/tools/test_cli_bad_inputs.py` into
`docs/reliability.md`.

    python docs/gen_reliability.py          # rewrite the generated part of the page
    python docs/gen_reliability.py --check  # exit 1 if the page is out of date

Run from the repository root. Each case is *run* (not copied): the bad setting,
policy option, policy output or command line of the test's table is tried, and the
table shows the error it raises now. A message that no longer matches the test's own
expectation stops the script, so the page cannot drift from the tests.
"""

from __future__ import annotations

import re
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import generated_section  # docs/generated_section.py: the marked part of the page, --check

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reliability.md"


def _error_of(action: Callable[[], object], expected: str) -> str:
    """The `Type: message` that `action` raises, checked against the test's regex."""
    try:
        action()
    except Exception as err:  # the table's cases raise ValueError or PolicyOutputError
        text = f"{type(err).__name__}: {err}"
        if not re.search(expected, str(err)):
            raise SystemExit(f"{text!r} no longer matches the test's expectation {expected!r}") from err
        return text
    raise SystemExit(f"no error for a case that expects {expected!r}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _settings(settings: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in settings.items())


def tables() -> str:
    sys.path.insert(0, str(ROOT))
    from tests.package import test_validation as tv
    from vasepatch import VaSEConfig, policies

    rows = ["| Settings (`VaSEConfig(...)` or `vasepatch.patch(model, ...)`) | Outcome |", "|---|---|"]
    for settings, _param, expected in tv.BAD_CONFIGS:
        rows.append(f"| `{_settings(settings)}` | {_cell(_error_of(lambda s=settings: VaSEConfig(**s), expected))} |")
    rows += ["", "| Policy options (at `patch`) | Outcome |", "|---|---|"]
    for settings, expected in tv.BAD_POLICY_OPTIONS:

        def build(s: dict = settings) -> object:
            return policies.for_config(VaSEConfig(budget=64, window=8, **s))

        rows.append(f"| `{_settings(settings)}` | {_cell(_error_of(build, expected))} |")
    rows += ["", "| A policy's picks at an eviction (batch 3, keep 8 of 12) | Outcome |", "|---|---|"]
    kept = tv._kept(tv.Rewritten(lambda i, v: i)).shape[-1]
    rows.append(f"| correct picks | accepted: {kept} slots kept per row and KV head (8 picked + the window) |")
    for bug, rewrite, expected in tv.BAD_OUTPUTS:
        outcome = _error_of(lambda r=rewrite: tv._kept(tv.Rewritten(r)), expected)
        rows.append(f"| {bug} | {_cell(outcome)} |")
    return "\n".join([*rows, "", cli_table()])


def cli_table() -> str:
    """Every bad command line of `tests/tools/test_cli_bad_inputs.py` and the one line it gets (exit status 2),
    with the temporary paths shown as the table's placeholders."""
    from transformers.utils import logging as hf_logging

    from tests.tools import test_cli_bad_inputs as tc

    hf_logging.disable_progress_bar()  # saving the tiny model
    rows = ["| Command line (`vasepatch ...`; exit status 2, before any work) | Error (stderr) |", "|---|---|"]
    with tempfile.TemporaryDirectory(prefix="vasepatch-gen-") as tmp:
        root = Path(tmp)
        (root / "paths").mkdir()
        paths = tc.placeholder_paths(root / "paths", tc.save_tiny_model(root / "tiny-model"))
        never = root / "never"
        for argv, expected in tc.BAD_INPUTS:
            code, err = tc.run_cli(tc.command_line(argv, paths, never))
            if code != 2 or not re.search(expected, err):
                raise SystemExit(f"vasepatch {argv}: exit {code}, {err!r} no longer matches {expected!r}")
            for placeholder, path in [*paths.items(), ("<out>", str(never))]:
                err = err.replace(path, placeholder)
            shown = shlex.join(argv).replace("\udcff", "\\xff") or "(no arguments)"
            rows.append(f"| `{_cell(shown)}` | {_cell(err.strip().removeprefix('vasepatch: error: '))} |")
    return "\n".join(rows)


if __name__ == "__main__":
    generated_section.main(__doc__, Path(__file__).name, PAGE, "tests/package/test_validation.py", tables)
