"""Write results as JSON, a markdown table and a PNG plot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return "—" if value is None else str(value)


def _setting(value: Any) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write(
    out: Path,
    stem: str,
    config: dict[str, Any],
    results: list[dict[str, Any]],
    columns: Sequence[str],
    title: str,
    plot: Callable[[Path], None] | None = None,
    tables: dict[str, tuple[list[dict[str, Any]], Sequence[str]]] | None = None,
) -> list[Path]:
    """`<stem>.json` (`{"config", "results", **tables}`), `<stem>.md` (the results, then each
    of `tables`: `{name: (rows, columns)}`) and, with `plot`, `<stem>.png`."""
    out.mkdir(parents=True, exist_ok=True)
    tables = tables or {}
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    content = {"config": config, "results": results, **{name: rows for name, (rows, _) in tables.items()}}
    paths[0].write_text(json.dumps(content, indent=2) + "\n")
    settings = ", ".join(f"{k}={_setting(v)}" for k, v in config.items() if not isinstance(v, dict))
    text = f"**{title}** ({settings})\n\n{markdown_table(results, columns)}"
    for name, (rows, cols) in tables.items():
        text += f"\n**{name}**\n\n{markdown_table(rows, cols)}"
    paths[1].write_text(text)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        png = out / f"{stem}.png"
        plot(png)
        paths.append(png)
    return paths
