"""vasepatch's TriAttention scores against the authors' own PyTorch scoring, on real keys and statistics.

For each model: calibrate with vasepatch (`calibration.calibrate`, MATH-500 text), run the model in float32 over
a different text (GSM8K questions and answers) with a plain transformers cache, take every layer's cached
post-RoPE keys and their positions, and score them twice at the round position `t = N` (the next token):

- ours: `triattention.future_scores` (raw, per query head) and `triattention_scores` (z-scored over the
  candidates, max over each KV head's group), `max_offset=65536`, and the kept set `topk(budget)` per KV head;
- theirs: `authors_side.py`, run in a throwaway virtual environment with their repository's modules
  (WeianMao/triattention at c3744ee6), on the same keys and positions and on our statistics converted to their
  file format (`{"layerLL_headHH": {"q_mean_real", "q_mean_imag", "q_abs_mean"}}`).

Two cases per model: `contiguous` (positions 0..N-1, as before any eviction) and `gapped` (each (layer, KV
head) keeps its own random subset of the slots with their true positions, as after a per-head compaction).

None of the authors' code is in this repository. Setup of their side, outside the repository:

    python3 -m venv /tmp/ta-venv
    /tmp/ta-venv/bin/pip install -q "torch==2.13.0" "transformers==4.57.1" safetensors numpy
    mkdir -p /tmp/ta-src
    git --git-dir=/work/.mirror/WeianMao+triattention/repo archive c3744ee6 \\
        triattention/__init__.py triattention/common triattention/methods | tar -x -C /tmp/ta-src

Then, in vasepatch's own environment:

    .venv/bin/python benchmarks/triattention/fidelity.py --ta-python /tmp/ta-venv/bin/python --ta-src /tmp/ta-src \\
        --work /tmp/ta-fidelity --out docs/results/triattention-fidelity

It writes `fidelity.json` (every layer's figures) and `table.md` (first, middle and last layer, and the worst
over all layers) to `--out`; the recorded tensors stay in `--work`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
AUTHORS_SIDE = Path(__file__).resolve().with_name("authors_side.py")
DEFAULT_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
AUTHORS_COMMIT = "c3744ee6"


# --- pure helpers (tested in tests/benchmarks/test_triattention_fidelity.py) -------------------------------


def authors_stats(q_mean: Tensor, q_abs: Tensor, head_dim: int, model_name: str) -> dict[str, Any]:
    """Our per-layer statistics (`q_mean` [L, Hq, F, 2], `q_abs` [L, Hq, F]) as the authors' stats payload
    (what their `save_head_frequency_stats` writes and `load_head_frequency_stats` reads): every (layer, query
    head) sampled, keys `layerLL_headHH`, float32 tensors [F]."""
    layers, heads, _ = q_abs.shape
    sampled = [[layer, head] for layer in range(layers) for head in range(heads)]
    stats = {
        f"layer{layer:02d}_head{head:02d}": {
            "q_mean_real": q_mean[layer, head, :, 0].float().contiguous().clone(),
            "q_mean_imag": q_mean[layer, head, :, 1].float().contiguous().clone(),
            "q_abs_mean": q_abs[layer, head].float().contiguous().clone(),
        }
        for layer, head in sampled
    }
    metadata = {"sampled_heads": sampled, "head_dim": int(head_dim), "rope_style": "half", "model_name": model_name}
    return {"metadata": metadata, "stats": stats}


def legacy_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A transformers-5 `config.json` (RoPE in `rope_parameters`) as transformers 4.x reads it (`rope_theta`
    and `rope_scaling` at the top level), with the list of fields added. Their `build_rotary` reads the rotary
    from `config.json` under transformers 4.57.1, which ignores `rope_parameters` and would otherwise fall back
    to its default `rope_theta`."""
    out, changed = dict(config), []
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        if "rope_theta" not in config:
            out["rope_theta"] = params["rope_theta"]
            changed.append(f"rope_theta={params['rope_theta']}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default" and not config.get("rope_scaling"):
            out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
            changed.append(f"rope_scaling={out['rope_scaling']}")
    return out, changed


def gapped_positions(layers: int, kv_heads: int, n: int, keep: int, seed: int) -> Tensor:
    """[L, Hkv, keep] int64: for each (layer, KV head) its own random subset of `keep` of the positions
    0..n-1, ascending (the slots a compaction keeps, with their true positions)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n, generator=g)[:keep].sort().values for _ in range(layers * kv_heads)]
    return torch.stack(rows).reshape(layers, kv_heads, keep)


def compare_raw(ours: Tensor, theirs: Tensor) -> dict[str, float]:
    """Raw scores of one layer ([Hq, N] each): the largest absolute difference, the largest magnitude of
    theirs (`scale`), their ratio (`max_rel`: the largest difference relative to the layer's score scale),
    and the largest elementwise relative difference over the scores at least 1% of the scale in magnitude."""
    diff = (ours.double() - theirs.double()).abs()
    scale = theirs.double().abs().max().clamp_min(1e-30)
    big = theirs.double().abs() >= 0.01 * scale
    elementwise = (diff[big] / theirs.double().abs()[big]).max() if big.any() else torch.tensor(0.0)
    return {
        "max_abs": float(diff.max()),
        "scale": float(scale),
        "max_rel": float(diff.max() / scale),
        "max_rel_elementwise": float(elementwise),
    }


def compare_kept(ours: Tensor, theirs: Tensor, aggregated: Tensor, budget: int) -> dict[str, Any]:
    """Kept sets of one layer (`ours`, `theirs` [Hkv, budget] slot indices): how many KV heads keep the same
    set, how many slots differ in all, and per head the margin at the cut of the reference ranking
    (`aggregated` [Hkv, N], theirs): the score gap between the last kept and the first dropped slot."""
    heads = ours.shape[0]
    same, differing, margins = 0, 0, []
    for h in range(heads):
        a, b = set(ours[h].tolist()), set(theirs[h].tolist())
        same += a == b
        differing += len(a - b)
        ranked = aggregated[h].sort(descending=True).values
        margins.append(float(ranked[budget - 1] - ranked[budget]) if budget < ranked.numel() else float("inf"))
    return {"heads_identical": same, "heads": heads, "slots_differing": differing, "min_cut_margin": min(margins)}


# --- the run ----------------------------------------------------------------------------------------------


def gsm8k_ids(tokenizer: Any, tokens: int) -> list[int]:
    """The first `tokens` ids of GSM8K's test questions and answers in file order (`Question: ...\\nAnswer:
    ...\\n\\n` each), tokenized without special tokens."""
    from vasepatch.eval.data import DATASETS, data_dir

    ids: list[int] = []
    for line in (data_dir() / DATASETS["gsm8k"]).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            text = f"Question: {record['question']}\nAnswer: {record['answer']}\n\n"
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens:
                return ids[:tokens]
    raise ValueError(f"GSM8K has only {len(ids)} tokens with this tokenizer")


def calibrated(model: Any, tokenizer: Any, path: Path, tokens: int) -> Path:
    """`path`, calibrated on `tokens` tokens of MATH-500 (as `vasepatch calibrate` builds its text) unless it
    exists."""
    if path.is_file():
        return path
    from vasepatch.integration.calibration import calibrate
    from vasepatch.tools.calibrate import MATH500, math500_pieces, token_ids

    ids, sha = token_ids(tokenizer, math500_pieces(), tokens, MATH500)
    meta = {"text_source": "vasepatch/data/math500", "text_sha256": sha}
    return calibrate(model, torch.tensor([ids]), path=path, metadata=meta)


def cached_keys(model: Any, ids: list[int]) -> Tensor:
    """[L, Hkv, N, D] float32: every layer's post-RoPE keys in a plain transformers cache after one forward pass."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(config=model.config), use_cache=True)
    cache = out.past_key_values
    layers = [layer.keys for layer in cache.layers] if hasattr(cache, "layers") else list(cache.key_cache)
    return torch.stack([k[0].float() for k in layers])


def our_scores(keys: Tensor, positions: Tensor, now: int, stats_file: Path, max_offset: int) -> tuple[Tensor, Tensor]:
    """vasepatch's raw scores [L, Hq, N] (`future_scores`) and group-max z-scores [L, Hkv, N]
    (`triattention_scores`), every slot a valid candidate."""
    import importlib

    from vasepatch.policies.query_stats import load_stats

    triattention = importlib.import_module("vasepatch.policies.triattention")  # the package exports the function

    table = load_stats(stats_file)
    layers, kv_heads, n, _ = keys.shape
    raw, agg = [], []
    for layer in range(layers):
        k, p = keys[layer].unsqueeze(0), positions[layer].unsqueeze(0)
        rows = table.rows(torch.arange(kv_heads).unsqueeze(0) + layer * kv_heads)
        t = torch.full((1, kv_heads), now, dtype=torch.int64)
        valid = torch.ones(1, kv_heads, n, dtype=torch.bool)
        raw.append(triattention.future_scores(k, p, t, rows, max_offset)[0].reshape(-1, n))
        agg.append(triattention.triattention_scores(k, p, valid, t, rows, max_offset)[0])
    return torch.stack(raw), torch.stack(agg)


def run_theirs(args: argparse.Namespace, work: Path, stats_pt: Path, config_dir: Path, inputs: Path) -> dict:
    out = inputs.with_name(inputs.stem + "-theirs.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    cmd = [args.ta_python, str(AUTHORS_SIDE), "--src", args.ta_src, "--stats", str(stats_pt),
           "--model-dir", str(config_dir), "--inputs", str(inputs), "--out", str(out),
           "--offset-max-length", str(args.max_offset)]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, cwd=str(work))
    return torch.load(out, weights_only=False)


def compare_case(ours_raw: Tensor, ours_agg: Tensor, theirs: dict, budgets: list[int]) -> list[dict]:
    rows = []
    for layer in range(ours_agg.shape[0]):
        row = {"layer": layer, **compare_raw(ours_raw[layer], theirs["raw"][layer])}
        row["z_max_abs"] = max(
            float((ours_agg[layer].double() - theirs["aggregated"][b][layer].double()).abs().max()) for b in budgets
        )
        for b in budgets:
            mine = ours_agg[layer].topk(b, dim=-1).indices
            row[f"kept_{b}"] = compare_kept(mine, theirs["kept"][b][layer], theirs["aggregated"][b][layer], b)
        rows.append(row)
    return rows


def run_model(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    from vasepatch import models
    from vasepatch.integration.calibration import rotary_of
    from vasepatch.policies.triattention import future_offsets

    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)
    folder = models.resolve(name)
    model, tokenizer = models.load(name, dtype=torch.float32)
    start = time.perf_counter()
    stats_file = calibrated(model, tokenizer, work / "stats.safetensors", args.calib_tokens)
    print(f"{name}: statistics {stats_file} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    tensors = load_file(str(stats_file))
    inv_freq, scaling = rotary_of(model)

    # their side reads their stats format and rebuilds the rotary from a config.json that transformers 4.x reads
    stats_pt = work / "stats-authors-format.pt"
    head_dim = 2 * tensors["inv_freq"].shape[1]
    torch.save(authors_stats(tensors["q_mean"], tensors["q_abs"], head_dim, name), stats_pt)
    config_dir = work / "config-4x"
    config_dir.mkdir(exist_ok=True)
    config, changed = legacy_config(json.loads((Path(folder) / "config.json").read_text()))
    if args.keep_config:  # a control: their rotary from the transformers-5 config.json as it is
        config, changed = json.loads((Path(folder) / "config.json").read_text()), []
    (config_dir / "config.json").write_text(json.dumps(config, indent=2))

    ids = gsm8k_ids(tokenizer, args.tokens)
    keys = cached_keys(model, ids)
    layers, kv_heads, n, _ = keys.shape
    del model
    result: dict[str, Any] = {
        "model": name,
        "folder": str(folder),
        "layers": layers,
        "kv_heads": kv_heads,
        "q_heads": tensors["q_abs"].shape[1],
        "head_dim": head_dim,
        "calibration_tokens": args.calib_tokens,
        "config_fields_added_for_transformers_4": changed,
        "cases": {},
    }
    cases = {
        "contiguous": torch.arange(n).expand(layers, kv_heads, n).contiguous(),
        "gapped": gapped_positions(layers, kv_heads, n, round(args.gap_keep * n), args.seed),
    }
    for case, positions in cases.items():
        slots = positions if case == "gapped" else None
        k = keys if slots is None else torch.gather(keys, 2, slots.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
        inputs = work / f"{case}.pt"
        torch.save({"keys": k, "positions": positions, "now": n, "per_head_positions": case == "gapped",
                    "budgets": args.budgets}, inputs)  # fmt: skip
        start = time.perf_counter()
        ours_raw, ours_agg = our_scores(k, positions, n, stats_file, args.max_offset)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        theirs = run_theirs(args, work, stats_pt, config_dir, inputs)
        theirs_s = time.perf_counter() - start
        result["constants"] = {
            "omega_max_abs_diff": float((theirs["omega"].double() - inv_freq[0].double()).abs().max()),
            "freq_scale_sq": sorted({round(float(x), 9) for x in theirs["freq_scale_sq"]}),
            "our_scaling": sorted({float(x) for x in scaling}),
            "offsets": [float(x) for x in theirs["offsets"]],
            "offsets_match": [float(x) for x in theirs["offsets"]] == future_offsets(args.max_offset),
            "their_torch": theirs["torch_version"],
            "their_transformers": theirs["transformers_version"],
        }
        rows = compare_case(ours_raw, ours_agg, theirs, args.budgets)
        result["cases"][case] = {"candidates": positions.shape[-1], "now": n, "seconds_ours": round(ours_s, 2),
                                 "seconds_theirs_subprocess": round(theirs_s, 2), "layers": rows}  # fmt: skip
        worst = max(r["max_rel"] for r in rows)
        same = {b: sum(r[f"kept_{b}"]["heads_identical"] for r in rows) for b in args.budgets}
        print(f"{name} {case}: worst max_rel {worst:.2e}; identical kept sets {same} of {layers * kv_heads}",
              file=sys.stderr, flush=True)  # fmt: skip
    return result


def table(results: list[dict], budgets: list[int]) -> str:
    head = ["model", "case", "layer", "max abs diff (raw)", "score scale", "max rel (raw)", "max rel elementwise",
            "max abs diff (z, group max)"] + [f"kept sets identical, budget {b}" for b in budgets]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        for case, data in res["cases"].items():
            rows = data["layers"]
            picks = sorted({0, len(rows) // 2, len(rows) - 1})
            for i in [*picks, "all"]:
                sel = rows if i == "all" else [rows[i]]
                keys = ("max_abs", "scale", "max_rel", "max_rel_elementwise", "z_max_abs")
                r = {k: max(x[k] for x in sel) for k in keys}
                kept = []
                for b in budgets:
                    same = sum(x[f"kept_{b}"]["heads_identical"] for x in sel)
                    total = sum(x[f"kept_{b}"]["heads"] for x in sel)
                    diff = sum(x[f"kept_{b}"]["slots_differing"] for x in sel)
                    kept.append(f"{same}/{total}" + (f" ({diff} slots differ)" if diff else ""))
                label = f"all {len(rows)} (worst)" if i == "all" else str(i)
                cells = [res["model"], f"{case} (N={data['candidates']}, t={data['now']})", label,
                         f"{r['max_abs']:.2e}", f"{r['scale']:.3g}", f"{r['max_rel']:.2e}",
                         f"{r['max_rel_elementwise']:.2e}", f"{r['z_max_abs']:.2e}", *kept]  # fmt: skip
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rounded(value: Any) -> Any:
    """`value` with every float to 4 significant digits (the JSON of the figures stays small)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--ta-python", default="/tmp/ta-venv/bin/python", help="python of the throwaway environment")
    p.add_argument("--ta-src", default="/tmp/ta-src", help="extracted copy of the authors' repository")
    p.add_argument("--work", default="/tmp/ta-fidelity", help="where the tensors and statistics go")
    p.add_argument("--out", default=str(ROOT / "docs/results/triattention-fidelity"))
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=1024, help="GSM8K tokens whose keys are scored")
    p.add_argument("--gap-keep", type=float, default=0.6, help="fraction of the slots the gapped case keeps")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 128])
    p.add_argument("--max-offset", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-config",
        action="store_true",
        help="a control: give their side the model's config.json unchanged (transformers 4.57.1 then misses "
        "rope_parameters' rope_theta), to see the comparison catch a wrong rotary",
    )
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)

    results = [run_model(args, name) for name in args.models]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/triattention/fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = {"command": command, "authors_commit": AUTHORS_COMMIT, "torch": torch.__version__,
               "budgets": args.budgets, "max_offset": args.max_offset, "results": results}  # fmt: skip
    import transformers

    payload["transformers"] = transformers.__version__
    (out / "fidelity.json").write_text(json.dumps(rounded(payload), indent=1) + "\n")
    (out / "table.md").write_text(table(results, args.budgets))
    print(table(results, args.budgets))


if __name__ == "__main__":
    main()
