"""`vasepatch generate`: stream a model's answer to one prompt through the vasepatch cache.

The text streams to stdout as it is generated; a live status line (tok/s, occupancy,
evictions, KV memory) sits under it while stderr is a terminal, and a summary follows.
`--compare` generates again with the full cache and prints both texts, their speeds and
KV memory side by side, and where the texts part.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vasepatch import models
from vasepatch.config import PREFILL_MODES, VaSEConfig
from vasepatch.tools import threads
from vasepatch.tools.cli_args import (
    check_positions,
    device,
    int_in,
    max_positions,
    number_in,
    policy_name,
    policy_names_text,
    read_utf8,
    seed,
)
from vasepatch.tools.streaming import LiveOutput, full_cache_bytes, human_bytes

if TYPE_CHECKING:
    import torch

MODEL_HELP = (
    f"a registered name ({', '.join(models.available())}), an HF directory, a .gguf file or a Hub id (org/name)"
)
DTYPES = ("bfloat16", "float16", "float32")
"""The `--dtype` choices: names of torch dtypes (torch is imported when the command runs, not to parse)."""


def policy_help() -> str:
    """The `--policy` help: what it is and every name it takes."""
    return f"selection policy: {policy_names_text()} (full never evicts)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = " (default: %(default)s)"
    p.add_argument("prompt", help="the prompt; - reads it from stdin (UTF-8)")
    p.add_argument("--model", default="smollm2-135m", help=MODEL_HELP + d)
    add_cache_options(p, "seeds VaSE's eviction sampling and --temperature sampling")
    p.add_argument("--max-new-tokens", type=int_in(1), default=512, help="stop after this many tokens" + d)
    p.add_argument(
        "--temperature",
        "--sample-temperature",
        dest="temperature",
        type=number_in(0, what="0 = greedy"),
        default=0.0,
        help="sampling temperature, 0 = greedy; the eval commands call it --sample-temperature" + d,
    )
    p.add_argument(
        "--top-p",
        type=number_in(0, 1, lo_open=True),
        default=1.0,
        help="nucleus sampling mass, with --temperature > 0" + d,
    )
    p.add_argument(
        "--repetition-penalty", type=number_in(0, lo_open=True, what="1.0 = none"), default=1.1, help="1.0 = none" + d
    )
    p.add_argument("--raw", action="store_true", help="feed the prompt as it is, without the chat template")
    p.add_argument("--compare", action="store_true", help="generate again with the full cache and compare")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N" + d)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV cache dtype" + d)


def add_cache_options(p: argparse.ArgumentParser, seed_help: str) -> None:
    """The cache options (`cache_config`): --budget, --window, --policy, --protect, --sinks, --prefill, --seed."""
    d = " (default: %(default)s)"
    p.add_argument(
        "--budget", type=int_in(2), default=256, help="KV pairs kept per layer and head after each eviction" + d
    )
    p.add_argument(
        "--window", type=int_in(1), default=64, help="recent tokens always kept; evicts every WINDOW tokens" + d
    )
    p.add_argument("--policy", type=policy_name, default="vase", help=policy_help() + d)
    p.add_argument("--protect", type=int_in(0), default=None, help="protected slots (default: budget // 4)")
    p.add_argument("--sinks", type=int_in(0), default=4, help="first tokens always kept" + d)
    p.add_argument("--prefill", choices=PREFILL_MODES, default="compress", help="compress, keep or pin the prompt" + d)
    p.add_argument("--seed", type=seed, default=0, help=seed_help + d)


def read_prompt(text: str, stdin: Any = None) -> str:
    """The prompt argument, or stdin's content for `-` (its bytes must be UTF-8: a `ValueError` names the
    first byte that is not, and its offset); an empty prompt is an error."""
    if text == "-":
        text = read_utf8(stdin or sys.stdin, "the prompt on stdin")
    if not text.strip():
        raise ValueError("prompt is empty (pass the text, or - and the text on stdin)")
    return text


def check_policy(config: VaSEConfig) -> None:
    """Build the config's policy once, so that an unknown name or option fails before any model loads."""
    from vasepatch.integration.patching import policy_for

    policy_for(config)


def cache_config(args: argparse.Namespace) -> VaSEConfig:
    """The validated cache settings, checked before any model is loaded (policy name included)."""
    config = VaSEConfig(
        budget=args.budget,
        window=args.window,
        protect=args.protect,
        sinks=args.sinks,
        policy=args.policy,
        seed=args.seed,
        prefill=args.prefill,
    )
    check_policy(config)
    return config


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """`generate` keywords for the sampling flags (ValueError naming a bad one)."""
    if not args.temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"top-p must lie in (0, 1], got {args.top_p}")
    if not args.repetition_penalty > 0:
        raise ValueError(f"repetition-penalty must be > 0 (1.0 = none), got {args.repetition_penalty}")
    options: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "repetition_penalty": args.repetition_penalty}
    if args.temperature > 0:
        options.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0)
    else:
        options.update(do_sample=False)
    return options


def encode(tokenizer: Any, prompt: str, raw: bool, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Token ids of the prompt, through the chat template unless `raw` (or the tokenizer has none)."""
    if not raw and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        if not raw:
            print("vasepatch: the tokenizer has no chat template; using the prompt as it is", file=sys.stderr)
        inputs = tokenizer(prompt, return_tensors="pt")
    return {k: v.to(device) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}


@dataclass
class Run:
    """One generation: its text and token ids, speed, and KV memory."""

    label: str
    text: str
    ids: list[int]
    seconds: float
    prefill_seconds: float
    rate: float | None
    kv_bytes: int
    full_kv_bytes: int
    stats: dict[str, int] | None = None
    first_evicted: int | None = None

    @property
    def tokens(self) -> int:
        return len(self.ids)


def dense_cache_bytes(cache: Any) -> int:
    """K+V bytes held by transformers' own (dynamic) cache."""
    import torch

    layers = getattr(cache, "layers", None) or []
    return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


def generate_once(
    model: Any,
    tokenizer: Any,
    inputs: dict[str, torch.Tensor],
    options: dict[str, Any],
    live: LiveOutput,
    config: VaSEConfig | None,
    label: str,
) -> Run:
    """Generate once, streaming through `live`: patched with `config`, or with the full cache
    (`config=None`). Sampling draws from torch's generator seeded with `options["seed"]`, in a forked RNG
    state, so the caller's random state is left as it was."""
    import torch

    import vasepatch
    from vasepatch.integration.compat import output_cache
    from vasepatch.tools.streaming import TokenStreamer

    seed = options.get("seed", 0)
    kwargs = {k: v for k, v in options.items() if k != "seed"}
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    handle = vasepatch.patch(model, config=config) if config is not None else None
    try:
        streamer = TokenStreamer(tokenizer, live, handle.stats if handle else None)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = model.generate(**inputs, **kwargs, streamer=streamer, return_dict_in_generate=True)
        stats = handle.stats() if handle else None
    finally:
        if handle is not None:
            handle.remove()
    ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    if stats is not None:
        kv, full = stats["kv_bytes"], full_cache_bytes(stats)
    else:
        kv = full = dense_cache_bytes(output_cache(out))
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return Run(label, text, ids, streamer.seconds, streamer.prefill_seconds, streamer.decode_rate, kv, full, stats,
               streamer.first_evicted)  # fmt: skip


def summary(run: Run) -> str:
    """`vasepatch: 384 tokens in 35.1 s (11.0 tok/s), 11 evictions, KV 7.03 MiB vs 21.45 MiB full (3.05x less)`."""
    rate = f"{run.rate:.1f} tok/s" if run.rate else "- tok/s"
    line = f"{run.label}: {run.tokens} tokens in {run.seconds:.1f} s ({rate}, prefill {run.prefill_seconds:.2f} s)"
    if run.stats is None:
        return f"{line}, KV {human_bytes(run.kv_bytes)}"
    return (
        f"{line}, {run.stats['evictions']} evictions, KV {human_bytes(run.kv_bytes)} "
        f"vs {human_bytes(run.full_kv_bytes)} for the full cache ({compare_memory(run.kv_bytes, run.full_kv_bytes)})"
    )


def compare_memory(ours: int, full: int) -> str:
    """`3.05x less`, or, when the run is shorter than the buffer, `7.81x more: the buffer holds
    budget + window slots whatever the length; the budget pays off on long generations`."""
    if ours and full >= ours:
        return f"{full / ours:.2f}x less"
    if not full:
        return "no full-cache figure"
    return (
        f"{ours / full:.2f}x more: the buffer holds budget + window slots whatever the length, "
        "so it pays off only once a generation outgrows it"
    )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first generated token where `a` and `b` differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _snippet(text: str, width: int, tail: bool = False) -> str:
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    return "..." + flat[-width:] if tail else flat[:width] + "..."


def explain_difference(tokenizer: Any, ours: Run, full: Run) -> list[str]:
    """Where the vasepatch text leaves the full-cache text, and why it can."""
    i = first_difference(ours.ids, full.ids)
    if i is None:
        why = "no eviction happened" if ours.first_evicted is None else "the evictions did not flip any token"
        return [f"The two texts are identical ({why})."]
    common = tokenizer.decode(ours.ids[:i], skip_special_tokens=True)
    lines = [
        f"The texts agree on the first {i} generated tokens, then part:",
        f'  common:     "{_snippet(common, 70, tail=True)}"',
        f'  {ours.label + ":":<11} "{_snippet(tokenizer.decode(ours.ids[i : i + 16], skip_special_tokens=True), 70)}"',
        f'  {full.label + ":":<11} "{_snippet(tokenizer.decode(full.ids[i : i + 16], skip_special_tokens=True), 70)}"',
        "Why: an eviction drops KV pairs, so every later token attends only to what the policy kept. The "
        "next-token scores shift a little; once one choice flips, each later token continues a different text.",
    ]
    if ours.first_evicted == 1:  # counted when the first token arrives: the prompt was compressed at prefill
        lines.append(
            "Here the prompt was longer than the budget and was compressed at prefill, so every generated token "
            f"attended to the compressed prompt; the texts stayed the same until token {i}."
        )
    elif ours.first_evicted is not None:
        lines.append(
            f"Here the first eviction took effect at generated token {ours.first_evicted}; "
            f"the texts stayed the same until token {i}."
        )
    return lines


def comparison_table(runs: list[Run]) -> list[str]:
    """Speeds and KV memory of the runs side by side."""
    rows = [
        ("generated tokens", [str(r.tokens) for r in runs]),
        ("time (s)", [f"{r.seconds:.1f}" for r in runs]),
        ("decode tok/s", [f"{r.rate:.1f}" if r.rate else "-" for r in runs]),
        ("KV memory", [human_bytes(r.kv_bytes) for r in runs]),
        ("evictions", [str(r.stats["evictions"]) if r.stats else "0" for r in runs]),
    ]
    width = max(12, *(len(r.label) for r in runs))
    lines = [f"{'':<18}" + "".join(f"{r.label:>{width + 2}}" for r in runs)]
    lines += [f"{name:<18}" + "".join(f"{v:>{width + 2}}" for v in values) for name, values in rows]
    return lines


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def run(args: argparse.Namespace) -> None:
    prompt = read_prompt(args.prompt)
    config = cache_config(args)
    options = {**sampling_options(args), "seed": args.seed}
    # resolves the model before any line is printed: a name or folder that is none is one line, exit 2
    check_positions(args.model, max_positions(args.model), {"--max-new-tokens": args.max_new_tokens})
    threads.warn_if_busy(args)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model, tokenizer = models.load(args.model, dtype=_torch_dtype(args.dtype), device=args.device)
    inputs = encode(tokenizer, prompt, args.raw, model.device)
    live = LiveOutput(sys.stdout, sys.stderr)
    ours = f"vasepatch (budget={config.budget}, window={config.window}, policy={config.policy}"
    ours += ")" if config.prefill == "compress" else f", prefill={config.prefill})"
    if args.compare:
        print(f"--- {ours} ---", flush=True)
    runs = [generate_once(model, tokenizer, inputs, options, live, config, "vasepatch")]
    print(summary(runs[0]), file=sys.stderr, flush=True)
    if not args.compare:
        return
    print("\n--- full cache (no eviction) ---", flush=True)
    runs.append(generate_once(model, tokenizer, inputs, options, live, None, "full cache"))
    print(summary(runs[1]), file=sys.stderr, flush=True)
    print(f"\n--- {inputs['input_ids'].shape[1]} prompt tokens; {ours} vs the full cache ---")
    print("\n".join(comparison_table(runs)))
    print()
    print("\n".join(explain_difference(tokenizer, runs[0], runs[1])))
