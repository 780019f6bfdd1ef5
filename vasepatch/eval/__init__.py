"""Evaluation harness: fidelity to the full cache and accuracy on reasoning tasks.

`vasepatch eval fidelity` (`fidelity.run`) and `vasepatch eval task`
(`task.run`); the pieces (data, metrics, grading, teacher forcing, reports) are
separate modules usable on their own.
"""
