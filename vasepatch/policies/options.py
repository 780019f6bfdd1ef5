"""A policy's options: read from its function's keyword-only parameters, checked when it is built.

An option's type annotation states what it accepts: `int`, `float` (any real
number), `bool` or `str`, optionally wrapped in `typing.Annotated` with one
constraint (`AtLeast`, `Above`, `Between`, `OneOf`). The aliases below are the
options the cache passes to every policy that declares them (`COMMON_OPTIONS`).
A numpy scalar or 0-d tensor counts as the Python value it holds (`config.plain`),
and the policy is built with that plain value; a bool is never an int or a number.
An int option needs a finite range (`Between`): its value sizes tensors at the first
eviction, too late to refuse it.
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from vasepatch.config import MAX_SLOTS, MIN_TEMPERATURE, SEED_RANGE, is_number, plain

COMMON_OPTIONS = ("protect", "sinks", "temperature", "smooth")
_KINDS = {bool: "a bool", int: "an int", float: "a number", str: "a string"}


@dataclass(frozen=True)
class AtLeast:
    low: float
    finite: bool = False

    def ok(self, value: Any) -> bool:
        return value >= self.low and (not self.finite or math.isfinite(value))

    def __str__(self) -> str:
        return f"{'finite and ' if self.finite else ''}>= {self.low}"


@dataclass(frozen=True)
class Above:
    low: float

    def ok(self, value: Any) -> bool:
        return math.isfinite(value) and value > self.low

    def __str__(self) -> str:
        return f"finite and > {self.low}"


@dataclass(frozen=True)
class Between:
    low: float
    high: float
    odd: bool = False  # only odd values (a width centred on one slot)

    def ok(self, value: Any) -> bool:
        return self.low <= value <= self.high and (not self.odd or value % 2 == 1)

    def __str__(self) -> str:
        return f"in [{self.low}, {self.high}]"


@dataclass(frozen=True)
class OneOf:
    choices: tuple[Any, ...]

    def ok(self, value: Any) -> bool:
        return value in self.choices

    def __str__(self) -> str:
        return "one of " + ", ".join(map(repr, self.choices))


# The bounds are those of VaSEConfig (vasepatch.config), so that a policy built by hand accepts what a patch does.
Protect = Annotated[int, Between(0, MAX_SLOTS)]  # slots for the sinks and the largest-range values
Sinks = Annotated[int, Between(0, MAX_SLOTS)]  # candidates at absolute positions < sinks are kept
Temperature = Annotated[float, AtLeast(MIN_TEMPERATURE, finite=True)]  # of the window-attention softmax
Smooth = Annotated[int, Between(1, MAX_SLOTS, odd=True)]  # width of the centred average pool (1 = off)
Seed = Annotated[int, Between(*SEED_RANGE)]  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class Option:
    """One keyword-only parameter of a priority function: its default, type and constraint."""

    name: str
    default: Any
    kind: type | None = None
    constraint: Any = None

    def requirement(self) -> str:
        kind = _KINDS.get(self.kind, "")
        if getattr(self.constraint, "odd", False):
            kind = "an odd int" if self.kind is int else f"odd and {kind}".strip()
        if isinstance(self.constraint, OneOf):
            return str(self.constraint)
        return " ".join(p for p in (kind, str(self.constraint) if self.constraint else "") if p)

    def check(self, policy: str, value: Any) -> None:
        """Raise a ValueError naming the policy, the option and what it accepts."""
        if self._accepts(value):
            return
        raise ValueError(f"policy {policy!r}: option {self.name} must be {self.requirement()}, got {value!r}")

    def _accepts(self, value: Any) -> bool:
        value = plain(value)
        if self.kind is float:
            typed = is_number(value)
        elif self.kind is int:
            typed = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind in (bool, str):
            typed = isinstance(value, self.kind)
        else:
            typed = True
        if not typed or self.constraint is None:
            return typed
        try:
            return bool(self.constraint.ok(value))
        except (TypeError, ValueError, OverflowError):  # a value the constraint cannot compare (an option of a
            return False  # type vasepatch does not know, an int too large for math.isfinite)


def options_of(fn: Callable[..., Any]) -> dict[str, Option]:
    """The options of a priority function: its keyword-only parameters, each with a default."""
    hints = typing.get_type_hints(fn, include_extras=True)
    found = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        if p.default is inspect.Parameter.empty:
            raise TypeError(f"option {p.name!r} of {fn.__name__} needs a default value")
        hint, constraint = hints.get(p.name), None
        if typing.get_origin(hint) is Annotated:
            hint, constraint = typing.get_args(hint)[:2]
        kind = hint if hint in _KINDS else None
        found[p.name] = Option(p.name, p.default, kind, constraint)
    return found


def resolve(policy: str, declared: Mapping[str, Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults updated by `given`, every value checked, numpy scalars and 0-d tensors turned into
    the plain values they hold. Common options the policy does not declare are dropped; any other
    unknown option is a ValueError naming the policy's options."""
    unknown = sorted(k for k in given if k not in declared and k not in COMMON_OPTIONS)
    if unknown:
        names = ", ".join(declared) or "none"
        raise ValueError(f"policy {policy!r} has no option(s) {', '.join(unknown)}; its options are: {names}")
    values = {name: given.get(name, opt.default) for name, opt in declared.items()}
    for name, value in values.items():
        declared[name].check(policy, value)
    return {name: plain(value) for name, value in values.items()}
