"""The pass-key task through vLLM (the vasepatch plugin), compared with the committed transformers run.

    VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python benchmarks/vllm_passkey.py \\
        --reference docs/results/smollm2-passkey --out docs/results/vllm-passkey

The prompts are the transformers run's own: `vasepatch.eval.passkey.items` with the settings read from
the header of `<reference>/passkey.json` (model, samples, depths, seed, max_new_tokens, cache settings),
tokenised as `vasepatch.eval.data.encode` tokenises them and handed to vLLM as token ids
(`TokensPrompt`), so both engines see the same tokens. Every (policy, context length, sample) request
goes to one `vllm.LLM` (float32, eager, no prefix caching) in a single `generate` call, greedy, with the
policy and cache settings as per-request `extra_args` (`vasepatch_policy="full"`: vLLM's full cache).
Answers are graded and summarised by `vasepatch.eval.passkey` (`make_record`, `summarise`).

Written to `--out`: `passkey-<policy>.jsonl` (one record per prompt, as the transformers run writes them,
plus the transformers answer), `passkey.json` and `passkey.md`: per (policy, length) the vLLM and the
transformers accuracy with their standard errors, the difference, its standard error
`sqrt(se_vllm**2 + se_transformers**2)` (independent samples) and whether the difference is within two
of them, and how many prompts got the same answer text (and the same grade) from both.

The transformers run answered batches of 8 left-padded prompts, and VaSE's randomness is keyed by the
batch row, so `vase` is not expected to agree prompt by prompt (a vLLM request is always row 0);
`snapkv` and `full` are deterministic, so their differences come from numerics and padding alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV pool
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vasepatch import models
from vasepatch.cache import footprint
from vasepatch.config import FULL, VaSEConfig
from vasepatch.eval import answers, data, passkey
from vasepatch.eval.task_settings import PASSKEY, TaskSettings
from vasepatch.reporting.tables import markdown_table

CACHE_KEYS = ("budget", "window", "protect", "sinks", "temperature", "smooth", "seed")
COLUMNS = (
    "policy",
    "context_length",
    "n",
    "vllm_accuracy",
    "vllm_stderr",
    "hf_accuracy",
    "hf_stderr",
    "difference",
    "diff_stderr",
    "within_2se",
    "same_answer",
    "same_grade",
)


def settings_from(reference: dict[str, Any], args: argparse.Namespace) -> TaskSettings:
    """The transformers run's settings (its `passkey.json` header), with this run's policies, lengths, samples."""
    head = reference["config"]
    if head.get("prefill", "compress") != "compress":
        raise SystemExit(f"the reference run used prefill={head['prefill']!r}; the plugin always compresses")
    config = VaSEConfig(**{k: head[k] for k in CACHE_KEYS}, prefill="compress")
    return TaskSettings(
        model=head["model"],
        task=PASSKEY,
        config=config,
        policies=args.policies,
        samples=args.samples or head["samples"],
        sample_temperature=head["sample_temperature"],
        max_new_tokens=head["max_new_tokens"],
        batch_size=head["batch_size"],
        context_lengths=args.context_lengths,
        depths=head["depths"],
        out=args.out,
    )


def request_args(name: str, config: VaSEConfig) -> dict[str, Any]:
    """The plugin's per-request settings of policy `name` (`"full"`: vLLM's own full cache)."""
    if name == FULL:
        return {"vasepatch_policy": FULL}
    return {"vasepatch_policy": name, **{f"vasepatch_{k}": getattr(config, k) for k in CACHE_KEYS}}


def prompts(settings: TaskSettings, tokenizer) -> list[tuple[answers.Item, list[int]]]:
    """Every prompt of every context length with its token ids (as the transformers run tokenised it)."""
    out = []
    for length in settings.context_lengths:
        for item in passkey.items(settings, tokenizer, length):
            ids, _ = data.encode(tokenizer, [item.prompt])
            ids = ids[0].tolist()
            if len(ids) != item.fields["prompt_tokens"]:
                raise SystemExit(
                    f"{item.ident}: {len(ids)} tokens, the haystack counted {item.fields['prompt_tokens']}"
                )
            out.append((item, ids))
    return out


def generate(path: str, settings: TaskSettings, work: list[tuple[str, list[int]]], block_size: int):
    """vLLM's greedy completions of `(policy, token ids)` requests, all in one `generate` call; and its seconds."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        path,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
        block_size=block_size,
        max_model_len=max(len(ids) for _, ids in work) + settings.max_new_tokens,
        seed=settings.config.seed,
    )
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=settings.max_new_tokens,
            extra_args=request_args(name, settings.config),
        )
        for name, _ in work
    ]
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in work], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.llm_engine.engine_core.shutdown()
    return [o.outputs[0] for o in outputs], seconds


def kv_bytes(config: VaSEConfig | None, prompt: int, new: int, block_size: int, per_token: int) -> float:
    """The bytes of the blocks the request holds at its end, from the plugin's block math
    (`footprint.held_at_end`: the prompt compressed to `budget`, then one slot per answer token but the last)."""
    return float(footprint.block_bytes(footprint.held_at_end(config, prompt, new), block_size, per_token))


def load_reference(folder: Path, name: str) -> dict[tuple[int, int], dict[str, Any]]:
    """The transformers run's records of policy `name`, by (context length, index)."""
    path = folder / f"{PASSKEY}-{name}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["context_length"], r["index"]): r for r in records}


def bytes_per_token(path: str) -> int:
    """K and V bytes of one token over all layers (float32), from the model's config (`footprint`'s count)."""
    from transformers import AutoConfig

    return footprint.model_bytes_per_token(AutoConfig.from_pretrained(path), footprint.dtype_bytes("float32"))


def records_of(name, settings, tokenizer, done, reference, sizes) -> list[dict[str, Any]]:
    """The records of policy `name` (`done`: its `(item, ids, output)`), each with the transformers answer."""
    config = None if name == FULL else settings.config.replace(policy=name)
    key = settings.run_key(name, "LlamaForCausalLM")  # the reference run's key, with vLLM's batching
    key = json.dumps({"engine": "vllm", **key, "batch_size": None, "reference_batch_size": key["batch_size"]})
    out = []
    for item, ids, output in done:
        tokens = list(output.token_ids)
        size = kv_bytes(config, len(ids), len(tokens), *sizes)
        completion = answers.Completion(tokens, len(ids), output.finish_reason == "length", size)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        record = {**passkey.make_record(item, completion, text), "policy": name, "kv_bytes": size}
        hf = reference[(item.fields["context_length"], item.fields["index"])]
        if hf["key"] != record["key"] or hf["prompt_tokens"] != record["prompt_tokens"]:
            raise SystemExit(
                f"{item.ident}: not the reference run's prompt (key, length {hf['key']}, {hf['prompt_tokens']})"
            )
        record.update(hf_output=hf["output"], hf_correct=hf["correct"], same_answer=hf["output"] == text)
        out.append({**record, "run": key})
    return out


def compare(name: str, records, settings: TaskSettings, reference) -> list[dict]:
    """Per context length: vLLM against the transformers run (accuracy, stderr, difference, agreement); the
    transformers accuracy is summarised from its records of the same prompts."""
    rows, _ = passkey.summarise(name, records, settings)
    hf_records = [reference[(r["context_length"], r["index"])] for r in records]
    hf_rows = {r["context_length"]: r for r in passkey.summarise(name, hf_records, settings)[0]}
    out = []
    for row in rows:
        length = row["context_length"]
        hf = hf_rows[length]
        at = [r for r in records if r["context_length"] == length]
        diff = row["accuracy"] - hf["accuracy"]
        se = math.hypot(row["stderr"], hf["stderr"])
        out.append(
            {
                "policy": name,
                "context_length": length,
                "n": row["n"],
                "vllm_accuracy": row["accuracy"],
                "vllm_stderr": row["stderr"],
                "hf_accuracy": hf["accuracy"],
                "hf_stderr": hf["stderr"],
                "difference": diff,
                "diff_stderr": se,
                "within_2se": abs(diff) <= 2 * se + 1e-12,
                "same_answer": sum(r["same_answer"] for r in at),
                "same_grade": sum(r["correct"] == r["hf_correct"] for r in at),
                "prompt_tokens": row["prompt_tokens"],
                "kv_bytes": row["kv_bytes"],
            }
        )
    return out


def depth_rows(name: str, records, settings: TaskSettings, reference) -> list[dict]:
    """Per (context length, depth): the vLLM and the transformers accuracy."""
    hf_records = [reference[(r["context_length"], r["index"])] for r in records]
    ours = passkey.summarise(name, records, settings)[1]
    theirs = passkey.summarise(name, hf_records, settings)[1]
    return [{**a, "hf_accuracy": b["accuracy"]} for a, b in zip(ours, theirs, strict=True)]


def write(out: Path, header: dict[str, Any], rows, by_depth, per_policy: dict[str, list[dict]]) -> None:
    """`passkey-<policy>.jsonl`, `passkey.json` and `passkey.md` under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name, records in per_policy.items():
        with open(out / f"{PASSKEY}-{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    content = {"config": header, "results": rows, "by_depth": by_depth}
    (out / f"{PASSKEY}.json").write_text(json.dumps(content, indent=2) + "\n")
    shown = {k: v for k, v in header.items() if k != "command"}
    settings = ", ".join(f"{k}={v}" for k, v in shown.items())
    text = (
        "**Pass-key retrieval: vLLM (vasepatch plugin) against the committed transformers run**\n\n"
        f"```bash\n{header['command']}\n```\n\n({settings})\n\n"
        "`difference` is vLLM minus transformers; `diff_stderr` is its standard error "
        "`sqrt(vllm_stderr**2 + hf_stderr**2)` (the two runs taken as independent samples); `within_2se`: "
        "`|difference| <= 2 * diff_stderr`. `same_answer`: prompts whose answer text is identical in both runs; "
        "`same_grade`: prompts graded the same (both right or both wrong). vLLM batches the requests itself "
        "(`batch_size` none); `kv_bytes` in the JSON is the blocks a request holds at its end, from the "
        "plugin's block math (not measured).\n\n"
        f"{markdown_table(rows, COLUMNS)}\n**by_depth** (vLLM `accuracy`, transformers `hf_accuracy`)\n\n"
        f"{markdown_table(by_depth, ('policy', 'context_length', 'depth', 'accuracy', 'hf_accuracy', 'n'))}"
    )
    (out / f"{PASSKEY}.md").write_text(text)


def header_of(settings: TaskSettings, args: argparse.Namespace, requests: int, seconds: float, start: float) -> dict:
    """The command, the settings (the transformers run's header, less its batching), and vLLM's own."""
    import vllm

    head = settings.header(None)
    head.pop("model_class")
    head["reference_batch_size"] = head.pop("batch_size")
    argv = shlex.join(["benchmarks/vllm_passkey.py", *sys.argv[1:]])
    return {
        "command": f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} .venv-vllm/bin/python {argv}",
        "reference": args.reference,
        **head,
        "engine": f"vllm {vllm.__version__}",
        "block_size": args.block_size,
        "requests": requests,
        "generate_seconds": round(seconds, 1),
        "wall_seconds": round(time.perf_counter() - start, 1),  # with the engine's start and the prompts
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", default="docs/results/smollm2-passkey", help="the transformers run's folder")
    parser.add_argument("--out", default="docs/results/vllm-passkey")
    parser.add_argument("--policies", type=lambda s: s.split(","), default=[FULL, "vase", "snapkv"])
    parser.add_argument("--context-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024])
    parser.add_argument("--samples", type=int, default=None, help="default: the reference run's")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's block size (a multiple of 32 on the CPU)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    reference = Path(args.reference)
    settings = settings_from(json.loads((reference / f"{PASSKEY}.json").read_text()), args)
    from transformers import AutoTokenizer

    path = str(models.resolve(settings.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    todo = prompts(settings, tokenizer)
    work = [(name, item, ids) for name in settings.policies for item, ids in todo]
    outputs, seconds = generate(path, settings, [(name, ids) for name, _, ids in work], args.block_size)
    sizes = (args.block_size, bytes_per_token(path))
    rows, by_depth, per_policy = [], [], {}
    for name in settings.policies:
        done = [(item, ids, o) for (n, item, ids), o in zip(work, outputs, strict=True) if n == name]
        ref = load_reference(reference, name)
        per_policy[name] = records_of(name, settings, tokenizer, done, ref, sizes)
        rows += compare(name, per_policy[name], settings, ref)
        by_depth += depth_rows(name, per_policy[name], settings, ref)
    header = header_of(settings, args, len(work), seconds, start)
    write(Path(args.out), header, rows, by_depth, per_policy)
    print(markdown_table(rows, COLUMNS))
    print(f"{len(work)} requests in {seconds:.1f} s; written to {args.out}")


if __name__ == "__main__":
    main()
