"""`vasepatch eval fidelity`: how close each policy stays to the full cache.

Per prompt batch:

1. A reference continuation of `tokens` tokens is *sampled* from the full cache
   (`reference_temperature`, seeded, EOS/BOS/padding tokens suppressed so every
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
tokens, dense predictions) for several policy seeds.
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
from vasepatch.eval import data, metrics, report
from vasepatch.eval.forcing import teacher_force

# Our policy names -> the probe file's anchor results of the authors' implementation. (Its kvpress
# anchors are another library's policies, with known differences, so they are not matched.)
PROBE_ANCHORS = {
    "full": "dense",
    "vase": "authors_vase_attnv_range_sink_sample_attn_n_large_64_smooth",
    "vase-dkv": "authors_vase_dkv_cur_resample_gauss",
    "snapkv": "authors_snapkv_style_attn_smooth",
    "rkv": "authors_rkv_lambda_0.5_smooth",
    "evict-large": "authors_ablation_evict_large_range",
}
METRICS = ("kl", "top1", "nll_delta")


@dataclass
class Settings:
    """What `vasepatch eval fidelity` runs (the CLI flags, validated)."""

    model: str = "smollm2-135m"
    prompts: str = "gsm8k:16"
    tokens: int = 768
    budget: int = 256
    window: int = 64
    protect: int | None = None
    sinks: int = 4
    temperature: float = 1.0
    smooth: int = 5
    policies: list[str] = field(default_factory=lambda: ["full", "vase", "snapkv"])
    reference_temperature: float = 0.8
    seed: int = 0
    seeds: int = 3
    batch_size: int = 4
    data_dir: str | None = None
    probe: str | None = None
    out: str = "fidelity-results"

    def __post_init__(self) -> None:
        if self.tokens < 2:
            raise ValueError(f"tokens must be >= 2, got {self.tokens}")
        if self.batch_size < 1 or self.seeds < 1:
            raise ValueError(f"batch_size and seeds must be >= 1, got {self.batch_size}, {self.seeds}")
        if not self.reference_temperature > 0:
            raise ValueError(
                f"reference_temperature must be > 0 (the reference is sampled), got {self.reference_temperature}"
            )
        unknown = [p for p in self.policies if p not in policies.available()]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; registered: {', '.join(policies.available())}")
        self.policies = ["full", *[p for p in self.policies if p != "full"]]  # the reference comes first
        self.policy_config("vase")  # validates budget/window/protect/... before any work

    def policy_config(self, name: str, seed: int | None = None, full_length: int = 0) -> VaSEConfig:
        budget = max(full_length, self.window + 1) if name == "full" else self.budget
        return VaSEConfig(
            budget=budget,
            window=self.window,
            protect=None if name == "full" else self.protect,
            sinks=self.sinks,
            policy=name,
            temperature=self.temperature,
            smooth=self.smooth,
            seed=self.seed if seed is None else seed,
        )


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True)


def _end_ids(model, tokenizer) -> list[int]:
    """Tokens that end or frame a turn (EOS, BOS, padding): suppressed in forced-length samples."""
    ids: set[int] = set()
    for source in (model.generation_config, tokenizer):
        for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(source, attr, None)
            ids.update([value] if isinstance(value, int) else list(value or []))
    return sorted(ids)


def sample(model, ids, mask, settings: Settings, seed: int, pad_id: int, suppress: list[int]) -> torch.Tensor:
    """`[B, tokens]` sampled tokens (forced length, EOS suppressed), seeded."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=settings.reference_temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=settings.tokens,
            min_new_tokens=settings.tokens,
            suppress_tokens=suppress,
            pad_token_id=pad_id,
        )
    return out[:, ids.shape[1] :]


def force_metrics(model, configs: dict[str, VaSEConfig], ids, mask, continuation) -> dict[str, dict[str, torch.Tensor]]:
    """Teacher-force `continuation` through a cache per config, against the `full` one:
    `{name: {"kl"|"top1"|"nll_delta": [B, T]}}` (the `full` entry is the reference)."""
    if next(iter(configs)) != "full":
        raise ValueError("the first config must be the 'full' reference")
    out: dict[str, dict[str, list[torch.Tensor]]] = {n: {m: [] for m in METRICS} for n in configs}
    with vasepatch.patched(model, config=configs["full"]) as handle:
        caches = {name: handle.new_cache(cfg) for name, cfg in configs.items()}
        for start, logits in teacher_force(model, handle.cache_keyword, caches, ids, mask, continuation):
            ref = logits["full"]
            targets = continuation[:, start : start + ref.shape[1]]
            for name, lg in logits.items():
                for m, v in metrics.next_token_metrics(ref, lg, targets).items():
                    out[name][m].append(v)
    return {n: {m: torch.cat(v, 1) for m, v in d.items()} for n, d in out.items()}


def run_prompts(settings: Settings, model, tokenizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    examples = data.load_examples(settings.prompts, settings.data_dir)
    texts = data.chat_prompts(tokenizer, [e.question for e in examples])
    batches = [texts[i : i + settings.batch_size] for i in range(0, len(texts), settings.batch_size)]
    pad_id = tokenizer.pad_token_id
    suppress = _end_ids(model, tokenizer)
    names = settings.policies
    per_row: dict[str, dict[str, list[torch.Tensor]]] = {n: {m: [] for m in METRICS} for n in names}
    free: dict[str, dict[str, list[float]]] = {n: {"loop": [], "div": []} for n in names}
    longest = 0
    bar = _progress(len(batches) * (1 + len(names)), "fidelity")
    for b, batch in enumerate(batches):
        ids, mask = data.encode(tokenizer, batch)
        full_length = ids.shape[1] + settings.tokens
        longest = max(longest, int(mask.sum(-1).max()) + settings.tokens)
        configs = {n: settings.policy_config(n, full_length=full_length) for n in names}
        with vasepatch.patched(model, config=configs["full"]):
            reference = sample(model, ids, mask, settings, settings.seed + b, pad_id, suppress)
        bar.update(1)
        for name, values in force_metrics(model, configs, ids, mask, reference).items():
            for m, v in values.items():
                per_row[name][m].append(v)
        for name in names:
            if name == "full":
                tokens = reference
            else:
                with vasepatch.patched(model, config=configs[name]):
                    tokens = sample(model, ids, mask, settings, settings.seed + b, pad_id, suppress)
            for row, ref_row in zip(tokens.tolist(), reference.tolist(), strict=True):
                free[name]["loop"].append(float(metrics.is_looping(row)))
                free[name]["div"].append(float(metrics.first_divergence(row, ref_row)))
            bar.update(1)
    bar.close()

    results = []
    for name in names:
        rows = {m: torch.cat(v, 0) for m, v in per_row[name].items()}  # [n_prompts, T]
        top1_mean, top1_se = metrics.mean_stderr(rows["top1"].mean(-1).tolist())
        kl_mean, kl_se = metrics.mean_stderr(rows["kl"].mean(-1).tolist())
        loop_mean, _ = metrics.mean_stderr(free[name]["loop"])
        div_mean, _ = metrics.mean_stderr(free[name]["div"])
        results.append(
            {
                "policy": name,
                "kl": kl_mean,
                "kl_stderr": kl_se,
                "top1_agreement": top1_mean,
                "top1_stderr": top1_se,
                "nll_delta": rows["nll_delta"].mean().item(),
                "loop_rate": loop_mean,
                "first_divergence": div_mean,
                "n_prompts": rows["top1"].shape[0],
                "n_tokens": rows["top1"].numel(),
                "kl_by_position": rows["kl"].mean(0).tolist(),
            }
        )
    config = _config_dict(settings, model)
    config["longest_sequence"] = longest
    config["compression"] = round(longest / settings.budget, 2)
    return config, results


def run_probe(settings: Settings, model, tokenizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    probe = json.loads(Path(settings.probe).read_text())
    ids = torch.tensor([probe["prompt_ids"]])
    mask = torch.ones_like(ids)
    reference = torch.tensor([probe["reference_tokens"]])
    file_dense = torch.tensor(probe["dense_predictions"])
    anchors = probe.get("anchor_results_top1_agreement", {})
    full_length = ids.shape[1] + reference.shape[1]
    configs = {"full": settings.policy_config("full", full_length=full_length)}
    for name in settings.policies:
        if name != "full":
            for s in range(settings.seeds):
                configs[f"{name}@{s}"] = settings.policy_config(name, seed=settings.seed + s)
    bar = _progress(1, "probe")
    dense_pred: list[torch.Tensor] = []
    agree: dict[str, list[torch.Tensor]] = {n: [] for n in configs}
    values: dict[str, dict[str, list[torch.Tensor]]] = {n: {m: [] for m in METRICS} for n in configs}
    with vasepatch.patched(model, config=configs["full"]) as handle:
        caches = {name: handle.new_cache(cfg) for name, cfg in configs.items()}
        for start, logits in teacher_force(model, handle.cache_keyword, caches, ids, mask, reference):
            ref = logits["full"]
            targets = reference[:, start : start + ref.shape[1]]
            dense_pred.append(ref.argmax(-1)[0])
            for name, lg in logits.items():
                agree[name].append(lg.argmax(-1)[0])
                for m, v in metrics.next_token_metrics(ref, lg, targets).items():
                    values[name][m].append(v[0])
    bar.update(1)
    bar.close()
    dense = torch.cat(dense_pred)
    results = []
    for name in settings.policies:
        keys = ["full"] if name == "full" else [f"{name}@{s}" for s in range(settings.seeds)]
        top1 = [(torch.cat(agree[k]) == dense).float().mean().item() for k in keys]
        vs_file = [(torch.cat(agree[k]) == file_dense).float().mean().item() for k in keys]
        mean, se = metrics.mean_stderr(top1)
        anchor = anchors.get(PROBE_ANCHORS.get(name, ""))
        results.append(
            {
                "policy": name,
                "top1_agreement": mean,
                "top1_stderr": se,
                "top1_seeds": [round(t, 4) for t in top1],
                "top1_vs_file_dense": metrics.mean_stderr(vs_file)[0],
                "kl": sum(torch.cat(values[k]["kl"]).mean().item() for k in keys) / len(keys),
                "nll_delta": sum(torch.cat(values[k]["nll_delta"]).mean().item() for k in keys) / len(keys),
                "reference_implementation": anchor["mean"] if isinstance(anchor, dict) else anchor,
                "n_tokens": int(dense.numel()),
            }
        )
    config = _config_dict(settings, model)
    for unused in ("prompts", "tokens", "reference_temperature", "batch_size"):
        config.pop(unused)
    config["probe"] = Path(settings.probe).name
    config["dense_matches_file"] = (dense == file_dense).float().mean().item()
    return config, results


def _config_dict(settings: Settings, model) -> dict[str, Any]:
    d = {k: v for k, v in vars(settings).items() if k not in ("out", "data_dir", "probe", "seeds")}
    if settings.probe:
        d["seeds"] = settings.seeds
    d["model_class"] = type(model).__name__
    d["protect_effective"] = settings.policy_config("vase").n_protect
    d["torch"] = torch.__version__
    import transformers

    d["transformers"] = transformers.__version__
    return d


def _plot_prompts(results: list[dict[str, Any]]):
    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
        for r in results:
            if r["policy"] == "full":
                continue
            kl = torch.tensor(r["kl_by_position"])
            width = 32
            n = len(kl) // width * width
            smooth = kl[:n].view(-1, width).mean(-1)
            ax1.plot(torch.arange(len(smooth)) * width + width / 2, smooth, label=r["policy"])
        ax1.set(
            xlabel="generated position", ylabel=f"KL(full || policy), mean over prompts and {32} tokens", yscale="log"
        )
        ax1.legend(fontsize=7, ncol=2)
        ordered = sorted(results, key=lambda r: r["top1_agreement"])
        ax2.barh(
            [r["policy"] for r in ordered],
            [r["top1_agreement"] for r in ordered],
            xerr=[r["top1_stderr"] for r in ordered],
        )
        lo = min(r["top1_agreement"] for r in ordered)
        ax2.set(xlabel="top-1 agreement with the full cache", xlim=(max(0.0, lo - 0.05), 1.0))
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return plot


def _plot_probe(results: list[dict[str, Any]]):
    def plot(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        names = [r["policy"] for r in results]
        y = torch.arange(len(names), dtype=torch.float32)
        ax.barh(
            y - 0.2,
            [r["top1_agreement"] for r in results],
            height=0.4,
            xerr=[r["top1_stderr"] for r in results],
            label="vasepatch",
        )
        ref = [r["reference_implementation"] for r in results]
        ax.barh(
            [yy + 0.2 for yy, v in zip(y.tolist(), ref, strict=True) if v is not None],
            [v for v in ref if v is not None],
            height=0.4,
            label="reference implementation (probe file)",
        )
        ax.set_yticks(y.tolist(), names)
        lo = min(r["top1_agreement"] for r in results)
        ax.set(xlabel="top-1 agreement with the full cache", xlim=(max(0.0, lo - 0.05), 1.0))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return plot


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
)
PROBE_COLUMNS = (
    "policy",
    "top1_agreement",
    "top1_stderr",
    "reference_implementation",
    "top1_seeds",
    "top1_vs_file_dense",
    "kl",
    "nll_delta",
)


def run(settings: Settings, model=None, tokenizer=None) -> list[Path]:
    """Run the evaluation and write its outputs; returns their paths."""
    if model is None:
        from vasepatch import models

        model, tokenizer = models.load(settings.model)
    out = Path(settings.out)
    if settings.probe:
        config, results = run_probe(settings, model, tokenizer)
        return report.write(
            out,
            "probe",
            config,
            results,
            PROBE_COLUMNS,
            "Fixed probe: top-1 agreement with the full cache",
            _plot_probe(results),
        )
    config, results = run_prompts(settings, model, tokenizer)
    return report.write(
        out, "fidelity", config, results, PROMPT_COLUMNS, "Fidelity to the full cache", _plot_prompts(results)
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--model", default=d.model, help="registered name, HF directory or .gguf file")
    p.add_argument("--prompts", default=d.prompts, help="gsm8k:N, math500:N, aime25:N or a .jsonl file[:N]")
    p.add_argument("--probe", default=None, help="a probe JSON file (prompt ids, reference tokens, dense predictions)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="length of the sampled reference continuation")
    p.add_argument("--budget", type=int, default=d.budget)
    p.add_argument("--window", type=int, default=d.window)
    p.add_argument("--protect", type=int, default=None, help="protected slots (default budget // 4)")
    p.add_argument("--sinks", type=int, default=d.sinks)
    p.add_argument("--temperature", type=float, default=d.temperature, help="attention-score softmax temperature")
    p.add_argument("--smooth", type=int, default=d.smooth)
    p.add_argument("--policies", default="all", help="comma-separated policy names, or 'all'")
    p.add_argument("--reference-temperature", type=float, default=d.reference_temperature)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--seeds", type=int, default=d.seeds, help="policy seeds per policy (probe only)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts per batch (left padded)")
    p.add_argument("--data-dir", default=None, help="folder with gsm8k/ math500/ aime25/ (or $VASEPATCH_DATA_DIR)")
    p.add_argument("--out", default=d.out)


def parse_policies(text: str) -> list[str]:
    if text == "all":
        return policies.available()
    return [p.strip() for p in text.split(",") if p.strip()]


def main(args: argparse.Namespace) -> None:
    settings = Settings(
        model=args.model,
        prompts=args.prompts,
        tokens=args.tokens,
        budget=args.budget,
        window=args.window,
        protect=args.protect,
        sinks=args.sinks,
        temperature=args.temperature,
        smooth=args.smooth,
        policies=parse_policies(args.policies),
        reference_temperature=args.reference_temperature,
        seed=args.seed,
        seeds=args.seeds,
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        probe=args.probe,
        out=args.out,
    )
    for path in run(settings):
        print(path)
