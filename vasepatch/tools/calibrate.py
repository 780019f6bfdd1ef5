"""`vasepatch calibrate MODEL`: the query statistics that the `triattention` policy reads.

Runs the model over a calibration text and writes its statistics (`vasepatch.integration.calibration`):
by default to the cache, `cache_dir()/triattention/<model key>.safetensors`, where the policy finds them.
The default text is the package's MATH-500 (`vasepatch/data/math500/test.jsonl`, or `$VASEPATCH_DATA_DIR`'s):
each problem and its reference solution, in file order, until `--tokens` tokens; `--text FILE` reads a UTF-8
file instead. The text is tokenized without special tokens and read in independent windows of 4096 tokens.
Bad input (an unknown model, a RoPE the policy cannot use, more tokens than the text has, an unreadable
file) is one line and exit status 2, before the weights load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vasepatch import models
from vasepatch.tools import threads
from vasepatch.tools.cli_args import device, folder_problem, int_in

DEFAULT_TOKENS = 8192
"""Calibration tokens by default: SmolLM2-135M reads them in about a minute on 2 CPU cores (two windows of
4096; measured 29 s a window with other jobs on the machine)."""
MATH500 = "MATH-500 (problems and solutions)"


def stats_file(text: str) -> str:
    """argparse type of `--out`: a file path that is not a folder and whose folder can be made and written."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; expected a file path (e.g. stats.safetensors)")
    problem = folder_problem(str(path.parent))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = " (default: %(default)s)"
    p.add_argument(
        "model", help=f"a registered name ({', '.join(models.available())}), an HF directory, a .gguf or a Hub id"
    )
    p.add_argument("--tokens", type=int_in(1), default=DEFAULT_TOKENS, help="calibration tokens to read" + d)
    p.add_argument("--text", default=None, help=f"a UTF-8 text file to calibrate on (default: {MATH500})")
    p.add_argument(
        "--out", type=stats_file, default=None, help="the file to write (default: the cache, where triattention looks)"
    )
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N" + d)


def read_text(path: str) -> str:
    """The content of the `--text` file, UTF-8 and not blank (ValueError / OSError naming the file)."""
    try:
        data = Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"--text {path}: no such file") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"--text {path}: is a folder, not a file") from None
    except OSError as err:
        raise ValueError(f"--text {path}: cannot be read ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--text {path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})"
        ) from None
    if not text.strip():
        raise ValueError(f"--text {path}: the file is empty")
    return text


def math500_pieces() -> Iterator[str]:
    """MATH-500's problems and reference solutions, in file order: `problem\\n\\nsolution\\n\\n` each."""
    from vasepatch.eval.data import DATASETS, DataError, data_dir

    path = data_dir() / DATASETS["math500"]
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # as read_jsonl: U+2028 in a string is no line end
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot be read ({err})") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
                yield f"{record['problem']}\n\n{record['solution']}\n\n"
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}:{number}: expected JSON with 'problem' and 'solution' strings") from None


def text_pieces(text: str) -> Iterator[str]:
    """`text` in paragraphs (each with the blank line after it), so that a long file is tokenized piece by piece."""
    parts = text.split("\n\n")
    for i, part in enumerate(parts):
        piece = part + ("\n\n" if i < len(parts) - 1 else "")
        if piece:
            yield piece


def token_ids(tokenizer: Any, pieces: Iterator[str], tokens: int, source: str) -> tuple[list[int], str]:
    """The first `tokens` ids of the pieces, each tokenized without special tokens, and the sha256 of the text
    they came from; ValueError saying how many the text has if it has fewer."""
    ids: list[int] = []
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece.encode("utf-8"))
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            return ids[:tokens], digest.hexdigest()
    raise ValueError(
        f"--tokens {tokens} is more than {source} has: {len(ids)} tokens with this model's tokenizer; "
        "lower --tokens or pass a longer --text"
    )


def check_model(name: str) -> None:
    """A name or path that is no model, or a config whose RoPE `triattention` cannot use: ValueError, read from
    the config before any weight loads (a Hub id not yet local is checked once loaded)."""
    from transformers import AutoConfig

    from vasepatch.integration.calibration import check_rope

    folder = models.resolve(name)
    if isinstance(folder, Path):
        with models.no_progress_bars():
            check_rope(AutoConfig.from_pretrained(folder))


def run(args: argparse.Namespace) -> None:
    text = read_text(args.text) if args.text is not None else None
    check_model(args.model)
    tokenizer, _ = models.load_tokenizer(args.model)
    source = f"--text {args.text}" if text is not None else MATH500
    pieces = text_pieces(text) if text is not None else math500_pieces()
    ids, sha256 = token_ids(tokenizer, pieces, args.tokens, source)
    threads.warn_if_busy(args)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model, _ = models.load(args.model, device=args.device)
    import torch

    from vasepatch.integration.calibration import calibrate
    from vasepatch.tools.streaming import human_bytes

    meta = {
        "model_argument": str(args.model),  # the name it was asked by; `model` is the folder it loaded
        "text_source": str(args.text) if text is not None else "vasepatch/data/math500",
        "text_sha256": sha256,
    }
    start = time.perf_counter()
    path = calibrate(model, torch.tensor([ids]), path=args.out, metadata=meta, progress=_report)
    seconds = time.perf_counter() - start
    print(path)
    print(f"{len(ids)} tokens of {source} in {seconds:.1f} s; {human_bytes(path.stat().st_size)}")


def _report(done: int, total: int) -> None:
    """One line on stderr per calibration window read."""
    print(f"calibrating: {done}/{total} tokens", file=sys.stderr, flush=True)
