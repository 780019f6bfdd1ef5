"""Evaluation harness: fidelity to the full cache, accuracy on reasoning tasks and pass-key retrieval.

`vasepatch eval fidelity` (`fidelity.run`, `probe`) and `vasepatch eval task`
(`task.run`, `passkey` for `--task passkey`); the pieces (shared options, data,
pass-key prompts, metrics, grading, teacher forcing, resumable answers, progress
bars, reports, plots and their shared `style`, `replot` of written results) are
separate modules usable on their own.
"""
