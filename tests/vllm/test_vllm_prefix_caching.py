"""Prefix caching on (vLLM's default) with eviction: `prefill="pin"` keeps the prompt's blocks as the prefix
cache published them and evicts only what each request generates.

Two requests share a 256-token prefix (8 blocks of 32). The second one's prefix comes from the cache (vLLM's
own counter, `num_cached_tokens`), both evict 12 times, the shared blocks hold the same bytes after both
have evicted, and the tokens are those of an engine with prefix caching off and of the transformers path's
`prefill="pin"`. An engine with prefix caching on refuses `prefill="compress"`, naming the setting.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run's vLLM pass runs these in their own venv")

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from tests.vllm.engines import engine, record_blocks, seen_blocks, worker_state

BUDGET, WINDOW, NEW, SHARED, BLOCK = 16, 8, 120, 256, 32
EVICTIONS = (NEW - 1 - BUDGET - WINDOW) // WINDOW + 1  # 12 per request: at 24, 32, ..., 112 generated slots held
ASKS = {"vasepatch_budget": BUDGET, "vasepatch_window": WINDOW, "vasepatch_policy": "vase", "vasepatch_seed": 0}


def blocks_digest(worker, blocks: list[int]) -> str:
    """A digest of the bytes of `blocks` in every layer's paged cache."""
    from vasepatch.vllm import engine_access

    _, caches, _, _ = engine_access.layer_caches(worker.model_runner)
    digest = hashlib.sha256()
    for cache in caches:
        digest.update(cache[torch.tensor(blocks)].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def blocks_gap(worker, cached: list[int], computed: list[int]) -> list[float]:
    """For each pair of blocks, the largest difference between their keys and values, over every layer."""
    from vasepatch.vllm import engine_access

    _, caches, _, _ = engine_access.layer_caches(worker.model_runner)
    pairs = zip(cached, computed, strict=True)
    return [max(float((cache[a] - cache[b]).abs().max()) for cache in caches) for a, b in pairs]


def prompts(path: str, prompt: list[int]) -> list[list[int]]:
    """Two prompts of 275 tokens: the same first 256, then an instruction of their own (one that makes the
    answer depend on what the request generated, so that evicting it changes the greedy tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    asks = [
        " Now write a long story about a dragon who learns to cook, with many characters and places.",
        " Now write a long poem about the bakery, its people and its bread, in many verses.",
    ]
    return [prompt[:SHARED] + tokenizer(text).input_ids for text in asks]


def one_by_one(llm, requests: list[list[int]], extra: dict) -> list:
    params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0, extra_args=extra)
    return [llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0] for p in requests]


@pytest.mark.timeout(900)
def test_shared_prefix_blocks_are_reused_and_never_written_by_evicting_requests(smollm2_path, prompt):
    first, second = prompts(smollm2_path, prompt)
    with engine(smollm2_path, enable_prefix_caching=True) as llm:
        llm.collective_rpc(record_blocks)
        (a,) = one_by_one(llm, [first], ASKS)
        a_blocks = next(iter(llm.collective_rpc(seen_blocks)[0].values()))
        shared = a_blocks[0][: SHARED // BLOCK]
        before = llm.collective_rpc(blocks_digest, args=(shared,))[0]
        (b,) = one_by_one(llm, [second], ASKS)
        b_blocks = next(v for k, v in llm.collective_rpc(seen_blocks)[0].items() if k != a.request_id)
        after = llm.collective_rpc(blocks_digest, args=(shared,))[0]
        state = llm.collective_rpc(worker_state)[0]
        with pytest.raises(VLLMValidationError, match="prefill='compress' with prefix caching on") as refused:
            one_by_one(llm, [first], {**ASKS, "vasepatch_prefill": "compress"})
    assert refused.value.parameter == "vasepatch_prefill"
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == SHARED  # vLLM's own prefix-cache hit counter
    assert b_blocks[0][: SHARED // BLOCK] == shared  # the second request ran on the first one's blocks
    assert state["evictions"] == 2 * EVICTIONS
    assert max(len(blocks) for blocks in a_blocks + b_blocks) <= -(-(len(first) + BUDGET + WINDOW) // BLOCK)
    assert after == before  # the shared blocks' bytes, after both requests evicted
    got = [list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)]
    with engine(smollm2_path, enable_prefix_caching=False) as llm:
        pinned = {**ASKS, "vasepatch_prefill": "pin"}
        off = [list(o.outputs[0].token_ids) for o in one_by_one(llm, [first, second], pinned)]
        full = [list(o.outputs[0].token_ids) for o in one_by_one(llm, [first, second], None)]
    assert got == off
    assert got[0] == transformers_pinned(smollm2_path, first) and got[1] == transformers_pinned(smollm2_path, second)
    assert got != full  # the evictions changed the text: the comparisons above are not vacuous


def transformers_pinned(path: str, prompt: list[int]) -> list[int]:
    """Greedy tokens of the transformers path with `prefill="pin"` and the same settings."""
    from transformers import AutoModelForCausalLM

    import vasepatch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, policy="vase", seed=0, prefill="pin"):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.timeout(900)
def test_a_recomputed_pinned_request_shares_no_block_past_its_prompt(smollm2_path, capfd):
    """A full-cache request and three pinned ones with the same 80-token prompt, greedy: they generate the same
    tokens until the pinned ones first evict (96 tokens), and the full-cache one publishes those blocks. It then
    outgrows the pool, so vLLM preempts the pinned ones after they have evicted, and recomputes them: their
    logical tokens match the published blocks, but a pinned request must not share them (its next eviction
    would rewrite them), nor publish its own. The prompt ends inside its third block (80 = 2.5 blocks of 32),
    the block where a pinned request's compaction starts: a recompute shares the prompt's 2 full blocks only,
    never that one, though the cache holds it. A request whose prompt is those 176 tokens then reads 160 of them
    from the prefix cache: the 5 blocks it reads hold the keys and values that computing them afresh gives, and
    it answers as it does reading none, with the same log-probabilities (its greedy tokens alone hardly depend
    on those blocks)."""
    prompt_len, full_new, pinned_new = 80, 1130, 1000  # the full request ends at 1,210 tokens: 38 of 40 blocks
    prompt = [1 + (3 * j) % 500 for j in range(prompt_len)]
    asks = {"vasepatch_budget": 64, "vasepatch_window": 32, "vasepatch_policy": "vase", "vasepatch_prefill": "pin"}
    params = [SamplingParams(max_tokens=full_new, min_tokens=full_new, temperature=0)]
    params += [SamplingParams(max_tokens=pinned_new, min_tokens=pinned_new, temperature=0, extra_args=asks)] * 3
    with engine(
        smollm2_path, enable_prefix_caching=True, num_gpu_blocks_override=40, max_model_len=1248,
        disable_log_stats=False,
    ) as llm:  # fmt: skip
        llm.collective_rpc(record_blocks)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * 4, params, use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        published = prompt + list(outputs[0].outputs[0].token_ids[:96])
        follow = SamplingParams(max_tokens=32, temperature=0, logprobs=1)
        read = llm.generate([TokensPrompt(prompt_token_ids=published)], follow, use_tqdm=False)[0]
        fresh = SamplingParams(max_tokens=32, temperature=0, logprobs=1, skip_reading_prefix_cache=True)
        recomputed = llm.generate([TokensPrompt(prompt_token_ids=published)], fresh, use_tqdm=False)[0]
        first = {r.rsplit("-", 1)[0]: runs[0] for r, runs in llm.collective_rpc(seen_blocks)[0].items()}
        cached, computed = first[read.request_id][:5], first[recomputed.request_id][:5]
        kv_gaps = llm.collective_rpc(blocks_gap, args=(cached, computed))[0]
        state = llm.collective_rpc(worker_state)[0]
    log = capfd.readouterr()
    preempted = [line for line in (log.out + log.err).splitlines() if "preempted after" in line]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [full_new] + [pinned_new] * 3
    assert metrics["vllm:num_preemptions"] > 0 and preempted, "no pinned request was preempted after evicting"
    assert [list(o.outputs[0].token_ids[:96]) for o in outputs[1:]] == [published[prompt_len:]] * 3
    assert read.num_cached_tokens == 160 and recomputed.num_cached_tokens == 0
    print(f"largest gap between a cached block's keys and values and a fresh computation's, by block: {kv_gaps}")
    assert len(set(cached) | set(computed)) == 10 and max(kv_gaps) < 1e-3  # no cached block was rewritten
    assert list(read.outputs[0].token_ids) == list(recomputed.outputs[0].token_ids)
    steps = zip(read.outputs[0].token_ids, read.outputs[0].logprobs, recomputed.outputs[0].logprobs, strict=True)
    gaps = [abs(a[t].logprob - b[t].logprob) for t, a, b in steps]
    assert max(gaps) < 1e-3  # the cached blocks hold what computing them again gives, up to float rounding
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    assert (state["requests"], state["ring_bytes"]) == (0, 0)


@pytest.mark.parametrize("prompt_len", [64, 80, 100], ids=["on-a-boundary", "mid-block", "late-in-a-block"])
def test_a_recompute_shares_its_prompts_full_blocks_and_not_the_block_holding_its_end(prompt_len):
    """vLLM's own `KVCacheManager` with prefix caching (no engine): a full-cache request publishes the 6 full
    blocks of a 200-token sequence; a pinned request with a `prompt_len` prefix of it, whose generated tokens so
    far are the rest (a recompute after preemption), gets a hit of its prompt's full blocks only, the full-cache
    request's own: not the block holding the prompt's end, where its compaction starts writing (it would rewrite
    a block the cache shares). A full-cache request with the same sequence reads all 192 cached tokens."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from vasepatch.vllm import patches, scheduler_side

    patches.install()
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=41, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    manager = KVCacheManager(config, 4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True)
    sequence = [1 + (3 * j) % 500 for j in range(200)]
    published = Request("published", sequence, SamplingParams(max_tokens=8), None, block_hasher=hasher)
    manager.allocate_slots(published, len(sequence))
    owner = manager.get_block_ids("published")[0]

    def hit(request_id: str, extra: dict | None) -> tuple[int, list[int]]:
        params = SamplingParams(max_tokens=300, extra_args=extra)
        request = Request(request_id, sequence[:prompt_len], params, None, block_hasher=hasher)
        engine = SimpleNamespace(
            additional_config={}, cache_config=SimpleNamespace(enable_prefix_caching=True),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=256, long_prefill_token_threshold=0),
        )  # fmt: skip
        scheduler_side.state_of(request, SimpleNamespace(vllm_config=engine))  # as the scheduler first sees it
        request.append_output_token_ids(sequence[prompt_len:])
        blocks, tokens, *_ = manager.get_computed_blocks(request)
        return tokens, blocks.get_block_ids()[0]

    full = prompt_len // BLOCK
    assert hit("pinned", {**ASKS, "vasepatch_prefill": "pin"}) == (full * BLOCK, owner[:full])
    assert hit("full-cache", None) == (192, owner[:6])
