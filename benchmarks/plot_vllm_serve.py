"""The figure of `benchmarks/vllm_serve.py` runs: output tok/s (with its ratio to `full`) and inter-token
latency per method, for every workload, pool and request rate, side by side.

    .venv/bin/python benchmarks/plot_vllm_serve.py docs/results/vllm-serve/w2-pool2 docs/results/vllm-serve/w2-pool4 \\
        --labels W2,W2 --out docs/results/vllm-serve/w2.png

Each argument is a folder holding a `results.json` of `vllm_serve.py` (one run per method, pool and rate).
Runs in the main venv (matplotlib, the `bench` extra); it reads only the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vasepatch.reporting import style


def groups(folders: list[Path], labels: list[str]) -> list[tuple[str, list[dict[str, Any]]]]:
    """`(title, runs)` per workload, pool and rate, in the order met; each group's runs by method as run."""
    found: dict[str, list[dict[str, Any]]] = {}
    for folder, label in zip(folders, labels, strict=True):
        for run in json.loads((folder / "results.json").read_text())["runs"]:
            if "output_throughput" not in run:  # a run that failed is in the table, not in the figure
                continue
            title = f"{label}, pool {run['pool_fits']} full ({run['pool_blocks']} blocks), rate {run['rate']}"
            found.setdefault(title, []).append(run)
    return list(found.items())


def figure(found: list[tuple[str, list[dict[str, Any]]]], suptitle: str):
    """Two panels: output tok/s per method and group, each bar labelled with its ratio to `full`; ITL p50
    (bars) and p99 (markers) in ms."""
    methods = list(dict.fromkeys(run["method"] for _, runs in found for run in runs))
    fig, axes = style.subplots(1, 2, panel=(max(6.5, 1.7 * len(found)), 4.2))  # room for every group's label
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        xs, tok, ratio, p50, p99 = [], [], [], [], []
        for g, (_, runs) in enumerate(found):
            run = next((r for r in runs if r["method"] == method), None)
            if run is not None:
                xs.append(g + (i - (len(methods) - 1) / 2) * width)
                tok.append(run["output_throughput"])
                ratio.append(run.get("vs_full"))
                p50.append(run["p50_itl_ms"])
                p99.append(run["p99_itl_ms"])
        colour = style.series(i)["color"]
        bars = axes[0, 0].bar(xs, tok, width, label=method, color=colour, alpha=style.ALPHA)
        for bar, r in zip(bars, ratio, strict=True):
            if r is not None:
                axes[0, 0].annotate(f"{r:.2f}x", (bar.get_x() + width / 2, bar.get_height()), ha="center",
                                    va="bottom", fontsize=7)  # fmt: skip
        axes[0, 1].bar(xs, p50, width, label=method, color=colour, alpha=style.ALPHA)
        axes[0, 1].scatter(xs, p99, color=colour, marker="_", s=120, linewidths=2)
    names = [title.replace(", pool", "\npool").replace(", rate", "\nrate") for title, _ in found]
    for ax, label in zip(axes[0], ("output tok/s (label: vs full)", "ITL ms: p50 (bar), p99 (tick)"), strict=True):
        ax.set_xticks(range(len(found)), names, fontsize=7)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(fontsize=7)
    return style.finish(fig, suptitle)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="folders with a results.json of vllm_serve.py")
    p.add_argument("--labels", help="one label per folder, comma-separated (default: the folders' names)")
    p.add_argument("--title", default="vLLM's serving benchmark, one fixed KV pool per server")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [f.name for f in args.folders]
    if len(labels) != len(args.folders):
        p.error(f"--labels: {len(labels)} labels for {len(args.folders)} folders")
    style.use_agg()
    found = groups(args.folders, labels)
    if not found:
        p.error("no finished runs in the folders given")
    style.save(figure(found, args.title), args.out)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
