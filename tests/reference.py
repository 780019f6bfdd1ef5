"""A slow, obviously-correct reference of the VaSE cache: Python lists and loops.

One entry per cached token and (row, KV head): its position, whether it is real,
and its K/V. Evictions follow the spec step by step in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    pos: int
    valid: bool
    k: torch.Tensor
    v: torch.Tensor


class ReferenceCache:
    def __init__(self, batch, kv_heads, budget, window, protect, sinks, temperature=1.0, smooth=5, seed=None):
        self.entries = [[[] for _ in range(kv_heads)] for _ in range(batch)]
        self.ring: list[list[torch.Tensor]] = [[] for _ in range(batch)]  # last `window` queries [Hq, D]
        self.next_pos = [0] * batch
        self.budget, self.window, self.protect, self.sinks = budget, window, protect, sinks
        self.temperature, self.smooth = temperature, smooth
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.prefilled = False

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
        over = occupancy - self.budget
        if first or over <= 0 or over % self.window:
            return False
        noise = None
        if self.generator is not None:
            n_cand = occupancy - self.window
            u = torch.rand((batch, kv_heads, n_cand), generator=self.generator).clamp(1.1754943508222875e-38, 1 - 1e-7)
            noise = -torch.log(-torch.log(u.double()))
        for b in range(batch):
            for h in range(kv_heads):
                self.entries[b][h] = self._evict(b, h, None if noise is None else noise[b, h])
        return True

    def _evict(self, b, h, noise):
        entries = self.entries[b][h]
        n_cand = len(entries) - self.window
        cand, recent = entries[:n_cand], entries[n_cand:]
        n_keep = self.budget - self.window
        # 1. value range; sinks forced in; invalid last
        ranges = []
        for e in cand:
            if not e.valid:
                ranges.append(-math.inf)
            elif e.pos < self.sinks:
                ranges.append(math.inf)
            else:
                ranges.append(max(e.v.double().tolist()) - min(e.v.double().tolist()))
        by_range = sorted(range(n_cand), key=lambda c: -ranges[c])
        protected = {c for c in by_range[: min(self.protect, n_keep)] if cand[c].valid}
        # 2. window attention over valid candidates, averaged over the window and the GQA group
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
        # 3. priority: protected, then log-score (+ Gumbel noise), invalid last
        priority = []
        for c in range(n_cand):
            if c in protected:
                priority.append(math.inf)
            elif cand[c].valid:
                key = math.log(max(scores[c], 1.1754943508222875e-38))
                priority.append(key + (float(noise[c]) if noise is not None else 0.0))
            else:
                priority.append(-math.inf)
        kept = sorted(sorted(range(n_cand), key=lambda c: -priority[c])[:n_keep])
        # kept padding first, then real tokens in sequence order, then the window
        return [cand[c] for c in kept if not cand[c].valid] + [cand[c] for c in kept if cand[c].valid] + recent
