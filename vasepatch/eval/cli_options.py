"""The options the eval commands share: the cache settings (one `VaSEConfig`, its flags and its
header), the policy names (`--policies`, `--shared-heads`), `--help` with every default, and the
software versions written beside each result. (A policy's own options: `vasepatch.policies.options`.)

The cache settings of a run are one `VaSEConfig`; the config of each policy is
`config.replace(policy=name)`. `full` (never evict) is a mode of the cache, so it
needs nothing of its own: its buffer grows with the sequence.
"""

from __future__ import annotations

import argparse
from typing import Any

from vasepatch.config import FULL, PREFILL_MODES, VaSEConfig
from vasepatch.tools.cli_args import MIN_TEMPERATURE, int_in, number_in, odd_int, policy_names, policy_names_text, seed

SHARED_HEADS = ("off", "on", "both")
SHARED_SUFFIX = "+shared"  # the run of a policy with shared_heads=True, under --shared-heads both
BUDGET_MARK = "@"  # `vase@64`: the run of a policy at its own budget (the run's other cache settings unchanged)


def default_config() -> VaSEConfig:
    """The eval commands' default cache settings (a seed is required: runs are reproducible)."""
    return VaSEConfig(budget=256, window=64, seed=0)


def parse_policies(text: str) -> list[str]:
    """`"all"` -> every policy name (`vasepatch.tools.cli_args.policy_names()`, the registry's: `full` first);
    otherwise the comma-separated names, in order."""
    if text.strip() == "all":
        return policy_names()
    return [name.strip() for name in text.split(",") if name.strip()]


def split_budget(name: str) -> tuple[str, int | None]:
    """A run name and its own budget: `"vase@64"` -> `("vase", 64)`, `"vase"` -> `("vase", None)`;
    `ValueError` for a budget that is not a positive int."""
    name, mark, budget = name.partition(BUDGET_MARK)
    if not mark:
        return name, None
    if not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"policy {name}{mark}{budget}: the budget after {BUDGET_MARK!r} must be a positive int")
    return name, int(budget)


def base_name(name: str) -> str:
    """The policy of a run name (`"vase+shared"` -> `"vase"`, `"vase@64"` -> `"vase"`)."""
    return split_budget(name)[0].removesuffix(SHARED_SUFFIX)


def with_shared(names: list[str], shared_heads: str) -> list[str]:
    """The run names of `--shared-heads`: `"both"` adds `<name>+shared` after every evicting
    policy (idempotent); `"off"` and `"on"` keep `names` (`"on"` sets `config.shared_heads`)."""
    if shared_heads not in SHARED_HEADS:
        raise ValueError(f"shared_heads must be one of {', '.join(SHARED_HEADS)}, got {shared_heads!r}")
    if shared_heads != "both":
        return list(names)
    out: list[str] = []
    for name in names:
        out.append(name)
        twin = name + SHARED_SUFFIX
        if name != FULL and not name.endswith(SHARED_SUFFIX) and twin not in names:
            out.append(twin)
    return out


def run_config(config: VaSEConfig, name: str) -> VaSEConfig:
    """The cache config of run `name`: `config` with its policy, `shared_heads=True` for a
    `<policy>+shared` run, and its own budget for a `<policy>@<budget>` run."""
    named, budget = split_budget(name)
    changes: dict[str, Any] = {"policy": base_name(name)}
    if named.endswith(SHARED_SUFFIX):
        changes["shared_heads"] = True
    if budget is not None:
        changes["budget"] = budget
    return config.replace(**changes)


def check_run(config: VaSEConfig, names: list[str]) -> None:
    """Raise `ValueError` for unknown policy names or a config without a seed."""
    if not isinstance(config, VaSEConfig):
        raise ValueError(f"config must be a vasepatch.VaSEConfig, got {type(config).__name__}")
    known = policy_names()  # the registry's names, without importing it (and torch) for a parser's defaults
    unknown = [name for name in names if base_name(name) not in known or split_budget(name)[0] == FULL + SHARED_SUFFIX]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(known)}")
    if not names:
        raise ValueError("policies must name at least one policy")
    if len(set(names)) != len(names):
        raise ValueError(f"policies must not repeat a run, got {names}")
    for name in names:
        if base_name(name) == FULL and split_budget(name)[1] is not None:
            raise ValueError(f"policy {name}: full keeps every token, so it takes no budget")
        try:
            run_config(config, name)
        except ValueError as err:  # a budget the other settings do not allow: VaSEConfig's own message
            raise ValueError(f"policy {name}: {err}") from None
    if config.seed is None:
        raise ValueError("the eval needs a seeded config (seed=None would not be reproducible)")


def cache_header(config: VaSEConfig) -> dict[str, Any]:
    """The cache settings a run used, as written in its header (`protect` is the effective one;
    `shared_heads` only when on, so that the run keys of per-head runs written before it existed
    still match)."""
    header = {
        "budget": config.budget,
        "window": config.window,
        "protect": config.n_protect,
        "sinks": config.sinks,
        "temperature": config.temperature,
        "smooth": config.smooth,
        "prefill": config.prefill,
        "seed": config.seed,
    }
    if config.shared_heads:
        header["shared_heads"] = True
    return header


def environment(model) -> dict[str, Any]:
    """The model class (`model`: the model, or its class's name) and the torch / transformers versions of a run."""
    import torch
    import transformers

    model_class = model if isinstance(model, str) else type(model).__name__
    return {"model_class": model_class, "torch": torch.__version__, "transformers": transformers.__version__}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every default. A `None` default is explained by the help text itself, a
    help text that already names its default is left alone, and on/off switches need none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))
        if action.default is None or switch or "default" in text:
            return action.help
        return super()._get_help_string(action)


def use_help_formatter(p: argparse.ArgumentParser) -> None:
    """Make `p --help` show the defaults (whatever formatter the caller built `p` with)."""
    p.formatter_class = HelpFormatter


def add_cache_arguments(p: argparse.ArgumentParser, defaults: VaSEConfig, policies_default: str) -> None:
    """The flags of the cache settings (`VaSEConfig` fields) and `--policies`."""
    p.add_argument(
        "--policies",
        default=policies_default,
        help=f"comma-separated policy names ({policy_names_text()}), or 'all' (full first)",
    )
    p.add_argument(
        "--budget", type=int_in(2), default=defaults.budget, help="KV slots kept per layer and head after each eviction"
    )
    p.add_argument(
        "--window",
        type=int_in(1),
        default=defaults.window,
        help="recent tokens never evicted; one eviction every window steps",
    )
    p.add_argument(
        "--protect",
        type=int_in(0),
        default=defaults.protect,
        help="protected slots per eviction (default: budget // 4)",
    )
    p.add_argument("--sinks", type=int_in(0), default=defaults.sinks, help="tokens at positions < sinks, always kept")
    p.add_argument(
        "--temperature",
        "--score-temperature",
        dest="temperature",
        type=number_in(MIN_TEMPERATURE),
        default=defaults.temperature,
        help="softmax temperature of the policies' attention scores (not the sampling temperature)",
    )
    p.add_argument(
        "--smooth",
        type=odd_int,
        default=defaults.smooth,
        help="width of the centred average pool over attention scores, odd (1 = off)",
    )
    p.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default=defaults.prefill,
        help="the prompt: compressed at prefill, kept whole (keep: the paper's setting), or never evicted (pin)",
    )
    p.add_argument("--seed", type=seed, default=defaults.seed, help="seed of the policies and of the sampling")


def add_shared_heads_argument(p: argparse.ArgumentParser) -> None:
    """`--shared-heads off|on|both`: per-head eviction, head-shared eviction, or both side by side."""
    p.add_argument(
        "--shared-heads",
        choices=SHARED_HEADS,
        default="off",
        help="on: every layer keeps one set of tokens for all its KV heads (VaSEConfig.shared_heads); "
        "both: each policy twice, per-head and as '<policy>+shared'",
    )


def cache_config(args: argparse.Namespace) -> VaSEConfig:
    """The `VaSEConfig` of the parsed cache flags (validated)."""
    return VaSEConfig(
        budget=args.budget,
        window=args.window,
        protect=args.protect,
        sinks=args.sinks,
        temperature=args.temperature,
        smooth=args.smooth,
        prefill=args.prefill,
        seed=args.seed,
        shared_heads=getattr(args, "shared_heads", "off") == "on",
    )
