"""What the tools share to show their results. `vasepatch.eval` and `vasepatch.bench` never import
each other; what both need lives here: `style` (one look for every figure), `tables` (markdown
tables of result rows) and `bench_figures` (the throughput and memory figures of a `bench.json`,
drawn by `vasepatch bench` and redrawn by `python -m vasepatch.eval.replot`).
"""
