"""Benchmark prompts: GSM8K, MATH-500 and AIME25 jsonl files, or any jsonl of questions.

The data live outside the repository. Their folder is `--data-dir`, else
`$VASEPATCH_DATA_DIR`, else `../shared/data` relative to the working directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DATASETS = {"gsm8k": "gsm8k/test.jsonl", "math500": "math500/test.jsonl", "aime25": "aime25/test.jsonl"}
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Example:
    """One problem: `question`, its reference `answer` (None if unknown) and a stable `id`."""

    id: str
    question: str
    answer: str | None


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding `gsm8k/`, `math500/`, `aime25/` (see the module docstring)."""
    for candidate in (explicit, os.environ.get("VASEPATCH_DATA_DIR"), "../shared/data"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise FileNotFoundError(
        "benchmark data not found: pass --data-dir or set VASEPATCH_DATA_DIR to the folder with "
        f"{', '.join(DATASETS.values())}"
    )


def _answer(name: str, record: dict) -> str | None:
    if name == "gsm8k" and "answer" in record:
        return str(record["answer"]).split("####")[-1].strip()
    value = record.get("answer")
    return None if value is None else str(value)


def read_jsonl(path: Path, name: str = "") -> list[Example]:
    examples = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            record = json.loads(line)
            question = record.get("question", record.get("problem"))
            if not isinstance(question, str):
                raise ValueError(f"{path}:{i + 1}: each line needs a 'question' or 'problem' string")
            examples.append(Example(str(record.get("id", i)), question, _answer(name, record)))
    return examples


def load_examples(spec: str, directory: str | os.PathLike[str] | None = None) -> list[Example]:
    """`"gsm8k:16"`, `"math500"` (all), `"aime25:5"`, or `"path/to/file.jsonl[:N]"`: the first N examples."""
    source, _, count = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if count and not count.isdigit():
        source, count = spec, ""
    if count == "0":
        raise ValueError(f"prompt count must be a positive int, got {spec!r}")
    if source in DATASETS:
        examples = read_jsonl(data_dir(directory) / DATASETS[source], source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"prompts {spec!r}: expected {'/'.join(DATASETS)}[:N] or an existing .jsonl file")
        examples = read_jsonl(path)
    return examples[: int(count)] if count else examples


def chat_prompts(tokenizer, questions: list[str], instruction: str = INSTRUCTION) -> list[str]:
    """Each question with the instruction, in the model's chat template (generation prompt added)."""
    texts = []
    for q in questions:
        content = f"{q}\n{instruction}" if instruction else q
        texts.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        )
    return texts


def encode(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids`, `attention_mask` (the chat template already holds special tokens)."""
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch["input_ids"], batch["attention_mask"]
