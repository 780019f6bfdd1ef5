"""`vasepatch eval fidelity --probe FILE`: a fixed probe teacher-forced through every policy.

The probe file holds prompt ids, reference tokens and the dense predictions of
another implementation, and that implementation's top-1 agreement per policy.
Each policy runs with `seeds` policy seeds; the full cache is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import vasepatch
from vasepatch.config import FULL, VaSEConfig
from vasepatch.eval import cli_options, data, metrics
from vasepatch.eval.fidelity_settings import FidelitySettings

if TYPE_CHECKING:
    import torch

# Our policy names -> the probe file's anchor results of the authors' implementation. (Its kvpress
# anchors are another library's policies, with known differences, so they are not matched.)
PROBE_ANCHORS = {
    "full": "dense",
    "vase": "authors_vase_attnv_range_sink_sample_attn_n_large_64_smooth",
    "vase-dkv": "authors_vase_dkv_cur_resample_gauss",
    "snapkv": "authors_snapkv_style_attn_smooth",
    "rkv": "authors_rkv_lambda_0.5_smooth",
    "evict-large": "authors_ablation_evict_large_range",
}
COLUMNS = (
    "policy",
    "top1_agreement",
    "top1_stderr",
    "reference_implementation",
    "top1_seeds",
    "top1_vs_file_dense",
    "kl",
    "nll_delta",
)


def run_keys(settings: FidelitySettings, name: str) -> list[str]:
    """The caches of policy `name`: one per policy seed (one for `full`)."""
    return [FULL] if name == FULL else [f"{name}@{s}" for s in range(settings.seeds)]


def probe_configs(settings: FidelitySettings) -> dict[str, VaSEConfig]:
    """`{"full": ..., "<policy>@<s>": config with seed + s}`, the reference first."""
    configs = {FULL: settings.config.replace(policy=FULL)}
    for name in settings.policies:
        if name != FULL:
            for s in range(settings.seeds):
                config = cli_options.run_config(settings.config, name)
                configs[f"{name}@{s}"] = config.replace(seed=settings.config.seed + s)
    return configs


def force_probe(model, configs: dict[str, VaSEConfig], ids, reference):
    """Teacher-force the probe: `(full argmax [T], {key: argmax [T]}, {key: {metric: [T]}})`."""
    import torch

    from vasepatch.eval.forcing import teacher_force

    mask = torch.ones_like(ids)
    dense: list[torch.Tensor] = []
    argmax: dict[str, list[torch.Tensor]] = {k: [] for k in configs}
    values: dict[str, dict[str, list[torch.Tensor]]] = {k: {} for k in configs}
    with vasepatch.patched(model, config=configs[FULL]) as handle:
        caches = {key: handle.new_cache(cfg) for key, cfg in configs.items()}
        for start, logits in teacher_force(model, handle.cache_keyword, caches, ids, mask, reference):
            ref = logits[FULL]
            targets = reference[:, start : start + ref.shape[1]]
            dense.append(ref.argmax(-1)[0])
            for key, lg in logits.items():
                argmax[key].append(lg.argmax(-1)[0])
                for m, v in metrics.next_token_metrics(ref, lg, targets).items():
                    values[key].setdefault(m, []).append(v[0])
    cat = {k: {m: torch.cat(v) for m, v in d.items()} for k, d in values.items()}
    return torch.cat(dense), {k: torch.cat(v) for k, v in argmax.items()}, cat


def _anchor(anchors: dict[str, Any], name: str) -> Any:
    """The probe file's result for policy `name` (none for a head-shared run: the file has none)."""
    return None if name.endswith(cli_options.SHARED_SUFFIX) else anchors.get(PROBE_ANCHORS.get(name, ""))


def _row(name: str, keys: list[str], dense, file_dense, argmax, values, anchor) -> dict[str, Any]:
    top1 = [(argmax[k] == dense).float().mean().item() for k in keys]
    vs_file = [(argmax[k] == file_dense).float().mean().item() for k in keys]
    mean, se = metrics.mean_stderr(top1)
    return {
        "policy": name,
        "top1_agreement": mean,
        "top1_stderr": se,
        "top1_seeds": [round(t, 4) for t in top1],
        "top1_vs_file_dense": metrics.mean_stderr(vs_file)[0],
        "kl": sum(values[k]["kl"].mean().item() for k in keys) / len(keys),
        "nll_delta": sum(values[k]["nll_delta"].mean().item() for k in keys) / len(keys),
        "reference_implementation": anchor["mean"] if isinstance(anchor, dict) else anchor,
        "n_tokens": int(dense.numel()),
    }


PROBE_KEYS = ("prompt_ids", "reference_tokens", "dense_predictions")


def read(path: str | Path) -> dict[str, Any]:
    """The probe file, checked: a `data.DataError` (one line) if it is missing or malformed."""
    path = Path(path)
    if path.is_dir():
        raise data.DataError(f"probe file {path}: is a folder, not a file")
    if not path.is_file():
        raise data.DataNotFoundError(f"probe file {path}: no such file")
    try:
        probe = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise data.DataError(f"probe file {path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise data.DataError(f"probe file {path}: not valid JSON ({e})") from None
    except OSError as e:
        raise data.DataError(f"probe file {path}: cannot be read ({e.strerror})") from None
    if not isinstance(probe, dict):
        raise data.DataError(f"probe file {path}: expected a JSON object, got {type(probe).__name__}")
    for key in PROBE_KEYS:
        value = probe.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(t, int) for t in value):
            raise data.DataError(f"probe file {path}: {key!r} must be a non-empty list of token ids")
    if len(probe["dense_predictions"]) != len(probe["reference_tokens"]):
        raise data.DataError(f"probe file {path}: 'dense_predictions' and 'reference_tokens' differ in length")
    return probe


def run_probe(
    settings: FidelitySettings, model, probe: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[dict]]:
    """`(header, one result row per policy)` of the probe `settings.probe` (read here unless given)."""
    import torch

    if probe is None:
        probe = read(settings.probe)
    ids = torch.tensor([probe["prompt_ids"]])
    reference = torch.tensor([probe["reference_tokens"]])
    file_dense = torch.tensor(probe["dense_predictions"])
    anchors = probe.get("anchor_results_top1_agreement", {})
    dense, argmax, values = force_probe(model, probe_configs(settings), ids, reference)
    results = [
        _row(name, run_keys(settings, name), dense, file_dense, argmax, values, _anchor(anchors, name))
        for name in settings.policies
    ]
    header = settings.header(model)
    longest = ids.shape[1] + reference.shape[1]
    header.update(longest_sequence=longest, compression=round(longest / settings.config.budget, 2))
    header["dense_matches_file"] = (dense == file_dense).float().mean().item()
    return header, results
