"""Evaluation harness: fidelity to the full cache, accuracy on reasoning tasks and pass-key retrieval.

`vasepatch eval fidelity` (`fidelity.run`, `probe`; its settings `fidelity_settings.FidelitySettings`)
and `vasepatch eval task` (`task.run`, `passkey` for `--task passkey`; its settings
`task_settings.TaskSettings`); the pieces (the options the commands share, `cli_options`; data,
pass-key prompts, metrics, grading, teacher forcing, resumable answers, progress bars, reports,
plots, `replot` of written results) are separate modules usable on their own. The plot style and
the markdown tables are shared with `vasepatch bench`: `vasepatch.reporting`.
"""
