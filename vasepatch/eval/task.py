"""`vasepatch eval task`: final-answer accuracy per policy on GSM8K, MATH-500 or AIME25,
or pass-key retrieval from long synthetic prompts (`--task passkey`, `vasepatch.eval.passkey`).

Every (problem, sample) pair is generated in batches of left-padded prompts,
graded as it finishes and appended to `<out>/<task>-<policy>.jsonl`, so an
interrupted run resumes where it stopped (batches are fixed by the settings and
seeded by their index, so a resumed run draws what an uninterrupted one would).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from vasepatch.eval import answers, cli_options, data, grading, metrics, paired, passkey, plots, report, vllm_answers
from vasepatch.eval.progress import Progress, require_extras
from vasepatch.eval.task_settings import ENGINES, PASSKEY, TASK_DEFAULTS, TASKS, VLLM_DTYPES, TaskSettings
from vasepatch.tools import threads
from vasepatch.tools.cli_args import (
    check_positions,
    install_hint,
    int_in,
    int_list,
    max_positions,
    number_in,
    number_list,
    output_dir,
)

COLUMNS = ("policy", "accuracy", "stderr", "ci95", "n", "mean_tokens", "loop_rate", "truncated_rate", "kv_bytes")


def _batches(settings: TaskSettings, examples: list[data.Example], prompts: list[str]):
    """`(seed, items)` per batch: every (problem, sample) pair, `batch_size` at a time."""
    items = [
        answers.Item((ex.id, s), prompt, {"id": ex.id, "sample": s, "answer": ex.answer})
        for ex, prompt in zip(examples, prompts, strict=True)
        for s in range(settings.samples)
    ]
    size = settings.batch_size
    return [(settings.config.seed + b, items[i : i + size]) for b, i in enumerate(range(0, len(items), size))]


def _record(task: str, item: answers.Item, completion: answers.Completion, text: str) -> dict[str, Any]:
    extracted, correct = grading.grade(task, text, item.fields["answer"] or "")
    return {
        **item.fields,
        "extracted": extracted,
        "correct": correct,
        "grading": grading.method(task),
        "prompt_tokens": completion.prompt_tokens,
        "n_tokens": len(completion.tokens),
        "truncated": completion.truncated,
        "looping": metrics.is_looping(completion.tokens),
        "text": text,
    }


def summarise(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """One result row: accuracy (its standard error over problems, and Wilson's 95% interval over answers),
    lengths, loops, KV bytes."""
    by_example: dict[str, list[float]] = {}
    for r in records:
        by_example.setdefault(r["id"], []).append(float(r["correct"]))
    acc, se = metrics.mean_stderr([sum(v) / len(v) for v in by_example.values()])
    n = len(records)
    return {
        "policy": name,
        "accuracy": acc,
        "stderr": se,
        "ci95": list(paired.wilson(sum(bool(r["correct"]) for r in records), n)),
        "n": n,
        "mean_tokens": sum(r["n_tokens"] for r in records) / max(n, 1),
        "loop_rate": sum(r["looping"] for r in records) / max(n, 1),
        "truncated_rate": sum(r["truncated"] for r in records) / max(n, 1),
        "kv_bytes": sum(r["kv_bytes"] for r in records) / max(n, 1),
    }


def used(settings: TaskSettings, header: dict[str, Any], items: int, records: list[dict[str, Any]]) -> None:
    """Put the values a run actually used into its `header`: the batch size (no larger than the work; the
    transformers path), and the longest sequence (prompt + answer) with its compression, `longest / budget`."""
    if settings.engine == "transformers":  # vLLM batches the requests itself
        header["batch_size"] = min(settings.batch_size, items)
    lengths = [r["prompt_tokens"] + r["n_tokens"] for r in records if "prompt_tokens" in r]
    if lengths:
        header.update(longest_sequence=max(lengths), compression=round(max(lengths) / settings.config.budget, 2))


def run_math(settings: TaskSettings, answerer, examples: list[data.Example], echo: bool = False) -> list[Path]:
    """Accuracy of every run on the problems `examples`; `answerer`: `answers.TransformersAnswers` or
    `vllm_answers.VLLMAnswers`."""
    tokenizer = answerer.tokenizer
    batches = _batches(settings, examples, data.chat_prompts(tokenizer, [e.question for e in examples]))
    make_record = partial(_record, settings.task)
    per_policy = len(examples) * settings.samples
    bar = Progress(len(settings.policies) * per_policy, "answer")
    try:  # the bar ends its line before any error is printed
        per_run = answerer.answer(settings, batches, make_record, lambda r: (r["id"], r["sample"]), bar)
    finally:
        bar.close()
    results = [summarise(name, records) for name, records in zip(settings.policies, per_run, strict=True)]
    records = [r for run in per_run for r in run]
    title = f"Accuracy on {settings.task}"
    header = {**settings.header(answerer.model_class), **answerer.environment()}
    header["problems"] = len(examples)
    header["grading"] = grading.describe([r.get("grading") for r in records])
    used(settings, header, per_policy, records)
    tables = paired.tables(settings.policies, per_run, settings.against)
    plot = plots.task_plot(results, header)
    return report.write(
        Path(settings.out), settings.task, header, results, COLUMNS, title, plot, tables=tables, echo=echo
    )


def check_resume(settings: TaskSettings, model_class: str | None = None) -> None:
    """`ValueError` if an answers file in `settings.out` was written with other settings, naming each
    differing setting with its old and new value. Before the model loads (`model_class=None`) the model's
    class is not compared; everything else is."""
    for name in settings.policies:
        path = Path(settings.out) / f"{settings.task}-{name}.jsonl"
        ignore = ("model_class",) if model_class is None else ()
        answers.load(path, settings.run_key(name, model_class or ""), ident=lambda r: id(r), ignore=ignore)


def check_length(settings: TaskSettings, limit: int | None) -> None:
    """`ValueError` if a prompt (pass-key context length) plus the longest answer exceeds the model's
    `limit` positions (`max_position_embeddings`), before any prefill."""
    new = settings.max_new_tokens
    needed = {f"--max-new-tokens {new}": new}
    if settings.kind == PASSKEY:
        n = max(settings.context_lengths)
        needed = {f"--context-lengths {n} with --max-new-tokens {new}": n + new}
    check_positions(settings.model, limit, needed)


def _note_grading(settings: TaskSettings) -> None:
    if grading.method(settings.task) == grading.STRING_ONLY:
        print(
            "vasepatch: note: math-verify is not installed, so MATH-500 answers are graded by normalised string "
            f"comparison only (an equal answer in another form counts wrong); to grade symbolically: "
            f"{install_hint('eval')}",
            file=sys.stderr,
        )


def run(
    settings: TaskSettings,
    model=None,
    tokenizer=None,
    echo: bool = False,
    before_load: Callable[[], object] | None = None,
) -> list[Path]:
    """Run (or resume) the evaluation and write its outputs; returns their paths. The `[eval]`
    extras, the data, the answer files to resume and the sequence length (against the model's config)
    are checked first: a missing or malformed file, other settings in `--out` or a pass-key context
    longer than the model takes fail before the model loads. `echo` prints the results table at the end;
    `before_load` is called once every check has passed, right before the model loads (not at all when
    `model` is given)."""
    require_extras()
    examples = None
    if settings.kind == "math":
        examples = data.load_examples(f"{settings.task}:{settings.limit}", settings.data_dir)
    if settings.engine == "vllm":
        vllm_answers.require_vllm()
    check_resume(settings)
    if model is None:
        check_length(settings, max_positions(settings.model))
    _note_grading(settings)
    answerer = _answerer(settings, model, tokenizer, before_load)
    check_resume(settings, answerer.model_class)
    if examples is None:
        return passkey.run(settings, answerer, echo=echo)
    return run_math(settings, answerer, examples, echo=echo)


def _answerer(settings: TaskSettings, model, tokenizer, before_load: Callable[[], object] | None):
    """Who answers: the vLLM engine (`settings.engine`), or the transformers `model` (loaded here when None)."""
    if settings.engine == "vllm":
        if model is not None:
            raise ValueError("engine='vllm' loads the model itself: pass no model")
        if before_load is not None:
            before_load()
        return vllm_answers.VLLMAnswers(settings)
    if model is None:
        from vasepatch import models

        if before_load is not None:
            before_load()
        model, tokenizer = models.load(settings.model)
    check_length(settings, max_positions(model))
    return answers.TransformersAnswers(model, tokenizer)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `vasepatch eval task`; `--help` shows every default."""
    cli_options.use_help_formatter(p)
    d = TaskSettings()
    math_, key = TASK_DEFAULTS["math"], TASK_DEFAULTS[PASSKEY]
    p.add_argument("--task", default=d.task, choices=TASKS, help="data set to answer, or pass-key retrieval")
    p.add_argument("--model", default=d.model, help="registered name, HF directory or .gguf file")
    p.add_argument("--limit", type=int_in(1), default=d.limit, help="first N problems (data sets)")
    cli_options.add_cache_arguments(p, d.config, policies_default="full,vase")
    p.add_argument(
        "--samples",
        type=int_in(1),
        help=f"samples per problem (default: {math_['samples']}); passkey: prompts per context length, spread "
        f"evenly over the depths (default: {key['samples']})",
    )
    p.add_argument(
        "--sample-temperature",
        type=number_in(0, what="0 = greedy"),
        help=f"sampling temperature of the answers, 0 = greedy (default: {math_['sample_temperature']}; "
        f"passkey: {key['sample_temperature']:g})",
    )
    p.add_argument(
        "--top-p", type=number_in(0, 1, lo_open=True), default=d.top_p, help="nucleus sampling of the answers"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int_in(1),
        help=f"longest answer (default: {math_['max_new_tokens']}; passkey: {key['max_new_tokens']})",
    )
    p.add_argument("--batch-size", type=int_in(1), default=d.batch_size, help="sequences per generate() call")
    p.add_argument(
        "--context-lengths",
        type=int_list(1),
        default=",".join(map(str, d.context_lengths)),
        help="passkey: prompt tokens, comma-separated",
    )
    p.add_argument(
        "--depths",
        type=number_list(0, 1),
        default=",".join(map(str, d.depths)),
        help="passkey: where the key sits, 0 (start) to 1 (end), comma-separated",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder with gsm8k/ math500/ aime25/ (default: $VASEPATCH_DATA_DIR, else the data shipped with vasepatch)",
    )
    p.add_argument(
        "--out", type=output_dir, default=d.out, help="folder for the answers (jsonl, resumable) and the results"
    )
    _add_engine_arguments(p, d)
    p.add_argument(
        "--against",
        default=",".join(d.against),
        help="the paired table's reference policies, comma-separated: every run against each, at the run's own "
        "budget where that ran (snapkv@64 against vase@64)",
    )


def _add_engine_arguments(p: argparse.ArgumentParser, d: TaskSettings) -> None:
    """`--engine` and the vLLM engine's own flags."""
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=d.engine,
        help="who answers: transformers, one run after another in batches; or vLLM (its own venv, docs/vllm.md), "
        "every run's requests in one engine, each with its own cache settings",
    )
    p.add_argument("--dtype", choices=VLLM_DTYPES, default=d.dtype, help="vllm: weights and KV cache")
    p.add_argument("--max-num-seqs", type=int_in(1), default=d.max_num_seqs, help="vllm: requests in flight at once")


def main(args: argparse.Namespace) -> None:
    settings = TaskSettings(
        model=args.model,
        task=args.task,
        config=cli_options.cache_config(args),
        policies=cli_options.parse_policies(args.policies),
        limit=args.limit,
        samples=args.samples,
        sample_temperature=args.sample_temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        context_lengths=args.context_lengths,
        depths=args.depths,
        data_dir=args.data_dir,
        out=args.out,
        engine=args.engine,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        against=cli_options.parse_policies(args.against),
    )
    run(settings, echo=True, before_load=lambda: threads.warn_if_busy(args))  # a busy machine: one line
