"""Markdown tables of result rows: `markdown_table` for files, `aligned_table` for a terminal.

A row is a dict; `columns` name the keys shown, in order. Floats show 4 significant digits,
lists as comma-separated values, `None` and NaN as a dash; `SHOWN_AS` columns in another unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return "—" if value is None else str(value)


SHOWN_AS = {"kv_bytes": ("kv_mib", 2**20)}
"""Columns shown in another unit in the tables (the JSON keeps the raw value): header, divisor."""


def _shown(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> tuple[list[str], list[list[Any]]]:
    """The headers and values of the table cells, with `SHOWN_AS` applied."""
    headers = [SHOWN_AS.get(c, (c, 1))[0] for c in columns]
    values = []
    for row in rows:
        line = []
        for c in columns:
            value, scale = row.get(c), SHOWN_AS.get(c, (c, 1))[1]
            line.append(value / scale if scale != 1 and isinstance(value, (int, float)) else value)
        values.append(line)
    return headers, values


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    headers, values = _shown(rows, columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in line) + " |" for line in values]
    return "\n".join(lines) + "\n"


def aligned_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """The markdown table with padded columns (numbers right-aligned): readable in a terminal as it is."""
    headers, values = _shown(rows, columns)
    cells = [[_cell(v) for v in line] for line in values]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [bool(values) and all(_is_number(line[i]) for line in values) for i in range(len(columns))]

    def line(texts: Sequence[str]) -> str:
        padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(texts, widths, numeric, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = "|".join(("-" * (w + 1) + ":") if num else "-" * (w + 2) for w, num in zip(widths, numeric, strict=True))
    return "\n".join([line(headers), "|" + rule + "|", *(line(r) for r in cells)])


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
