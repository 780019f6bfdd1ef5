"""What the eval commands print while they run and when they end.

- `require_extras()`: the `[eval]` extras (tqdm, matplotlib), checked before any model loads.
- `Progress`: one tqdm bar per command, labelled `<policy> · <work>` (`vase · free run`,
  `snapkv · gsm8k`) in the command's work unit (prompts, answers), with the tokens per
  second of the work so far as its postfix.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence

from vasepatch.tools.cli_args import install_hint

EXTRAS = ("tqdm", "matplotlib")


class MissingExtraError(ImportError, ValueError):
    """A package of the `[eval]` extra is not installed. The message is one line saying what to install.
    Also a ValueError, so that the command line reports it as the user's to fix, in that one line."""


def require_extras(packages: Sequence[str] = EXTRAS) -> None:
    """Raise `MissingExtraError` unless every package of the `[eval]` extra can be imported."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise MissingExtraError(
            f"the eval commands need {' and '.join(missing)}, not installed: {install_hint('eval')}"
        )


class Progress:
    """A tqdm bar of `total` work units whose label names the policy at work, with tok/s.

    `phase(policy, work)` relabels it; `advance(n, tokens)` moves it `n` units on and counts
    `tokens` generated (or teacher-forced) tokens toward the tok/s postfix. Work skipped
    (answers found in a resumed file) advances the bar with `tokens=0`, so the rate stays honest."""

    def __init__(self, total: int, unit: str, enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit=unit, dynamic_ncols=True, disable=not enabled)
        self.tokens = 0
        self.start = time.perf_counter()

    def phase(self, policy: str, work: str) -> None:
        self.bar.set_description(f"{policy} · {work}", refresh=True)

    def advance(self, n: int, tokens: int = 0) -> None:
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        if self.tokens and elapsed > 0:
            self.bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s", refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()

    @property
    def label(self) -> str:
        """The bar's current label (`<policy> · <work>`)."""
        return self.bar.desc
