"""`vasepatch bench`: decode throughput and memory of KV caches, methods interleaved.

`run_benchmark(BenchSettings(...))` returns the results as a dict (callable without
the CLI, e.g. from a GPU check script); `report.write(result, out)` writes
`bench.json`, `bench.md` and the plots. Parts: `settings` (options, method
names; the cache settings are one `VaSEConfig`), `shapes` (random-weight model
shapes), `methods` (how each method builds its cache and steps), `measure`
(timing and memory of one method), `workers` (where a method runs: its own
process or this one), `runner` (interleaving the methods), `summary` (result
rows), `report`, `cli`.

`run_benchmark` and `summarise` (their modules import torch) are imported on first use (PEP 562), so that
`vasepatch bench --help` and its usage errors do not wait for torch; `from vasepatch.bench import run_benchmark`
works as with an eager import.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from vasepatch.bench.settings import BenchSettings, MethodSpec

if _TYPE_CHECKING:
    from vasepatch.bench.runner import run_benchmark
    from vasepatch.bench.summary import summarise

_LAZY = {"run_benchmark": "vasepatch.bench.runner", "summarise": "vasepatch.bench.summary"}
"""Public name -> the module it comes from, imported on first use (these import torch)."""

__all__ = ["BenchSettings", "MethodSpec", "run_benchmark", "summarise"]


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'vasepatch.bench' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included (before their first use too), without the helpers."""
    return sorted({name for name in globals() if not name.startswith("_") or name.startswith("__")} | set(__all__))
