"""`summarise(settings, segments)`: one result row per method, batch size and generated length."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from vasepatch.bench.measure import MIB
from vasepatch.bench.settings import BenchSettings, MethodSpec

Segments = dict[int, dict[str, Any]]  # one method, batch and length: repeat -> segment


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(settings: BenchSettings, segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method, batch and length: decode tok/s median and min/max over repeats,
    the median per-repeat ratio to `dense`, to the floor (`floor+compile` for compiled methods
    when it ran, else `floor`) and to the eager method (for `+compile`), KV MiB, peak MiB and
    the eviction share (medians over repeats). A `--skip`ped row says so (`skipped`) and has
    no numbers."""
    by_key: dict[tuple[str, int, int], Segments] = defaultdict(dict)
    for seg in segments:
        by_key[seg["method"], seg["batch"], seg["length"]][seg["repeat"]] = seg
    rows = []
    for spec in settings.specs:
        for batch in settings.batch:
            for length in settings.tokens:
                key = {"method": spec.name, "batch": batch, "length": length}
                segs = by_key.get((spec.name, batch, length))
                if segs:
                    compiled_floor = spec.compile and by_key.get(("floor+compile", batch, length))
                    floor = "floor+compile" if compiled_floor else "floor"
                    ref = {
                        "dense": by_key.get(("dense", batch, length), {}),
                        "eager": by_key.get((spec.base, batch, length), {}),
                        "floor": by_key.get((floor, batch, length), {}),
                    }
                    rows.append({**key, **_row(spec, segs, ref)})
                elif settings.is_skipped(spec.name, batch, length):
                    rows.append({**key, **SKIPPED_ROW})
    return rows


SKIPPED_ROW: dict[str, Any] = {
    "skipped": True,
    **dict.fromkeys(("tok_s", "tok_s_min", "tok_s_max", "ratio_to_dense", "ratio_to_floor", "compile_speedup")),
    **dict.fromkeys(("kv_mib", "peak_mib", "eviction_share")),
    "evicting_steps": 0,
    "repeats": 0,
}


def _ratio(segs: Segments, ref: Segments) -> float | None:
    """Median over repeats of `tok_s / ref's tok_s` (the repeats both have)."""
    return _median([s["tok_s"] / ref[r]["tok_s"] for r, s in segs.items() if r in ref])


def _row(spec: MethodSpec, segs: Segments, ref: dict[str, Segments]) -> dict[str, Any]:
    """The measured columns of one row; `ref` holds the segments of `dense`, of the eager method
    (`spec.base`) and of the floor it is compared with."""
    tok_s = [s["tok_s"] for s in segs.values()]
    return {
        "tok_s": statistics.median(tok_s),
        "tok_s_min": min(tok_s),
        "tok_s_max": max(tok_s),
        "ratio_to_dense": _ratio(segs, ref["dense"]) if spec.name != "dense" else 1.0,
        "ratio_to_floor": _ratio(segs, ref["floor"]) if spec.base != "floor" else 1.0,
        "compile_speedup": _ratio(segs, ref["eager"]) if spec.compile else None,
        "kv_mib": _median([s["kv_bytes"] / MIB for s in segs.values()]),
        "peak_mib": _median([s["peak_bytes"] / MIB for s in segs.values()]),
        "eviction_share": _median([s["eviction_share"] for s in segs.values()]),
        "evicting_steps": sum(s["evicting_steps"] for s in segs.values()),
        "repeats": len(segs),
    }
