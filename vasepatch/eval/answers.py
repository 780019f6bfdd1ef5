"""Generated answers, one policy at a time, kept in a resumable jsonl file.

`answer_all` generates the prompts of each batch with one policy (`generate`),
turns every completion into a record (the task's own function), and appends the
records to the policy's file as soon as the batch finishes. Every record carries
the run key: the settings its answer depends on. A rerun with the same key skips
what is already there; a file that holds another key is refused, so results of
different settings never mix. KV sizes come from the cache's own `stats()`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import vasepatch
from vasepatch.config import VaSEConfig
from vasepatch.eval import cli_options


class Completion(NamedTuple):
    """One generated answer: tokens up to and including EOS, the real prompt length, whether
    it hit `max_new_tokens`, and the KV bytes the cache held per sequence at the end."""

    tokens: list[int]
    prompt_tokens: int
    truncated: bool
    kv_bytes: float


@dataclass(frozen=True)
class Item:
    """One prompt to answer: `ident` names its record, `fields` are copied into it."""

    ident: Hashable
    prompt: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decoding:
    """How answers are generated: `sample_temperature` 0 is greedy."""

    max_new_tokens: int
    sample_temperature: float
    top_p: float = 1.0

    def generate_kwargs(self) -> dict[str, Any]:
        if self.sample_temperature == 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {
            "do_sample": True,
            "temperature": self.sample_temperature,
            "top_p": self.top_p,
            "top_k": 0,
            "max_new_tokens": self.max_new_tokens,
        }


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or [])


def generate(model, tokenizer, config: VaSEConfig, prompts: list[str], decoding: Decoding, seed: int):
    """Completions of a batch of chat prompts (left padded) with the cache `config`."""
    import torch

    from vasepatch.eval import data

    ids, mask = data.encode(tokenizer, prompts)
    torch.manual_seed(seed)
    with vasepatch.patched(model, config=config) as handle, torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, pad_token_id=tokenizer.pad_token_id, **decoding.generate_kwargs()
        )
        kv_bytes = handle.stats()["kv_bytes"] / ids.shape[0]
    eos = _eos_ids(model)
    rows = []
    for row, m in zip(out[:, ids.shape[1] :].tolist(), mask, strict=True):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        truncated = end == len(row) and row[-1] not in eos
        rows.append(Completion(row[:end], int(m.sum()), truncated, kv_bytes))
    return rows


def legacy_key(key: dict[str, Any]) -> dict[str, Any]:
    """A run key written before the sampling temperature got its own name, in today's
    terms: `temperature` was the sampling temperature and `score_temperature` the policies'
    softmax temperature; the whole prompt was kept (`prefill="keep"`); `protect=None`
    meant `budget // 4`."""
    if "sample_temperature" in key or "temperature" not in key:
        return key
    key = dict(key)
    key["sample_temperature"] = key.pop("temperature")
    if "score_temperature" in key:
        key["temperature"] = key.pop("score_temperature")
    if "budget" in key:
        key.setdefault("prefill", "keep")
        if key.get("protect") is None:
            key["protect"] = key["budget"] // 4
    return key


def _written_key(written: Any) -> dict[str, Any] | None:
    try:
        key = json.loads(written)
    except (TypeError, ValueError):
        return None
    return legacy_key(key) if isinstance(key, dict) else None


def key_difference(old: dict[str, Any] | None, new: dict[str, Any], ignore: tuple[str, ...] = ()) -> str:
    """The settings in which run key `old` (as written in a file) differs from `new`, old and new value each:
    `budget was 256, now 128; window was 64, now 32`."""
    if not isinstance(old, dict):
        return f"its records carry no readable settings ({old!r})"
    keys = [k for k in dict.fromkeys([*old, *new]) if k not in ignore]
    missing = object()
    parts = []
    for k in keys:
        a, b = old.get(k, missing), new.get(k, missing)
        if a != b:
            was = "(not set)" if a is missing else repr(a)
            now = "(not set)" if b is missing else repr(b)
            parts.append(f"{k} was {was}, now {now}")
    return "; ".join(parts)


def load(
    path: Path, key: dict[str, Any], ident: Callable[[dict[str, Any]], Hashable], ignore: tuple[str, ...] = ()
) -> dict[Hashable, dict]:
    """The records of `path` by `ident(record)`; `ValueError` naming the differing settings (old and new values)
    if one was written with another key. `ignore`: keys not compared (e.g. `model_class` before the model loads)."""
    records: dict[Hashable, dict] = {}
    if not path.is_file():
        return records
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot be read to resume ({err}); choose another --out") from None
    wanted = {k: v for k, v in key.items() if k not in ignore}
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interruption: that item is run again
        written = _written_key(record.get("run")) if isinstance(record, dict) else None
        if written is None or {k: v for k, v in written.items() if k not in ignore} != wanted:
            raise ValueError(
                f"{path} holds answers of other settings: {key_difference(written, key, ignore)} "
                "(resume only with the same settings, or choose another --out)"
            )
        records[ident(record)] = record
    return records


@dataclass
class PolicyRun:
    """What one policy's answers need: its file, run key, cache config and decoding."""

    path: Path
    key: dict[str, Any]
    config: VaSEConfig
    decoding: Decoding
    ident: Callable[[dict[str, Any]], Hashable]
    make_record: Callable[[Item, Completion, str], dict[str, Any]]


def append(path: Path, record: dict[str, Any]) -> None:
    """Append `record` to the jsonl file `path`, on a line of its own even after a line cut by an interruption
    (which `load` skips, so that its item is answered again)."""
    with open(path, "a+b") as f:  # writes go to the end whatever was read
        cut = False
        if f.seek(0, 2) > 0:
            f.seek(-1, 2)
            cut = f.read(1) != b"\n"
        f.write((b"\n" if cut else b"") + json.dumps(record).encode() + b"\n")


def record_of(run: PolicyRun, item: Item, completion: Completion, tokenizer) -> dict[str, Any]:
    """The record of one answer, as its file keeps it: the task's fields, the policy, the KV bytes and the run key."""
    text = tokenizer.decode(completion.tokens, skip_special_tokens=True)
    return {
        **run.make_record(item, completion, text),
        "policy": run.config.policy,
        "kv_bytes": completion.kv_bytes,
        "run": json.dumps(run.key),
    }


def answer_all(run: PolicyRun, model, tokenizer, batches: list[tuple[int, list[Item]]], bar=None) -> list[dict]:
    """Answer every `(seed, items)` batch not answered yet; the records of all items, in order.
    `bar` (a `progress.Progress`) advances by each batch's items and the tokens generated."""
    run.path.parent.mkdir(parents=True, exist_ok=True)
    done = load(run.path, run.key, run.ident)
    for seed, items in batches:
        todo = [item for item in items if item.ident not in done]
        generated = 0
        if todo:
            completions = generate(model, tokenizer, run.config, [item.prompt for item in items], run.decoding, seed)
            for item, completion in zip(items, completions, strict=True):
                if item.ident in done:
                    continue
                record = record_of(run, item, completion, tokenizer)
                append(run.path, record)
                done[item.ident] = record
            generated = sum(len(c.tokens) for c in completions)
        if bar is not None:
            bar.advance(len(items), generated)
    return [done[item.ident] for _, items in batches for item in items]


class TransformersAnswers:
    """The answers of an evaluation's runs from a transformers `model`, patched with each run's cache in turn,
    in batches of left-padded prompts (`answer_all`). `vasepatch.eval.vllm_answers.VLLMAnswers` is the same
    interface on a vLLM engine."""

    def __init__(self, model, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.model_class = type(model).__name__

    def environment(self) -> dict[str, Any]:
        return cli_options.environment(self.model)

    def answer(self, settings, batches, make_record, ident, bar=None) -> list[list[dict[str, Any]]]:
        """Every run's records (`settings.policies`, one after another) of every item of `batches`."""
        out = []
        for name in settings.policies:
            if bar is not None:
                bar.phase(name, settings.task)
            run = settings.policy_run(name, self.model_class, make_record, ident)
            out.append(answer_all(run, self.model, self.tokenizer, batches, bar))
        return out
