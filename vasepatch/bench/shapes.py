"""Models to benchmark: registered ones, or random weights in a known shape (`shape:NAME`).

Decode speed and memory depend on a model's shape, not on its weights, so
`shape:qwen3-4b` builds Qwen3-4B's architecture with random weights (no
download). `tiny-qwen3` is for tests.
"""

from __future__ import annotations

from typing import Any

import torch

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
    "tiny-qwen3": dict(
        _QWEN3,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
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
    return Qwen3Config(
        **SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa"
    )


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
