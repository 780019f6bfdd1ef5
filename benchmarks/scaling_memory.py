"""What each tensor-parallel rank holds: vasepatch's KV buffers against the full cache, Qwen3-14B and Qwen3-32B.

    python benchmarks/scaling_memory.py                       # print the markdown tables
    python benchmarks/scaling_memory.py --check docs/scaling.md   # exit 1 if the page's tables are not these

Nothing is downloaded and nothing is measured on a device: every number is the size of a tensor that
vasepatch's own cache (or transformers' `DynamicLayer`, for the full cache) allocates, made on PyTorch's
`meta` device, which records shapes and dtypes without allocating memory. One `VaSELayer` per table row
takes a one-token prompt and records its query, so it allocates everything it keeps for a generation:
the K and V buffers (`budget + window` slots, the size `vasepatch.cache.schedule.capacity` gives), the
per-slot positions (int64) and validity (bool), the query ring, and the small bookkeeping tensors. The
buffers are the same for any prompt with the default `prefill="compress"`, so the one-token prompt stands
for a 16K or 32K one. Every tensor attribute of the layer and of its parts is counted, so a buffer added to
the cache later shows up here without a change to this script.

Tensor parallelism (transformers' `tp_plan="auto"`) shards the `q_proj`/`k_proj`/`v_proj` columns, so a
rank of `world` holds `num_key_value_heads / world` KV heads and `num_attention_heads / world` query heads
of every layer, and all the layers: that is the shape each rank's layer is given here.

The model shapes are the values of the Hugging Face `config.json` of `Qwen/Qwen3-14B` and `Qwen/Qwen3-32B`
(https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json, .../Qwen3-32B/blob/main/config.json; both
files say `"transformers_version": "4.51.0"`). This machine has no hub access: the values were copied
from verbatim copies of both files found with a code-search tool, and they agree with the model cards
(14B: 40 layers, 40 query heads, 8 KV heads; 32B: 64 layers, 64 query heads, 8 KV heads).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers.cache_utils import DynamicLayer

from vasepatch import policies
from vasepatch.cache import schedule
from vasepatch.cache.cache import VaSECache
from vasepatch.config import VaSEConfig

BUDGET, WINDOW = 4096, 64
FULL_LENGTHS = (16 * 1024, 32 * 1024)
WORLD_SIZES = (1, 2, 4, 8)
BATCHES = (1, 16)
META = torch.device("meta")


@dataclass(frozen=True)
class Shape:
    """The `config.json` values that size a KV cache."""

    name: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dtype: torch.dtype

    def heads_per_rank(self, world: int) -> tuple[int, int]:
        """(KV heads, query heads) one rank holds; ValueError when `world` does not divide them."""
        if self.num_key_value_heads % world or self.num_attention_heads % world:
            raise ValueError(
                f"{self.name}: {self.num_key_value_heads} KV heads / {self.num_attention_heads} query heads "
                f"do not divide over {world} ranks"
            )
        return self.num_key_value_heads // world, self.num_attention_heads // world


# Hugging Face config.json of Qwen/Qwen3-14B and Qwen/Qwen3-32B ("torch_dtype": "bfloat16" in both).
MODELS = (
    Shape("Qwen3-14B", num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
          dtype=torch.bfloat16),
    Shape("Qwen3-32B", num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
          dtype=torch.bfloat16),
)  # fmt: skip


def _holds_storage(name: str, value: object) -> bool:
    """A vasepatch object the layer holds (the query ring, its counters, ...), not one of its settings."""
    vasepatch_object = type(value).__module__.startswith("vasepatch.") and hasattr(value, "__dict__")
    return vasepatch_object and name not in ("config", "policy", "plan")


def layer_tensors(obj: object, prefix: str = "", seen: set[int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor held by `obj`'s attributes and by the vasepatch objects it holds (the query ring, ...),
    each counted once, named by its attribute path."""
    seen = set() if seen is None else seen
    found = []
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                found.append((prefix + name, value))
        elif _holds_storage(name, value):
            found += layer_tensors(value, f"{prefix}{name}.", seen)
    return found


def vasepatch_layer(shape: Shape, world: int, batch: int) -> list[tuple[str, torch.Tensor]]:
    """The tensors one rank's `VaSELayer` allocates for a generation (on the meta device)."""
    config = VaSEConfig(budget=BUDGET, window=WINDOW)
    cache = VaSECache(config, policies.for_config(config), num_layers=1)
    layer = cache.layers[0]
    kv_heads, q_heads = shape.heads_per_rank(world)
    kv = torch.empty((batch, kv_heads, 1, shape.head_dim), dtype=shape.dtype, device=META)
    query = torch.empty((batch, q_heads, 1, shape.head_dim), dtype=shape.dtype, device=META)
    layer.step(query, kv, kv.clone(), None, lambda step: None)
    slots = schedule.capacity(BUDGET, WINDOW, 1, config.prefill)
    if layer.keys.shape[2] != slots or layer.counters.kv_bytes != layer.keys.nbytes + layer.values.nbytes:
        raise AssertionError(f"the layer allocated {layer.keys.shape[2]} slots, schedule.capacity says {slots}")
    return layer_tensors(layer)


def full_cache_bytes(shape: Shape, world: int, batch: int, tokens: int) -> int:
    """K and V that transformers' `DynamicCache` holds on one rank after `tokens` tokens, all layers."""
    kv_heads, _ = shape.heads_per_rank(world)
    layer = DynamicLayer()
    kv = torch.empty((batch, kv_heads, tokens, shape.head_dim), dtype=shape.dtype, device=META)
    layer.update(kv, kv.clone())
    return shape.num_hidden_layers * (layer.keys.nbytes + layer.values.nbytes)


def size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def memory_table(shape: Shape) -> list[str]:
    """One row per (ranks, batch): what one rank holds, summed over the layers."""
    full = " | ".join(f"full cache {t // 1024}K | full {t // 1024}K / vasepatch" for t in FULL_LENGTHS)
    lines = [
        f"| ranks | batch | KV heads / rank | query heads / rank | vasepatch K+V (`kv_bytes`) | vasepatch, all "
        f"buffers | {full} |",
        "|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(FULL_LENGTHS),
    ]
    for world in WORLD_SIZES:
        kv_heads, q_heads = shape.heads_per_rank(world)
        for batch in BATCHES:
            tensors = dict(vasepatch_layer(shape, world, batch))
            layers = shape.num_hidden_layers
            kv = layers * (tensors["keys"].nbytes + tensors["values"].nbytes)
            everything = layers * sum(t.nbytes for t in tensors.values())
            cells = [str(world), str(batch), str(kv_heads), str(q_heads), size(kv), size(everything)]
            for tokens in FULL_LENGTHS:
                full_bytes = full_cache_bytes(shape, world, batch, tokens)
                cells += [size(full_bytes), f"{full_bytes / everything:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def buffer_table(shape: Shape) -> list[str]:
    """Every tensor of one layer, one sequence, one rank (of 1), with its share of the layer's bytes."""
    tensors = vasepatch_layer(shape, world=1, batch=1)
    total = sum(t.nbytes for _, t in tensors)
    lines = ["| tensor | shape | dtype | bytes | share |", "|---|---|---|---:|---:|"]
    for name, t in sorted(tensors, key=lambda item: -item[1].nbytes):
        dtype = str(t.dtype).removeprefix("torch.")
        lines.append(f"| `{name}` | {tuple(t.shape)} | {dtype} | {t.nbytes:,} | {t.nbytes / total:.2%} |")
    lines.append(f"| **total** | | | **{total:,}** | 100% |")
    return lines


def overhead(shape: Shape) -> str:
    """How much the buffers beyond K and V add to `kv_bytes` (one rank, one sequence)."""
    tensors = dict(vasepatch_layer(shape, world=1, batch=1))
    kv = tensors["keys"].nbytes + tensors["values"].nbytes
    rest = sum(t.nbytes for t in tensors.values()) - kv
    return f"The buffers beyond K and V add {rest / kv:.1%} to `kv_bytes` (1 rank, batch 1)"


def beyond_kv_heads(shape: Shape) -> str:
    """What happens past `num_key_value_heads` ranks (checked against the shape, not assumed)."""
    world = 2 * shape.num_key_value_heads
    try:
        shape.heads_per_rank(world)
    except ValueError:
        return (
            f"{world} ranks: not possible ({shape.num_key_value_heads} KV heads do not divide over {world} ranks: "
            "transformers' `tp_plan` splits the `k_proj`/`v_proj` columns and does not replicate KV heads, "
            "so a rank would hold half a head)"
        )
    return f"{world} ranks: {shape.heads_per_rank(world)[0]} KV heads per rank"


def report() -> str:
    slots = schedule.capacity(BUDGET, WINDOW, 1, "compress")
    out = [
        f"vasepatch at `budget={BUDGET}, window={WINDOW}` ({slots} slots per row and KV head, "
        f"`schedule.capacity`), bf16, against the full cache (transformers' `DynamicCache`) after "
        f"{' and '.join(f'{t:,}' for t in FULL_LENGTHS)} tokens. Per rank, all layers; `kv_bytes` is what "
        "`handle.stats()` reports on that rank.",
        "",
    ]
    for shape in MODELS:
        out += [
            f"**{shape.name}** ({shape.num_hidden_layers} layers, {shape.num_attention_heads} query heads, "
            f"{shape.num_key_value_heads} KV heads, head_dim {shape.head_dim}, "
            f"{str(shape.dtype).removeprefix('torch.')}). {overhead(shape)}. {beyond_kv_heads(shape)}.",
            "",
            *memory_table(shape),
            "",
        ]
    shape = MODELS[0]
    out += [
        f"What one layer allocates, per sequence on one rank ({shape.name}; the query ring holds the last "
        f"{WINDOW} queries of all {shape.num_attention_heads} query heads):",
        "",
        *buffer_table(shape),
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="FILE", type=Path, help="exit 1 unless FILE contains these tables verbatim")
    args = parser.parse_args(argv)
    text = report()
    if args.check is None:
        print(text, end="")
        return 0
    if text not in args.check.read_text():
        print(f"{args.check} does not contain the tables of benchmarks/scaling_memory.py; paste its output in")
        return 1
    print(f"{args.check}: the memory tables are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
