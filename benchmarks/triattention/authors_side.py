"""The authors' side of the TriAttention fidelity comparison (`fidelity.py` runs it): their own scoring code,
called on tensors that the driver recorded.

Runs ONLY in a throwaway environment outside this repository (torch 2.13.0, transformers 4.57.1), with `--src`
an extracted copy of their repository (WeianMao/triattention at c3744ee6; `fidelity.py`'s docstring has the
commands). None of their code is in vasepatch: this script imports their modules from `--src` and calls them;
it computes nothing of the method itself.

What it calls, all from `triattention/methods/triattention.py` (their HF runtime, "TA" in NOTES.md):

- `TriAttention(TriAttentionConfig(...))` with their experiment defaults that matter for scoring: offsets up to
  65536, `score_aggregation="mean"`, `normalize_scores=True`, `per_layer_perhead_pruning=True` with
  `layer_perhead_aggregation="max"`, `disable_mlr=False`, float32, and `seed=None` (no tie-breaking noise). Its
  constructor loads the statistics (`load_head_frequency_stats`) and rebuilds the rotary from the model
  folder's `config.json` (`build_rotary`).
- Raw per-query-head scores: `_compute_layer_head_scores(keys, positions, layer, start_index=0,
  positions_per_kv_head=...)` with `absolute_position` (their round start `t`) set to the driver's `now`. That
  is their per-head path: `invert_rope` -> `compute_frequency_statistics_from_means` -> `score_keys_for_round`.
- Kept sets: `compute_keep_indices(pkv, prefix_length=0)` with `budget` set to each budget, their top-level
  entry point, which in `per_layer_perhead` mode z-scores each layer's rows, takes the max over each KV head's
  group and calls `topk`. With `prefix_length=0` every slot is a candidate (vasepatch's `valid` all true).
  Where the driver gives each (layer, KV head) its own positions (gaps, as after a compaction), they go in
  `cache_positions_per_layer_perhead`, as their runtime tracks them after a per-layer-per-head compaction.
- The group-max z-scores that their `topk` ranks are recorded by wrapping `torch.Tensor.topk` for the
  duration of that call (instrumentation only: the wrapper returns their own `topk`'s result unchanged).

Input (`--inputs`, torch.save): `keys` [L, Hkv, N, D] float32 (post-RoPE, as cached), `positions`
[L, Hkv, N] int64, `now` int, `per_head_positions` bool, `budgets` list of int. Output (`--out`, torch.save):
`raw` [L, Hq, N], `kept` {budget: [L, Hkv, budget] int64}, `aggregated` {budget: [L, Hkv, N]}, and the
constants their runtime built: `omega`, `freq_scale_sq`, `offsets`, `attention_scale`, and the versions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="extracted copy of the authors' repository")
    p.add_argument("--stats", required=True, help="statistics in their format (torch.save)")
    p.add_argument("--model-dir", required=True, help="folder with the model's config.json (their build_rotary)")
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--offset-max-length", type=int, default=65536)
    args = p.parse_args()

    sys.path.insert(0, str(Path(args.src).resolve()))
    import transformers
    from triattention.methods.triattention import TriAttention, TriAttentionConfig

    data = torch.load(args.inputs, weights_only=True)
    keys, positions, now = data["keys"].float(), data["positions"].long(), int(data["now"])
    per_head = bool(data["per_head_positions"])
    layers, kv_heads, n, _ = keys.shape

    def runtime(budget: int) -> TriAttention:
        config = TriAttentionConfig(
            stats_path=Path(args.stats),
            model_path=Path(args.model_dir),
            device=torch.device("cpu"),
            dtype=torch.float32,  # apply_triattention_patch forces float32 (TA:715)
            budget=budget,
            offset_max_length=args.offset_max_length,
            score_aggregation="mean",
            seed=None,  # no tie-breaking noise
            normalize_scores=True,
            per_layer_perhead_pruning=True,
            layer_perhead_aggregation="max",
            disable_mlr=False,
        )
        return TriAttention(config)

    pkv = tuple((keys[i].unsqueeze(0), keys[i].unsqueeze(0)) for i in range(layers))
    per_layer_head = {(i, h): positions[i, h].tolist() for i in range(layers) for h in range(kv_heads)}

    comp = runtime(min(data["budgets"]))
    comp.absolute_position = now
    raw = []
    with torch.no_grad():
        for layer in range(layers):
            scores = comp._compute_layer_head_scores(
                pkv[layer][0],
                positions[layer, 0],
                layer,
                start_index=0,
                positions_per_kv_head=[positions[layer, h] for h in range(kv_heads)] if per_head else None,
            )
            raw.append(scores)
    raw_t = torch.stack(raw)  # [L, Hq, N]

    kept, aggregated = {}, {}
    original_topk = torch.Tensor.topk
    for budget in data["budgets"]:
        comp = runtime(budget)
        comp.absolute_position = now
        comp.prefix_length = 0
        comp.cache_positions = positions[0, 0].tolist()
        comp.cache_positions_per_layer_perhead = dict(per_layer_head) if per_head else None
        seen: list[torch.Tensor] = []

        def recording_topk(self, *a, seen=seen, **kw):
            seen.append(self.detach().clone())
            return original_topk(self, *a, **kw)

        torch.Tensor.topk = recording_topk
        try:
            with torch.no_grad():
                indices = comp.compute_keep_indices(pkv, prefix_length=0)
        finally:
            torch.Tensor.topk = original_topk
        expected = (layers, kv_heads, budget)
        if tuple(indices.shape) != expected:
            raise RuntimeError(f"compute_keep_indices gave {tuple(indices.shape)}, expected {expected}")
        if len(seen) != layers * kv_heads:
            raise RuntimeError(f"saw {len(seen)} topk calls, expected {layers * kv_heads}")
        kept[budget] = indices.clone()
        aggregated[budget] = torch.stack(seen).reshape(layers, kv_heads, n)

    torch.save(
        {
            "raw": raw_t,
            "kept": kept,
            "aggregated": aggregated,
            "omega": comp.omega.clone(),
            "freq_scale_sq": comp.freq_scale_sq.clone(),
            "offsets": comp.offsets.clone(),
            "attention_scale": comp.attention_scale,
            "num_key_value_groups": comp.num_key_value_groups,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
