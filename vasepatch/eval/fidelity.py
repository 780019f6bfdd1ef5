"""`vasepatch eval fidelity`: how close each policy stays to the full cache.

Per prompt batch:

1. A reference continuation of `tokens` tokens is *sampled* from the full cache
   (`sample_temperature`, seeded, EOS/BOS/padding tokens suppressed so every
   row has the same length). Greedy references loop on small models and flatter every
   policy under teacher forcing.
2. The reference is teacher-forced through every policy's cache in lockstep
   with a never-evicting cache (`full`); per generated position we record
   KL(full || policy), top-1 agreement and the NLL increase of the reference token.
3. Each policy then generates freely from the prompt with the same sampling
   settings and seed; we record whether the text ends in a repetition loop
   (`metrics.loop_period`) and the first position where it leaves the reference.
   The `full` row's free run is the reference itself.

`--probe FILE` instead teacher-forces the fixed probe (prompt ids, reference
tokens, dense predictions) for several policy seeds (`vasepatch.eval.probe`).

torch is imported by the functions that run the work, so that `--help` and the usage errors answer at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import vasepatch
from vasepatch.config import FULL, VaSEConfig
from vasepatch.eval import cli_options, data, metrics, plots, probe, report
from vasepatch.eval.fidelity_settings import FidelitySettings
from vasepatch.eval.progress import Progress, require_extras
from vasepatch.tools import threads
from vasepatch.tools.cli_args import check_positions, int_in, max_positions, number_in, output_dir

if TYPE_CHECKING:
    import torch

METRICS = ("kl", "top1", "nll_delta")
PROMPT_COLUMNS = (
    "policy",
    "kl",
    "top1_agreement",
    "top1_stderr",
    "nll_delta",
    "loop_rate",
    "first_divergence",
    "n_prompts",
    "n_tokens",
    "kv_bytes",
)


def _end_ids(model, tokenizer) -> list[int]:
    """Tokens that end or frame a turn (EOS, BOS, padding): suppressed in forced-length samples."""
    ids: set[int] = set()
    for source in (model.generation_config, tokenizer):
        for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(source, attr, None)
            ids.update([value] if isinstance(value, int) else list(value or []))
    return sorted(ids)


def sample(model, ids, mask, settings: FidelitySettings, seed: int, pad_id: int, suppress: list[int]) -> torch.Tensor:
    """`[B, tokens]` sampled tokens (forced length, EOS suppressed), seeded."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=settings.sample_temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=settings.tokens,
            min_new_tokens=settings.tokens,
            suppress_tokens=suppress,
            pad_token_id=pad_id,
        )
    return out[:, ids.shape[1] :]


def force_metrics(model, configs: dict[str, VaSEConfig], ids, mask, continuation):
    """Teacher-force `continuation` through a cache per config, against the `full` one.

    Returns `({name: {"kl"|"top1"|"nll_delta": [B, T]}}, {name: cache stats})` (the `full`
    entry is the reference)."""
    import torch

    from vasepatch.eval.forcing import teacher_force

    if next(iter(configs)) != FULL:
        raise ValueError("the first config must be the 'full' reference")
    out: dict[str, dict[str, list[torch.Tensor]]] = {n: {m: [] for m in METRICS} for n in configs}
    with vasepatch.patched(model, config=configs[FULL]) as handle:
        caches = {name: handle.new_cache(cfg) for name, cfg in configs.items()}
        for start, logits in teacher_force(model, handle.cache_keyword, caches, ids, mask, continuation):
            ref = logits[FULL]
            targets = continuation[:, start : start + ref.shape[1]]
            for name, lg in logits.items():
                for m, v in metrics.next_token_metrics(ref, lg, targets).items():
                    out[name][m].append(v)
    values = {n: {m: torch.cat(v, 1) for m, v in d.items()} for n, d in out.items()}
    return values, {name: cache.stats() for name, cache in caches.items()}


class _Tally:
    """Per policy: the forced metrics of every prompt, the free runs and the KV bytes."""

    def __init__(self, names: list[str]) -> None:
        self.rows: dict[str, dict[str, list[torch.Tensor]]] = {n: {m: [] for m in METRICS} for n in names}
        self.free: dict[str, dict[str, list[float]]] = {n: {"loop": [], "div": []} for n in names}
        self.kv_bytes: dict[str, list[float]] = {n: [] for n in names}

    def add_forced(self, values: dict[str, dict[str, torch.Tensor]], stats: dict[str, dict[str, int]], rows: int):
        for name, per_metric in values.items():
            for m, v in per_metric.items():
                self.rows[name][m].append(v)
            self.kv_bytes[name].append(stats[name]["kv_bytes"] / rows)

    def add_free(self, name: str, tokens: torch.Tensor, reference: torch.Tensor) -> None:
        for row, ref_row in zip(tokens.tolist(), reference.tolist(), strict=True):
            self.free[name]["loop"].append(float(metrics.is_looping(row)))
            self.free[name]["div"].append(float(metrics.first_divergence(row, ref_row)))

    def summary(self, name: str) -> dict[str, Any]:
        import torch

        rows = {m: torch.cat(v, 0) for m, v in self.rows[name].items()}  # [n_prompts, T]
        top1_mean, top1_se = metrics.mean_stderr(rows["top1"].mean(-1).tolist())
        kl_mean, kl_se = metrics.mean_stderr(rows["kl"].mean(-1).tolist())
        return {
            "policy": name,
            "kl": kl_mean,
            "kl_stderr": kl_se,
            "top1_agreement": top1_mean,
            "top1_stderr": top1_se,
            "nll_delta": rows["nll_delta"].mean().item(),
            "loop_rate": metrics.mean_stderr(self.free[name]["loop"])[0],
            "first_divergence": metrics.mean_stderr(self.free[name]["div"])[0],
            "n_prompts": rows["top1"].shape[0],
            "n_tokens": rows["top1"].numel(),
            "kv_bytes": sum(self.kv_bytes[name]) / len(self.kv_bytes[name]),
            "kl_by_position": rows["kl"].mean(0).tolist(),
        }


def _run_batch(
    settings: FidelitySettings, model, tokenizer, ids, mask, seed: int, tally: _Tally, bar: Progress
) -> None:
    """Reference, teacher forcing and free runs of one batch of prompts."""
    configs = settings.configs()
    pad_id, suppress = tokenizer.pad_token_id, _end_ids(model, tokenizer)
    rows, tokens = ids.shape[0], ids.shape[0] * settings.tokens
    bar.phase(FULL, "reference")
    with vasepatch.patched(model, config=configs[FULL]):
        reference = sample(model, ids, mask, settings, seed, pad_id, suppress)
    bar.advance(rows, tokens)
    bar.phase(f"{len(configs)} policies", "teacher forcing")
    tally.add_forced(*force_metrics(model, configs, ids, mask, reference), rows=rows)
    tally.add_free(FULL, reference, reference)
    bar.advance(rows, tokens * len(configs))
    for name, cfg in configs.items():
        if name != FULL:
            bar.phase(name, "free run")
            with vasepatch.patched(model, config=cfg):
                tally.add_free(name, sample(model, ids, mask, settings, seed, pad_id, suppress), reference)
            bar.advance(rows, tokens)


def run_prompts(
    settings: FidelitySettings, model, tokenizer, examples: list[data.Example] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Fidelity of every policy on the prompts: `(header, one result row per policy)`."""
    if examples is None:
        examples = data.load_examples(settings.prompts, settings.data_dir)
    texts = data.chat_prompts(tokenizer, [e.question for e in examples])
    size = settings.batch_size
    batches = [data.encode(tokenizer, texts[i : i + size]) for i in range(0, len(texts), size)]
    longest = max(ids.shape[1] for ids, _ in batches)
    needed = {f"the longest prompt ({longest} tokens) with --tokens {settings.tokens}": longest + settings.tokens}
    check_positions(settings.model, max_positions(model), needed)
    tally = _Tally(settings.policies)
    bar = Progress(len(texts) * (1 + len(settings.policies)), "prompt")
    for b, (ids, mask) in enumerate(batches):
        _run_batch(settings, model, tokenizer, ids, mask, settings.seed + b, tally, bar)
    bar.close()
    longest = max(int(mask.sum(-1).max()) for _, mask in batches) + settings.tokens
    header = settings.header(model)
    header.update(
        n_prompts=len(texts),
        batch_size=min(size, len(texts)),  # the batch actually run, not the flag
        longest_sequence=longest,
        compression=round(longest / settings.config.budget, 2),
    )
    return header, [tally.summary(name) for name in settings.policies]


def _read_inputs(settings: FidelitySettings) -> list[data.Example] | dict[str, Any]:
    """The prompts (or the probe file), read and checked before any model loads."""
    if settings.probe:
        return probe.read(settings.probe)
    return data.load_examples(settings.prompts, settings.data_dir)


def _needed(settings: FidelitySettings, inputs: list[data.Example] | dict[str, Any]) -> dict[str, int]:
    """The positions a run needs, known before tokenizing: the probe's whole sequence, or `--tokens` plus one
    prompt token (the prompts' lengths are checked again once they are tokenized)."""
    if settings.probe:
        n = len(inputs["prompt_ids"]) + len(inputs["reference_tokens"])
        return {f"the probe {settings.probe} ({n} tokens)": n}
    return {f"--tokens {settings.tokens}": settings.tokens + 1}


def run(
    settings: FidelitySettings,
    model=None,
    tokenizer=None,
    echo: bool = False,
    before_load: Callable[[], object] | None = None,
) -> list[Path]:
    """Run the evaluation and write its outputs; returns their paths. The inputs and the
    `[eval]` extras are checked first, so a bad file fails in well under a second, before
    the model loads. `echo` prints the results table at the end; `before_load` is called once
    every check has passed, right before the model loads (not at all when `model` is given)."""
    require_extras()
    inputs = _read_inputs(settings)
    if model is None:
        from vasepatch import models

        check_positions(settings.model, max_positions(settings.model), _needed(settings, inputs))
        if before_load is not None:
            before_load()
        model, tokenizer = models.load(settings.model)
    check_positions(settings.model, max_positions(model), _needed(settings, inputs))
    out = Path(settings.out)
    if settings.probe:
        header, results = probe.run_probe(settings, model, inputs)
        title = "Fixed probe: top-1 agreement with the full cache"
        plot = plots.probe_plot(results, header)
        return report.write(out, "probe", header, results, probe.COLUMNS, title, plot, echo=echo)
    header, results = run_prompts(settings, model, tokenizer, inputs)
    title = "Fidelity to the full cache"
    plot = plots.fidelity_plot(results, header)
    return report.write(out, "fidelity", header, results, PROMPT_COLUMNS, title, plot, echo=echo)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `vasepatch eval fidelity`; `--help` shows every default."""
    cli_options.use_help_formatter(p)
    d = FidelitySettings()
    p.add_argument("--model", default=d.model, help="registered name, HF directory or .gguf file")
    p.add_argument("--prompts", default=d.prompts, help="gsm8k:N, math500:N, aime25:N or a .jsonl file[:N]")
    p.add_argument(
        "--probe",
        default=None,
        help="a probe JSON file (prompt ids, reference tokens, dense predictions); replaces --prompts",
    )
    p.add_argument("--tokens", type=int_in(2), default=d.tokens, help="length of the sampled reference continuation")
    cli_options.add_cache_arguments(p, d.config, policies_default="all")
    cli_options.add_shared_heads_argument(p)
    p.add_argument(
        "--sample-temperature",
        "--reference-temperature",
        dest="sample_temperature",
        type=number_in(0, lo_open=True, what="the reference is sampled"),
        default=d.sample_temperature,
        help="sampling temperature of the reference and the free runs",
    )
    p.add_argument("--seeds", type=int_in(1), default=d.seeds, help="policy seeds per policy (probe only)")
    p.add_argument("--batch-size", type=int_in(1), default=d.batch_size, help="prompts per batch (left padded)")
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder with gsm8k/ math500/ aime25/ (default: $VASEPATCH_DATA_DIR, else the data shipped with vasepatch)",
    )
    p.add_argument("--out", type=output_dir, default=d.out, help="folder for the JSON, markdown and PNG results")


def main(args: argparse.Namespace) -> None:
    settings = FidelitySettings(
        model=args.model,
        config=cli_options.cache_config(args),
        policies=cli_options.parse_policies(args.policies),
        prompts=args.prompts,
        tokens=args.tokens,
        sample_temperature=args.sample_temperature,
        seeds=args.seeds,
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        probe=args.probe,
        out=args.out,
        shared_heads=args.shared_heads,
    )
    run(settings, echo=True, before_load=lambda: threads.warn_if_busy(args))  # a busy machine: one line
