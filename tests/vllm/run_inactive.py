"""vLLM with its version faked to one the plugin was not written for: what the plugin does there, as JSON on
the last line of stdout (`test_vllm_guards.py`).

    python tests/vllm/run_inactive.py MODEL_PATH

The version is faked before vLLM loads its plugins, in this process; its engine and worker processes are
forked from it (`VLLM_WORKER_MULTIPROC_METHOD=fork`, set by the test), so they see the same version.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import vllm

    vllm.__version__ = "0.33.0"
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    from tests.vllm.engines import ENGINE_DEFAULTS, engine

    model, found = sys.argv[1], {}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with engine(model) as llm:  # no VaSE settings: vLLM's own engine
        prompt = [TokensPrompt(prompt_token_ids=list(range(1, 40)))]
        found["tokens"] = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        found["schedule_wrapped"] = hasattr(Scheduler.schedule, "__wrapped__")
        try:
            asks = SamplingParams(max_tokens=4, extra_args={"vasepatch_budget": 16})
            llm.generate(prompt, asks, use_tqdm=False)
            found["request"] = None
        except ValueError as exc:
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
