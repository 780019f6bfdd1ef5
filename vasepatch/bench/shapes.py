"""Models to benchmark: registered ones, or random weights in a known shape (`shape:NAME`).

Decode speed and memory depend on a model's shape, not on its weights, so
`shape:qwen3-4b` builds Qwen3-4B's architecture with random weights (no
download). `tiny-qwen3` is for tests.

`TINY_CONFIG` is the one definition of the tiny random-weight models: the tests build every family's tiny
model from it (`tests/tiny_models.py`, `tests/family_matrix.py`), and `tiny-qwen3`, the detection tests'
models and `benchmarks/soak.py`'s model are it with overrides.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

TINY_CONFIG: Mapping[str, Any] = MappingProxyType(
    dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
)
"""Config settings of a tiny random-weight decoder (a family's config class adds its own): 2 layers,
hidden 64, 4 query heads, vocab 128. The number of KV heads is each user's (the tests: 2 where the family
has grouped-query attention)."""

_QWEN3 = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    use_sliding_window=False,
)

SHAPES: dict[str, dict[str, Any]] = {
    "tiny-qwen3": {
        **_QWEN3,
        **TINY_CONFIG,
        "vocab_size": 256,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": _QWEN3["max_position_embeddings"],
        "pad_token_id": None,
    },
    "qwen3-0.6b": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        _QWEN3,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=True,
    ),
    "qwen3-14b": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
    ),
}


def shape_config(name: str) -> Any:
    """A `Qwen3Config` for the shape `name` (a key of `SHAPES`), sdpa attention."""
    from transformers import Qwen3Config

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    tokens = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen3Config(**{**tokens, **SHAPES[name]}, attn_implementation="sdpa")


def load_model(spec: str, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """The model named by `spec` in eval mode: `shape:NAME` (random weights from `seed`,
    built directly on `device`), a registered name, a HF directory or a `.gguf` file."""
    if spec.startswith("shape:"):
        from transformers import AutoModelForCausalLM

        config = shape_config(spec.removeprefix("shape:"))
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        return model.eval()
    from vasepatch import models

    return models.load(spec, dtype=dtype, device=device)[0]
