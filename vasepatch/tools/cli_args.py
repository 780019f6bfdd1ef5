"""What the `vasepatch` commands share to check their input before any work.

- argparse `type=` functions for every numeric flag (`int_in`, `number_in`, `int_list`,
  `number_list`): a wrong type, NaN, infinity or a value out of range is a usage error
  naming the flag, the allowed range and the value, at parse time.
- `device`: a device this torch can use (`--device cuda` on a CPU-only build, `--device banana`); `cpu`,
  the default, is taken without importing torch.
- `policy_name`, `policy_names`, `policy_names_text`: the names `VaSEConfig.policy` takes (`full` first),
  for `--policy`/`--policies` help and errors, without importing torch (`BUILTIN_POLICIES`).
- `check_utf8`, `read_utf8`: text that is not UTF-8 (an argument, stdin) is refused with the byte
  and its offset, before any model loads.
- `output_dir`: an `--out` folder that can be created and written.
- `max_positions`, `check_positions`: the longest sequence a model takes, read from its config
  before the weights load where the model is a local folder.
- `install_hint`: the `pip install` line for an extra (see
  `vasepatch.errors.install_hint`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vasepatch.config import FULL, MAX_SLOTS, MIN_TEMPERATURE, SEED_RANGE
from vasepatch.errors import install_hint

__all__ = [
    "BUILTIN_POLICIES",
    "MAX_COUNT",
    "MIN_TEMPERATURE",
    "SEED_RANGE",
    "check_positions",
    "check_utf8",
    "device",
    "folder_problem",
    "install_hint",
    "int_in",
    "odd_int",
    "int_list",
    "max_positions",
    "number_in",
    "number_list",
    "output_dir",
    "policy_name",
    "policy_names",
    "policy_names_text",
    "read_utf8",
    "seed",
]

MAX_COUNT = MAX_SLOTS
"""The largest count a flag takes (tokens, lengths, batch sizes, slots): 2**31 - 1, what the kernels index."""


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if hi is None:
        return f"> {lo:g}" if lo_open else f">= {lo}"
    if lo is None:
        return f"<= {hi}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def int_in(lo: int | None = 1, hi: int | None = MAX_COUNT, what: str = "") -> Callable[[str], int]:
    """argparse type: an int in `[lo, hi]` (`None`: unbounded); `what` says what the number is."""
    allowed = _range_text(lo, hi)
    suffix = f" ({what})" if what else ""

    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int {allowed}{suffix}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an int {allowed}{suffix}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def odd_int(text: str) -> int:
    """argparse type: an odd int in [1, 2**31 - 1] (the width of a centred pool)."""
    what = f"must be an odd int in [1, {MAX_COUNT}] (the width of a centred average pool)"
    try:
        value = int(text.strip().replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
    if value < 1 or value > MAX_COUNT or value % 2 == 0:
        raise argparse.ArgumentTypeError(f"{what}, got {value}")
    return value


def seed(text: str) -> int:
    """argparse type: a seed torch's generator takes, an int in [-2**63, 2**64 - 1]."""
    return int_in(*SEED_RANGE, what="a seed torch.Generator takes")(text)


def number_in(
    lo: float | None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False, what: str = ""
) -> Callable[[str], float]:
    """argparse type: a finite number in the range (`lo_open`: `lo` itself excluded); NaN and inf are refused."""
    allowed = _range_text(lo, hi, lo_open, hi_open)
    suffix = f" ({what})" if what else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a finite number {allowed}{suffix}, got {text!r}") from None
        below = lo is not None and (value <= lo if lo_open else value < lo)
        above = hi is not None and (value >= hi if hi_open else value > hi)
        if not math.isfinite(value) or below or above:
            raise argparse.ArgumentTypeError(f"must be a finite number {allowed}{suffix}, got {text.strip()}")
        return value

    parse.__name__ = "number"
    return parse


def _listed(item: Callable[[str], Any], kind: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        parts = [x for x in text.split(",") if x.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind}s, got {text!r}")
        values = []
        for part in parts:
            try:
                values.append(item(part))
            except argparse.ArgumentTypeError as err:
                raise argparse.ArgumentTypeError(f"each of the comma-separated values {err}") from None
        return values

    parse.__name__ = f"{kind} list"
    return parse


def int_list(lo: int = 1, hi: int = MAX_COUNT) -> Callable[[str], list[int]]:
    """argparse type: comma-separated ints, each in `[lo, hi]`."""
    return _listed(int_in(lo, hi), "int")


def number_list(lo: float, hi: float) -> Callable[[str], list[float]]:
    """argparse type: comma-separated finite numbers, each in `[lo, hi]`."""
    return _listed(number_in(lo, hi), "number")


BUILTIN_POLICIES = (
    "cur", "evict-large", "knorm", "protect-random", "random", "rkv", "snapkv", "streaming", "triattention", "vase",
    "vase-dkv", "vase-l2", "vase-topk", "vase-var",
)  # fmt: skip
"""The policies `vasepatch.policies` registers, sorted: what `policies.available()` returns in a fresh process,
without importing torch (tests/tools/test_cli_startup.py keeps the two equal)."""


def policy_names() -> list[str]:
    """Every name `VaSEConfig.policy` takes, `full` first: the registry's (`policies.config_names()`) where
    `vasepatch.policies` is already imported (policies registered in this process included), else the
    built-in ones, which are the registry's in a fresh process."""
    registry = sys.modules.get("vasepatch.policies")
    if registry is not None and hasattr(registry, "config_names"):
        return list(registry.config_names())
    return [FULL, *BUILTIN_POLICIES]


def policy_names_text() -> str:
    """`full, cur, evict-large, ...`: the names for a `--policy` help text or an error."""
    return ", ".join(policy_names())


def policy_name(text: str) -> str:
    """argparse type of `--policy`: a name of `policy_names()`, else a usage error listing them."""
    name = text.strip()
    if name not in policy_names():
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; choose one of: {policy_names_text()}")
    return name


def available_devices() -> list[str]:
    """The devices this torch can run on: `cpu`, and `cuda`, `cuda:0`, ... where CUDA is available."""
    import torch

    names = ["cpu"]
    if torch.cuda.is_available():
        names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return names


def device(text: str) -> str:
    """argparse type: a device this torch can use (`cpu`, `cuda`, `cuda:N`), else a usage error naming those it has.
    `cpu` (every command's default, which argparse passes through here too) needs no check and no torch import;
    any other name imports torch to ask it."""
    if text == "cpu":
        return text
    import torch

    available = available_devices()
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; available here: {', '.join(available)}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise argparse.ArgumentTypeError(f"{text!r} is not available ({why}); available here: {', '.join(available)}")
    if parsed.type not in ("cpu", "cuda") and text not in available:  # mps where available; meta, xla, ...
        raise argparse.ArgumentTypeError(f"{text!r} is not available; available here: {', '.join(available)}")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise argparse.ArgumentTypeError(
            f"{text!r} is not available (no such GPU: {count} visible); available here: {', '.join(available)}"
        )
    return text


def _not_utf8(text: str) -> tuple[int, int] | None:
    """`(byte, offset)` of the first byte of `text` that is not UTF-8 (Python holds undecodable bytes of an
    argument as lone surrogates, `surrogateescape`), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        char = ord(text[err.start])
        byte = char - 0xDC00 if 0xDC80 <= char <= 0xDCFF else char
        return byte, len(text[: err.start].encode("utf-8", "surrogateescape"))
    return None


def check_utf8(argv: list[str]) -> None:
    """`ValueError` naming the first argument that is not UTF-8 text, the byte and its offset."""
    for i, arg in enumerate(argv):
        bad = _not_utf8(arg)
        if bad is not None:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise ValueError(
                f"argument {i + 1} ('{shown}') is not UTF-8 text: byte 0x{bad[0]:02x} at offset {bad[1]}; "
                "pass UTF-8 (e.g. convert it with iconv -t UTF-8)"
            )


def read_utf8(stream: Any, name: str = "stdin") -> str:
    """All of `stream` as text: its bytes decoded as UTF-8 (a `ValueError` naming `name`, the byte and its
    offset if they are not), or its text where it has no byte buffer."""
    buffer = getattr(stream, "buffer", None)
    if buffer is None:
        return stream.read()
    data = buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{name} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start}; "
            "pass UTF-8 (e.g. convert it with iconv -t UTF-8)"
        ) from None


def folder_problem(text: str) -> str | None:
    """Why `text` cannot be an output folder (exists as a file, cannot be created, cannot be written), or None.
    Nothing is left behind (the check makes a temporary folder in the nearest existing one and removes it)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        return f"{text} is a file, not a folder"
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return f"{text} cannot be created: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{text} cannot be written: no write permission on {existing}"
    return _write_problem(text, existing)


def _write_problem(text: str, existing: Path) -> str | None:
    """Whether a folder can really be made in `existing` (root passes every permission check, yet cannot
    write /proc or a read-only mount): a temporary folder is made there and removed at once."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vasepatch-check-", dir=existing))
    except OSError as err:
        return f"{text} cannot be written: {err.strerror or err} in {existing}"
    return None


def output_dir(text: str) -> str:
    """argparse type: a folder that exists or can be created, and can be written (checked, not created)."""
    problem = folder_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _config_positions(config: dict[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def max_positions(model: Any) -> int | None:
    """The longest sequence `model` takes (`max_position_embeddings`): a loaded model, or a name or path
    (`vasepatch.models` resolves it; its `config.json` is read, the weights are not loaded). None where
    unknown (a Hub id not yet local, a config without the field)."""
    if not isinstance(model, (str, os.PathLike)):
        config = getattr(model, "config", None)
        text = getattr(config, "text_config", None)
        for source in (config, text):
            value = getattr(source, "max_position_embeddings", None)
            if isinstance(value, int) and value > 0:
                return value
        return None
    if str(model).startswith("shape:"):
        return None
    from vasepatch import models

    folder = models.resolve(model)
    if isinstance(folder, str) or not (folder / "config.json").is_file():
        return None
    try:
        return _config_positions(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return None  # the load reports a broken folder


def check_positions(model_name: str, limit: int | None, needed: dict[str, int]) -> None:
    """`ValueError` if a sequence of `needed` (what: tokens) is longer than the model's `limit` positions."""
    if limit is None:
        return
    for what, tokens in needed.items():
        if tokens > limit:
            raise ValueError(
                f"{what} needs {tokens} positions, more than the {limit} that {model_name} takes "
                f"(its max_position_embeddings); lower it to fit"
            )
