"""Where a model's attention runs: its tensor-parallel shard of the KV heads, and the device
each layer executes on under accelerate's `device_map`.

Tensor parallelism (`from_pretrained(..., tp_plan="auto")` under torch.distributed) splits
each layer's K/V projections by output rows, so a rank computes, caches and evicts only its
own KV heads: VaSE chooses per KV head, so eviction needs no communication. `Sharding`
records which heads this process holds (read from the DTensor placement of the layers'
`k_proj` weights, no communication); the layer plans get their global `head_offset` from it,
and `stats()` the totals over all ranks (the heads are split evenly, so total = local x world).

accelerate's dispatch (`device_map=...`, CPU or disk offload) leaves offloaded weights on the
`meta` device and moves them in at each call; `execution_devices` reads where each attention
layer really runs, from accelerate's hooks, for the memory check and the backend choice.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from vasepatch.errors import UnsupportedModelError
from vasepatch.integration.families import ModelLayout, text_config


@dataclass(frozen=True)
class Sharding:
    """Which KV heads of every layer this process holds (the same for all layers)."""

    world_size: int  # processes the KV heads are split over (the tensor-parallel degree; 1: not split)
    rank: int  # this process's place among them, 0 <= rank < world_size
    kv_heads: int  # KV heads per layer held here
    total_kv_heads: int  # KV heads per layer over all ranks

    @property
    def head_offset(self) -> int:
        """Global index of the first KV head held here (contiguous, even shards)."""
        return self.rank * self.kv_heads

    def stats(self, kv_bytes: int) -> dict[str, int]:
        """`kv_bytes_total` (all ranks, computed: the shards are even), `world_size`, `rank`."""
        return {"kv_bytes_total": kv_bytes * self.world_size, "world_size": self.world_size, "rank": self.rank}


def _split(weight: Any) -> tuple[int, int]:
    """(ranks, rank) over which a projection weight's output rows are split (1, 0 if not)."""
    placements = getattr(weight, "placements", None)
    mesh = getattr(weight, "device_mesh", None)
    if placements is None or mesh is None:  # a plain tensor: this process holds all of it
        return 1, 0
    dims = [d for d, p in enumerate(placements) if p.is_shard(0) and mesh.size(d) > 1]
    if len(dims) > 1:
        raise UnsupportedModelError(
            f"vasepatch cannot patch a model whose K/V projections are split over several mesh dimensions "
            f"({placements} on {mesh}); shard the attention heads over one tensor-parallel dimension"
        )
    if not dims:
        return 1, 0
    return mesh.size(dims[0]), mesh.get_local_rank(dims[0])


def _local_rows(weight: torch.Tensor) -> int:
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return int(local.shape[0])


def sharding(model: torch.nn.Module, layout: ModelLayout) -> Sharding:
    """This process's share of the KV heads; `UnsupportedModelError` (before any change) when
    the heads do not split evenly over the tensor-parallel ranks, or the layers disagree."""
    text = text_config(model.config)
    total_q = text.num_attention_heads
    total_kv = getattr(text, "num_key_value_heads", None) or total_q
    splits = set()
    for attn in layout.attention_modules:
        weight = getattr(getattr(attn, "k_proj", None), "weight", None)
        if weight is None:
            splits.add((1, 0, total_kv * layout.head_dim))
            continue
        splits.add((*_split(weight), _local_rows(weight)))
    if len(splits) != 1:
        raise UnsupportedModelError(
            f"vasepatch needs every layer's KV heads split the same way over the tensor-parallel ranks; "
            f"this model's layers differ ((ranks, rank, local K rows): {sorted(splits)})"
        )
    world, rank, rows = splits.pop()
    if total_kv % world or total_q % world:
        raise UnsupportedModelError(
            f"vasepatch cannot patch this tensor-parallel model: its {total_kv} KV heads and {total_q} query heads "
            f"must both divide evenly over its {world} tensor-parallel ranks (each rank caches whole KV heads); "
            f"load it with a tensor-parallel size that divides {total_kv}"
        )
    local = total_kv // world
    if rows != local * layout.head_dim:
        raise UnsupportedModelError(
            f"vasepatch cannot patch this tensor-parallel model: rank {rank} of {world} holds {rows} K projection "
            f"rows, not its {local} KV heads x head_dim {layout.head_dim} = {local * layout.head_dim}"
        )
    return Sharding(world, rank, local, total_kv)


def with_head_offsets(layout: ModelLayout, shard: Sharding) -> ModelLayout:
    """`layout` whose layer plans carry the global index of this process's first KV head, and the KV heads of
    all processes."""
    if shard.world_size == 1:  # one process holds every head: the plans' defaults
        return layout
    plans = tuple(
        dataclasses.replace(p, head_offset=shard.head_offset, kv_heads=shard.total_kv_heads)
        for p in layout.layer_plans()
    )
    return dataclasses.replace(layout, plans=plans)


def _hook_device(hook: Any) -> torch.device | None:
    """The execution device of an accelerate hook (a `SequentialHook` of several: the first that has one)."""
    for inner in getattr(hook, "hooks", None) or (hook,):
        device = getattr(inner, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return None


def _parameter_device(module: torch.nn.Module) -> torch.device | None:
    devices = [p.device for p in module.parameters() if p.device.type != "meta"]
    return Counter(devices).most_common(1)[0][0] if devices else None


def execution_devices(model: torch.nn.Module, layout: ModelLayout) -> list[torch.device]:
    """The device each attention layer runs on: accelerate's hook on it or its nearest parent
    (offloaded weights sit on `meta` and move there per call), else where its weights are,
    else where the model's weights are (CPU for a model with none)."""
    hooks = {name: _hook_device(m._hf_hook) for name, m in model.named_modules() if hasattr(m, "_hf_hook")}
    names = {id(m): name for name, m in model.named_modules()}
    fallback = _parameter_device(model) or torch.device("cpu")
    devices = []
    for attn in layout.attention_modules:
        name = names.get(id(attn), "")
        parents = [name.rsplit(".", k)[0] for k in range(name.count(".") + 1)] + [""]
        hooked = [hooks[p] for p in parents if hooks.get(p) is not None]
        devices.append(hooked[0] if hooked else _parameter_device(attn) or fallback)
    return devices


def compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating-point weights (meta ones included), else None."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return Counter(dtypes).most_common(1)[0][0] if dtypes else None
