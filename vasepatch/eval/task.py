"""`vasepatch eval task`: final-answer accuracy on GSM8K, MATH-500 or AIME25 per policy.

Every (problem, sample) pair is generated in batches of left-padded prompts,
graded as it finishes and appended to `<out>/<task>-<policy>.jsonl`, so an
interrupted run resumes where it stopped (batches are fixed by the settings and
seeded by their index, so a resumed run draws what an uninterrupted one would).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import vasepatch
from vasepatch import policies
from vasepatch.config import VaSEConfig
from vasepatch.eval import data, grading, metrics, report


@dataclass
class TaskSettings:
    """What `vasepatch eval task` runs (the CLI flags, validated)."""

    model: str = "qwen2.5-coder-0.5b"
    task: str = "gsm8k"
    limit: int = 50
    policies: list[str] = field(default_factory=lambda: ["full", "vase"])
    budget: int = 256
    window: int = 64
    protect: int | None = None
    sinks: int = 4
    score_temperature: float = 1.0
    smooth: int = 5
    samples: int = 1
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 1024
    seed: int = 0
    batch_size: int = 8
    data_dir: str | None = None
    out: str = "task-results"

    def __post_init__(self) -> None:
        if self.task not in grading.GRADERS:
            raise ValueError(f"task must be one of {sorted(grading.GRADERS)}, got {self.task!r}")
        for name in ("limit", "samples", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")
        unknown = [p for p in self.policies if p not in policies.available()]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; registered: {', '.join(policies.available())}")
        self.policy_config("vase", 0)  # validates budget/window/protect/... before any work

    def policy_config(self, name: str, prompt_length: int) -> VaSEConfig:
        full = name == "full"
        return VaSEConfig(
            budget=max(prompt_length + self.max_new_tokens, self.window + 1) if full else self.budget,
            window=self.window,
            protect=None if full else self.protect,
            sinks=self.sinks,
            policy=name,
            temperature=self.score_temperature,
            smooth=self.smooth,
            seed=self.seed,
        )


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V per token, summed over layers."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * itemsize


def _work(settings: TaskSettings, examples: list[data.Example]) -> list[list[tuple[int, int]]]:
    items = [(i, s) for i in range(len(examples)) for s in range(settings.samples)]
    return [items[i : i + settings.batch_size] for i in range(0, len(items), settings.batch_size)]


def run_key(settings: TaskSettings, name: str, model_class: str) -> str:
    """What the records of policy `name` depend on; a resumed run must match it exactly."""
    keep = ["model", "task", "samples", "temperature", "top_p", "max_new_tokens", "seed", "batch_size"]
    if name != "full":
        keep += ["budget", "window", "protect", "sinks", "score_temperature", "smooth"]
    return json.dumps({"policy": name, "model_class": model_class, **{k: getattr(settings, k) for k in keep}})


def _done(path: Path, key: str) -> dict[tuple[str, int], dict[str, Any]]:
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by an interruption: that item is run again
                if r.get("run") != key:
                    raise ValueError(
                        f"{path} holds results of other settings ({r.get('run')}); resume only with the same "
                        "settings, or choose another --out"
                    )
                records[(r["id"], r["sample"])] = r
    return records


def generate_batch(model, tokenizer, settings: TaskSettings, name: str, questions: list[str], seed: int):
    """Completions of one batch with policy `name`: per row `(generated ids up to and including
    EOS, real prompt length, hit max_new_tokens, padded prompt length)`."""
    ids, mask = data.encode(tokenizer, data.chat_prompts(tokenizer, questions))
    cfg = settings.policy_config(name, ids.shape[1])
    sampling = {"do_sample": False}
    if settings.temperature > 0:
        sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
    torch.manual_seed(seed)
    with vasepatch.patched(model, config=cfg), torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=settings.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    rows = []
    for row, m in zip(out[:, ids.shape[1] :].tolist(), mask, strict=True):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append((row[:end], int(m.sum()), end == len(row) and row[-1] not in eos, ids.shape[1]))
    return rows


def run_policy(settings: TaskSettings, name: str, model, tokenizer, examples, bar) -> list[dict[str, Any]]:
    path = Path(settings.out) / f"{settings.task}-{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    key = run_key(settings, name, type(model).__name__)
    done = _done(path, key)
    per_token = kv_bytes_per_token(model)
    for b, batch in enumerate(_work(settings, examples)):
        if all((examples[i].id, s) in done for i, s in batch):
            bar.update(len(batch))
            continue
        rows = generate_batch(
            model, tokenizer, settings, name, [examples[i].question for i, _ in batch], settings.seed + b
        )
        with open(path, "a") as f:
            for (i, s), (tokens, prompt_len, truncated, padded_len) in zip(batch, rows, strict=True):
                ex = examples[i]
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                extracted, correct = grading.grade(settings.task, text, ex.answer or "")
                held = (
                    prompt_len + len(tokens) if name == "full" else max(padded_len, settings.budget) + settings.window
                )
                record = {
                    "id": ex.id,
                    "sample": s,
                    "policy": name,
                    "answer": ex.answer,
                    "extracted": extracted,
                    "correct": correct,
                    "n_tokens": len(tokens),
                    "truncated": truncated,
                    "looping": metrics.is_looping(tokens),
                    "kv_bytes": held * per_token,
                    "text": text,
                    "run": key,
                }
                if (ex.id, s) not in done:
                    f.write(json.dumps(record) + "\n")
                    done[(ex.id, s)] = record
        bar.update(len(batch))
    wanted = {(ex.id, s) for ex in examples for s in range(settings.samples)}
    return [r for k, r in done.items() if k in wanted]


def summarise(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    by_example: dict[str, list[float]] = {}
    for r in records:
        by_example.setdefault(r["id"], []).append(float(r["correct"]))
    acc, se = metrics.mean_stderr([sum(v) / len(v) for v in by_example.values()])
    n = len(records)
    return {
        "policy": name,
        "accuracy": acc,
        "stderr": se,
        "n": n,
        "mean_tokens": sum(r["n_tokens"] for r in records) / max(n, 1),
        "loop_rate": sum(r["looping"] for r in records) / max(n, 1),
        "truncated_rate": sum(r["truncated"] for r in records) / max(n, 1),
        "kv_bytes": sum(r["kv_bytes"] for r in records) / max(n, 1),
    }


def _plot(results: list[dict[str, Any]]):
    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["policy"] for r in results]
        ax1.bar(names, [100 * r["accuracy"] for r in results], yerr=[100 * r["stderr"] for r in results], capsize=3)
        ax1.set(ylabel="accuracy (%) ± s.e.")
        ax1.tick_params(axis="x", rotation=30)
        ax2.bar(names, [r["kv_bytes"] / 2**20 for r in results])
        ax2.set(ylabel="KV MiB per sequence")
        ax2.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return plot


COLUMNS = ("policy", "accuracy", "stderr", "n", "mean_tokens", "loop_rate", "truncated_rate", "kv_bytes")


def run(settings: TaskSettings, model=None, tokenizer=None) -> list[Path]:
    """Run (or resume) the evaluation and write its outputs; returns their paths."""
    examples = data.load_examples(f"{settings.task}:{settings.limit}", settings.data_dir)
    if model is None:
        from vasepatch import models

        model, tokenizer = models.load(settings.model)
    from tqdm.auto import tqdm

    total = len(settings.policies) * len(examples) * settings.samples
    bar = tqdm(total=total, desc=f"{settings.task}", unit="answer", dynamic_ncols=True)
    results = [summarise(n, run_policy(settings, n, model, tokenizer, examples, bar)) for n in settings.policies]
    bar.close()
    config = {k: v for k, v in vars(settings).items() if k not in ("out", "data_dir")}
    config["model_class"] = type(model).__name__
    config["kv_bytes_per_token"] = kv_bytes_per_token(model)
    return report.write(
        Path(settings.out), settings.task, config, results, COLUMNS, f"Accuracy on {settings.task}", _plot(results)
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TaskSettings()
    p.add_argument("--task", default=d.task, choices=sorted(grading.GRADERS))
    p.add_argument("--model", default=d.model, help="registered name, HF directory or .gguf file")
    p.add_argument("--limit", type=int, default=d.limit, help="first N problems")
    p.add_argument("--policies", default="full,vase", help="comma-separated policy names, or 'all'")
    p.add_argument("--budget", type=int, default=d.budget)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--protect", type=int, default=None, help="protected slots (default budget // 4)")
    p.add_argument("--sinks", type=int, default=d.sinks)
    p.add_argument(
        "--score-temperature",
        type=float,
        default=d.score_temperature,
        help="softmax temperature of the attention scores",
    )
    p.add_argument("--smooth", type=int, default=d.smooth)
    p.add_argument("--samples", type=int, default=d.samples, help="samples per problem")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per generate() call")
    p.add_argument("--data-dir", default=None, help="folder with gsm8k/ math500/ aime25/ (or $VASEPATCH_DATA_DIR)")
    p.add_argument("--out", default=d.out)


def main(args: argparse.Namespace) -> None:
    from vasepatch.eval.fidelity import parse_policies

    settings = TaskSettings(
        model=args.model,
        task=args.task,
        limit=args.limit,
        policies=parse_policies(args.policies),
        budget=args.budget,
        window=args.window,
        protect=args.protect,
        sinks=args.sinks,
        score_temperature=args.score_temperature,
        smooth=args.smooth,
        samples=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        out=args.out,
    )
    for path in run(settings):
        print(path)
