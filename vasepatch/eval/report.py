"""Write the results of an eval command as JSON, a markdown table and a PNG plot."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vasepatch.reporting.tables import aligned_table, markdown_table


def _setting(value: Any) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def write(
    out: Path,
    stem: str,
    config: dict[str, Any],
    results: list[dict[str, Any]],
    columns: Sequence[str],
    title: str,
    plot: Callable[[Path], None] | None = None,
    tables: dict[str, tuple[list[dict[str, Any]], Sequence[str]]] | None = None,
    echo: bool = False,
) -> list[Path]:
    """`<stem>.json` (`{"config", "results", **tables}`), `<stem>.md` (the results, then each
    of `tables`: `{name: (rows, columns)}`) and, with `plot`, `<stem>.png`. With `echo`, the
    results table is printed too (what a command shows when it ends)."""
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
        from vasepatch.reporting import style

        style.use_agg()
        png = out / f"{stem}.png"
        plot(png)
        paths.append(png)
    if echo:
        print(f"\n{title} ({settings})\n\n{aligned_table(results, columns)}\n\nwritten: {', '.join(map(str, paths))}")
    return paths
