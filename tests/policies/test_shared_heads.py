"""Head-shared eviction (`VaSEConfig(shared_heads=True)`): one set of kept tokens per layer."""

from __future__ import annotations

import pytest
import torch

from tests import drive
from tests.query_stats_files import options_for
from vasepatch import policies
from vasepatch.cache import VaSECache
from vasepatch.config import VaSEConfig
from vasepatch.eval import cli_options
from vasepatch.eval.fidelity_settings import FidelitySettings
from vasepatch.policies.keyed import KeyedGenerator
from vasepatch.policies.shared import shared_top_k


def _case(b=2, h=3, n=24, d=8, group=2, seed=0):
    """Random candidates with one layout shared by all heads (rows after the first left-padded by 3)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    queries = torch.randn(b, h * group, 4, d, generator=g)
    valid = torch.ones(b, h, n, dtype=torch.bool)
    valid[1:, :, :3] = False
    positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
    return keys, values, queries, positions, valid


@pytest.mark.parametrize("name", policies.available())
def test_every_head_keeps_the_same_tokens(name):
    args = _case()
    stats = options_for(name, layers=1, q_heads=6, kv_heads=3, head_dim=8)  # `_case`'s shapes
    policy = policies.get(name, protect=6, sinks=2, shared_heads=True, **stats)
    for generator in (KeyedGenerator(1, 0, 0), torch.Generator().manual_seed(1)):
        idx = policy.select(*args, 10, generator)
        assert (idx == idx[:, :1]).all(), "heads kept different tokens"
        policies.check_picks(name, idx, args[4], 10)  # distinct, real tokens first


def test_tokens_any_head_protects_are_kept():
    """Each head has its own large-range value; all of them, and the sinks, are kept by every head."""
    keys, values, queries, positions, valid = _case(b=1, h=3, n=30)
    values = values * 0.01
    big = {0: 7, 1: 13, 2: 21}  # head -> its one large-range slot
    for head, slot in big.items():
        values[0, head, slot] *= 1000
    policy = policies.get("vase", protect=4, sinks=2, shared_heads=True)  # 2 sinks + 2 more per head
    for seed in range(5):
        kept = policy.select(keys, values, queries, positions, valid, 8, KeyedGenerator(seed, 0, 0))[0, 0].tolist()
        assert {0, 1, *big.values()} <= set(kept), kept


def test_the_sinks_win_when_the_protected_tokens_of_all_heads_overflow():
    """Every head protects `protect` tokens of its own: their union (2 + 3 x 4) exceeds n_keep = 8;
    the sinks, protected by every head, are kept first."""
    keys, values, queries, positions, valid = _case(b=1, h=3, n=40)
    values = values * 0.01
    for head in range(3):
        values[0, head, 10 + 8 * head : 14 + 8 * head] *= 1000
    policy = policies.get("vase-topk", protect=6, sinks=2, shared_heads=True)
    kept = set(policy.select(keys, values, queries, positions, valid, 8)[0, 0].tolist())
    assert {0, 1} <= kept
    assert len(kept & set(range(10, 34))) == 6  # the rest: protected tokens only


def test_on_identical_heads_sharing_changes_nothing():
    """Copies of one head: the shared choice (shared noise, max over equal priorities) is that
    head's own choice."""
    keys, values, queries, positions, valid = _case(b=2, h=1, group=2)
    many = [t.expand(-1, 4, *t.shape[2:]) for t in (keys, values, positions, valid)]
    many_q = queries.repeat(1, 4, 1, 1)
    for name in ("vase", "snapkv", "rkv", "random", "knorm"):
        one = policies.get(name, protect=5, sinks=2).select(
            keys, values, queries, positions, valid, 9, KeyedGenerator(3, 0, 0).shared_heads()
        )
        shared = policies.get(name, protect=5, sinks=2, shared_heads=True)
        both = shared.select(many[0], many[1], many_q, many[2], many[3], 9, KeyedGenerator(3, 0, 0))
        assert torch.equal(both[:, 0].sort(-1).values, one[:, 0].sort(-1).values), name


def test_the_combination_is_the_max_over_heads():
    """A token that one head scores highest is kept even if every other head scores it lowest."""
    priority = torch.tensor([[[0.0, 1.0, 2.0, 9.0], [5.0, 1.0, 2.0, -9.0], [0.0, 4.0, 2.0, -9.0]]])
    valid = torch.ones(1, 3, 4, dtype=torch.bool)
    assert shared_top_k(priority, valid, 3)[0, 0].sort().values.tolist() == [0, 1, 3]


def test_padding_is_kept_only_after_every_real_token():
    priority = torch.tensor([[[float("inf"), 1.0, 5.0, 0.0], [1.0, 2.0, 5.0, 0.0]]])
    valid = torch.tensor([[[False, True, True, True]]]).expand(1, 2, 4)
    assert shared_top_k(priority, valid, 3)[0, 0].sort().values.tolist() == [1, 2, 3]


def test_per_head_eviction_is_unchanged():
    args = _case()
    config = VaSEConfig(budget=32, window=4, seed=0)
    assert config.shared_heads is False and policies.for_config(config).shared_heads is False
    assert policies.for_config(config.replace(shared_heads=True)).shared_heads is True
    per_head = policies.get("vase", protect=6, sinks=2)
    idx = per_head.select(*args, 10, KeyedGenerator(1, 0, 0))
    assert not (idx.sort(-1).values == idx.sort(-1).values[:, :1]).all()  # the heads choose their own


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_shared_heads_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="shared_heads must be a bool"):
        VaSEConfig(budget=256, shared_heads=bad)
    with pytest.raises(ValueError, match="shared_heads must be a bool"):
        policies.get("vase", shared_heads=bad)


def test_a_head_shared_cache_keeps_one_layout_for_all_heads():
    """Driven through the production step, every eviction leaves the same positions in every head."""
    config = VaSEConfig(budget=10, window=2, protect=4, sinks=2, seed=0, shared_heads=True)
    cache = VaSECache(config, policies.for_config(config), 1)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(2, 3, 30, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g), torch.randn(2, 6, 30, 8)
    drive.step(layer, k[:, :, :12], v[:, :, :12], q[:, :, :12])
    for t in range(12, 30):
        drive.step(layer, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
    assert cache.stats()["evictions"] >= 5
    assert (layer.positions == layer.positions[:, :1]).all() and (layer.valid == layer.valid[:, :1]).all()


def test_the_eval_runs_each_policy_per_head_and_shared():
    settings = FidelitySettings(policies=["full", "vase", "snapkv"], shared_heads="both")
    assert settings.policies == ["full", "vase", "vase+shared", "snapkv", "snapkv+shared"]
    configs = settings.configs()
    assert configs["vase+shared"].shared_heads and configs["vase+shared"].policy == "vase"
    assert not configs["vase"].shared_heads and not configs["full"].shared_heads
    assert cli_options.with_shared(settings.policies, "both") == settings.policies  # idempotent
    with pytest.raises(ValueError, match="unknown policies"):
        cli_options.check_run(settings.config, ["full+shared"])


def test_the_cli_flag():
    from vasepatch.tools import cli

    parser = cli.build_parser()
    on = parser.parse_args(["eval", "fidelity", "--shared-heads", "on"])
    assert cli_options.cache_config(on).shared_heads is True
    assert cli_options.cache_config(parser.parse_args(["eval", "fidelity"])).shared_heads is False
    assert parser.parse_args(["eval", "fidelity", "--shared-heads", "both"]).shared_heads == "both"
