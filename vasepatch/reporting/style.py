"""One look for every figure of the eval and bench commands (and `benchmarks/occupancy_figure.py`).

Readers compare lines that often coincide (`vase` and `vase-dkv` at the same accuracy), so
each series gets its own colour, marker and line style, drawn slightly transparent; memory
axes start at zero so that small gaps look small; and every figure carries a title naming
the model, the budget and the compression.

The compression of a run is the length the full cache would hold divided by the budget
(a 926-token sequence under a budget of 192 is a 4.8x compression), as in `docs/results.md`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
LINESTYLES: tuple[Any, ...] = ("-", "--", ":", "-.")
ALPHA = 0.85
DPI = 110


def series(i: int) -> dict[str, Any]:
    """Plot keywords of the `i`-th series: colour, marker and line style cycle at different
    periods (10, 10, 4), so the first 20 series never share a (marker, line style) pair."""
    return {
        "color": f"C{i % 10}",
        "marker": MARKERS[i % len(MARKERS)],
        "linestyle": LINESTYLES[i % len(LINESTYLES)],
        "alpha": ALPHA,
        "markersize": 5,
        "linewidth": 1.6,
    }


def _ratio(value: float) -> str:
    return f"{value:.1f}x"


def compression(tokens: float | list[float] | None, budget: int) -> str:
    """`"4.8x compression (926 tokens)"` for one full-cache length, `"2.0x-6.0x compression
    (512-1536 tokens)"` for several, `"compression not recorded"` for none."""
    if tokens is None or tokens == []:
        return "compression not recorded"
    lengths = sorted(tokens) if isinstance(tokens, list) else [tokens]
    lo, hi = lengths[0], lengths[-1]
    if lo == hi:
        return f"{_ratio(lo / budget)} compression ({lo:.0f} tokens)"
    return f"{_ratio(lo / budget)}-{_ratio(hi / budget)} compression ({lo:.0f}-{hi:.0f} tokens)"


def title(what: str, model: str, budget: int, window: int | None, tokens: float | list[float] | None) -> str:
    """The figure's title, two lines: `<what>` over `<model> · budget B (window W) · <compression>`."""
    cache = f"budget {budget}" + ("" if window is None else f" (window {window})")
    return f"{what}\n{model} · {cache} · {compression(tokens, budget)}"


def subplots(nrows: int = 1, ncols: int = 1, *, panel: tuple[float, float] = (5.5, 4.0), **kwargs: Any):
    """`plt.subplots` with a grid of panels of size `panel` (inches), always a 2-D `axes` array."""
    import matplotlib.pyplot as plt

    size = (panel[0] * ncols, panel[1] * nrows)
    return plt.subplots(nrows, ncols, figsize=size, squeeze=False, **kwargs)


def lines(
    ax, curves: list[tuple[str, list[float], list[float]]], first: int = 0, styles: list[int] | None = None
) -> None:
    """One styled line per `(label, xs, ys)` (styles `series(first)` on, so that a series keeps
    its colour in a neighbouring panel that also shows the ones left out here; or `series(styles[i])`
    for the `i`-th curve), a grid, a legend."""
    for i, (label, xs, ys) in enumerate(curves):
        ax.plot(xs, ys, label=label, **series(first + i if styles is None else styles[i]))
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=7, ncol=2 if len(curves) > 6 else 1)


def memory_axis(ax, label: str = "KV MiB") -> None:
    """A memory axis: labelled, from zero (small gaps must look small)."""
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)


def finish(fig, suptitle: str, legend_below: bool = False):
    """The figure's title (each line wrapped to the figure's width) and a tight layout; with
    `legend_below`, one legend for all panels (those of the first) under them. Returns `fig`."""
    import textwrap

    width = max(40, int(fig.get_figwidth() * 12))
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in suptitle.split("\n")), fontsize=11)
    bottom = 0.0
    if legend_below:
        handles, labels = fig.axes[0].get_legend_handles_labels()
        for ax in fig.axes:
            if ax.get_legend() is not None:
                ax.get_legend().remove()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
        bottom = 0.06 * (1 + (len(labels) - 1) // 6) * 4.3 / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def save(fig, path: Path) -> None:
    """The PNG at `DPI`, then the figure closed."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def use_agg() -> None:
    """Render off-screen (no display needed, same output everywhere)."""
    import matplotlib

    matplotlib.use("Agg")
