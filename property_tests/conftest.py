"""Hypothesis profiles.

`ci` (default): 200 examples per property. `thorough`: 10,000 examples per
property; select it with `VASEPATCH_HYPOTHESIS_PROFILE=thorough`.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", max_examples=200, **_COMMON)
settings.register_profile("thorough", max_examples=10_000, **_COMMON)
settings.register_profile("quick", max_examples=20, **_COMMON)
PROFILE = os.environ.get("VASEPATCH_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

torch.set_num_threads(1)


def pytest_report_header(config):
    return f"hypothesis profile: {PROFILE} ({settings().max_examples} examples per property)"
