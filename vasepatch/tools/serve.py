"""`vasepatch serve MODEL [cache options] [-- transformers serve options]`: transformers' OpenAI-compatible server
(`transformers serve --continuous-batching`) on a patched model.

transformers serve loads its model in a process of its own, so a model patched in the caller's process never
reaches it. This command runs transformers serve itself, with every option after `--` passed to it as it is, and
with a loader that patches each model it loads (`serve_loader.PatchingLoader`) with the cache options given here.
Continuous batching is on unless `--no-continuous-batching` is passed after `--` (each request then goes through
the patched `generate`). Every request evicts with these settings, inside transformers' paged cache, and each
request that evicted logs one line to the server's stderr when it ends:
`vasepatch: request <id> ended: 5 evictions, 640 tokens dropped, held at most 3 blocks`.

Checked before the server starts (a one-line error, exit status 2): the cache options (`VaSEConfig`, the policy),
serve's dependencies (`pip install "vasepatch[serve]"`), the transformers release (serve's loader, 5.25;
continuous batching that evicts, `compat.CONTINUOUS_BATCHING`), serve options that eviction refuses (CUDA graphs,
`--compile`, a flash attention), transformers serve's own usage errors, and, for a local model, its layers
(`hooks.layers_refusal`: sliding windows over the budget, layer kinds that do not evict). What needs the weights
(whether the patch takes the model at all) is checked in the model's process, which then stops the server with
its error. A registered name (`smollm2-135m`, ...) is served from its converted folder.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vasepatch import models
from vasepatch.tools.generate import MODEL_HELP, add_cache_options, cache_config

SERVE_EXTRA = 'pip install "vasepatch[serve]"'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=MODEL_HELP)
    add_cache_options(p, "seeds VaSE's eviction sampling")
    p.passthrough = "serve_args"  # `cli.CommandParser`: the words after `--`, unparsed
    p.set_defaults(serve_args=[])
    p.usage = "%(prog)s MODEL [cache options] [-- transformers serve options]"
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG


EPILOG = """\
Everything after -- goes to transformers serve as it is (-- --help lists it):
  vasepatch serve smollm2-135m --budget 32 --window 8 -- --host 127.0.0.1 --port 8000 --cb-num-blocks 64
--continuous-batching is added unless --no-continuous-batching is given. Without --cb-num-blocks,
transformers sizes the paged cache from the free memory (about 14 GB for SmolLM2 on a 24 GB machine).
"""


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The validated keyword arguments of `vasepatch.patch` (ValueError naming a bad one, the policy's included)."""
    return {"config": cache_config(args)}


def serve_argv(model: str, passed: list[str]) -> list[str]:
    """transformers serve's command line: `passed` (what followed `--`), continuous batching on unless it says."""
    batching = any(a in ("--continuous-batching", "--no-continuous-batching") for a in passed)
    return [model, *([] if batching else ["--continuous-batching"]), *passed]


def check_release(batching: bool) -> None:
    """ValueError unless this transformers can serve a patched model: serve's dependencies, its `ModelLoader`
    (5.25) and, with continuous batching, a batched path that evicts (a command-line error, before any work)."""
    import transformers
    from transformers.utils import import_utils

    from vasepatch.integration.compat import CONTINUOUS_BATCHING, evicts_in_continuous_batching

    found = transformers.__version__
    serve_available = getattr(import_utils, "is_serve_available", None)
    if serve_available is not None and not serve_available():
        raise ValueError(f"transformers serve needs its dependencies: {SERVE_EXTRA}")
    try:
        from transformers.cli.serving.model_manager import ModelLoader  # noqa: F401
    except ImportError:
        raise ValueError(f"vasepatch serve needs transformers >= 5.25 (serve's ModelLoader); found {found}") from None
    if batching and not evicts_in_continuous_batching():
        low, high = CONTINUOUS_BATCHING
        raise ValueError(
            f"continuous batching evicts with transformers >={low},<{high}; found {found} "
            "(pass -- --no-continuous-batching to serve through the patched generate)"
        )


REFUSED_OPTIONS = {
    "--cb-use-cuda-graph": "CUDA graphs run steps ahead of the host, which evicts between steps",
    "--compile": "compiled continuous batching is not supported",
}


def check_options(argv: list[str]) -> None:
    """ValueError naming a transformers serve option that eviction refuses (before the model's process would)."""
    for option, why in REFUSED_OPTIONS.items():
        if option in argv:
            raise ValueError(f"transformers serve option {option}: {why}")
    for i, word in enumerate(argv):
        value = word.partition("=")[2] if word.startswith("--attn-implementation=") else None
        if word == "--attn-implementation" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and "flash" in value:
            raise ValueError(
                f"transformers serve option --attn-implementation {value}: continuous batching evicts with the sdpa "
                "or eager attention"
            )


def check_layers(folder: Any, budget: int) -> None:
    """ValueError if a local model's config rules eviction out (a Hub id is checked in the model's process)."""
    from pathlib import Path

    if not isinstance(folder, Path):
        return
    from transformers import AutoConfig

    from vasepatch.integration.continuous.hooks import layers_refusal

    problem = layers_refusal(AutoConfig.from_pretrained(folder).get_text_config(), budget)
    if problem:
        raise ValueError(f"vasepatch cannot evict inside this continuous batching: {problem}")


def run(args: argparse.Namespace) -> int:
    patch_settings = settings(args)
    argv = serve_argv(args.model, args.serve_args)
    batching = "--no-continuous-batching" not in argv
    check_release(batching)
    if batching:
        check_options(argv)
    folder = models.resolve(args.model)  # a registered name's folder; a local folder or a Hub id as it is
    if batching:
        check_layers(folder, patch_settings["config"].budget)
    argv[0] = str(folder)
    return launch(argv, patch_settings)


def launch(argv: list[str], patch_settings: dict[str, Any]) -> int:
    """Run `transformers serve *argv` with `PatchingLoader` as serve's loader (until the server stops)."""
    import click
    from transformers.cli.transformers import app
    from typer.main import get_command

    from vasepatch.tools.serve_loader import installed

    group = app if isinstance(app, click.Group) else get_command(app)  # huggingface_hub's click group, or a Typer
    command = group.commands["serve"]
    try:  # serve's options parsed first: a usage error (or -- --help) before anything starts
        context = command.make_context("transformers serve", list(argv))
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.ClickException as err:  # transformers serve's usage errors: one line, as ours
        raise ValueError(f"transformers serve: {err.format_message()}") from None
    print(f"vasepatch: serving {argv[0]} (the model name requests give)", file=sys.stderr, flush=True)
    with installed(patch_settings), context:
        try:
            command.invoke(context)
        except click.exceptions.Abort:
            raise KeyboardInterrupt from None
    return 0
