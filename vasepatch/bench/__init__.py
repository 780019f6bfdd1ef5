"""`vasepatch bench`: decode throughput and memory of KV caches, methods interleaved.

`run_benchmark(Settings(...))` returns the results as a dict (callable without
the CLI, e.g. from a GPU check script); `report.write(result, out)` writes
`bench.json`, `bench.md` and the plots. Parts: `settings` (options, method
names), `shapes` (random-weight model shapes), `methods` (how each method
builds its cache and steps), `measure` (timing and memory of one method),
`runner` (worker processes, interleaving, summary), `report`, `cli`.
"""

from vasepatch.bench.runner import run_benchmark, summarise
from vasepatch.bench.settings import MethodSpec, Settings

__all__ = ["MethodSpec", "Settings", "run_benchmark", "summarise"]
