"""Eviction inside vLLM: the same tokens as vasepatch's transformers cache, whatever the batch, with the
tail blocks given back to vLLM's pool. One SmolLM2 engine for the module; requests carry their settings."""

from __future__ import annotations

import math
from collections import Counter

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

import torch
from transformers import AutoConfig
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from tests.vllm.engines import (
    engine,
    eviction_steps,
    record_blocks,
    record_eviction_steps,
    seen_blocks,
    worker_state,
)
from vasepatch.vllm import compaction

BUDGET, WINDOW, NEW = 128, 32, 60
BLOCK = 32  # the engine's block size (tests/vllm/engines.py)


def evicting(policy: str, **more) -> dict:
    return {"vasepatch_budget": BUDGET, "vasepatch_window": WINDOW, "vasepatch_policy": policy, **more}


@pytest.fixture(scope="module")
def stats(smollm2_path, prompt, tmp_path_factory) -> str:
    """SmolLM2's query statistics (`triattention`), calibrated on the test prompt: a file of the model's shapes and
    rotary, which the engine checks when it starts."""
    from transformers import AutoModelForCausalLM

    from vasepatch.integration import calibration

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    path = tmp_path_factory.mktemp("stats") / "smollm2.safetensors"
    return str(calibration.calibrate(model, torch.tensor([prompt]), path=path))


@pytest.fixture(scope="module")
def llm(smollm2_path, stats):
    # every prompt of a test prefills in one step, so chunking plays no part in these comparisons (seeded chunked
    # prefills: test_vllm_seeded.py). The engine names a statistics file, which turns no eviction on by itself.
    config = {"vasepatch": {"stats": stats}}
    with engine(smollm2_path, disable_log_stats=False, max_num_batched_tokens=8192, additional_config=config) as llm:
        yield llm


def transformers_tokens(path: str, prompt: list[int], prefill_chunk_size: int | None = None, **patch) -> list[int]:
    """Greedy tokens of vasepatch's own cache on the same model (a batch of one, the same seed), the prompt
    prefilled in chunks of `prefill_chunk_size` where given (transformers' chunked prefill)."""
    from transformers import AutoModelForCausalLM

    import vasepatch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with vasepatch.patched(model, **patch):
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            prefill_chunk_size=prefill_chunk_size,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def vllm_tokens(llm, prompts, params) -> list[list[int]]:
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("policy", "shared"), [("vase", False), ("snapkv", False), ("vase", True)], ids=["vase", "snapkv", "vase-shared"]
)
def test_tokens_equal_the_transformers_cache(llm, smollm2_path, prompt, policy, shared):
    settings = dict(budget=BUDGET, window=WINDOW, policy=policy, seed=0, shared_heads=shared)
    want = transformers_tokens(smollm2_path, prompt, **settings)
    params = SamplingParams(
        max_tokens=NEW, min_tokens=NEW, temperature=0,
        extra_args=evicting(policy, vasepatch_seed=0, vasepatch_shared_heads=shared),
    )  # fmt: skip
    before = llm.collective_rpc(worker_state)[0]["evictions"]
    (got,) = vllm_tokens(llm, [prompt], params)
    evictions = llm.collective_rpc(worker_state)[0]["evictions"] - before
    assert evictions >= 2  # the prompt compressed, then at least one decode eviction
    assert got == want
    full = vllm_tokens(llm, [prompt], SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0))[0]
    assert full != got  # the evictions changed the text: the comparison above is not vacuous


@pytest.mark.timeout(600)
def test_triattention_tokens_equal_the_transformers_cache(llm, smollm2_path, prompt, stats):
    """`triattention` on the engine's statistics file (`additional_config["vasepatch"]["stats"]`) keeps what
    `vasepatch.patch` keeps with the same file: its un-rotation reads the positions the plugin tracks, which after
    the first eviction are no longer the slots'."""
    want = transformers_tokens(
        smollm2_path, prompt, budget=BUDGET, window=WINDOW, policy="triattention", policy_options={"stats": stats}
    )
    before = llm.collective_rpc(worker_state)[0]["evictions"]
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=evicting("triattention"))
    (got,) = vllm_tokens(llm, [prompt], params)
    assert llm.collective_rpc(worker_state)[0]["evictions"] - before >= 2
    assert got == want
    streaming = transformers_tokens(smollm2_path, prompt, budget=BUDGET, window=WINDOW, policy="streaming")
    assert streaming != got  # the policy's choice shows in the tokens: the comparison above is not vacuous


@pytest.mark.timeout(600)
def test_a_budget_off_the_block_size_evicting_with_the_sampling_seed(llm, smollm2_path, prompt):
    """Budget 100 with 32-slot blocks (the last kept block part-filled), window 24, and no `vasepatch_seed`:
    the worker evicts with the request's sampling seed, as the transformers cache does with that seed. The
    `random` policy, whose kept sets are all seed, makes the seed show in the tokens."""
    settings = dict(budget=100, window=24, policy="random")
    want = transformers_tokens(smollm2_path, prompt, seed=7, **settings)
    asks = {"vasepatch_budget": 100, "vasepatch_window": 24, "vasepatch_policy": "random"}
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, seed=7, extra_args=asks)
    assert vllm_tokens(llm, [prompt], params)[0] == want
    default_seed = transformers_tokens(smollm2_path, prompt, seed=0, **settings)  # what ignoring seed=7 would give
    assert default_seed != want  # the seed changes the kept sets: the comparison above is not vacuous


@pytest.mark.timeout(600)
def test_requests_due_at_one_step_evict_in_one_call_per_policy_with_their_own_tokens(llm, smollm2_path, prompt):
    """Four requests of one prompt length, three `vase` (seeds 0, 1, 2) and one `snapkv`: at every step, the due
    requests of one policy and eviction round are evicted by stacked calls, as few as `compaction.chunks` allows
    (the worker's own count: two 626-token prompts fill one call's `STACK_BYTES`), and each request's greedy
    tokens equal the transformers cache's, run alone with its seed: stacking changes no kept set. (vLLM prefills
    the four in one or two steps, as they reach its engine core: the test counts calls step by step.)"""
    prompts = [prompt[k:] + prompt[:k] for k in (0, 11, 23, 37)]  # the same length, other tokens
    asks = [("vase", 0), ("vase", 1), ("vase", 2), ("snapkv", 0)]
    want = [
        transformers_tokens(smollm2_path, p, budget=BUDGET, window=WINDOW, policy=policy, seed=seed)
        for p, (policy, seed) in zip(prompts, asks, strict=True)
    ]
    params = [
        SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=evicting(policy, vasepatch_seed=seed))
        for policy, seed in asks
    ]
    llm.collective_rpc(record_eviction_steps)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    steps = llm.collective_rpc(eviction_steps)[0]
    assert sum(len(due) for due, _, _ in steps) == 8  # each prompt compressed, then one decode eviction each
    config = AutoConfig.from_pretrained(smollm2_path)
    slot_bytes = config.num_hidden_layers * config.num_key_value_heads * 2 * config.head_dim * 4  # float32 K and V

    def fewest_calls(due: list[str], rounds: list[int]) -> int:  # the prompt (round 0), then budget + window
        groups = Counter(zip(due, rounds, strict=True))
        per_call = {r: max(1, compaction.STACK_BYTES // (slot_bytes * (len(prompt) if r == 0 else BUDGET + WINDOW)))
                    for r in set(rounds)}  # fmt: skip
        return sum(math.ceil(count / per_call[r]) for (_, r), count in groups.items())

    assert all(calls == fewest_calls(due, rounds) for due, calls, rounds in steps), steps
    assert any(calls < len(due) for due, calls, _ in steps)  # requests were stacked: the check is not vacuous


@pytest.mark.timeout(600)
def test_evictions_per_step_spreads_requests_that_start_together(smollm2_path, prompt):
    """An engine with `evictions_per_step: 1`: four requests that start together compress their prompts at once
    (each is due), then their decode evictions are pulled apart, one per step, and stay apart; every request
    still gets all its tokens, and never holds more than `budget + window` slots (vLLM's block counter)."""
    spread = {"vasepatch": {"budget": BUDGET, "window": WINDOW, "policy": "vase", "evictions_per_step": 1}}
    with engine(smollm2_path, max_num_batched_tokens=8192, additional_config=spread) as llm:
        llm.collective_rpc(record_eviction_steps)
        llm.collective_rpc(record_blocks)
        prompts = [prompt[k:] + prompt[:k] for k in (0, 11, 23, 37)]
        params = SamplingParams(max_tokens=3 * WINDOW + 4, min_tokens=3 * WINDOW + 4, temperature=0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        steps = llm.collective_rpc(eviction_steps)[0]
        most = max(len(b) for runs in llm.collective_rpc(seen_blocks)[0].values() for b in runs[1:])
    assert all(len(o.outputs[0].token_ids) == 3 * WINDOW + 4 for o in outputs)
    decode = [[r for r in rounds if r >= 1] for _, _, rounds in steps]  # a late prompt may compress beside one
    assert sum(len(r) for r in decode) == 4 * 3  # three decode evictions each
    assert max(len(r) for r in decode) == 1, steps  # one request per step
    assert most <= -(-(BUDGET + WINDOW) // BLOCK)  # evicting early never holds more


@pytest.mark.timeout(600)
def test_a_request_gives_the_same_sample_alone_and_in_a_batch_of_eight(llm, prompt):
    params = SamplingParams(max_tokens=NEW, temperature=0.8, seed=5, extra_args=evicting("vase"))
    alone = vllm_tokens(llm, [prompt], params)[0]
    others = [prompt[k:] + prompt[:k] for k in range(7, 77, 10)]  # 7 other requests, other settings too
    other_params = [
        SamplingParams(
            max_tokens=NEW - 5 * i, temperature=0.8, seed=i, extra_args=evicting("snapkv" if i % 2 else "vase")
        )
        for i in range(7)
    ]
    batch = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in [*others[:3], prompt, *others[3:]]],
        [*other_params[:3], params, *other_params[3:]],
        use_tqdm=False,
    )
    assert list(batch[3].outputs[0].token_ids) == alone
    assert vllm_tokens(llm, [prompt], params)[0] == alone  # and run after run


@pytest.mark.timeout(600)
def test_n_samples_evict_as_separate_requests_with_consecutive_seeds(llm, prompt):
    """vLLM splits a request with `n` samples into `n` requests, sample `i` seeded `seed + i`: each evicts on
    its own, with that seed, as a separate request does."""
    params = SamplingParams(n=3, max_tokens=NEW, min_tokens=NEW, temperature=0.8, seed=11, extra_args=evicting("vase"))
    (together,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    samples = sorted(list(o.token_ids) for o in together.outputs)
    alone = [
        vllm_tokens(llm, [prompt], SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.8, seed=11 + i,
                                                  extra_args=evicting("vase")))[0]
        for i in range(3)
    ]  # fmt: skip
    assert samples == sorted(alone)
    assert len({tuple(s) for s in samples}) == 3  # three different samples: the seeds differ


def kv_usage(llm) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc")


@pytest.mark.timeout(600)
def test_tail_blocks_go_back_to_vllms_pool(llm, prompt):
    """vLLM's own KV usage metric: an evicting request holds at most ceil((budget + window) / block) blocks."""
    engine_ = llm.llm_engine
    total_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    most = {}
    for policy in ("full", "vase"):
        extra = None if policy == "full" else evicting("vase")
        params = SamplingParams(max_tokens=200, min_tokens=200, temperature=0, extra_args=extra)
        engine_.add_request(f"usage-{policy}", TokensPrompt(prompt_token_ids=prompt), params)
        peak = 0.0
        while engine_.has_unfinished_requests():
            engine_.step()
            peak = max(peak, kv_usage(llm))
        most[policy] = round(peak * (total_blocks - 1))
    assert most["full"] == -(-(len(prompt) + 200) // BLOCK)  # the whole sequence (the last token has no KV yet: <=)
    assert most["vase"] <= -(-max(len(prompt), BUDGET + WINDOW) // BLOCK)  # the prompt's blocks until it is compressed
    assert kv_usage(llm) == 0.0


@pytest.mark.timeout(300)
def test_bad_request_settings_are_refused_naming_the_key(llm, prompt):
    from vllm.exceptions import VLLMValidationError

    cases = (({"vasepatch_budget": -1}, "budget must be an int >= 2.*parameter=vasepatch_budget"),
             ({"vasepatch_bugdet": 3}, "unknown request setting 'vasepatch_bugdet'"))  # fmt: skip
    for extra, key in cases:
        with pytest.raises(VLLMValidationError, match=key):
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=4, extra_args=extra))
    assert (
        len(vllm_tokens(llm, [prompt], SamplingParams(max_tokens=4, min_tokens=4, temperature=0))[0]) == 4
    )  # still serving


def test_an_engine_that_cannot_evict_is_refused_before_it_starts(smollm2_path):
    from vllm import LLM

    with pytest.raises(ValueError, match=r"prefill='compress' with prefix caching on: compaction would rewrite"):
        compress = {"budget": 256, "prefill": "compress"}  # with prefix caching on, "pin" is the default
        LLM(smollm2_path, enable_prefix_caching=True, additional_config={"vasepatch": compress})
    with pytest.raises(ValueError, match=r"window must be smaller than budget"):
        LLM(smollm2_path, enable_prefix_caching=False, additional_config={"vasepatch": {"budget": 64}})
