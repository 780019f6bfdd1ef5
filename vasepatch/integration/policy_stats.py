"""Which calibrated statistics a patch's policy reads.

A policy with a `stats` option (`triattention`) reads a file of its model's query statistics. `with_stats` gives
it the file named in `policy_options["stats"]`, else the model's own (`calibration.stats_path`, written by
`vasepatch calibrate`), and checks before anything is patched that the model's RoPE is one the policy can
invert and that the file fits the model: its layers, query and KV heads, frequency pairs and rotary. A policy
without the option is left as it was.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch

from vasepatch import policies
from vasepatch.config import FULL, VaSEConfig
from vasepatch.integration import calibration
from vasepatch.integration.families import text_config
from vasepatch.policies import query_stats


def reads_stats(config: VaSEConfig) -> bool:
    """Whether `config`'s policy reads a statistics file (it has a `stats` option)."""
    return config.policy != FULL and "stats" in policies.get(config.policy).options


def with_stats(model: torch.nn.Module, config: VaSEConfig) -> VaSEConfig:
    """`config` whose policy options name the statistics file its policy reads, checked against `model`
    (ValueError naming `policy_options['stats']` or the command that writes the file); `config` itself when
    its policy reads none."""
    if not reads_stats(config):
        return config
    inv_freq, scaling = calibration.rotary_of(model)  # refuses a RoPE the policy cannot invert
    given = config.policy_options.get("stats")
    path = Path(given) if given else calibration.stats_path(model)
    if not path.is_file():
        raise ValueError(_missing(model, config.policy, path, given))
    try:
        stats = query_stats.load_stats(path)
    except ValueError as exc:
        raise ValueError(f"policy_options['stats']: {exc}") from None
    dtype = calibration.rotary_dtype(model)
    if dtype == torch.float64:  # a float64 rotary holds float32 frequencies cast up, exactly: the file's
        dtype = torch.float32
    check_fits(model, stats, inv_freq, scaling, path, dtype)
    if given:
        _warn_if_foreign(model, path)
    options = {**config.policy_options, "stats": str(path), "rotary_dtype": str(dtype).removeprefix("torch.")}
    return dataclasses.replace(config, policy_options=options)


def _warn_if_foreign(model: torch.nn.Module, path: Path) -> None:
    """A file given by hand for a model of the same shape but other query weights (a fine-tune calibrated on
    its base, say) is used, with a warning."""
    written_for, key = query_stats.read_metadata(path).get("model_key"), calibration.model_key(model)
    if written_for is not None and written_for != key:
        warnings.warn(
            f"policy_options['stats']: {str(path)!r} was calibrated on a model with other query weights "
            f"(model key {written_for}, this one's {key}); its scores follow that model's queries",
            UserWarning,
            stacklevel=4,
        )


def _missing(model: torch.nn.Module, policy: str, path: Path, given: Any) -> str:
    if given:
        return f"policy_options['stats']: no query statistics file at {str(path)!r}"
    name = getattr(model.config, "_name_or_path", "") or "MODEL"
    return (
        f"policy {policy!r} needs this model's calibrated query statistics, and there are none at {str(path)!r} "
        f"(the model's key: {path.stem}): run `vasepatch calibrate {name}` first, or pass "
        "policy_options={'stats': PATH}"
    )


def check_fits(
    model: torch.nn.Module,
    stats: query_stats.QueryStats,
    inv_freq: torch.Tensor,
    scaling: torch.Tensor,
    path: Path,
    dtype: torch.dtype = torch.float32,
) -> None:
    """The statistics in `path` are for a model shaped like `model`, with its rotary (`query_stats.check_fits`:
    ValueError naming `policy_options['stats']` and what differs)."""
    config = text_config(model.config)
    q_heads = config.num_attention_heads
    shape = (inv_freq.shape[0], q_heads, getattr(config, "num_key_value_heads", None) or q_heads)
    query_stats.check_fits(stats, shape, inv_freq, scaling, f"policy_options['stats']: {str(path)!r}", dtype)
