"""The calibrated query statistics that `triattention` reads: the tensors, and the file that holds them.

The file is safetensors (no code runs on load), with these tensors for a model of `L` layers, `Hq` query
heads, `Hkv` KV heads and head size `D` (`F = D / 2` RoPE frequency pairs, half-split):

- `q_mean` `[L, Hq, F, 2]` float32: the mean pre-RoPE query per frequency pair (real, imaginary);
- `q_abs` `[L, Hq, F]` float32: the mean magnitude of each pair;
- `inv_freq` `[L, F]` float32: each layer's rotary inverse frequencies, after the rotary's scaling;
- `scaling` `[L]` float32: each layer's rotary attention scaling;

and string metadata: `format` (`FORMAT`), `kv_heads`, and what the calibration was (model, tokens, text).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

FORMAT = "vasepatch-query-stats-1"
TENSORS = ("q_mean", "q_abs", "inv_freq", "scaling")


@dataclass(frozen=True)
class QueryStats:
    """Calibrated statistics, one row per (layer, global KV head), `layer * kv_heads + head` (a policy's
    `head_ids`), each for the `G` query heads that share that KV head (query heads `head * G .. head * G + G - 1`):

    - `q_mean`: `[M, G, F, 2]` float32, the mean pre-RoPE query per frequency pair (real, imaginary);
    - `q_abs`: `[M, G, F]` float32, the mean magnitude of the pre-RoPE query's pair;
    - `inv_freq`: `[M, F]` float32, the rotary's inverse frequencies (after its scaling: linear, llama3, YaRN);
    - `scaling`: `[M]` float32, the rotary's attention scaling `a` (1 unless YaRN or longrope).
    """

    q_mean: Tensor
    q_abs: Tensor
    inv_freq: Tensor
    scaling: Tensor

    def rows(self, head_ids: Tensor) -> QueryStats:
        """The statistics of `head_ids` (`[B, H]` int64), each tensor indexed `[B, H, ...]`, on their device."""
        ids = head_ids.to(self.q_mean.device)
        picked = (t[ids].to(head_ids.device) for t in (self.q_mean, self.q_abs, self.inv_freq, self.scaling))
        return QueryStats(*picked)

    @classmethod
    def from_layers(cls, q_mean: Tensor, q_abs: Tensor, inv_freq: Tensor, scaling: Tensor, kv_heads: int) -> QueryStats:
        """Rows from the per-layer tensors of the file (`[L, Hq, F, 2]`, `[L, Hq, F]`, `[L, F]`, `[L]`)."""
        layers, q_heads, pairs = q_abs.shape
        if q_heads % kv_heads:
            raise ValueError(f"{q_heads} query heads are not a multiple of kv_heads={kv_heads}")
        group = q_heads // kv_heads
        return cls(
            q_mean.reshape(layers * kv_heads, group, pairs, 2).float(),
            q_abs.reshape(layers * kv_heads, group, pairs).float(),
            inv_freq.float().repeat_interleave(kv_heads, 0),
            scaling.float().repeat_interleave(kv_heads, 0),
        )


def save_stats(path: str | os.PathLike, tensors: dict[str, Tensor], kv_heads: int, metadata: dict[str, str]) -> Path:
    """Write the per-layer `tensors` (`TENSORS`, shapes in the module's docstring) to `path`, with `metadata`.
    The shapes are checked against each other first (ValueError naming the tensor)."""
    from safetensors.torch import save_file

    check_shapes(tensors, kv_heads)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    meta = {**{k: str(v) for k, v in metadata.items()}, "format": FORMAT, "kv_heads": str(kv_heads)}
    save_file({k: tensors[k].detach().float().contiguous().cpu() for k in TENSORS}, str(tmp), metadata=meta)
    os.replace(tmp, path)  # never a half-written file under the final name
    return path


def check_shapes(tensors: dict[str, Tensor], kv_heads: int) -> None:
    """The tensors of a statistics file fit together (ValueError naming the first that does not)."""
    missing = [k for k in TENSORS if k not in tensors]
    if missing:
        raise ValueError(f"query statistics lack {', '.join(missing)}")
    layers, q_heads, pairs = tensors["q_abs"].shape
    expected = {"q_mean": (layers, q_heads, pairs, 2), "inv_freq": (layers, pairs), "scaling": (layers,)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"query statistics: {name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"query statistics: {q_heads} query heads are not a multiple of kv_heads={kv_heads}")


def check_fits(
    stats: QueryStats,
    model: tuple[int, int, int],
    inv_freq: Tensor,
    scaling: Tensor,
    where: str,
    dtype: torch.dtype = torch.float32,
) -> None:
    """The statistics are for a model of `model` = `(layers, query heads, KV heads)` whose rotary has `inv_freq`
    `[L, F]` and `scaling` `[L]` (ValueError starting with `where`, naming what differs). A rotary kept in a
    lower precision (`dtype`) must hold the file's frequencies rounded to it."""
    layers, q_heads, kv_heads = model
    want = {"rows (layers x KV heads)": layers * kv_heads, "query heads per KV head": q_heads // kv_heads}
    got = {"rows (layers x KV heads)": stats.q_mean.shape[0], "query heads per KV head": stats.q_mean.shape[1]}
    want["frequency pairs"], got["frequency pairs"] = inv_freq.shape[1], stats.q_mean.shape[2]
    for what, value in want.items():
        if got[what] != value:
            raise ValueError(
                f"{where} has {got[what]} {what}, this model {value}: the statistics of another model (run "
                "`vasepatch calibrate` on this one)"
            )
    rows = torch.arange(layers) * kv_heads  # each layer's first row: every head of a layer has its rotary
    if dtype == torch.float32:
        same = torch.allclose(stats.inv_freq[rows], inv_freq.float(), rtol=1e-5, atol=0)
    else:
        same = torch.equal(stats.inv_freq[rows].to(dtype).float(), inv_freq.float())
    if not same or not torch.allclose(stats.scaling[rows], scaling.float(), rtol=1e-5, atol=0):
        raise ValueError(
            f"{where} was calibrated with another rotary (inverse frequencies or attention scaling) than this "
            "model's: its RoPE scaling changed since; calibrate it again"
        )


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a statistics file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_stats(path: str | os.PathLike) -> QueryStats:
    """The statistics in `path`, as rows (`QueryStats.from_layers`); read once per file version (path, size and
    modification time), so that a policy may call it at every eviction. A missing or foreign file is a
    ValueError naming the path and the command that writes one."""
    p = Path(path)
    if not str(path) or not p.is_file():
        where = f"no query statistics file at {str(path)!r}" if str(path) else "no query statistics file given"
        raise ValueError(
            f"{where}: triattention needs its model calibrated first (vasepatch calibrate MODEL), "
            "then patch() finds the file by itself, or pass policy_options={'stats': PATH}"
        )
    stat = p.stat()
    return _load(str(p.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, size: int, mtime_ns: int) -> QueryStats:
    from safetensors.torch import load_file

    try:
        meta = read_metadata(path)
    except Exception as exc:  # safetensors' own error types: the file is not one of its files
        raise ValueError(f"{path!r} is not a safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a vasepatch query statistics file (format {meta.get('format')!r})")
    tensors = load_file(path)
    kv_heads = int(meta["kv_heads"])
    check_shapes(tensors, kv_heads)
    return QueryStats.from_layers(*(tensors[k] for k in TENSORS), kv_heads=kv_heads)
