"""The PNG plots of the eval commands: each `*_plot(results)` returns `plot(path)`, run by
`report.write` (which selects matplotlib's Agg backend first)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Plot = Callable[[Path], None]
KL_WIDTH = 32  # generated positions averaged per point of the KL curve


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kl_curves(ax, results: list[dict[str, Any]]) -> None:
    for r in results:
        if r["policy"] == "full":
            continue
        kl = torch.tensor(r["kl_by_position"])
        n = len(kl) // KL_WIDTH * KL_WIDTH
        smooth = kl[:n].view(-1, KL_WIDTH).mean(-1)
        ax.plot(torch.arange(len(smooth)) * KL_WIDTH + KL_WIDTH / 2, smooth, label=r["policy"])
    ax.set(
        xlabel="generated position",
        ylabel=f"KL(full || policy), mean over prompts and {KL_WIDTH} tokens",
        yscale="log",
    )
    ax.legend(fontsize=7, ncol=2)


def fidelity_plot(results: list[dict[str, Any]]) -> Plot:
    """KL against the generated position, and top-1 agreement per policy."""

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
        _kl_curves(ax1, results)
        ordered = sorted(results, key=lambda r: r["top1_agreement"])
        ax2.barh(
            [r["policy"] for r in ordered],
            [r["top1_agreement"] for r in ordered],
            xerr=[r["top1_stderr"] for r in ordered],
        )
        lo = min(r["top1_agreement"] for r in ordered)
        ax2.set(xlabel="top-1 agreement with the full cache", xlim=(max(0.0, lo - 0.05), 1.0))
        _save(fig, path)

    return plot


def probe_plot(results: list[dict[str, Any]]) -> Plot:
    """Top-1 agreement per policy, ours beside the probe file's reference implementation."""

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        y = list(range(len(results)))
        ours = [r["top1_agreement"] for r in results]
        ax.barh([v - 0.2 for v in y], ours, height=0.4, xerr=[r["top1_stderr"] for r in results], label="vasepatch")
        ref = [(v, r["reference_implementation"]) for v, r in zip(y, results, strict=True)]
        ref = [(v, a) for v, a in ref if a is not None]
        ax.barh([v + 0.2 for v, _ in ref], [a for _, a in ref], height=0.4, label="reference implementation")
        ax.set_yticks(y, [r["policy"] for r in results])
        ax.set(xlabel="top-1 agreement with the full cache", xlim=(max(0.0, min(ours) - 0.05), 1.0))
        ax.legend(fontsize=8)
        _save(fig, path)

    return plot


def task_plot(results: list[dict[str, Any]]) -> Plot:
    """Accuracy and KV memory per policy."""

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["policy"] for r in results]
        ax1.bar(names, [100 * r["accuracy"] for r in results], yerr=[100 * r["stderr"] for r in results], capsize=3)
        ax1.set(ylabel="accuracy (%) ± s.e.")
        ax2.bar(names, [r["kv_bytes"] / 2**20 for r in results])
        ax2.set(ylabel="KV MiB per sequence")
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", rotation=30)
        _save(fig, path)

    return plot


MARKERS = ("o", "s", "^", "v", "D", "P", "X")
DASHES = ("-", "--", ":", "-.")


def passkey_plot(by_depth: list[dict[str, Any]], title: str = "") -> Plot:
    """Accuracy against the key's depth: one line per policy (each its own marker and dash,
    nudged sideways so that coinciding lines stay visible), one panel per context length."""

    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        lengths = sorted({r["context_length"] for r in by_depth})
        names = list(dict.fromkeys(r["policy"] for r in by_depth))
        fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4.3), sharey=True, squeeze=False)
        for ax, length in zip(axes[0], lengths, strict=True):
            for i, name in enumerate(names):
                rows = [r for r in by_depth if r["policy"] == name and r["context_length"] == length]
                nudge = (i - (len(names) - 1) / 2) * 0.01
                style = dict(marker=MARKERS[i % len(MARKERS)], linestyle=DASHES[i % len(DASHES)], label=name)
                ax.plot([r["depth"] + nudge for r in rows], [100 * r["accuracy"] for r in rows], **style)
            ax.set(title=f"{length} tokens", xlabel="depth of the key (0 = start, 1 = end)", ylim=(-5, 105))
        axes[0][0].set(ylabel="accuracy (%)")
        axes[0][-1].legend(fontsize=8)
        if title:
            fig.suptitle(title)
        _save(fig, path)

    return plot
