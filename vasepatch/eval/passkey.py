"""`vasepatch eval task --task passkey`: retrieve a 5-digit key hidden in long filler text.

For each context length, `samples` prompts (`vasepatch.eval.haystack`) spread
evenly over the depths (sample `i` at `depths[i % len(depths)]`), each with its own
key drawn from the seed. Every policy answers them greedily by default; the answer
is right when its first 5-digit number is the key. Records go to
`<out>/passkey-<policy>.jsonl` (resumable, as for the other tasks; records of
other context lengths in the same file are kept and left out of the summary).
The report: accuracy per (policy, length), per (policy, length, depth), and a
plot of accuracy against depth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vasepatch.eval import answers, grading, haystack, metrics, plots, report
from vasepatch.eval.progress import Progress
from vasepatch.eval.task_settings import PASSKEY, TaskSettings
from vasepatch.tools.cli_args import check_positions, max_positions

COLUMNS = ("policy", "context_length", "accuracy", "stderr", "n", "prompt_tokens", "kv_bytes")
DEPTH_COLUMNS = ("policy", "context_length", "depth", "accuracy", "n")


def items(settings: TaskSettings, tokenizer, length: int) -> list[answers.Item]:
    """The `samples` prompts of one context length."""
    out = []
    for i in range(settings.samples):
        depth = settings.depths[i % len(settings.depths)]
        hay = haystack.build(tokenizer, length, depth, haystack.pass_key(settings.config.seed, length, i))
        fields = {"id": f"{length}-{i}", "context_length": length, "index": i, "depth": depth, "key": hay.key}
        out.append(answers.Item((length, i), hay.prompt, {**fields, "prompt_tokens": hay.n_tokens}))
    return out


def batches(settings: TaskSettings, tokenizer) -> list[tuple[int, list[answers.Item]]]:
    """`(seed, items)` per batch; a batch holds prompts of one length, seeded by its index there."""
    out = []
    size = settings.batch_size
    for length in settings.context_lengths:
        todo = items(settings, tokenizer, length)
        out += [(settings.config.seed + b, todo[i : i + size]) for b, i in enumerate(range(0, len(todo), size))]
    return out


def make_record(item: answers.Item, completion: answers.Completion, text: str) -> dict[str, Any]:
    extracted, correct = grading.grade_passkey(text, item.fields["key"])
    return {
        **item.fields,
        "output": text,
        "extracted": extracted,
        "correct": correct,
        "n_tokens": len(completion.tokens),
        "truncated": completion.truncated,
    }


def _accuracy(records: list[dict[str, Any]]) -> tuple[float, float]:
    return metrics.mean_stderr([float(r["correct"]) for r in records])


def summarise(name: str, records: list[dict[str, Any]], settings: TaskSettings):
    """`(rows per context length, rows per (length, depth))` of policy `name`."""
    rows, by_depth = [], []
    for length in settings.context_lengths:
        at = [r for r in records if r["context_length"] == length]
        acc, se = _accuracy(at)
        n = len(at)
        rows.append(
            {
                "policy": name,
                "context_length": length,
                "accuracy": acc,
                "stderr": se,
                "n": n,
                "prompt_tokens": sum(r["prompt_tokens"] for r in at) / max(n, 1),
                "kv_bytes": sum(r["kv_bytes"] for r in at) / max(n, 1),
            }
        )
        for depth in dict.fromkeys(settings.depths):
            there = [r for r in at if r["depth"] == depth]
            if not there:  # fewer samples than depths: no row rather than a NaN (not valid JSON)
                continue
            row = {"policy": name, "context_length": length, "depth": depth}
            by_depth.append({**row, "accuracy": _accuracy(there)[0], "n": len(there)})
    return rows, by_depth


def run(settings: TaskSettings, answerer, echo: bool = False) -> list[Path]:
    """Pass-key accuracy of every run; writes `passkey.json`, `.md`, `.png` under `settings.out`
    (`echo`: and prints the results table). `answerer`: `answers.TransformersAnswers` or
    `vllm_answers.VLLMAnswers`."""
    work = batches(settings, answerer.tokenizer)
    per_policy = sum(len(b) for _, b in work)
    longest = max(item.fields["prompt_tokens"] for _, batch in work for item in batch)
    check_positions(
        settings.model,
        max_positions(getattr(answerer, "model", settings.model)),
        {
            f"the longest pass-key prompt ({longest} tokens) with --max-new-tokens {settings.max_new_tokens}": longest
            + settings.max_new_tokens
        },
    )
    bar = Progress(len(settings.policies) * per_policy, "prompt")
    try:  # the bar ends its line before any error is printed
        per_run = answerer.answer(settings, work, make_record, lambda r: (r["context_length"], r["index"]), bar)
    finally:
        bar.close()
    results, by_depth = [], []
    for name, records in zip(settings.policies, per_run, strict=True):
        rows, depth_rows = summarise(name, records, settings)
        results += rows
        by_depth += depth_rows
    title = "Pass-key retrieval accuracy"
    tables = {"by_depth": (by_depth, DEPTH_COLUMNS)}
    header = {**settings.header(answerer.model_class), **answerer.environment()}
    header["grading"] = grading.method(PASSKEY)
    # a batch never mixes context lengths; vLLM batches the requests itself
    header["batch_size"] = min(settings.batch_size, settings.samples) if settings.engine == "transformers" else None
    plot = plots.passkey_plot(results, by_depth, header)
    return report.write(Path(settings.out), PASSKEY, header, results, COLUMNS, title, plot, tables=tables, echo=echo)
