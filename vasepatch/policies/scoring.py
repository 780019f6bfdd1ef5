"""Pure tensor functions that policies are made of: scores, noise and selection.

Everything here is shape-static (no data-dependent Python branches, no host
syncs) so that it can run inside a compiled decode step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from vasepatch.policies.keyed import KeyedGenerator

Randomness = torch.Generator | KeyedGenerator | None  # what a policy's `generator` may be

VALUE_SCORES = ("range", "l2", "var")


def check_inputs(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    positions: torch.Tensor,
    valid: torch.Tensor,
    n_keep: int,
) -> None:
    """Validate the shapes of a `Policy.select` call (host-side metadata only)."""
    if keys.dim() != 4 or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"keys/values must be [B, Hkv, N, D], got {tuple(keys.shape)} and {tuple(values.shape)}")
    if positions.shape != keys.shape[:3] or valid.shape != keys.shape[:3]:
        raise ValueError(
            f"positions and valid must be [B, Hkv, N] = {tuple(keys.shape[:3])}, "
            f"got {tuple(positions.shape)} and {tuple(valid.shape)}"
        )
    if queries is not None:
        if queries.dim() != 4 or queries.shape[0] != keys.shape[0] or queries.shape[-1] != keys.shape[-1]:
            raise ValueError(f"queries must be [B, Hq, W, D], got {tuple(queries.shape)}")
        if queries.shape[1] % keys.shape[1]:
            raise ValueError(f"query heads ({queries.shape[1]}) must be a multiple of KV heads ({keys.shape[1]})")
    n = keys.shape[2]
    if not 0 <= n_keep <= n:
        raise ValueError(f"n_keep must be in [0, {n}] (the number of candidates), got {n_keep}")


def value_scores(values: torch.Tensor, kind: str = "range") -> torch.Tensor:
    """Per-candidate magnitude of the value vectors, `[B, H, N]` float32.

    `range` = max - min over the head dimension (the paper's choice), `l2` = the
    Euclidean norm, `var` = the variance.
    """
    v = values.float()
    if kind == "range":
        return v.amax(-1) - v.amin(-1)
    if kind == "l2":
        return torch.linalg.vector_norm(v, dim=-1)
    if kind == "var":
        return v.var(-1, unbiased=False)
    raise ValueError(f"score must be one of {VALUE_SCORES}, got {kind!r}")


def window_attention(
    keys: torch.Tensor,
    queries: torch.Tensor,
    valid: torch.Tensor,
    temperature: float = 1.0,
    smooth: int = 1,
) -> torch.Tensor:
    """Attention that the window's queries pay to each candidate, `[B, Hkv, N]` float32.

    `softmax(q k^T / (sqrt(D) * temperature))` over the valid candidates, averaged
    over the window and over the query heads sharing each KV head (GQA), then
    smoothed by an average pool of width `smooth` along the sequence, centred on each
    candidate (`smooth` odd: an even width has no centre slot; SnapKV's and the VaSE
    paper's widths are odd). Invalid candidates score 0.

    The `[G * W, N]` logits of each (row, KV head) are computed a few (row, KV head) pairs at a
    time (`attention_chunks`), so that the largest temporary of an eviction stays small: the
    same numbers as one batched product (each pair's product, softmax and mean are its own).
    """
    if smooth > 1 and smooth % 2 == 0:
        raise ValueError(f"smooth must be odd (the width of an average pool centred on each candidate), got {smooth}")
    h_kv, d = keys.shape[1], keys.shape[-1]
    q = rearrange(queries, "b (h g) w d -> (b h) (g w) d", h=h_kv)
    k, scale = keys.flatten(0, 1), 1.0 / (math.sqrt(d) * temperature)
    # -inf at the invalid candidates by adding a 0 / -inf bias in the pass that scales the logits: the same
    # numbers as a broadcast masked_fill (0 + s * x = s * x), which is much slower on a CPU. It needs the
    # invalid candidates' keys finite (NaN or inf plus -inf is NaN): a cache's empty slots are zeros, and a
    # padding token's key comes from a padding query that attends to its own slot.
    bias = torch.zeros(k.shape[:2], dtype=torch.float32, device=keys.device)
    bias = bias.masked_fill_(~valid.flatten(0, 1), -math.inf).unsqueeze(-2)
    scores = torch.empty(k.shape[:2], dtype=torch.float32, device=keys.device)
    for rows in attention_chunks(k.shape[0], q.shape[1] * k.shape[1], keys.device):
        logits = torch.matmul(q[rows].float(), k[rows].float().transpose(-1, -2))
        scores[rows] = torch.softmax(torch.add(bias[rows], logits, alpha=scale), dim=-1).mean(-2)
    # a (row, head) with no valid candidate has NaN in every query's row: zero its mean, not each row
    scores = scores.view(valid.shape).nan_to_num_(0.0)
    if smooth > 1:
        b, h, n = scores.shape
        pooled = F.avg_pool1d(scores.reshape(b * h, 1, n), kernel_size=smooth, padding=smooth // 2, stride=1)
        scores = pooled[..., :n].reshape(b, h, n)
    return scores.masked_fill(~valid, 0.0)


# The float32 logits one chunk of `window_attention` may hold. On a CPU a 2 MiB chunk stays in the caches
# and its temporaries are reused from malloc's heap; one product of a batch of 8 holds 9 MiB per layer. SmolLM2
# at batch 8, budget 512: an eviction of all 30 layers adds half as much to a decode step chunked as in one
# product (`benchmarks/eviction_chunks.py`: 289 against 577 ms). On an accelerator the chunks only bound the
# eviction's peak memory.
CHUNK_BYTES = {"cpu": 2 * 2**20}
DEVICE_CHUNK_BYTES = 256 * 2**20


def attention_chunks(pairs: int, logits_per_pair: int, device: torch.device) -> list[slice]:
    """Slices of the `pairs` (row, KV head) pairs, each holding at most the device's `CHUNK_BYTES` (else
    `DEVICE_CHUNK_BYTES`) of float32 logits, at least one pair: host arithmetic on shapes, no data read."""
    limit = CHUNK_BYTES.get(device.type, DEVICE_CHUNK_BYTES)
    step = max(1, limit // (4 * max(1, logits_per_pair)))
    return [slice(s, min(s + step, pairs)) for s in range(0, pairs, step)]


def uniform_noise(shape: torch.Size, device: torch.device, generator: Randomness = None) -> torch.Tensor:
    """`[B, H, N]` float32 uniforms strictly inside (0, 1), one per candidate.

    From a `KeyedGenerator` (what a cache passes at an eviction) each is a hash of its
    key, its row, its *global* KV head and its slot: the same whatever the sharding.
    From a plain `torch.Generator` (or None: torch's global one) they are `torch.rand`
    draws, clamped away from 0 and 1."""
    if isinstance(generator, KeyedGenerator):
        return generator.uniform_candidates(shape, device)
    u = torch.rand(shape, device=device, generator=generator, dtype=torch.float32)
    return u.clamp(torch.finfo(torch.float32).tiny, 1.0 - 1e-7)


def gumbel_noise(shape: torch.Size, device: torch.device, generator: Randomness = None) -> torch.Tensor:
    """Standard Gumbel noise per candidate (`[B, H, N]`, float32, from `uniform_noise`). Adding
    it to log-weights and taking the top-k draws k items without replacement with probability
    proportional to the weights."""
    return -torch.log(-torch.log(uniform_noise(shape, device, generator)))


def log_weights(scores: torch.Tensor) -> torch.Tensor:
    """`log(scores)` with zeros mapped to a very negative *finite* number, so that a
    zero-score valid candidate still ranks above every invalid one (-inf)."""
    return torch.log(scores.clamp_min(torch.finfo(torch.float32).tiny))


def mask_of(indices: torch.Tensor, n: int) -> torch.Tensor:
    """Boolean `[..., n]` mask that is True at `indices` (`[..., k]`)."""
    out = torch.zeros((*indices.shape[:-1], n), dtype=torch.bool, device=indices.device)
    return out.scatter(-1, indices, True)


def top_k_by_priority(priority: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Indices of the `n_keep` largest priorities per row (distinct by construction).

    Convention: protected candidates carry `+inf`, invalid ones `-inf`, the rest
    finite numbers, so protected come first and invalid last.
    """
    return torch.topk(priority, n_keep, dim=-1, sorted=False).indices


def sink_mask(positions: torch.Tensor, valid: torch.Tensor, sinks: int) -> torch.Tensor:
    """`[B, H, N]` bool: valid candidates at absolute positions `< sinks` (attention sinks)."""
    return valid & (positions < sinks)


def gaussian_projection(dim: int, rank: int, device: torch.device, generator: Randomness = None) -> torch.Tensor:
    """A `[dim, rank]` Gaussian sketch scaled by `1/sqrt(rank)` (float32). From a `KeyedGenerator`
    it is keyed by its entries' indices only (the same for every head and rank); from a
    `StackedKeyedGenerator` it is `[B, 1, dim, rank]`, each row's own sketch, for all its heads."""
    if isinstance(generator, KeyedGenerator):
        g = generator.normal((dim, rank), device)
        g = g.unsqueeze(1) if g.dim() == 3 else g
    else:
        g = torch.randn((dim, rank), device=device, generator=generator, dtype=torch.float32)
    return g * (1.0 / math.sqrt(rank))


def cur_scores(keys: torch.Tensor, values: torch.Tensor, projection: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """CUR-style leverage proxy `||K G||^2 * ||V G||^2`, normalised to sum 1 over the
    valid candidates of each `(b, h)`; `[B, H, N]` float32, 0 for invalid candidates."""
    k = torch.matmul(keys.float(), projection).square().sum(-1)
    v = torch.matmul(values.float(), projection).square().sum(-1)
    s = (k * v).masked_fill(~valid, 0.0)
    return s / s.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """R-KV redundancy, `[B, H, N]` float32: for each candidate the mean cosine similarity
    of its key to the *other* valid candidates' keys, turned into a distribution by a
    softmax over the valid candidates (invalid ones get 0)."""
    k = F.normalize(keys.float(), dim=-1)
    sim = torch.matmul(k, k.transpose(-1, -2))  # [B, H, N, N]
    n = sim.shape[-1]
    others = valid.unsqueeze(-2) & ~torch.eye(n, dtype=torch.bool, device=keys.device)
    sim = sim.masked_fill(~others, 0.0)
    mean = sim.sum(-1) / others.sum(-1).clamp_min(1)
    return torch.softmax(mean.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
