"""The figures of the eval commands, in the shared style (`vasepatch.reporting.style`).

Each `*_figure(results, header)` builds a matplotlib `Figure` from what the command
writes to JSON (so `vasepatch.eval.replot` redraws committed results), and each
`*_plot(...)` returns `plot(path)`, run by `report.write` (which selects the Agg backend).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vasepatch.reporting import style

Plot = Callable[[Path], None]
KL_WIDTH = 32  # generated positions averaged per point of the KL curve


def _title(what: str, header: dict[str, Any], tokens: float | list[float] | None) -> str:
    return style.title(what, header.get("model", "?"), header["budget"], header.get("window"), tokens)


def _saver(build: Callable[[], Any]) -> Plot:
    def plot(path: Path) -> None:
        style.save(build(), path)

    return plot


def _kl_curves(ax, results: list[dict[str, Any]]) -> None:
    import torch

    curves = []
    for r in results:
        if r["policy"] == "full":
            continue
        kl = torch.tensor(r["kl_by_position"])
        n = len(kl) // KL_WIDTH * KL_WIDTH
        smooth = kl[:n].view(-1, KL_WIDTH).mean(-1)
        curves.append((r["policy"], (torch.arange(len(smooth)) * KL_WIDTH + KL_WIDTH / 2).tolist(), smooth.tolist()))
    style.lines(ax, curves, first=len(results) - len(curves))  # `full` (first, if there) has no curve
    ax.set(
        xlabel="generated position",
        ylabel=f"KL(full || policy), mean over prompts and {KL_WIDTH} tokens",
        yscale="log",
    )


def _agreement_bars(ax, rows: list[dict[str, Any]]) -> None:
    ordered = sorted(rows, key=lambda r: r["top1_agreement"])
    ax.barh(
        [r["policy"] for r in ordered],
        [r["top1_agreement"] for r in ordered],
        xerr=[r["top1_stderr"] for r in ordered],
        color=[style.series(rows.index(r))["color"] for r in ordered],
    )
    lo = min(r["top1_agreement"] for r in ordered)
    ax.set(xlabel="top-1 agreement with the full cache (± s.e.)", xlim=(max(0.0, lo - 0.05), 1.0))
    ax.grid(axis="x", alpha=0.3)


def fidelity_figure(results: list[dict[str, Any]], header: dict[str, Any]):
    """KL against the generated position, and top-1 agreement per policy."""
    fig, axes = style.subplots(1, 2, panel=(6.5, 4.8))
    _kl_curves(axes[0][0], results)
    _agreement_bars(axes[0][1], results)
    return style.finish(fig, _title("Fidelity to the full cache", header, header.get("longest_sequence")))


def fidelity_plot(results: list[dict[str, Any]], header: dict[str, Any]) -> Plot:
    return _saver(lambda: fidelity_figure(results, header))


def probe_figure(results: list[dict[str, Any]], header: dict[str, Any]):
    """Top-1 agreement per policy, ours beside the probe file's reference implementation."""
    fig, axes = style.subplots(1, 1, panel=(9, 4.8))
    ax = axes[0][0]
    y = list(range(len(results)))
    ours = [r["top1_agreement"] for r in results]
    errs = [r["top1_stderr"] for r in results]
    ax.barh([v - 0.2 for v in y], ours, height=0.4, xerr=errs, label="vasepatch", color="C0")
    ref = [(v, r["reference_implementation"]) for v, r in zip(y, results, strict=True)]
    ref = [(v, a) for v, a in ref if a is not None]
    ax.barh([v + 0.2 for v, _ in ref], [a for _, a in ref], height=0.4, label="reference implementation", color="C1")
    ax.set_yticks(y, [r["policy"] for r in results])
    ax.set(xlabel="top-1 agreement with the full cache", xlim=(max(0.0, min(ours) - 0.05), 1.0))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    return style.finish(fig, _title("Fixed probe", header, header.get("longest_sequence")))


def probe_plot(results: list[dict[str, Any]], header: dict[str, Any]) -> Plot:
    return _saver(lambda: probe_figure(results, header))


def task_tokens(results: list[dict[str, Any]], header: dict[str, Any]) -> float | None:
    """The full-cache length of a task run: its header's `longest_sequence`, else (results
    written before it was recorded) the `full` row's KV bytes over the bytes per token."""
    if "longest_sequence" in header:
        return header["longest_sequence"]
    full = [r for r in results if r["policy"] == "full"]
    if full and header.get("kv_bytes_per_token"):
        return round(full[0]["kv_bytes"] / header["kv_bytes_per_token"])
    return None


def budget_curves(results: list[dict[str, Any]], header: dict[str, Any]) -> dict[str, list[tuple[int, dict]]]:
    """Per policy run at more than one budget (`vase` at the run's budget, `vase@64`, ...): its rows by budget."""
    curves: dict[str, list[tuple[int, dict]]] = {}
    for row in results:
        name, _, budget = row["policy"].partition("@")
        if name != "full":
            curves.setdefault(name, []).append((int(budget) if budget else header.get("budget", 0), row))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in curves.items() if len(points) > 1}


def _budget_axis(ax, results: list[dict[str, Any]], curves: dict[str, list[tuple[int, dict]]]) -> None:
    """Accuracy against the budget, with 95% intervals; the full cache's accuracy as a band."""
    for i, (name, points) in enumerate(curves.items()):
        budgets = [b for b, _ in points]
        acc = [100 * r["accuracy"] for _, r in points]
        bounds = [[100 * x for x in r.get("ci95", [r["accuracy"]] * 2)] for _, r in points]
        low = [max(0.0, a - lo) for a, (lo, _) in zip(acc, bounds, strict=True)]  # rounding: never below zero
        high = [max(0.0, hi - a) for a, (_, hi) in zip(acc, bounds, strict=True)]
        ax.errorbar(budgets, acc, yerr=[low, high], capsize=3, label=name, **style.series(i))
    for row in (r for r in results if r["policy"] == "full"):
        lo, hi = row.get("ci95", [row["accuracy"]] * 2)
        ax.axhspan(100 * lo, 100 * hi, color="0.85", label="full (95% interval)")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="budget (KV pairs kept)", ylabel="accuracy (%), 95% interval")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def task_figure(results: list[dict[str, Any]], header: dict[str, Any]):
    """Accuracy and KV memory per run; and accuracy against the budget where a policy ran at several."""
    curves = budget_curves(results, header)
    fig, axes = style.subplots(1, 3 if curves else 2, panel=(5.5, 4.2))
    ax1, ax2 = axes[0][:2]
    names = [r["policy"] for r in results]
    colors = [style.series(i)["color"] for i in range(len(results))]
    acc, err = [100 * r["accuracy"] for r in results], [100 * r["stderr"] for r in results]
    ax1.bar(names, acc, yerr=err, capsize=3, color=colors)
    ax1.set(ylabel="accuracy (%) ± s.e.", ylim=(0, max(5.0, max(a + e for a, e in zip(acc, err, strict=True)) * 1.1)))
    ax2.bar(names, [r["kv_bytes"] / 2**20 for r in results], color=colors)
    style.memory_axis(ax2, "KV MiB per sequence")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    if curves:
        _budget_axis(axes[0][2], results, curves)
    task = header.get("task", "task")
    return style.finish(fig, _title(f"Accuracy on {task}", header, task_tokens(results, header)))


def task_plot(results: list[dict[str, Any]], header: dict[str, Any]) -> Plot:
    return _saver(lambda: task_figure(results, header))


def passkey_figure(results: list[dict[str, Any]], by_depth: list[dict[str, Any]], header: dict[str, Any]):
    """Accuracy against the key's depth: one line per policy (each its own marker and dash,
    nudged sideways so that coinciding lines stay visible), one panel per context length."""
    lengths = sorted({r["context_length"] for r in by_depth})
    names = list(dict.fromkeys(r["policy"] for r in by_depth))
    prompt = {r["context_length"]: r["prompt_tokens"] for r in results}
    fig, axes = style.subplots(1, len(lengths), panel=(5, 4.3), sharey=True)
    for ax, length in zip(axes[0], lengths, strict=True):
        curves = []
        for i, name in enumerate(names):
            rows = [r for r in by_depth if r["policy"] == name and r["context_length"] == length]
            nudge = (i - (len(names) - 1) / 2) * 0.01
            curves.append((name, [r["depth"] + nudge for r in rows], [100 * r["accuracy"] for r in rows]))
        style.lines(ax, curves)
        held = f", {prompt[length] / header['budget']:.1f}x" if length in prompt else ""
        ax.set(title=f"{length}-token prompts{held}", xlabel="depth of the key (0 = start, 1 = end)", ylim=(-5, 105))
    axes[0][0].set(ylabel="accuracy (%)")
    tokens = [prompt[n] for n in lengths if n in prompt] or [float(n) for n in lengths]
    what = f"Pass-key retrieval (prefill={header.get('prefill', 'keep')})"
    return style.finish(fig, _title(what, header, tokens), legend_below=True)


def passkey_plot(results: list[dict[str, Any]], by_depth: list[dict[str, Any]], header: dict[str, Any]) -> Plot:
    return _saver(lambda: passkey_figure(results, by_depth, header))
