"""Redraw the PNGs of written results from their JSON, in the current style (nothing is rerun).

    python -m vasepatch.eval.replot docs/results/smollm2-fidelity docs/results/bench-cpu ...
        [--probe FILE]

Each folder may hold `fidelity.json`, `probe.json`, `passkey.json`, `bench.json` or the JSON of a
task (`gsm8k.json`, `math500.json`, `aime25.json`); the PNG beside it is replaced. Results
written before the probe's sequence length was recorded take it from `--probe` (the probe file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vasepatch.eval import grading, plots
from vasepatch.reporting import bench_figures, style

TASK_STEMS = tuple(name for name in sorted(grading.GRADERS) if name != "passkey")


def _probe_length(header: dict[str, Any], probe_file: str | None) -> dict[str, Any]:
    """`header` with `longest_sequence` from the probe file, if it was not recorded."""
    if "longest_sequence" in header or probe_file is None:
        return header
    probe = json.loads(Path(probe_file).read_text())
    return {**header, "longest_sequence": len(probe["prompt_ids"]) + len(probe["reference_tokens"])}


def replot(folder: Path, probe_file: str | None = None) -> list[Path]:
    """Redraw every known result of `folder`; returns the PNGs written."""
    style.use_agg()
    written = []
    for stem in ("fidelity", "probe", "passkey", *TASK_STEMS):
        path = folder / f"{stem}.json"
        if not path.is_file():
            continue
        content = json.loads(path.read_text())
        header, results = content["config"], content["results"]
        if stem == "fidelity":
            fig = plots.fidelity_figure(results, header)
        elif stem == "probe":
            fig = plots.probe_figure(results, _probe_length(header, probe_file))
        elif stem == "passkey":
            fig = plots.passkey_figure(results, content["by_depth"], header)
        else:
            fig = plots.task_figure(results, header)
        style.save(fig, folder / f"{stem}.png")
        written.append(folder / f"{stem}.png")
    bench = folder / "bench.json"
    if bench.is_file():
        written += bench_figures.plot(json.loads(bench.read_text()), folder)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m vasepatch.eval.replot", description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="folders of written results")
    p.add_argument("--probe", default=None, help="the probe file, for probe results without a recorded length")
    args = p.parse_args(argv)
    for folder in args.folders:
        paths = replot(folder, args.probe)
        if not paths:
            raise SystemExit(f"{folder}: no fidelity/probe/passkey/task/bench JSON found")
        for path in paths:
            print(path)


if __name__ == "__main__":
    main()
