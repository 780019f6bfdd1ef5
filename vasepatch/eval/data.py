"""Benchmark prompts: GSM8K, MATH-500 and AIME25 jsonl files, or any jsonl of questions.

The three data sets ship inside the package, each with its license (`vasepatch/data/<name>/test.jsonl`
and `LICENSE`). A folder with the same layout replaces them: `--data-dir`, else `$VASEPATCH_DATA_DIR`.
`load_examples` reads and checks every line, so a caller that runs it before loading a model stops on a
missing or malformed file with a `DataError`: a ValueError whose message is one line naming the file, the
line and what is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DATASETS = {"gsm8k": "gsm8k/test.jsonl", "math500": "math500/test.jsonl", "aime25": "aime25/test.jsonl"}
ENV_VAR = "VASEPATCH_DATA_DIR"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class DataError(ValueError):
    """A benchmark folder or file that is missing or malformed. The message is one line: file, line, problem."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A benchmark folder or file that does not exist (also a FileNotFoundError, for callers that catch that)."""


@dataclass(frozen=True)
class Example:
    """One problem: `question`, its reference `answer` (None if unknown) and a stable `id`."""

    id: str
    question: str
    answer: str | None


def packaged_data_dir() -> Path:
    """The folder inside the installed package that holds `gsm8k/`, `math500/`, `aime25/`."""
    root = resources.files("vasepatch") / "data"
    if not isinstance(root, Path):  # a zip import; pip always installs vasepatch as plain files
        raise DataNotFoundError(f"packaged benchmark data unreadable at {root}: pass --data-dir or set {ENV_VAR}")
    return root


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding `gsm8k/`, `math500/`, `aime25/`: `explicit`, else `$VASEPATCH_DATA_DIR`, else the
    packaged data. A folder that was asked for but does not exist is an error, not a silent fallback."""
    for value, origin in ((explicit, "--data-dir"), (os.environ.get(ENV_VAR), f"${ENV_VAR}")):
        if value is None or str(value) == "":
            continue
        if Path(value).exists() and not Path(value).is_dir():
            raise DataError(f"data folder {value} (from {origin}) is a file, not a folder")
        if not Path(value).is_dir():
            raise DataNotFoundError(f"data folder {value} (from {origin}) does not exist")
        return Path(value)
    return packaged_data_dir()


def _answer(name: str, record: dict) -> str | None:
    if name == "gsm8k" and "answer" in record:
        return str(record["answer"]).split("####")[-1].strip()
    value = record.get("answer")
    return None if value is None else str(value)


def _example(path: Path, number: int, line: str, name: str) -> Example:
    """Line `number` (1-based) of `path` as an Example, or a DataError that names the file and the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        reason = e.msg.removesuffix(" at")  # "Unterminated string starting at": the column follows
        raise DataError(f"{path}:{number}: invalid JSON at column {e.colno} ({reason})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    question = record.get("question", record.get("problem"))
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{path}:{number}: no question (each line needs a non-empty 'question' or 'problem' string)")
    return Example(str(record.get("id", number - 1)), question, _answer(name, record))


def read_jsonl(path: Path, name: str = "") -> list[Example]:
    """Every non-blank line of `path` as an Example; `name` selects the answer format (`gsm8k`: after `####`).
    Any problem raises a DataError with a one-line message."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)  # splits at newlines only (str.splitlines would also split at U+2028 in a string)
    except FileNotFoundError:
        raise DataNotFoundError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a folder, not a file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    examples = [_example(path, i + 1, line, name) for i, line in enumerate(lines) if line.strip()]
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty)")
    return examples


def load_examples(spec: str, directory: str | os.PathLike[str] | None = None) -> list[Example]:
    """`"gsm8k:16"`, `"math500"` (all), `"aime25:5"`, or `"path/to/file.jsonl[:N]"`: the first N examples.

    A data set is read from `data_dir(directory)`. Every line of the file is checked, even past N, so a
    caller can run this before loading a model; a bad spec, folder or file raises a `DataError` (ValueError).
    """
    source, _, count = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if count and not count.isdigit():
        source, count = spec, ""
    if count and int(count) == 0:
        raise DataError(f"prompt count must be a positive int, got {spec!r}")
    if source in DATASETS:
        path = data_dir(directory) / DATASETS[source]
        if not path.is_file():
            raise DataNotFoundError(f"{path}: no such file (a data folder holds {', '.join(DATASETS.values())})")
        examples = read_jsonl(path, source)
    else:
        path = Path(source)
        if path.is_dir():
            raise DataError(f"prompts {spec!r}: {path} is a folder; expected a .jsonl file")
        if not path.is_file():
            raise DataError(f"prompts {spec!r}: expected {'/'.join(DATASETS)}[:N] or an existing .jsonl file")
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
