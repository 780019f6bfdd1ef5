"""A slow, obviously-correct reference of the cache and every registered policy: Python lists
and loops.

One entry per cached token and (row, KV head): its position, whether it is real, and its
K/V. Evictions follow the spec step by step in float64: the schedule (a prompt over the
budget is compressed at once with `prefill="compress"`, then one eviction every `window`
tokens past the budget), the candidates (all but the last `window`), each policy's
priority, and the order of what is kept (kept padding, then real tokens in sequence order,
then the window). The random draws are the library's own, from the same seeded generator,
in the same order and shapes, so that sampled policies can be compared exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vasepatch.policies.keyed import KeyedGenerator

TINY = 1.1754943508222875e-38  # float32's smallest normal: the floor of log-weights
FLOAT32_MIN = -3.4028234663852886e38
POLICIES = (
    "vase",
    "vase-topk",
    "vase-l2",
    "vase-var",
    "protect-random",
    "evict-large",
    "vase-dkv",
    "cur",
    "snapkv",
    "rkv",
    "knorm",
    "streaming",
    "random",
    "triattention",
)


@dataclass
class Entry:
    pos: int
    valid: bool
    k: torch.Tensor
    v: torch.Tensor


def _range(v: torch.Tensor, score: str) -> float:
    x = v.double().tolist()
    if score == "range":
        return max(x) - min(x)
    if score == "l2":
        return math.sqrt(sum(a * a for a in x))
    mean = sum(x) / len(x)
    return sum((a - mean) ** 2 for a in x) / len(x)


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u.clamp(TINY, 1 - 1e-7).double()))


class ReferenceCache:
    def __init__(
        self,
        batch,
        kv_heads,
        budget,
        window,
        protect,
        sinks,
        temperature=1.0,
        smooth=5,
        seed=None,
        policy="vase",
        prefill="compress",
        lam=0.5,
        rank=20,
        stats="",
        max_offset=65536,
    ):
        self.entries = [[[] for _ in range(kv_heads)] for _ in range(batch)]
        self.ring: list[list[torch.Tensor]] = [[] for _ in range(batch)]  # last `window` queries [Hq, D]
        self.next_pos = [0] * batch
        self.budget, self.window, self.protect, self.sinks = budget, window, protect, sinks
        self.temperature, self.smooth, self.policy, self.prefill = temperature, smooth, policy, prefill
        self.lam, self.rank = lam, rank
        self.stats, self.max_offset = stats, max_offset  # triattention: its statistics file (layer 0's rows)
        self.seed, self.rounds = seed, 0
        self.prefilled = False
        self.evicted = 0
        self.pinned = 0  # leading entries no eviction touches (the prompt, with prefill="pin")

    def step(self, k, v, q, padding=None):
        batch, kv_heads, q_len, _ = k.shape
        new_valid = [[True] * q_len for _ in range(batch)] if padding is None else padding[:, -q_len:].bool().tolist()
        for b in range(batch):
            for i in range(q_len):
                pos = -1
                if new_valid[b][i]:
                    pos = self.next_pos[b]
                    self.next_pos[b] += 1
                for h in range(kv_heads):
                    self.entries[b][h].append(Entry(pos, new_valid[b][i], k[b, h, i].clone(), v[b, h, i].clone()))
                if i >= q_len - self.window:
                    self.ring[b].append(q[b, :, i].clone() if new_valid[b][i] else torch.zeros_like(q[b, :, i]))
                    self.ring[b] = self.ring[b][-self.window :]
        first = not self.prefilled
        self.prefilled = True
        occupancy = len(self.entries[0][0])
        if first and self.prefill == "pin":
            self.pinned = occupancy
        over = occupancy - self.pinned - self.budget
        if over <= 0 or (first and self.prefill == "keep") or (not first and over % self.window):
            return False
        draws = self._draws(batch, kv_heads, occupancy - self.pinned - self.window, k.shape[-1])
        for b in range(batch):
            for h in range(kv_heads):
                self.entries[b][h] = self.entries[b][h][: self.pinned] + self._evict(
                    b, h, {name: d[b, h] if d.dim() == 3 else d for name, d in draws.items()}
                )
        self.evicted += over
        return True

    def _draws(self, batch, kv_heads, n_cand, dim) -> dict[str, torch.Tensor]:
        """The policy's random draws, as the library makes them: keyed by (seed, layer 0, round)
        (called once per eviction round)."""
        shape, p, cpu = (batch, kv_heads, n_cand), self.policy, torch.device("cpu")
        g = KeyedGenerator(self.seed, 0, self.rounds)
        self.rounds += 1
        draws = {}
        if p == "protect-random":
            draws["protect_u"] = g.uniform_candidates(shape, cpu)
        if p in ("vase", "vase-l2", "vase-var", "protect-random", "evict-large"):
            draws["gumbel"] = _gumbel(g.uniform_candidates(shape, cpu))
        if p == "random":
            draws["uniform"] = g.uniform_candidates(shape, cpu)
        if p == "vase-dkv":
            draws["projection"] = g.normal((dim, self.rank), cpu) * (1.0 / math.sqrt(self.rank))
        if p == "cur":
            fixed = torch.Generator().manual_seed(0)
            draws["projection"] = torch.randn((dim, self.rank), generator=fixed) * (1.0 / math.sqrt(self.rank))
        return draws

    def _evict(self, b, h, draws):
        entries = self.entries[b][h][self.pinned :]
        n_cand = len(entries) - self.window
        cand, recent = entries[:n_cand], entries[n_cand:]
        priority = self._priority(b, h, cand, draws)
        for c, e in enumerate(cand):
            if not e.valid:
                priority[c] = -math.inf
        n_keep = self.budget - self.window
        kept = sorted(sorted(range(n_cand), key=lambda c: -priority[c])[:n_keep])
        # kept padding first, then real tokens in sequence order, then the window
        return [cand[c] for c in kept if not cand[c].valid] + [cand[c] for c in kept if cand[c].valid] + recent

    def _priority(self, b, h, cand, draws) -> list[float]:
        p = self.policy
        sink = [e.valid and e.pos < self.sinks for e in cand]
        if p in ("knorm", "streaming"):
            own = [
                -math.sqrt(sum(x * x for x in e.k.double().tolist())) if p == "knorm" else float(e.pos) for e in cand
            ]
            return [math.inf if s else x for s, x in zip(sink, own, strict=True)]
        if p in ("vase-dkv", "cur"):
            return self._dkv(cand, sink, draws["projection"])
        if p == "random":
            return draws["uniform"].double().tolist()
        if p == "triattention":
            return self._triattention(b, h, cand)
        attention = self._window_attention(b, h, cand)
        if p == "snapkv":
            return attention
        if p == "rkv":
            redundancy = self._redundancy(cand)
            return [self.lam * a - (1 - self.lam) * r for a, r in zip(attention, redundancy, strict=True)]
        return self._vase(cand, sink, attention, draws)

    def _vase(self, cand, sink, attention, draws) -> list[float]:
        """Protection (sinks, then the largest scores; or random; or none: evict-large), then
        log-attention, plus Gumbel noise when sampling."""
        p, n_keep = self.policy, self.budget - self.window
        score = {"vase-l2": "l2", "vase-var": "var"}.get(p, "range")
        scores = [_range(e.v, score) for e in cand]
        if p == "protect-random":
            r = [math.inf if s else u for s, u in zip(sink, draws["protect_u"].double().tolist(), strict=True)]
        else:
            r = [math.inf if s else x for s, x in zip(sink, scores, strict=True)]
        r = [x if e.valid else -math.inf for x, e in zip(r, cand, strict=True)]
        ranked = sorted(range(len(cand)), key=lambda c: -r[c])
        protected = {c for c in ranked[: min(self.protect, n_keep)] if cand[c].valid}
        if p == "evict-large":
            protected = {c for c, s in enumerate(sink) if s}
            others = sorted((c for c, e in enumerate(cand) if e.valid and not sink[c]), key=lambda c: -scores[c])
            banned = set(others[: self.protect])
        key = [math.log(max(a, TINY)) for a in attention]
        if "gumbel" in draws:
            key = [x + float(g) for x, g in zip(key, draws["gumbel"], strict=True)]
        if p == "evict-large":
            key = [FLOAT32_MIN if c in banned else x for c, x in enumerate(key)]
        return [math.inf if c in protected else x for c, x in enumerate(key)]

    def _window_attention(self, b, h, cand) -> list[float]:
        """Softmax of each window query over the real candidates, averaged over the window and
        the GQA group, then smoothed by a centred mean of width `smooth` (zero-padded)."""
        n_cand = len(cand)
        heads_per_kv = self.ring[b][0].shape[0] // len(self.entries[b])
        d = cand[0].k.shape[-1]
        scores = [0.0] * n_cand
        queries = [qv[hq] for qv in self.ring[b] for hq in range(h * heads_per_kv, (h + 1) * heads_per_kv)]
        for query in queries:
            logits = {
                c: float(query.double() @ cand[c].k.double()) / (math.sqrt(d) * self.temperature)
                for c in range(n_cand)
                if cand[c].valid
            }
            if not logits:
                continue
            top = max(logits.values())
            total = sum(math.exp(x - top) for x in logits.values())
            for c, x in logits.items():
                scores[c] += math.exp(x - top) / total / len(queries)
        if self.smooth > 1:
            half = self.smooth // 2
            scores = [
                sum(scores[j] for j in range(c - half, c - half + self.smooth) if 0 <= j < n_cand) / self.smooth
                for c in range(n_cand)
            ]
        return scores

    def _redundancy(self, cand) -> list[float]:
        """R-KV: each real candidate's mean cosine similarity to the other real ones, softmaxed."""
        unit = [e.k.double() / max(float(e.k.double().norm()), 1e-12) for e in cand]
        real = [c for c, e in enumerate(cand) if e.valid]
        mean = {c: sum(float(unit[c] @ unit[o]) for o in real if o != c) / max(len(real) - 1, 1) for c in real}
        top = max(mean.values(), default=0.0)
        total = sum(math.exp(x - top) for x in mean.values())
        return [math.exp(mean[c] - top) / total if c in mean else 0.0 for c in range(len(cand))]

    def _dkv(self, cand, sink, projection) -> list[float]:
        """`||k G||^2 * ||v G||^2` (normalisation over the candidates changes no ranking)."""
        g = projection.double()
        own = [float((e.k.double() @ g).square().sum() * (e.v.double() @ g).square().sum()) for e in cand]
        return [math.inf if s else x for s, x in zip(sink, own, strict=True)]

    def _triattention(self, b, h, cand) -> list[float]:
        """TriAttention on layer 0: the mean query of each of KV head `h`'s query heads rotated by RoPE to each
        future position `now + d` and dotted with each key (`test_triattention.reference_scores`, float64),
        z-scored over the real candidates, the largest over the query heads. `now` is the position after the
        newest token (the last entry, in the window)."""
        from safetensors.torch import load_file

        from tests.policies.test_triattention import reference_scores

        t = load_file(self.stats)
        group = t["q_mean"].shape[1] // len(self.entries[b])
        heads = slice(h * group, (h + 1) * group)
        keys = torch.stack([e.k for e in cand]).unsqueeze(0)  # [1, N, D], after RoPE
        now = self.entries[b][h][-1].pos + 1
        a, inv_freq = float(t["scaling"][0]), t["inv_freq"][0]
        scores = reference_scores(
            keys, None, now, t["q_mean"][0, heads][None], t["q_abs"][0, heads][None], inv_freq, a, self.max_offset
        )[0]  # [G, N]
        real = [c for c, e in enumerate(cand) if e.valid]
        best = [-math.inf] * len(cand)
        for row in scores.tolist():
            mean = sum(row[c] for c in real) / max(len(real), 1)
            std = max(math.sqrt(sum((row[c] - mean) ** 2 for c in real) / max(len(real), 1)), 1e-6)
            for c in real:
                best[c] = max(best[c], (row[c] - mean) / std)
        return best
