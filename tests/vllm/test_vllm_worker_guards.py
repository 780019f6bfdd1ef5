"""The worker's own refusal of a model it cannot evict, on vLLM's own attention layers (no engine).

vLLM's config-level refusal (`test_vllm_guards.py`) catches the ALiBi models it knows before an engine starts;
the worker's guard is the second line, for a model that check missed. ALiBi biases attention by slot distance,
and compaction moves slots, so a layer whose backend carries ALiBi slopes must never be evicted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs

from tests.vllm.engines import ENGINE_DEFAULTS

BLOCK, HEADS, KV_HEADS, HEAD = 32, 4, 2, 64
ASKS = {"vasepatch_budget": 64, "vasepatch_window": 16}


def _runner(config, layer, blocks: list[int]):
    """A model runner holding one request (`r`, in `blocks`) over one real attention layer, its cache bound and
    its ISA set as vLLM's CPU backend sets them."""
    from vasepatch.vllm import engine_access

    layer.isa = engine_access.attention_isa(config)
    layer.kv_cache = torch.zeros(8, KV_HEADS, BLOCK, 2 * HEAD)
    group = SimpleNamespace(layer_names=[layer.layer_name], kv_cache_spec=SimpleNamespace(block_size=BLOCK))
    request = SimpleNamespace(sampling_params=SamplingParams(max_tokens=8, extra_args=ASKS), block_ids=(blocks,))
    return SimpleNamespace(
        vllm_config=config, compilation_config=config.compilation_config, requests={"r": request},
        kv_cache_config=SimpleNamespace(kv_cache_groups=[group]), input_batch=SimpleNamespace(req_id_to_index={}),
    )  # fmt: skip


def _ordered_eviction(runner) -> tuple[object, object]:
    """A worker that has recorded the request's last 16 queries, and a step ordering it to evict 80 slots."""
    from vasepatch.vllm.scheduler_side import STEP_ATTR, Order, Step
    from vasepatch.vllm.worker_side import WorkerEviction

    worker = WorkerEviction()
    worker.settings_of(runner, "r")
    worker.rings.plan(["r"], [0], [16], [64])
    worker.record(runner.kv_cache_config.kv_cache_groups[0].layer_names[0], torch.randn(16, HEADS, HEAD), 16)
    step = Step(orders={"r": Order(80, 0, 0)}, dropped={"r": 16})
    return worker, SimpleNamespace(**{STEP_ATTR: step}, preempted_req_ids=set())


def test_the_worker_refuses_to_evict_a_layer_whose_backend_has_alibi_slopes(smollm2_path):
    """Two real vLLM attention layers (CPU backend), one built with ALiBi slopes, which vLLM keeps on the layer's
    backend (`layer.impl`), not on the layer. The same order on the same request: the plain layer's worker
    evicts it (its block list is cut to the budget's 2 blocks), the ALiBi layer's worker refuses, naming ALiBi,
    and leaves the request's blocks as they were."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    args = {**ENGINE_DEFAULTS, "skip_tokenizer_init": True}
    config = EngineArgs(model=smollm2_path, **args).create_engine_config()
    with set_current_vllm_config(config):
        alibi = Attention(HEADS, HEAD, HEAD**-0.5, KV_HEADS, alibi_slopes=[2.0**-i for i in range(1, HEADS + 1)],
                          prefix="alibi.attn")  # fmt: skip
        plain = Attention(HEADS, HEAD, HEAD**-0.5, KV_HEADS, prefix="plain.attn")
    assert alibi.impl.alibi_slopes is not None and getattr(alibi, "alibi_slopes", None) is None  # the case tested

    runner = _runner(config, plain, [1, 2, 3])
    worker, output = _ordered_eviction(runner)
    worker.before_update(runner, output)
    assert runner.requests["r"].block_ids[0] == [1, 2] and worker.evictions == 1  # the fixture evicts

    runner = _runner(config, alibi, [1, 2, 3])
    worker, output = _ordered_eviction(runner)
    with pytest.raises(RuntimeError, match="cannot evict from a model with an ALiBi bias"):
        worker.before_update(runner, output)
    assert runner.requests["r"].block_ids[0] == [1, 2, 3] and worker.evictions == 0
