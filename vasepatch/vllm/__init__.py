"""VaSE inside vLLM: a fixed KV budget per request, as an out-of-tree vLLM plugin.

vLLM calls `register` in every process it starts (the `vllm.general_plugins` entry point in
vasepatch's `pyproject.toml`); it wraps a few internals of the one vLLM version it was written against
(`patches`; on any other it is inert, `inactive`). Without VaSE settings a request runs with vLLM's full
cache; the one change every 0.32 engine gets is that a seeded request whose prefill is chunked no longer
kills vLLM's CPU engine (`patches`, `_sample`).

    from vllm import LLM, SamplingParams
    llm = LLM(model, enable_prefix_caching=False,
              additional_config={"vasepatch": {"budget": 1024, "window": 64, "policy": "vase"}})

Settings, per engine and per request: `settings`. Guide: docs/vllm.md.
"""

from __future__ import annotations

import logging

LOG = logging.getLogger("vllm.vasepatch")  # a child of vLLM's own logger: its handler and format


def register() -> None:
    """The `vllm.general_plugins` entry point: install the patches in this process (idempotent)."""
    from vasepatch.vllm import patches

    patches.install()
