"""Pass-key retrieval prompts: a 5-digit key hidden in filler text, generated from a seed.

Each prompt is an instruction, a haystack of repetitive neutral sentences with the
key's sentence placed after a `depth` fraction of them (0: before all the filler,
1: after it), and the question, in the model's chat template. Its length in tokens
of the model's tokenizer is brought as close to the target as whole filler
sentences allow (within half a sentence, unless the target is shorter than the
prompt without filler, which is an error). Nothing is downloaded; the key of
`(seed, length, index)` is always the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vasepatch.eval import data

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it: "
    "you will be asked for it at the end."
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"


@dataclass(frozen=True)
class Haystack:
    """One pass-key prompt: `prompt` (chat text, `n_tokens` tokens) hides `key` after
    `needle_at` of its `n_filler` filler sentences."""

    key: str
    depth: float
    n_filler: int
    needle_at: int
    prompt: str
    n_tokens: int


def pass_key(seed: int, length: int, index: int) -> str:
    """The 5-digit key of sample `index` at context length `length` (a pure function of the three)."""
    return str(random.Random(f"passkey:{seed}:{length}:{index}").randint(10000, 99999))


def needle_index(n_filler: int, depth: float) -> int:
    """How many filler sentences come before the key's sentence."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    return round(depth * n_filler)


def user_message(n_filler: int, depth: float, key: str) -> str:
    """Instruction, filler with the key's sentence at `depth`, question."""
    sentences = [FILLER[i % len(FILLER)] for i in range(n_filler)]
    sentences.insert(needle_index(n_filler, depth), NEEDLE.format(key=key))
    return f"{INSTRUCTION}\n\n{' '.join(sentences)}\n\n{QUESTION}"


class _Counter:
    """Token counts of the chat prompt with `n` filler sentences (memoised)."""

    def __init__(self, tokenizer, depth: float, key: str) -> None:
        self.tokenizer, self.depth, self.key = tokenizer, depth, key
        self.counts: dict[int, int] = {}

    def prompt(self, n: int) -> str:
        return data.chat_prompts(self.tokenizer, [user_message(n, self.depth, self.key)], instruction="")[0]

    def __call__(self, n: int) -> int:
        if n not in self.counts:
            self.counts[n] = len(self.tokenizer(self.prompt(n), add_special_tokens=False)["input_ids"])
        return self.counts[n]


def _filler_count(count: _Counter, length: int) -> int:
    """The number of filler sentences whose prompt length is closest to `length`."""
    base = count(0)
    if length < base:
        raise ValueError(f"context length {length} is shorter than the prompt without filler ({base} tokens)")
    per = max((count(2 * len(FILLER)) - base) / (2 * len(FILLER)), 1e-9)  # tokens per filler sentence
    n = max(0, round((length - base) / per))
    for _ in range(2):  # secant steps: close in on the target from the estimate
        n = max(0, n + round((length - count(n)) / per))
    while n > 0 and count(n) > length:
        n -= 1
    while count(n + 1) <= length:
        n += 1
    return n + 1 if count(n + 1) - length < length - count(n) else n


def build(tokenizer, length: int, depth: float, key: str) -> Haystack:
    """The pass-key prompt of about `length` tokens with `key` at `depth`."""
    count = _Counter(tokenizer, depth, key)
    n = _filler_count(count, length)
    return Haystack(key, depth, n, needle_index(n, depth), count.prompt(n), count(n))
