"""Paired comparisons of an evaluation's runs: every run answered the same problems with the same sampling
seeds, so two runs are compared answer by answer, not as two independent samples.

- `wilson`: a 95% interval of an accuracy (Wilson's score interval; right near 0 and 1, unlike mean ± 2 SE).
- `mcnemar`: the exact McNemar test of two paired runs: of the answers that one run got right and the other
  wrong (`b` and `c`), how likely a split at least this uneven is if both runs were equally good (two-sided,
  binomial with p = 1/2 over `b + c`).
- `difference`: the paired difference of accuracy with its 95% interval (the normal approximation over the
  per-answer differences) and McNemar's p.
- `tables`: every run against each reference policy (`against`, default `full` and `vase`) at the run's own
  budget (`reference_of`), where that ran, as a report table.

Answers are paired by their record's `(id, sample)`. With several samples per problem the pairs of one
problem are not independent, so the p-values are then optimistic; the study uses one sample per problem.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Z95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal
REFERENCES = ("full", "vase")
COLUMNS = ("run", "against", "n", "accuracy", "reference_accuracy", "difference", "ci95", "b", "c", "mcnemar_p")


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of `correct` successes in `n` trials; `(0, 1)` when `n` is 0."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if correct == 0 else max(0.0, centre - half)  # exact at the ends, whatever the rounding
    return low, 1.0 if correct == n else min(1.0, centre + half)


def mcnemar(b: int, c: int) -> float:
    """The exact two-sided McNemar p-value of `b` answers right only in one run and `c` right only in the other."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def difference(run: Sequence[bool], reference: Sequence[bool]) -> dict[str, Any]:
    """`run` against `reference`, answer by answer (the same length, the same order)."""
    if len(run) != len(reference):
        raise ValueError(f"paired runs need as many answers each, got {len(run)} and {len(reference)}")
    n = len(run)
    b = sum(1 for x, y in zip(run, reference, strict=True) if x and not y)
    c = sum(1 for x, y in zip(run, reference, strict=True) if y and not x)
    diff = (b - c) / n if n else 0.0
    var = ((b + c) / n - diff * diff) / max(n - 1, 1) if n else 0.0
    half = Z95 * math.sqrt(max(var, 0.0))
    return {
        "n": n,
        "accuracy": sum(map(bool, run)) / n if n else 0.0,
        "reference_accuracy": sum(map(bool, reference)) / n if n else 0.0,
        "difference": diff,
        "ci95": [diff - half, diff + half],
        "b": b,
        "c": c,
        "mcnemar_p": mcnemar(b, c),
    }


def _by_answer(records: Sequence[dict[str, Any]]) -> dict[tuple, bool]:
    return {(r["id"], r["sample"]): bool(r["correct"]) for r in records}


def reference_of(run: str, against: str, ran: Sequence[str]) -> str | None:
    """The run that `run` is paired with for the reference policy `against`, or None: `against` at `run`'s own
    budget (`snapkv@64` against `vase` is paired with `vase@64`; `snapkv` with `vase`), `full` as it is (it keeps
    everything), and a policy at its own budget with the policy at the default one (`vase@64` with `vase`: what
    the smaller budget costs). None where that run did not run, or is `run` itself."""
    policy, at, budget = run.partition("@")
    reference = against if against == "full" or not at or policy == against else f"{against}@{budget}"
    return reference if reference != run and reference in ran else None


def rows(
    names: Sequence[str], per_run: Sequence[Sequence[dict[str, Any]]], against: Sequence[str] = REFERENCES
) -> list[dict[str, Any]]:
    """Every run against each reference policy of `against` (`reference_of`), on the answers both have."""
    answers = {name: _by_answer(records) for name, records in zip(names, per_run, strict=True)}
    out = []
    for policy in against:
        for name in names:
            reference = reference_of(name, policy, names)
            if reference is None:
                continue
            shared = [k for k in answers[name] if k in answers[reference]]
            pair = difference([answers[name][k] for k in shared], [answers[reference][k] for k in shared])
            out.append({"run": name, "against": reference, **pair})
    return out


def tables(
    names: Sequence[str], per_run: Sequence[Sequence[dict[str, Any]]], against: Sequence[str] = REFERENCES
) -> dict[str, tuple[list, tuple]]:
    """`{"paired": (rows, COLUMNS)}` for a report, or nothing when no run has a reference among `names`."""
    found = rows(names, per_run, against)
    return {"paired": (found, COLUMNS)} if found else {}
