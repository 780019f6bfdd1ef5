"""Fidelity metrics, loop detection and graders against hand-computed answers."""

from __future__ import annotations

import math

import pytest
import torch

from vasepatch.eval import grading, metrics


def test_identical_distributions_score_perfectly():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    m = metrics.next_token_metrics(logits, logits.clone(), targets)
    assert m["kl"].abs().max() < 1e-6 and m["top1"].min() == 1 and m["nll_delta"].abs().max() < 1e-6


def test_kl_top1_and_nll_delta_hand_computed():
    p, q = torch.tensor([0.75, 0.25]), torch.tensor([0.25, 0.75])
    m = metrics.next_token_metrics(p.log(), q.log(), torch.tensor(0))
    assert m["kl"].item() == pytest.approx(0.75 * math.log(3) + 0.25 * math.log(1 / 3), abs=1e-6)
    assert m["top1"].item() == 0.0
    assert m["nll_delta"].item() == pytest.approx(math.log(0.75 / 0.25), abs=1e-6)
    # logits are shift-invariant
    assert metrics.next_token_metrics(p.log() + 7, q.log(), torch.tensor(1))["top1"].item() == 0.0


def test_loop_detection():
    period7 = [3, 1, 4, 1, 5, 9, 2] * 60
    assert metrics.loop_period(period7) == 7 and metrics.is_looping(period7)
    g = torch.Generator().manual_seed(0)
    assert not metrics.is_looping(torch.randint(0, 1000, (600,), generator=g).tolist())
    assert metrics.loop_period([5] * 256) is None  # too short to judge: needs > span tokens
    assert metrics.loop_period([5] * 257) == 1
    # a prefix of free text followed by a loop that fills the last 256 tokens
    text = torch.randint(0, 1000, (300,), generator=g).tolist()
    assert metrics.loop_period(text + [1, 2, 3] * 90) == 3
    # one corrupted token in ten still counts (threshold 0.9), one in three does not
    noisy = [t if i % 10 else 999 for i, t in enumerate([1, 2] * 200)]
    assert metrics.is_looping(noisy)
    assert not metrics.is_looping([t if i % 3 else 999 + i for i, t in enumerate([1, 2] * 200)])


def test_first_divergence_and_mean_stderr():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2
    assert metrics.first_divergence([], [1]) == 0
    mean, se = metrics.mean_stderr([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx(math.sqrt((4 * 0.25 / 3) / 4))
    assert metrics.mean_stderr([2.0]) == (2.0, 0.0)


@pytest.mark.parametrize(
    ("completion", "gold", "correct"),
    [
        ("so the answer is \\boxed{18}.", "18", True),
        ("\\boxed{\\$1,234.50}", "1234.5", True),
        ("\\boxed{18 \\text{ dollars}}", "18", True),
        ("\\boxed{75\\%}", "75", True),
        ("\\boxed{\\frac{3}{4}}", "0.75", True),
        ("\\boxed{3/4}", "0.75", True),
        ("\\boxed{-5}", "-5", True),
        ("\\boxed{18.0}", "18", True),
        ("The total is 1,000 apples.", "1000", True),  # no box: the last number
        ("First 12, then \\boxed{13}, finally 14", "13", True),  # the box wins over later numbers
        ("\\boxed{17}", "18", False),
        ("\\boxed{\\text{no idea}}", "18", False),
        ("nothing numeric here", "18", False),
        ("\\boxed{18} \\boxed{19}", "18", False),  # the last box counts
    ],
)
def test_numeric_grader(completion, gold, correct):
    assert grading.grade("gsm8k", completion, gold)[1] is correct


@pytest.mark.parametrize(
    ("completion", "gold", "correct"),
    [
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
        ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", True),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", False),
        ("no box, answer 7", "8", False),
    ],
)
def test_math_grader(completion, gold, correct):
    assert grading.grade("math500", completion, gold)[1] is correct


def test_last_boxed_balances_braces():
    assert grading.last_boxed("a \\boxed{\\frac{a}{b}} b") == "\\frac{a}{b}"
    assert grading.last_boxed("\\boxed{unclosed") is None
    assert grading.last_boxed("none") is None
    with pytest.raises(ValueError, match="no grader"):
        grading.grade("hellaswag", "x", "y")
