"""Answer extraction and grading.

GSM8K and AIME answers are numbers: the model's final answer (the last
`\\boxed{...}`, else the last number in the text) is parsed to a number and
compared with the reference (`|a - b| <= 1e-6 * max(1, |b|)`). MATH answers are
graded with HuggingFace's `math-verify` (symbolic equivalence of LaTeX answers;
install `vasepatch[eval]`), with a plain normalised-string comparison as the
fallback when it is not installed. Pass keys are exact: the first 5-digit number
of the answer (not part of a longer number) must be the key.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FIVE_DIGITS = re.compile(r"(?<![0-9])[0-9]{5}(?![0-9])")
_FRAC = re.compile(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: the last boxed expression, else the last number in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> float | None:
    """A number from an answer string: drops `$`, `%`, thousands commas, `\\text{...}`
    units and LaTeX spacing; understands `a/b` and `\\frac{a}{b}`. None if no number."""
    if text is None:
        return None
    s = re.sub(r"\\text\{[^}]*\}|\\[,;!]|\\%|\\\$|\\left|\\right|[$%]", "", text)
    s = s.replace("\\cdot", "*").strip()
    frac = _FRAC.search(s)
    if frac:
        num, den = float(frac.group(1)), float(frac.group(2))
        return num / den if den else None
    numbers = _NUMBER.findall(s)
    if not numbers:
        return None
    token = numbers[-1].replace(",", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return float(num) / float(den) if float(den) else None
        return float(token)
    except ValueError:
        return None


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def grade_numeric(completion: str, gold: str) -> tuple[str | None, bool]:
    """(extracted answer, correct) for numeric tasks (GSM8K, AIME)."""
    extracted = extract_answer(completion)
    return extracted, numbers_equal(parse_number(extracted), parse_number(gold))


def _normalise(s: str) -> str:
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\s+|\$", "", s)
    return s.rstrip(".").lower()


def grade_math(completion: str, gold: str) -> tuple[str | None, bool]:
    """(extracted answer, correct) for MATH-style LaTeX answers."""
    extracted = last_boxed(completion)
    if extracted is None:
        extracted = extract_answer(completion)
    if extracted is None:
        return None, False
    try:
        from math_verify import parse, verify
    except ImportError:
        return extracted, _normalise(extracted) == _normalise(gold)
    gold_parsed = parse(f"${gold}$")
    pred_parsed = parse(f"${extracted}$")
    if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed):
        return extracted, True
    return extracted, _normalise(extracted) == _normalise(gold)


def grade_passkey(completion: str, key: str) -> tuple[str | None, bool]:
    """(first 5-digit number of the answer, whether it is the key)."""
    found = _FIVE_DIGITS.search(completion)
    extracted = found.group(0) if found else None
    return extracted, extracted is not None and extracted == key


GRADERS = {"gsm8k": grade_numeric, "aime25": grade_numeric, "math500": grade_math, "passkey": grade_passkey}
METHODS = {"gsm8k": "numeric", "aime25": "numeric", "passkey": "exact key"}
MATH_VERIFY = "math-verify, else normalised string"
STRING_ONLY = "normalised string only (math-verify not installed)"


def has_math_verify() -> bool:
    """Whether `math_verify` can be imported (MATH answers are then checked symbolically)."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def method(task: str) -> str:
    """How the answers of `task` are graded now: `numeric`, `exact key`, or for MATH-500 `MATH_VERIFY`
    or `STRING_ONLY` (math-verify not installed: a symbolically equal answer in another form counts wrong)."""
    if task == "math500":
        return MATH_VERIFY if has_math_verify() else STRING_ONLY
    return METHODS.get(task, "unknown")


def describe(methods: list[str | None]) -> str:
    """The grading of a set of answers (one method per answer; None: written before it was recorded)."""
    counts: dict[str, int] = {}
    for m in methods:
        counts[m or "not recorded"] = counts.get(m or "not recorded", 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return "mixed: " + "; ".join(f"{n} answers by {m}" for m, n in counts.items())


def grade(task: str, completion: str, gold: str) -> tuple[str | None, bool]:
    """Grade `completion` against `gold` with the grader of `task`."""
    try:
        return GRADERS[task](completion, gold)
    except KeyError:
        raise ValueError(f"no grader for task {task!r}; tasks: {', '.join(GRADERS)}") from None
