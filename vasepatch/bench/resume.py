"""`vasepatch bench --resume DIR`: read `DIR/bench.json` and check its whole structure before any work.

Every problem (a file that is missing, not JSON, or whose settings, methods, warm-ups, segments or
errors have the wrong shape) is a `ValueError` whose one-line message names the file and the field;
the file is only read here, never written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_INT, _NUMBER, _STR, _BOOL = "an int", "a number", "a string", "a bool"

# the `settings` keys `BenchSettings.to_dict` writes, and what each must be (`None` allowed where listed)
SETTINGS: dict[str, tuple[str, bool]] = {
    "model": (_STR, False),
    "tokens": ("ints", False),
    "budget": (_INT, False),
    "window": (_INT, False),
    "batch": ("ints", False),
    "methods": ("strings", False),
    "prompt_len": (_INT, False),
    "repeats": (_INT, False),
    "steps": (_INT, True),
    "dtype": (_STR, True),
    "device": (_STR, False),
    "seed": (_INT, True),
    "threads": (_INT, True),
    "isolate": (_STR, False),
    "mask": (_STR, False),
    "skip": ("strings", False),
    "out": (_STR, False),
}
WARMUP = {"method": (_STR, False), "batch": (_INT, False), "prefill_s": (_NUMBER, False)}
WARMUP |= {"warmup_s": (_NUMBER, False), "graphs": (_INT, False)}
SEGMENT = {"method": (_STR, False), "batch": (_INT, False), "length": (_INT, False), "repeat": (_INT, False)}
SEGMENT |= {"tok_s": (_NUMBER, False), "kv_bytes": (_NUMBER, False), "peak_bytes": (_NUMBER, False)}
SEGMENT |= {"eviction_share": (_NUMBER, True), "evicting_steps": (_INT, False), "graphs": (_INT, False)}
ERROR = {"method": (_STR, False), "batch": (_INT, True), "stage": (_STR, False), "error": (_STR, False)}


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a bool", type(None): "null"}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    return names.get(type(value), type(value).__name__)


def _is(value: Any, kind: str) -> bool:
    if kind == _STR:
        return isinstance(value, str)
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == _INT:
        return isinstance(value, int)
    return isinstance(value, (int, float))


class _Checker:
    """Checks values of one file; `fail(where, what)` raises the one-line error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> None:
        raise ValueError(f"resume: {self.path}: {where} {what}; it is not a bench.json this version can resume")

    def value(self, where: str, value: Any, kind: str, nullable: bool) -> None:
        if value is None and nullable:
            return
        if kind in ("ints", "strings"):
            item = _INT if kind == "ints" else _STR
            if not isinstance(value, list):
                self.fail(where, f"must be a list of {kind}, got {_kind(value)}")
            for i, v in enumerate(value):
                if not _is(v, item):
                    self.fail(f"{where}[{i}]", f"must be {item}, got {_kind(v)}")
        elif not _is(value, kind):
            self.fail(where, f"must be {kind}{' or null' if nullable else ''}, got {_kind(value)}")

    def record(self, where: str, record: Any, fields: dict[str, tuple[str, bool]], exact: bool = False) -> None:
        if not isinstance(record, dict):
            self.fail(where, f"must be an object, got {_kind(record)}")
        missing = [k for k in fields if k not in record]
        if missing:
            self.fail(where, f"lacks {', '.join(map(repr, missing))}")
        unknown = [k for k in record if k not in fields] if exact else []
        if unknown:
            self.fail(where, f"has unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(fields)}")
        for k, (kind, nullable) in fields.items():
            self.value(f"{where}.{k}", record[k], kind, nullable)

    def records(self, result: dict[str, Any], key: str, fields: dict[str, tuple[str, bool]]) -> None:
        value = result.get(key, [])
        if not isinstance(value, list):
            self.fail(f'"{key}"', f"must be a list, got {_kind(value)}")
        for i, record in enumerate(value):
            self.record(f"{key}[{i}]", record, fields)


def _settings(check: _Checker, stored: Any) -> dict[str, Any]:
    if not isinstance(stored, dict):
        check.fail('"settings"', f"must be an object, got {_kind(stored)}")
    stored = {"skip": [], **stored}
    optional = {k: v for k, v in SETTINGS.items() if k in stored}  # older files may lack some
    check.record("settings", stored, optional, exact=True)
    return stored


def check_result(path: Path, result: Any) -> dict[str, Any]:
    """`result` (the parsed `bench.json` at `path`) if its structure is one `run_benchmark` can resume;
    otherwise a `ValueError` naming the file and the first field that is wrong."""
    check = _Checker(path)
    if not isinstance(result, dict):
        check.fail("the top level", f"must be a JSON object, got {_kind(result)}")
    if "settings" not in result:
        check.fail("the top level", 'lacks "settings"')
    result = {**result, "settings": _settings(check, result["settings"])}
    methods = result.get("methods", {})
    if not isinstance(methods, dict) or not all(isinstance(v, dict) for v in methods.values()):
        check.fail('"methods"', f"must be an object of method name -> object, got {_kind(methods)}")
    check.records(result, "warmups", WARMUP)
    check.records(result, "segments", SEGMENT)
    check.records(result, "errors", ERROR)
    for key, kind in (("wall_s", _NUMBER), ("started", _STR)):
        if key in result:
            check.value(f'"{key}"', result[key], kind, False)
    if "resumed" in result:
        check.value('"resumed"', result["resumed"], "strings", False)
    return result


def read(directory: str) -> tuple[Path, dict[str, Any]]:
    """`(path, result)` of `DIR/bench.json`, checked (`check_result`); a one-line `ValueError` otherwise."""
    folder = Path(directory)
    path = folder / "bench.json"
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise ValueError(f"resume: {directory} {what}; --resume takes the folder of a bench run (its --out)")
    if not path.is_file():
        what = "is a folder" if path.exists() else "does not exist"
        raise ValueError(f"resume: {path} {what}; --resume takes the folder of a bench run (its --out)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"resume: {path} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"resume: {path} cannot be read ({err.strerror})") from None
    try:
        result = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"resume: {path} is not valid JSON (line {err.lineno} column {err.colno}: {err.msg})"
        ) from None
    return path, check_result(path, result)
