"""Counter-based eviction randomness: noise that is a pure function of a key.

An eviction's random draws must not depend on how the model is sharded. Under
tensor parallelism a rank holds a contiguous slice of the KV heads, so a
`torch.rand([B, H_local, N])` draw from one generator gives head `h` a different
number on every world size. Here the uniform number of a candidate is a hash of
`(seed, layer, round, draw, row, global KV head, slot)` instead: the same on one
process and on any rank holding that head, on any device, run after run.

The hash is murmur3's 32-bit finaliser, computed in int64 tensors with every
product below 2**63 (a 32 x 32-bit product is split in 16-bit halves), so no step
overflows; it needs no host sync and no data-dependent branch (it traces under
`torch.compile`). The host-side part of the key (seed, layer, round, draw) is
hashed in Python ints.

`KeyedGenerator` is a plain object holding the key. The built-in policies draw
through `scoring.uniform_noise`, `gumbel_noise` and `gaussian_projection`, which read
it, and are marked `draws_keyed_noise`. A priority function that is not marked
(a user's policy calling `torch.rand(..., generator=generator)`) is handed a plain
`torch.Generator` seeded from `(seed, layer, round)` instead: it keeps working and
is reproducible run after run, but a draw shaped by the local heads is not
sharding-invariant.

`EvictionRandomness` makes the `KeyedGenerator` of every eviction of a cache's layers, a pure
function of `(seed, layer index, eviction round)` plus the layer's global head offset, made where
the eviction runs (eagerly, on the host: building it reads plain ints and moves no data). Nothing
is carried from one eviction to the next, so the order in which layers evict does not matter
either. `seed=None` draws the key's seed from torch's global CPU generator at the first eviction
of each generation (so it follows `torch.manual_seed`); `reset` (a new generation on the same
cache) starts over: a seeded cache repeats a fresh one.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32 multipliers
_GOLDEN = 0x9E3779B9
_MANTISSA = 23  # uniforms (k + 0.5) / 2**23: exact in float32, strictly inside (0, 1)
SHARED_HEAD = MASK32  # the head coordinate of every head when the heads share their noise


def mix(x: int) -> int:
    """murmur3's 32-bit finaliser of a Python int in [0, 2**32)."""
    x ^= x >> 16
    x = (x * _C1) & MASK32
    x ^= x >> 13
    x = (x * _C2) & MASK32
    return x ^ (x >> 16)


def absorb(key: int, value: int) -> int:
    """Fold a Python int of up to 64 bits (any sign) into a 32-bit key."""
    value &= 2**64 - 1
    for part in (value & MASK32, value >> 32):
        key = mix(key ^ mix((part + _GOLDEN) & MASK32))
    return key


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`x * c mod 2**32` for int64 `x` in [0, 2**32): in 16-bit halves, every product < 2**48."""
    lo, hi = x & 0xFFFF, x >> 16
    return ((((hi * c) & 0xFFFF) << 16) + lo * c) & MASK32


def mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """`mix` elementwise on an int64 tensor of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def absorb_tensor(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`absorb` of int64 values in [0, 2**32) (broadcasting)."""
    return mix_tensor(key ^ mix_tensor((value + _GOLDEN) & MASK32))


def _index_mix(start: int, count: int, device: torch.device) -> torch.Tensor:
    values = torch.arange(start, start + count, device=device, dtype=torch.int64) & MASK32
    return mix_tensor((values + _GOLDEN) & MASK32)


@functools.lru_cache(maxsize=64)
def _cached_index_mix(start: int, count: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
        return _index_mix(start, count, device)


def mixed_indices(start: int, count: int, device: torch.device) -> torch.Tensor:
    """`[count]`: for each `v` in `start, ..., start + count - 1` (mod 2**32) the half of
    `absorb_tensor(key, v)` that does not depend on the key, `mix((v + GOLDEN) mod 2**32)`. A pure
    function of host ints: eagerly computed once per (start, count, device) and shared (read only);
    under compilation computed in the graph."""
    if torch.compiler.is_compiling():
        return _index_mix(start, count, device)
    return _cached_index_mix(start, count, device)


def absorb_mixed(key: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """`absorb_tensor(key, value)` given `mixed = mixed_indices(...)` of the values (broadcasting)."""
    return mix_tensor(key ^ mixed)


def to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms in [2**-24, 1 - 2**-24], never 0 or 1."""
    k = (bits >> (32 - _MANTISSA)).to(torch.float32)
    return (k + 0.5) * (1.0 / 2**_MANTISSA)


def draws_keyed_noise(fn):
    """Mark a priority function that draws its noise through `scoring.uniform_noise`,
    `scoring.gumbel_noise` or `scoring.gaussian_projection`: it is handed the cache's
    `KeyedGenerator` itself. An unmarked function is handed `KeyedGenerator.torch_generator()`
    instead, a plain `torch.Generator`, so that `torch.rand(..., generator=generator)` works."""
    fn.draws_keyed_noise = True
    return fn


def marked_keyed(fn) -> bool:
    """Whether a priority function is marked by `draws_keyed_noise`."""
    return bool(getattr(fn, "draws_keyed_noise", False))


class KeyedGenerator:
    """The `generator` a cache hands its policy at one eviction: a key, no state but a draw count.

    `uniform_candidates([B, H, N])` is keyed by `(seed, layer, eviction, draw, row,
    head_offset + h, slot)`, `normal(shape)` by `(seed, layer, eviction, draw, flat index)` (no
    head: the same on every rank); `draw` counts the calls, so two draws of one eviction differ.
    `shared_heads()` is the same key with one head coordinate for every head. A plain Python
    object, so a compiled function can take it as an input and trace its draws in one graph.
    `torch_generator()`: a `torch.Generator` on `device` seeded from `(seed, layer, eviction)`,
    what a priority function that is not marked `draws_keyed_noise` receives.
    """

    def __init__(
        self, seed: int, layer: int, eviction: int, head_offset: int = 0, device=None, shared: bool = False
    ) -> None:
        self.seed, self.layer, self.eviction = int(seed), int(layer), int(eviction)
        self.head_offset, self.shared = int(head_offset), bool(shared)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.key = absorb(absorb(absorb(0, self.seed), self.layer), self.eviction)
        self.draws = 0

    def __repr__(self) -> str:
        return (
            f"KeyedGenerator(seed={self.seed}, layer={self.layer}, eviction={self.eviction}, "
            f"head_offset={self.head_offset}, device={str(self.device)!r}, shared={self.shared})"
        )

    def shared_heads(self) -> KeyedGenerator:
        """The same key with one noise per slot for all heads (head-shared eviction)."""
        return KeyedGenerator(self.seed, self.layer, self.eviction, self.head_offset, self.device, shared=True)

    def torch_generator(self) -> torch.Generator:
        """A `torch.Generator` on `device` seeded from `(seed, layer, eviction)` (not the head offset)."""
        return torch.Generator(device=self.device).manual_seed(self.key)

    def _next_key(self, device: torch.device) -> torch.Tensor:
        key = absorb(self.key, self.draws)
        self.draws += 1
        return torch.full((), key, device=device, dtype=torch.int64)

    def _rows(self, b: int, device: torch.device) -> torch.Tensor:
        """The row coordinate of the key's hash: row `i` of the batch is row `i`."""
        return mixed_indices(0, b, device)

    def uniform_candidates(self, shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
        """`[B, H, N]` float32 uniforms in (0, 1), one per (row, KV head, candidate slot)."""
        b, h, n = shape
        key = self._next_key(device)
        device = key.device  # with its index: the key of the cached halves
        if self.shared:
            heads = mixed_indices(SHARED_HEAD, 1, device).expand(h)
        else:
            heads = mixed_indices(self.head_offset, h, device)
        # = absorb_tensor(absorb_tensor(absorb_tensor(key, rows), heads), slots): the key-free halves are cached
        x = absorb_mixed(key.view(-1, 1, 1), self._rows(b, device).view(b, 1, 1))
        x = absorb_mixed(x, heads.view(1, h, 1))
        return to_uniform(absorb_mixed(x, mixed_indices(0, n, device).view(1, 1, n)))

    def normal(self, shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Standard normal float32 noise of any `shape`, keyed by the flat index (Box-Muller)."""
        key = self._next_key(device)
        flat = mixed_indices(0, 2 * math.prod(shape), key.device).view(*shape, 2)  # = absorb_tensor(key, index)
        key = key if key.dim() == 0 else key.view(-1, *(1 for _ in shape), 1)  # stacked: one key per row
        u = to_uniform(absorb_mixed(key, flat))
        radius = torch.sqrt(-2.0 * torch.log(u[..., 0]))
        return radius * torch.cos((2.0 * math.pi) * u[..., 1])


class StackedKeyedGenerator(KeyedGenerator):
    """The generators of several evictions stacked along the batch, for one policy call on their stacked
    candidates: key `i` owns rows `i * rows .. i * rows + rows - 1`, which draw exactly what
    `KeyedGenerator(*keys[i], head_offset)` draws for a batch of `rows` (one vLLM request per key: `rows=1`;
    one layer of a batch per key: `rows=batch`). `normal(shape)` is `[B, *shape]`, one draw per row. There is
    no `torch_generator()`: a priority function that is not marked `draws_keyed_noise` draws from one
    `torch.Generator` per eviction and cannot be stacked.
    """

    def __init__(self, keys, head_offset: int = 0, device=None, shared: bool = False, rows: int = 1) -> None:
        self.keys = [(int(s), int(layer), int(e)) for s, layer, e in keys]
        if not self.keys or rows < 1:
            raise ValueError(f"StackedKeyedGenerator needs (seed, layer, eviction) keys and rows >= 1, got {rows}")
        super().__init__(*self.keys[0], head_offset, device, shared)
        self.rows = rows
        self.row_keys = [absorb(absorb(absorb(0, s), layer), e) for s, layer, e in self.keys for _ in range(rows)]

    def __repr__(self) -> str:
        return (
            f"StackedKeyedGenerator({len(self.keys)} keys, rows={self.rows}, head_offset={self.head_offset}, "
            f"shared={self.shared})"
        )

    def shared_heads(self) -> StackedKeyedGenerator:
        return StackedKeyedGenerator(self.keys, self.head_offset, self.device, shared=True, rows=self.rows)

    def torch_generator(self) -> torch.Generator:
        raise TypeError(
            "a StackedKeyedGenerator has one key per row and no torch.Generator: only a priority function "
            "marked draws_keyed_noise can draw from stacked evictions"
        )

    def _next_key(self, device: torch.device) -> torch.Tensor:
        keys = [absorb(key, self.draws) for key in self.row_keys]
        self.draws += 1
        return torch.tensor(keys, device=device, dtype=torch.int64)

    def _rows(self, b: int, device: torch.device) -> torch.Tensor:
        if b != len(self.row_keys):
            raise ValueError(f"a draw of {b} rows from a StackedKeyedGenerator of {len(self.row_keys)} rows")
        return mixed_indices(0, self.rows, device).repeat(len(self.keys))  # each key's rows are rows 0, 1, ...


_SEED_DRAW = 2**62  # a drawn seed: uniform in [0, 2**62)


class EvictionRandomness:
    """The `generator` factory of one cache's layers (shared by all of them)."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._drawn: int | None = None

    def reset(self) -> None:
        """A new generation: a seeded cache repeats its draws; `seed=None` draws a new seed."""
        self._drawn = None

    def generation_seed(self) -> int:
        """The seed of this generation's keys (`seed`, or one drawn from torch's global generator)."""
        if self.seed is not None:
            return self.seed
        if self._drawn is None:  # a CPU draw: no device sync
            self._drawn = int(torch.randint(0, _SEED_DRAW, (), dtype=torch.int64))
        return self._drawn

    def for_eviction(self, plan: Any, eviction: int, device: torch.device) -> KeyedGenerator:
        """The generator of eviction round `eviction` (0-based) of the layer `plan` describes (a
        `vasepatch.cache.plan.LayerPlan`: its `index` and `head_offset`)."""
        return KeyedGenerator(self.generation_seed(), plan.index, eviction, plan.head_offset, device)
