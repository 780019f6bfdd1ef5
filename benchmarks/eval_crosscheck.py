"""Where two engines' greedy answers part, and by how much the model hesitated there.

Reads two runs of `vasepatch eval task` that answered the same problems greedily with the full cache
(say, the transformers path and `--engine vllm`, both float32), counts the answers that are identical,
and for each pair that parts, re-tokenizes both answers, finds the first token where they differ, and
runs the unpatched model (transformers, float32) on the prompt plus the shared prefix. Its logits
there say whether the parting is a near-tie that float rounding can flip (a gap of a few hundredths
between the top two logits) or a real difference in what the engines computed (a large gap).

    python benchmarks/eval_crosscheck.py \\
        --a docs/results/qwen-gsm8k-crosscheck/transformers-greedy/gsm8k-full.jsonl \\
        --b docs/results/qwen-gsm8k-crosscheck/vllm-greedy/gsm8k-full.jsonl \\
        --model qwen2.5-coder-0.5b --task gsm8k --out docs/results/qwen-gsm8k-crosscheck/greedy-partings.json

Prints a markdown table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def read(path: Path) -> dict[tuple[str, int], dict]:
    """The run's records by (problem id, sample) (the header line, which has no id, is skipped)."""
    records = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "id" in record:
                records[record["id"], record.get("sample", 0)] = record
    return records


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where `a` and `b` differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


@torch.no_grad()
def parting(model, tokenizer, prompt: str, text_a: str, text_b: str) -> dict:
    """The first differing token of two answers to `prompt`, and the model's top two logits there."""
    a = tokenizer(text_a, add_special_tokens=False)["input_ids"]
    b = tokenizer(text_b, add_special_tokens=False)["input_ids"]
    i = first_difference(a, b)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + a[:i]
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    token_a, token_b = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)

    def logit(token: int | None) -> float | None:
        return None if token is None else round(float(logits[token]), 4)

    return {
        "token": i,
        "a": tokenizer.decode([token_a]) if token_a is not None else "<end>",
        "b": tokenizer.decode([token_b]) if token_b is not None else "<end>",
        "top2_gap": round(float(top.values[0] - top.values[1]), 4),
        "gap_a_b": None if None in (token_a, token_b) else round(float(logits[token_a] - logits[token_b]), 4),
        "logit_a": logit(token_a),
        "logit_b": logit(token_b),
        "a_is_top1": token_a == int(top.indices[0]),
        "b_is_top1": token_b == int(top.indices[0]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="first run's JSONL (e.g. the transformers path)")
    p.add_argument("--b", type=Path, required=True, help="second run's JSONL (e.g. --engine vllm)")
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registered name, HF folder or .gguf file")
    p.add_argument("--task", default="gsm8k", help="the data set both runs answered")
    p.add_argument("--out", type=Path, help="JSON file for the numbers")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from vasepatch import models
    from vasepatch.eval import data

    runs = read(args.a), read(args.b)
    ids = [i for i in runs[0] if i in runs[1]]
    examples = {str(e.id): e for e in data.load_examples(args.task)}
    parted = [i for i in ids if runs[0][i]["text"] != runs[1][i]["text"]]
    rows, same = [], len(ids) - len(parted)
    if parted:  # the model only for the answers that part
        model, tokenizer = models.load(args.model, dtype=torch.float32)[:2]
        model.eval()
    for i in parted:
        ra, rb = runs[0][i], runs[1][i]
        prompt = data.chat_prompts(tokenizer, [examples[i[0]].question])[0]
        rows.append({"id": i[0], "sample": i[1], **parting(model, tokenizer, prompt, ra["text"], rb["text"])})
    gaps = sorted(r["top2_gap"] for r in rows)
    summary = {
        "a": str(args.a),
        "b": str(args.b),
        "problems": len(ids),
        "identical": same,
        "parted": len(rows),
        "top2_gap_median": gaps[len(gaps) // 2] if gaps else None,
        "top2_gap_max": gaps[-1] if gaps else None,
        "partings": rows,
    }
    print(f"{same} of {len(ids)} answers identical; {len(rows)} part")
    print("\n| id | token | a | b | top-2 gap | logit(a) - logit(b) |\n|---|---:|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['id']} | {r['token']} | {r['a']!r} | {r['b']!r} | {r['top2_gap']} | {r['gap_a_b']} |")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
