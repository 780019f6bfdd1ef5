"""The figures of eval and bench share one style: a title naming the model, the budget and the
compression; lines told apart by marker and line style; memory axes from zero. Checked on the
matplotlib Figure objects (Agg backend), built from synthetic rows and from committed results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from vasepatch.eval import plots, replot
from vasepatch.reporting import bench_figures, style

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
HEADER = {"model": "tiny", "budget": 16, "window": 4, "longest_sequence": 64, "task": "gsm8k"}


@pytest.fixture(autouse=True)
def agg():
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    matplotlib.use("Agg")
    yield
    plt.close("all")
    matplotlib.use(backend)


def _styles(ax) -> list[tuple[str, object]]:
    return [(line.get_marker(), line.get_linestyle()) for line in ax.get_lines() if line.get_label()[0] != "_"]


def _title(fig) -> str:
    return fig._suptitle.get_text().replace("\n", " ")


def test_series_styles_differ_for_twenty_series():
    pairs = [(style.series(i)["marker"], style.series(i)["linestyle"]) for i in range(20)]
    assert len(set(pairs)) == 20
    assert all(0 < style.series(i)["alpha"] < 1 for i in range(3))


def test_compression_text():
    assert style.compression(926, 192) == "4.8x compression (926 tokens)"
    assert style.compression([512.0, 1536.0, 1024.0], 256) == "2.0x-6.0x compression (512-1536 tokens)"
    assert style.compression(None, 256) == "compression not recorded"
    assert style.title("What", "m", 128, 32, 640) == "What\nm · budget 128 (window 32) · 5.0x compression (640 tokens)"


def _fidelity_rows(names: list[str]) -> list[dict]:
    return [
        {"policy": n, "kl_by_position": [0.1 * (i + 1)] * 96, "top1_agreement": 0.9, "top1_stderr": 0.01}
        for i, n in enumerate(names)
    ]


def test_fidelity_figure_titled_and_coinciding_lines_distinct():
    names = ["full", "vase", "vase-dkv", "snapkv", "rkv", "random"]
    rows = _fidelity_rows(names)
    rows[2]["kl_by_position"] = rows[1]["kl_by_position"]  # vase and vase-dkv coincide
    fig = plots.fidelity_figure(rows, HEADER)
    assert _title(fig) == "Fidelity to the full cache tiny · budget 16 (window 4) · 4.0x compression (64 tokens)"
    kl = fig.axes[0]
    assert [t.get_text() for t in kl.get_legend().get_texts()] == names[1:]  # full is the reference: no curve
    assert len(set(_styles(kl))) == len(names) - 1


def test_task_figure_memory_axis_from_zero():
    rows = [
        {"policy": p, "accuracy": a, "stderr": 0.05, "kv_bytes": b}
        for p, a, b in (("full", 0.5, 900 * 2**20), ("vase", 0.4, 890 * 2**20))
    ]
    fig = plots.task_figure(rows, HEADER)
    memory = fig.axes[1]
    assert memory.get_ylim()[0] == 0 and "MiB" in memory.get_ylabel()
    assert fig.axes[0].get_ylim()[0] == 0
    assert "Accuracy on gsm8k" in _title(fig) and "budget 16" in _title(fig) and "compression" in _title(fig)


def test_passkey_figure_per_length_compression_and_one_legend():
    by_depth = [
        {"policy": p, "context_length": n, "depth": d, "accuracy": 1.0, "n": 2}
        for p in ("full", "vase", "snapkv")
        for n in (64, 128)
        for d in (0.0, 1.0)
    ]
    results = [{"policy": "full", "context_length": n, "prompt_tokens": n + 1} for n in (64, 128)]
    fig = plots.passkey_figure(results, by_depth, {**HEADER, "prefill": "compress"})
    assert "4.1x-8.1x compression" in _title(fig)
    assert [ax.get_title() for ax in fig.axes] == ["64-token prompts, 4.1x", "128-token prompts, 8.1x"]
    for ax in fig.axes:
        assert len(set(_styles(ax))) == 3  # identical accuracies, still three distinct lines
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)


def test_bench_figures_from_the_committed_results():
    result = json.loads((RESULTS / "bench-cpu" / "bench.json").read_text())
    memory = bench_figures.figure(result, bench_figures.MEMORY, "KV and peak memory")
    title = _title(memory)
    assert "smollm2-135m" in title and "budget 512 (window 64)" in title and "2.2x-16.2x compression" in title
    drawn: dict[str, tuple] = {}
    for ax in memory.axes:
        assert ax.get_ylim()[0] == 0  # the peak was drawn from 890 MiB before
        labels = [line.get_label() for line in ax.get_lines() if line.get_label()[0] != "_"]
        styles = _styles(ax)
        assert len(set(styles)) == len(labels)  # distinct within a panel
        for label, look in zip(labels, styles, strict=True):  # and a method's own in every panel (batch 8 skips one)
            assert drawn.setdefault(label, look) == look
    assert set(drawn) == set(result["settings"]["methods"])


def test_replot_redraws_committed_results(tmp_path):
    folder = tmp_path / "qwen-gsm8k"
    folder.mkdir()
    shutil.copy(RESULTS / "qwen-gsm8k" / "gsm8k.json", folder)
    assert replot.replot(folder) == [folder / "gsm8k.png"]
    assert (folder / "gsm8k.png").stat().st_size > 0
    content = json.loads((folder / "gsm8k.json").read_text())
    # written before `longest_sequence` was: the full cache's length from its KV bytes
    assert plots.task_tokens(content["results"], content["config"]) == 409
