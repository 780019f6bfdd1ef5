"""Render the family matrix of `tests/family_matrix.py` into the supported-models page, `docs/models.md`.

    python docs/gen_models.py          # rewrite the generated part of the page
    python docs/gen_models.py --check  # exit 1 if the page is out of date

Run from the repository root, with the newest transformers vasepatch supports (every family of the matrix
must exist in it). Nothing in the tables is written by hand: each family's tiny config is built and put
through detection, so the features column is what `tests.attention_features.attention_features`
reports, and each rejected family's reason is the `UnsupportedModelError` that `patch` raises now. A family
of the matrix that detection rejects, or a rejected one it accepts, stops the script: the page cannot claim
more (or less) than the tests check.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import generated_section  # docs/generated_section.py: the marked part of the page, --check

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "models.md"

FEATURE_NAMES = {
    "gqa": "GQA",
    "sliding": "sliding window",
    "hybrid": "hybrid sliding/global",
    "sinks": "learned sinks",
    "softcap": "logit soft-capping",
}
MATH_PATH = "eager attention math whatever `attn_backend` (no SDPA or flash kernel takes {what})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _features(features: set[str]) -> str:
    unknown = features - set(FEATURE_NAMES)
    if unknown:
        raise SystemExit(f"detection reports features this page does not know: {sorted(unknown)}")
    shown = [label for name, label in FEATURE_NAMES.items() if name in features]
    return ", ".join(shown) if "gqa" in features else ", ".join(["MHA", *shown])


def _limits(family, features: set[str]) -> str:
    """What differs for this family: the eager math path for softcap and sinks, then the matrix's own note."""
    takes = [FEATURE_NAMES[f] for f in ("softcap", "sinks") if f in features]
    limits = [MATH_PATH.format(what=" or ".join(takes))] if takes else []
    return "; ".join([*limits, *([family.limits] if family.limits else [])])


def _tested_with(family, registered: list[str]) -> str:
    if not family.real_model:
        return "tiny config"
    if family.real_model not in registered:
        raise SystemExit(f"{family.name}: real model {family.real_model!r} is not in vasepatch.models.available()")
    return f"`{family.real_model}` + tiny config"


def accepted_table() -> str:
    from tests.attention_features import attention_features
    from tests.family_matrix import FAMILIES
    from vasepatch import models
    from vasepatch.integration import families

    registered = models.available()
    rows = ["| family (`model_type`) | attention | tested with | limits |", "|---|---|---|---|"]
    for family in FAMILIES:
        if family.missing():
            raise SystemExit(f"{family.missing()}: run this script with the newest transformers vasepatch supports")
        model = family.model()
        families.inspect_model(model)  # an UnsupportedModelError here stops the script
        features = {name for name, present in attention_features(model).items() if present}
        if features != set(family.features):
            raise SystemExit(
                f"{family.name}: detection reports {sorted(features)}, the matrix expects {family.features}"
            )
        row = [f"`{family.name}`", _features(features), _tested_with(family, registered), _limits(family, features)]
        rows.append(f"| {' | '.join(_cell(c) for c in row)} |")
    return "\n".join(rows)


def _refusal(family) -> str:
    from vasepatch.errors import UnsupportedModelError
    from vasepatch.integration import families

    try:
        families.inspect_model(family.model())
    except UnsupportedModelError as err:
        text = str(err)
        if not re.search(family.reason, text):
            raise SystemExit(f"{family.name}: {text!r} no longer matches the matrix's {family.reason!r}") from err
        return text.split(": ", 1)[-1]  # the reason, without "vasepatch cannot patch X, model type 'x'"
    raise SystemExit(f"{family.name}: detection accepts it, but the matrix lists it as rejected")


def rejected_table() -> str:
    from tests.family_matrix import REJECTED

    rows = ["| family (`model_type`) | why detection refuses it (`UnsupportedModelError`) |", "|---|---|"]
    for family in REJECTED:
        if family.missing():
            raise SystemExit(f"{family.missing()}: run this script with the newest transformers vasepatch supports")
        rows.append(f"| `{family.name}` | {_cell(_refusal(family))} |")
    return "\n".join(rows)


def tables() -> str:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from tests.family_matrix import FAMILIES, REJECTED

    transformers.logging.set_verbosity_error()  # tiny configs trip harmless config warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accepted, rejected = accepted_table(), rejected_table()
    return "\n\n".join(
        [
            f"### Accepted: {len(FAMILIES)} families",
            accepted,
            f"### Rejected: {len(REJECTED)} families",
            rejected,
        ]
    )


if __name__ == "__main__":
    generated_section.main(__doc__, Path(__file__).name, PAGE, "tests/family_matrix.py", tables)
