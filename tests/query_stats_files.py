"""Query statistics files for the tests: random but valid files of any shape, for a policy that reads one.

A policy with a `stats` option (`triattention`) needs a file of calibrated query statistics
(`vasepatch.policies.query_stats`) whose shapes fit the model or the test case: `layers` layers (a row's
`head_ids` is `layer * kv_heads + global KV head`), `q_heads` query heads, `kv_heads` KV heads and head size
`head_dim` (`head_dim // 2` RoPE frequency pairs, 0 for a head size of 1). `options_for` gives the policy
options that name such a file, so that a test over every registered policy stays generic:

    policies.get(name, **options_for(name, layers=1, q_heads=4, kv_heads=2, head_dim=8))

Each shape's file is written once per process, under a folder of this process in the temporary directory,
removed at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch

from vasepatch import policies
from vasepatch.policies import query_stats

STATS_OPTION = "stats"
_FOLDER = Path(tempfile.gettempdir()) / f"vasepatch-test-stats-{os.getpid()}"
_written: dict[tuple[int, int, int, int, int], Path] = {}


def stats_tensors(layers: int, q_heads: int, head_dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a statistics file (`query_stats.TENSORS`): random mean queries, mean magnitudes at least
    the mean's (`q_abs >= |q_mean|` per pair), RoPE's inverse frequencies `1 / 10000 ** (2 i / D)` and an
    attention scaling of 1."""
    g = torch.Generator().manual_seed(seed)
    pairs = head_dim // 2
    q_mean = torch.randn(layers, q_heads, pairs, 2, generator=g)
    q_abs = q_mean.norm(dim=-1) + torch.rand(layers, q_heads, pairs, generator=g)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(pairs, dtype=torch.float64) * 2 / head_dim)
    return {
        "q_mean": q_mean,
        "q_abs": q_abs,
        "inv_freq": inv_freq.float().expand(layers, pairs).clone(),
        "scaling": torch.ones(layers),
    }


def stats_file(layers: int, q_heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> Path:
    """A valid statistics file for these shapes (written by `query_stats.save_stats`), the same path for the
    same arguments within a process."""
    key = (layers, q_heads, kv_heads, head_dim, seed)
    if key not in _written or not _written[key].is_file():
        if not _written:
            atexit.register(shutil.rmtree, _FOLDER, True)
        name = f"l{layers}-q{q_heads}-kv{kv_heads}-d{head_dim}-s{seed}.safetensors"
        tensors = stats_tensors(layers, q_heads, head_dim, seed)
        _written[key] = query_stats.save_stats(_FOLDER / name, tensors, kv_heads, {"model": "random test statistics"})
    return _written[key]


def needs_stats(name: str) -> bool:
    """Whether the registered policy `name` reads a statistics file (it has a `stats` option)."""
    return STATS_OPTION in policies.get(name).options


def options_for(name: str, *, layers: int, q_heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> dict:
    """The policy options a test passes to `name`: `{"stats": path}` of a file of these shapes for a policy
    with a `stats` option, `{}` for any other."""
    if not needs_stats(name):
        return {}
    return {STATS_OPTION: str(stats_file(layers, q_heads, kv_heads, head_dim, seed))}
