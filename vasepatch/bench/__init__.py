"""`vasepatch bench`: decode throughput and memory of KV caches, methods interleaved.

`run_benchmark(BenchSettings(...))` returns the results as a dict (callable without
the CLI, e.g. from a GPU check script); `report.write(result, out)` writes
`bench.json`, `bench.md` and the plots. Parts: `settings` (options, method
names; the cache settings are one `VaSEConfig`), `shapes` (random-weight model
shapes), `methods` (how each method builds its cache and steps), `measure`
(timing and memory of one method), `workers` (where a method runs: its own
process or this one), `runner` (interleaving the methods), `summary` (result
rows), `report`, `cli`.
"""

from vasepatch.bench.runner import run_benchmark
from vasepatch.bench.settings import BenchSettings, MethodSpec
from vasepatch.bench.summary import summarise

__all__ = ["BenchSettings", "MethodSpec", "run_benchmark", "summarise"]
