"""`vasepatch demo`: generate with VaSE on SmolLM2 and compare KV memory with the full cache."""

from __future__ import annotations

import argparse

import torch

DEFAULT_PROMPT = (
    "A bakery sells croissants for $2.50 and muffins for $3.25. On Monday it sold 48 croissants and 36 muffins. "
    "On Tuesday it sold 25% more croissants and 8 fewer muffins. How much money did it take in over the two days? "
    "Reason step by step."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, HF directory or .gguf file")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--policy", default="vase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compare", action="store_true", help="skip the unpatched (full cache) run")


def _cache_bytes(cache) -> int:
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def _generate(model, inputs, max_new_tokens: int):
    with torch.no_grad():
        return model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=1.1,
            return_dict_in_generate=True,
        )


def run(args: argparse.Namespace) -> None:
    import vasepatch
    from vasepatch import models

    print(f"loading {args.model} ...", flush=True)
    model, tok = models.load(args.model)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    n = args.max_new_tokens

    with vasepatch.patched(model, budget=args.budget, window=args.window, policy=args.policy, seed=args.seed) as h:
        out = _generate(model, inputs, n)
        stats = h.stats()
    settings = f"budget={args.budget}, window={args.window}, policy={args.policy}; greedy, repetition_penalty=1.1"
    print(f"\n--- VaSE ({settings}) ---")
    print(tok.decode(out.sequences[0, prompt_len:], skip_special_tokens=True))
    print("\n--- stats ---")
    for key, value in stats.items():
        print(f"{key:>15}: {value}")

    rows = [("vasepatch", stats["kv_bytes"])]
    if not args.no_compare:
        full = _generate(model, inputs, n)
        cache = full.get("cache")  # called `past_key_values` by older transformers releases
        rows.append(("full cache", _cache_bytes(cache if cache is not None else full.past_key_values)))
        same = torch.equal(full.sequences, out.sequences)
        print(f"\nfull-cache text identical to the VaSE text: {same}")
    print(f"\n--- KV memory after {prompt_len} prompt + {n} generated tokens ---")
    for name, nbytes in rows:
        print(f"{name:>12}: {nbytes / 2**20:7.2f} MiB")
    if len(rows) == 2:
        print(f"{'ratio':>12}: {rows[1][1] / rows[0][1]:7.2f}x less KV memory with vasepatch")
