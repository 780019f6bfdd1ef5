"""How many files one decode step of a patched model runs through: the layer owns its step.

Python's profiler records every vasepatch function that one decode step of a tiny patched Llama
enters. A step that does not evict runs through the wrappers, the attention adapter, the layer,
its slots, the schedule, the kernels and the query ring; one that evicts adds the policy's files
(the keyed noise, the shared selection, the scoring and the policy itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import vasepatch
from tests.tiny_models import tiny_model

PACKAGE = str(Path(vasepatch.__file__).resolve().parent) + "/"
MOST_FILES = {False: 7, True: 11}  # by whether the step evicts


def _files_of_one_step(model, cache, token: torch.Tensor) -> list[str]:
    """The vasepatch files (relative to the package) whose functions one forward enters, in order."""
    seen: list[str] = []

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PACKAGE) and name[len(PACKAGE) :] not in seen:
            seen.append(name[len(PACKAGE) :])

    sys.setprofile(profile)
    try:
        model(input_ids=token, past_key_values=cache, use_cache=True)
    finally:
        sys.setprofile(None)
    return seen


def test_a_decode_step_enters_few_files_and_an_evicting_one_a_few_more():
    model = tiny_model("llama")
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), vasepatch.patched(model, budget=16, window=4, seed=0) as handle:
        cache = handle.new_cache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        for evicting in (False, True):
            while (cache.tokens_until_eviction() == 1) != evicting:
                model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
            evictions = cache.stats()["evictions"]
            files = _files_of_one_step(model, cache, ids[:, :1])
            assert cache.stats()["evictions"] == evictions + evicting  # the step was the kind it claims
            assert "cache/layer.py" in files and "integration/attention.py" in files  # the profiler saw it
            assert len(files) <= MOST_FILES[evicting], files
            assert any(f.startswith("policies/") for f in files) == evicting
