"""Starting and stopping vLLM engines in the tests: every engine has a bounded start and is shut down."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

ENGINE_DEFAULTS = dict(
    dtype="float32",
    enforce_eager=True,
    enable_prefix_caching=False,
    max_model_len=4096,
    seed=0,
    gpu_memory_utilization=0.3,  # on the CPU: the share of RAM vLLM may take (the KV pool is VLLM_CPU_KVCACHE_SPACE)
    block_size=32,
)


@contextlib.contextmanager
def engine(model: str, **kwargs: Any) -> Iterator[Any]:
    """An offline `vllm.LLM` with the tests' defaults (overridable), shut down on exit."""
    from vllm import LLM

    llm = LLM(model, **{**ENGINE_DEFAULTS, **kwargs})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def worker_state(worker: Any) -> dict[str, Any]:
    """What the plugin holds in a worker (run through `LLM.collective_rpc`)."""
    state = getattr(worker.model_runner, "vasepatch", None)
    if state is None:
        return {"evictions": 0, "requests": 0}
    return {"evictions": state.evictions, "requests": len(state.requests)}
