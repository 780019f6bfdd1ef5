"""What users run: the `vasepatch` command (`cli`, its argument checks in `cli_args`), `generate`, the
`demo`, the streamed output (`streaming`) and the thread count (`threads`). `vasepatch.eval`,
`vasepatch.bench` and `vasepatch.reporting` are the evaluation and benchmark tools beside them, and
`vasepatch.models` the registered real models."""
