"""The serving arithmetic, defined once: KV bytes per token, blocks and pools, and the slots a request holds.

Pure functions of host ints (and of a model's config, read by attribute or key), like `schedule.py`. The
transformers integration sizes its buffers with `kv_bytes_per_token`, the vLLM plugin's admission counts
`held_at_most`, and the lab (eval, benchmarks) prices answers and sizes engine pools with the rest, so a
figure in a report is the plugin's own arithmetic, not a copy of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vasepatch.cache import schedule
from vasepatch.config import VaSEConfig

NULL_BLOCKS = 1  # vLLM's pool keeps one block that no request ever holds (its null block)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}  # names vLLM's `dtype` takes


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one token's keys and values over `layers` layers of `kv_heads` heads of `head_dim` elements."""
    return 2 * layers * kv_heads * head_dim * itemsize


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of the KV cache dtype named `dtype` (vLLM's spelling)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}: got {dtype!r}")
    return DTYPE_BYTES[dtype]


def model_kv_shape(config: Any) -> tuple[int, int, int]:
    """`(layers, kv_heads, head_dim)` of a model's config: a transformers `PretrainedConfig` or the dict of its
    `config.json`; a multimodal config's `text_config` when it has one."""
    if isinstance(config, Mapping):
        config = config.get("text_config") or config
        read = config.get
    else:
        config = getattr(config, "text_config", None) or config

        def read(name: str) -> Any:
            return getattr(config, name, None)

    heads = read("num_attention_heads")
    head_dim = read("head_dim") or read("hidden_size") // heads
    return read("num_hidden_layers"), read("num_key_value_heads") or heads, head_dim


def model_bytes_per_token(config: Any, itemsize: int) -> int:
    """KV bytes of one token over all of a model's layers (`model_kv_shape` of `config`), `itemsize` per element."""
    return kv_bytes_per_token(*model_kv_shape(config), itemsize)


def blocks(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `tokens` tokens: `ceil(tokens / block_size)`."""
    return -(-tokens // block_size)


def block_bytes(slots: int, block_size: int, bytes_per_token: int) -> int:
    """Bytes of the whole blocks that hold `slots` KV pairs."""
    return blocks(slots, block_size) * block_size * bytes_per_token


def pool_blocks(requests: int, tokens: int, block_size: int) -> int:
    """A pool that holds `requests` whole caches of `tokens` tokens each, plus vLLM's null block."""
    return requests * blocks(tokens, block_size) + NULL_BLOCKS


def held_at_most(pinned: int, config: VaSEConfig, chunk: int = 0) -> int:
    """The most slots an evicting request holds: `pinned + budget + window` between its prefill chunks and
    decode steps (an eviction is due past that, mid-prompt included), plus the largest chunk prefilled at once
    (`chunk`; 0 between steps). A recompute after preemption is a prefill like any other, so it holds no more."""
    return pinned + config.budget + config.window + chunk


def held_slots(config: VaSEConfig, prompt: int, new: int) -> int:
    """The most KV slots a request of `prompt + new` tokens holds between steps: all of them for the full cache;
    for an evicting one no more than `held_at_most` with no chunk (its prompt pinned with `prefill="pin"`)."""
    length = prompt + new
    if not config.evicts:
        return length
    return min(length, held_at_most(schedule.pinned(config.prefill, prompt), config))


def held_at_end(config: VaSEConfig | None, prompt: int, new: int) -> int:
    """The slots a request holds after generating `new` tokens, for an answer shorter than the window (no
    eviction while decoding): the prompt as prefilled (compressed to `budget` by an evicting policy, whole
    when pinned or with the full cache, `config=None`), then one slot per generated token but the last."""
    whole = config is None or not config.evicts or config.prefill == "pin"
    return (prompt if whole else min(prompt, config.budget)) + max(new - 1, 0)
