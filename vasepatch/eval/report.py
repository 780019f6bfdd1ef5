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
) -> list[Path]:
    """`<stem>.json` (`{"config", "results"}`), `<stem>.md` and, with `plot`, `<stem>.png`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    settings = ", ".join(f"{k}={v}" for k, v in config.items() if not isinstance(v, (dict, list)))
    paths[1].write_text(f"**{title}** ({settings})\n\n{markdown_table(results, columns)}")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        png = out / f"{stem}.png"
        plot(png)
        paths.append(png)
    return paths
