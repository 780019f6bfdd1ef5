"""The figures of a `vasepatch bench` result (the dict written as `bench.json`): `throughput.png`
(decode tok/s against the generated length) and `memory.png` (KV and peak MiB), one panel per batch
size. `vasepatch bench` draws them at the end of a run, `python -m vasepatch.eval.replot` from the JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vasepatch.reporting import style


def figure(result: dict[str, Any], panels: list[tuple[str, str, bool]], what: str):
    """One row per `(key, label, memory)` of `panels` (memory axes start at zero), one column per
    batch size, one styled line per method; titled with the model, budget and compression."""
    s = result["settings"]
    methods = list(dict.fromkeys(r["method"] for r in result["results"]))
    fig, axes = style.subplots(len(panels), len(s["batch"]), panel=(5.5, 3.8))
    for col, batch in enumerate(s["batch"]):
        for row, (key, label, memory) in enumerate(panels):
            ax = axes[row][col]
            curves, styles = [], []  # a method keeps its style in every panel, even where others are missing
            for i, method in enumerate(methods):
                pts = [
                    (r["length"], r[key])
                    for r in result["results"]
                    if r["batch"] == batch and r["method"] == method and r[key] is not None
                ]
                if pts:
                    curves.append((method, [x for x, _ in pts], [y for _, y in pts]))
                    styles.append(i)
            style.lines(ax, curves, styles=styles)
            ax.set_xscale("log", base=2)
            ax.set_xticks(s["tokens"], [str(n) for n in s["tokens"]])
            ax.set(xlabel="generated tokens", ylabel=label, title=f"batch {batch}")
            if memory:
                style.memory_axis(ax, label)
            else:
                ax.set_ylim(bottom=0)
    tokens = [float(s["prompt_len"] + n) for n in s["tokens"]]
    return style.finish(fig, style.title(what, s["model"], s["budget"], s["window"], tokens))


THROUGHPUT = [("tok_s", "decode tok/s (median)", False)]
MEMORY = [("kv_mib", "KV cache MiB", True), ("peak_mib", "peak MiB (timed steps)", True)]


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """`throughput.png` and `memory.png` under `out` (matplotlib's Agg backend)."""
    style.use_agg()
    paths = [out / "throughput.png", out / "memory.png"]
    style.save(figure(result, THROUGHPUT, "Decode throughput"), paths[0])
    style.save(figure(result, MEMORY, "KV and peak memory"), paths[1])
    return paths
