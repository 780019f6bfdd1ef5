"""Greedy tokens from a fresh vLLM engine, as JSON on the last line of stdout: what the parity tests compare.

    python tests/vllm/run_greedy.py '{"model": ..., "prompts": [[ids...], ...], "max_tokens": 40,
                                      "engine": {...}, "extra_args": {...} or [{...} per prompt]}'

Run it with `VLLM_PLUGINS=none` for vLLM without the plugin (no plugin is called "none").
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.vllm.engines import engine

    detokenize = not spec.get("engine", {}).get("skip_tokenizer_init", False)  # a model folder with no tokenizer
    extra = spec.get("extra_args")
    params = [
        SamplingParams(
            max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True, detokenize=detokenize, extra_args=args
        )
        for args in (extra if isinstance(extra, list) else [extra] * len(spec["prompts"]))
    ]
    with engine(spec["model"], **spec.get("engine", {})) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps(tokens))


if __name__ == "__main__":
    main()
