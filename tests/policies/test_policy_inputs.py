"""The policy inputs `head_ids` and `now`: what `Policy.select` defaults them to, and what each engine's
eviction passes (the transformers cache's layers, with tensor parallelism's head offset; the vLLM plugin's
per-request and stacked compactions)."""

from __future__ import annotations

import torch

import vasepatch
from tests.tiny_models import VOCAB, tiny_model
from vasepatch import VaSEConfig, policies
from vasepatch.cache.plan import LayerPlan
from vasepatch.policies.base import Policy, kept_slots
from vasepatch.vllm import compaction

SEEN: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []


def record_ids(keys, positions, head_ids, now):
    """Keeps the first candidates, and records what it was given."""
    SEEN.append((head_ids.clone(), now.clone(), positions.clone()))
    return -positions.float()


def test_select_defaults_to_layer_zero_and_the_next_position():
    SEEN.clear()
    policy = Policy("record", record_ids, {})
    positions = torch.tensor([[[0, 1, 2, 3], [0, 1, 5, 9]]])
    valid = torch.tensor([[[True, True, True, False], [True, True, True, True]]])
    policy.select(torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2), None, positions, valid, 2)
    head_ids, now, _ = SEEN[-1]
    assert head_ids.tolist() == [[0, 1]] and now.tolist() == [[3, 10]]


def test_kept_slots_passes_the_position_after_the_window():
    SEEN.clear()
    policy = Policy("record", record_ids, {})
    positions = torch.tensor([[[4, 7, 8, 10, 11, 12]]])
    ids = torch.tensor([[5]])
    kept = kept_slots(policy, torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2), positions,
                      torch.ones(1, 1, 6, dtype=torch.bool), None, 6, 4, 2, None, ids)  # fmt: skip
    head_ids, now, candidates = SEEN[-1]
    assert head_ids.tolist() == [[5]] and now.tolist() == [[13]] and candidates.tolist() == [[[4, 7, 8, 10]]]
    assert kept.tolist() == [[[0, 1, 4, 5]]]


def test_layer_plans_give_global_ids():
    plan = LayerPlan(3, head_offset=2, kv_heads=4)
    assert plan.head_ids(2, 2, torch.device("cpu")).tolist() == [[14, 15], [14, 15]]
    assert LayerPlan(3).head_ids(2, 1, torch.device("cpu")).tolist() == [[6, 7]]


def test_the_transformers_cache_passes_each_layers_heads_and_the_next_position():
    """A patched tiny model (2 layers, 2 KV heads): every eviction of layer `l` gets `head_ids` `2 l + h`, and
    `now` one past its newest cached position, the same for every row of a batch that decodes together."""
    SEEN.clear()
    model = tiny_model("llama", kv_heads=2)
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    policies.register("test-record-ids", record_ids)
    try:
        with vasepatch.patched(model, budget=12, window=4, sinks=0, policy="test-record-ids"):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    finally:
        policies._REGISTRY.pop("test-record-ids")
    layers = model.config.num_hidden_layers
    assert len(SEEN) >= layers and len(SEEN) % layers == 0
    for i, (head_ids, now, positions) in enumerate(SEEN):
        layer = i % layers
        assert head_ids.tolist() == [[2 * layer, 2 * layer + 1]] * 2
        assert bool((now > positions.amax(-1)).all()) and now.unique().numel() == 1


def _due(r: int, n: int, layers: int, heads: int, window: int) -> compaction.Due:
    positions = compaction.candidate_positions(None, layers, heads, n, 0)
    return compaction.Due(
        torch.arange(r * 2, r * 2 + 2) + 1, n, 0, 0, 0, torch.zeros(layers, heads, window, 8), positions
    )


def test_the_vllm_compactions_pass_global_ids_per_layer_and_request():
    """One request a layer at a time (`compact`), and two stacked (`compact_stacked`): rows (layer, request)
    get `layer * kv_heads + head_offset + h`, and `now` is the request's slot count (nothing dropped yet)."""
    layers, heads, block, n = 3, 2, 4, 7
    caches = [torch.randn(6, heads, block, 16) for _ in range(layers)]
    policy = Policy("record", record_ids, {})
    config = VaSEConfig(budget=4, window=2, sinks=0, seed=0)
    SEEN.clear()
    d = _due(0, n, layers, heads, 2)
    compaction.compact(caches, d.blocks, n, d.queries, d.positions, config, policy, 0, head_offset=2, kv_heads=4)
    assert [s[0].tolist() for s in SEEN] == [[[2, 3]], [[6, 7]], [[10, 11]]]
    assert all(s[1].tolist() == [[n, n]] for s in SEEN)
    SEEN.clear()
    compaction.compact_stacked(caches, [_due(0, n, layers, heads, 2), _due(1, n, layers, heads, 2)], config,
                               policy, head_offset=2, kv_heads=4)  # fmt: skip
    (head_ids, now, _), *_ = SEEN
    assert head_ids.tolist() == [[2, 3], [2, 3], [6, 7], [6, 7], [10, 11], [10, 11]]
    assert now.tolist() == [[n, n]] * 6
