"""vLLM with its version faked to one the plugin was not written for: what the plugin does there, as JSON on
the last line of stdout (`test_vllm_guards.py`).

    PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/vllm/run_inactive.py MODEL_PATH

The version is faked when this module is imported, before vLLM loads its plugins. The test runs it with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, under which vLLM's CPU build runs the engine core and the worker in
this one process, so the faked version is the one every part of the engine sees, and the scheduler's,
block manager's, model runner's and attention backend's functions can be inspected here.
"""

from __future__ import annotations

import json
import sys

import vllm

vllm.__version__ = "0.33.0"


def vasepatch_wrapped(cls: type) -> list[str]:
    """The functions of `cls` whose code is vasepatch's (a wrapper installed by the plugin)."""
    code = {name: getattr(f, "__code__", None) for name, f in vars(cls).items()}
    return [name for name, c in code.items() if c is not None and "vasepatch" in c.co_filename]


def patched_in_worker(worker) -> list[str]:
    """The model runner's and attention backend's functions that vasepatch wrapped (`collective_rpc`)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return vasepatch_wrapped(GPUModelRunner) + vasepatch_wrapped(CPUAttentionBackendImpl)


def main() -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from tests.vllm.engines import ENGINE_DEFAULTS, engine

    model, found = sys.argv[1], {}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with engine(model) as llm:  # no VaSE settings: vLLM's own engine
        prompt = [TokensPrompt(prompt_token_ids=list(range(1, 40)))]
        found["tokens"] = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        found["scheduler_patched"] = [
            name for owner in (Scheduler, KVCacheManager, KVCacheCoordinator) for name in vasepatch_wrapped(owner)
        ]
        found["worker_patched"] = llm.collective_rpc(patched_in_worker)[0]
        try:
            asks = SamplingParams(max_tokens=4, extra_args={"vasepatch_budget": 16})
            llm.generate(prompt, asks, use_tqdm=False)
            found["request"] = None
        except Exception as exc:  # vLLM's own VLLMValidationError (an HTTP 400 on the server)
            found["request"] = str(exc)
    try:
        args = {**ENGINE_DEFAULTS, "additional_config": {"vasepatch": {"budget": 64}}}
        EngineArgs(model=model, **args).create_engine_config()
        found["engine"] = None
    except ValueError as exc:
        found["engine"] = str(exc)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
