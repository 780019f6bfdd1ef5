"""The tiny benchmark the bench tests share: a random-weight Qwen3 of test shape, two lengths,
two batch sizes, in this process (the model itself: the `tiny` fixture of `tests/conftest.py`)."""

from __future__ import annotations

from vasepatch import VaSEConfig
from vasepatch.bench import BenchSettings

TINY = "shape:tiny-qwen3"


def tiny_settings(**changes) -> BenchSettings:
    base = dict(
        model=TINY,
        cache=VaSEConfig(budget=16, window=4, seed=0),
        tokens=[16, 32],
        batch=[1, 2],
        methods=["dense", "vase"],
        prompt_len=8,
        repeats=1,
        threads=1,
        isolate="none",
        progress=False,
    )
    return BenchSettings(**{**base, **changes})
