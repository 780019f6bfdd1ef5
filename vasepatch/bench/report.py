"""Write a benchmark result as `bench.json`, `bench.md`, `throughput.png` and `memory.png`
(the figures: `vasepatch.reporting.bench_figures`)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from vasepatch.reporting import bench_figures
from vasepatch.reporting.tables import markdown_table
from vasepatch.tools.cli_args import install_hint


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def _mib(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.3f}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def batch_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of one batch size's rows."""
    compiled = any(r["compile_speedup"] is not None for r in rows)
    columns = ["method", "generated", "tok/s median [min-max]", "vs dense", "vs floor", "KV MiB", "peak MiB"]
    columns.append("eviction share")
    if compiled:
        columns.append("compiled / eager")
    cells = []
    for r in rows:
        if r.get("skipped"):
            cell = dict.fromkeys(columns, "—")
            cell.update(method=r["method"], generated=str(r["length"]))
            cells.append({**cell, "tok/s median [min-max]": "not run (--skip)"})
            continue
        cell = {
            "method": r["method"],
            "generated": str(r["length"]),
            "tok/s median [min-max]": f"{r['tok_s']:.1f} [{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}]",
            "vs dense": _num(r["ratio_to_dense"]),
            "vs floor": _num(r.get("ratio_to_floor")),
            "KV MiB": _mib(r["kv_mib"]),
            "peak MiB": _mib(r["peak_mib"]),
            "eviction share": _share(r["eviction_share"]),
        }
        if compiled:
            cell["compiled / eager"] = _num(r["compile_speedup"])
        cells.append(cell)
    return markdown_table(cells, columns)


FLOOR_LINE = (
    "*vs floor*: tok/s over that of `floor`, the dense model whose `DynamicCache` holds just a `budget`-token "
    "prompt, timed over its first `steps` decode steps (an ideal fixed-size cache; compiled methods are compared "
    "with `floor+compile`, a `StaticCache` of that size, when it ran)."
)


def markdown(result: dict[str, Any]) -> str:
    """The whole report: settings, environment, one table per batch size, warm-ups, errors."""
    s, env = result["settings"], result["environment"]
    lines = [
        f"**Decode throughput and memory** (model {s['model']}, prompt {s['prompt_len']} tokens, "
        f"budget={s['budget']}, window={s['window']}, {s['steps']} timed steps per segment, "
        f"{s['repeats']} repeats, {s['dtype']}, {s['device']} — {env['device_name']}, {env['threads']} threads; "
        f"torch {env['torch']}, transformers {env['transformers']}; isolation: {env['isolation']}; "
        f"{result['wall_s']:.0f} s)",
        "",
        FLOOR_LINE,
        "",
    ]
    if not result.get("complete", True):
        lines += ["**Incomplete run** (interrupted, or still running): `vasepatch bench --resume DIR` finishes it.", ""]
    rows = result["results"]
    for batch in s["batch"]:
        batch_rows = [r for r in rows if r["batch"] == batch]
        if batch_rows:
            lines += [f"Batch {batch}:", "", batch_table(batch_rows)]
    if result["warmups"]:
        warm = [
            {
                "method": w["method"],
                "batch": str(w["batch"]),
                "prefill s": f"{w['prefill_s']:.2f}",
                "warm-up s": f"{w['warmup_s']:.2f}",
                "graphs compiled": str(w["graphs"]),
            }
            for w in result["warmups"]
        ]
        lines += [
            f"Warm-up ({s['steps']} decode steps after the prefill; compilation happens here):",
            "",
            markdown_table(warm, ["method", "batch", "prefill s", "warm-up s", "graphs compiled"]),
        ]
    recompiled = sorted({seg["method"] for seg in result["segments"] if seg["graphs"]})
    if recompiled:
        lines += [f"Recompiled during timed segments: {', '.join(recompiled)}.", ""]
    for err in result["errors"]:
        where = "" if err["batch"] is None else f" (batch {err['batch']}, {err['stage']})"
        lines.append(f"- **{err['method']}** failed{where}: {err['error']}")
    return "\n".join(lines).rstrip() + "\n"


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a temporary file, then `os.replace`)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(result: dict[str, Any], out: Path) -> list[Path]:
    """`bench.json` and `bench.md` under `out`, each replaced atomically; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    _replace(paths[0], json.dumps(result, indent=1) + "\n")
    _replace(paths[1], markdown(result))
    return paths


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """`bench.json`, `bench.md` (see `save`), `throughput.png` (decode tok/s vs generated length)
    and `memory.png` (KV and peak MiB vs generated length) under `out`; returns their paths."""
    paths = save(result, out)
    if result["results"] and importlib.util.find_spec("matplotlib") is not None:  # the `eval` extra brings it
        paths += bench_figures.plot(result, out)
    elif result["results"]:
        print(f"plots skipped: matplotlib is not installed ({install_hint('eval')})", file=sys.stderr)
    return paths
