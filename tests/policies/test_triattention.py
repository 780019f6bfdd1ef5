"""TriAttention's scoring (`vasepatch.policies.triattention`) and its statistics file (`query_stats`), checked
against an independent computation: the calibrated mean query rotated by RoPE to each future position and
dotted with the cached key, as the model's own attention would, instead of the un-rotated trigonometric form."""

from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import save_file

from vasepatch.policies import query_stats
from vasepatch.policies.base import Policy
from vasepatch.policies.query_stats import QueryStats

# the module: `vasepatch.policies.triattention` is the policy's function, as for every registered policy
triattention = importlib.import_module("vasepatch.policies.triattention")


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, a: float) -> torch.Tensor:
    """Transformers' RoPE (`x * cos + rotate_half(x) * sin`, both scaled by the attention scaling `a`) in
    float64: `x` `[..., D]`, `pos` `[...]`, `inv_freq` `[D / 2]`."""
    x = x.double()
    angle = pos.double().unsqueeze(-1) * inv_freq.double()
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1) * a, torch.cat([angle.sin(), angle.sin()], -1) * a
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_scores(keys, positions, now, q_mean, q_abs, inv_freq, a, max_offset):
    """`[H, G, N]` float64 for one row: mean over the offsets of the dot product of the mean query, rotated to
    `now + d`, with each cached key, plus the magnitude term `sum_f a^2 (m_f - |qbar_f|) |k_f| / a`."""
    heads, group, pairs = q_abs.shape
    q = torch.cat([q_mean[..., 0], q_mean[..., 1]], -1).double()  # [H, G, D]
    offsets = triattention.future_offsets(max_offset)
    total = torch.zeros(heads, group, keys.shape[1], dtype=torch.float64)
    for d in offsets:
        rotated = rope(q, torch.full((heads, group), float(now + d)), inv_freq, a)
        total += torch.einsum("hgd,hnd->hgn", rotated, keys.double())
    k = keys.double()
    k_abs = torch.sqrt(k[..., :pairs] ** 2 + k[..., pairs:] ** 2) / a  # |pre-RoPE pair|: [H, N, F]
    q_abs_mean = torch.sqrt(q_mean[..., 0].double() ** 2 + q_mean[..., 1].double() ** 2)  # [H, G, F]
    extra = torch.einsum("hgf,hnf->hgn", (q_abs.double() - q_abs_mean) * a * a, k_abs)
    return total / len(offsets) + extra


def _case(heads=2, group=3, dim=16, n=40, seed=0, a=1.0, base=10000.0, start=0):
    g = torch.Generator().manual_seed(seed)
    pairs = dim // 2
    inv_freq = 1.0 / base ** (torch.arange(pairs, dtype=torch.float64) / pairs)
    positions = start + torch.randperm(4 * n, generator=g)[:n].sort().values  # gaps: a compacted cache
    pre = torch.randn(heads, n, dim, generator=g, dtype=torch.float64)
    keys = rope(pre, positions.expand(heads, n), inv_freq, a).float()
    q_mean = torch.randn(heads, group, pairs, 2, generator=g)
    q_abs = torch.sqrt(q_mean[..., 0] ** 2 + q_mean[..., 1] ** 2) + torch.rand(heads, group, pairs, generator=g)
    stats = QueryStats(q_mean, q_abs, inv_freq.float().expand(heads, pairs), torch.full((heads,), a))
    return keys, positions.expand(heads, n), pre, stats


@pytest.mark.parametrize("a", [1.0, 1.25])  # 1.25: a YaRN-like attention scaling
@pytest.mark.parametrize("start", [0, 3000])
def test_the_scores_are_the_rotated_mean_query_dotted_with_each_key(a, start):
    keys, positions, _, stats = _case(a=a, start=start)
    now = int(positions.max()) + 5
    got = triattention.future_scores(
        keys[None], positions[None], torch.full((1, 2), now), QueryStats(*(t[None] for t in _fields(stats))), 4096
    )[0]
    want = reference_scores(keys, positions, now, stats.q_mean, stats.q_abs, stats.inv_freq[0], a, 4096)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=2e-3 * want.abs().max().item(), rtol=0)


def _fields(stats: QueryStats):
    return stats.q_mean, stats.q_abs, stats.inv_freq, stats.scaling


def test_unrotate_gives_back_the_pre_rope_keys():
    keys, positions, pre, stats = _case(a=1.25, start=500)
    re, im = triattention.unrotate(keys[None], positions[None], stats.inv_freq[None], stats.scaling[None])
    got = torch.cat([re[0], im[0]], -1).double()
    assert torch.allclose(got, pre, atol=1e-3)


def test_future_offsets_are_the_powers_of_two_up_to_the_maximum():
    assert triattention.future_offsets(65536) == [float(2**i) for i in range(17)]
    assert triattention.future_offsets(100) == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    assert triattention.future_offsets(1) == [1.0]


def test_zscore_standardises_over_the_valid_candidates_only():
    scores = torch.tensor([[[[1.0, 2.0, 3.0, 100.0]]]])
    valid = torch.tensor([[[True, True, True, False]]])
    z = triattention.zscore(scores, valid)[0, 0, 0]
    expected = (torch.tensor([1.0, 2.0, 3.0]) - 2.0) / torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False)
    assert torch.allclose(z[:3], expected) and z[3] == 0
    assert torch.equal(
        triattention.zscore(torch.ones(1, 1, 1, 3), torch.ones(1, 1, 3, dtype=torch.bool)), torch.zeros(1, 1, 1, 3)
    )


def _write(path, layers=2, q_heads=6, kv_heads=2, dim=16, seed=0, **change):
    g = torch.Generator().manual_seed(seed)
    pairs = dim // 2
    q_mean = torch.randn(layers, q_heads, pairs, 2, generator=g)
    tensors = {
        "q_mean": q_mean,
        "q_abs": q_mean.norm(dim=-1) + torch.rand(layers, q_heads, pairs, generator=g),
        "inv_freq": (1.0 / 10000 ** (torch.arange(pairs) / pairs)).expand(layers, pairs).clone(),
        "scaling": torch.ones(layers),
        **change,
    }
    return query_stats.save_stats(path, tensors, kv_heads, {"model": "test"}), tensors


def test_the_policy_keeps_the_top_scores_of_the_rows_heads(tmp_path):
    """Through `Policy.select`: layer 1's statistics for rows whose `head_ids` say layer 1, the z-scored
    reference scores' max over each group, top `n_keep`."""
    path, tensors = _write(tmp_path / "stats.safetensors")
    keys, positions, _, _ = _case(heads=2, group=3, dim=16, n=40, seed=3)
    policy = Policy("triattention", triattention.triattention, {"stats": str(path), "max_offset": 1024})
    now = int(positions.max()) + 1
    valid = torch.ones(1, 2, 40, dtype=torch.bool)
    head_ids = torch.tensor([[2, 3]])  # layer 1, KV heads 0 and 1
    idx = policy.select(
        keys[None], keys[None], None, positions[None], valid, 10, head_ids=head_ids, now=torch.full((1, 2), now)
    )
    want = reference_scores(
        keys, positions, now, tensors["q_mean"][1].view(2, 3, 8, 2), tensors["q_abs"][1].view(2, 3, 8),
        tensors["inv_freq"][1], 1.0, 1024,
    )  # fmt: skip
    z = (want - want.mean(-1, keepdim=True)) / want.std(-1, unbiased=False, keepdim=True)
    top = z.amax(1).topk(10, dim=-1).indices
    assert torch.equal(idx[0].sort(-1).values, top.sort(-1).values)


def test_the_file_round_trips_into_rows_by_layer_and_kv_head(tmp_path):
    path, tensors = _write(tmp_path / "s.safetensors", layers=3, q_heads=4, kv_heads=2)
    stats = query_stats.load_stats(path)
    assert stats.q_mean.shape == (6, 2, 8, 2) and stats.scaling.shape == (6,)
    rows = stats.rows(torch.tensor([[5]]))  # layer 2, KV head 1: query heads 2 and 3
    assert torch.equal(rows.q_mean[0, 0], tensors["q_mean"][2, 2:4])
    assert torch.equal(rows.inv_freq[0, 0], tensors["inv_freq"][2])
    assert query_stats.read_metadata(path)["kv_heads"] == "2"


def test_a_missing_or_foreign_file_is_refused_with_the_command_that_writes_one(tmp_path):
    for where in ("", str(tmp_path), str(tmp_path / "absent.safetensors")):
        with pytest.raises(ValueError, match="vasepatch calibrate"):
            query_stats.load_stats(where)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(1)}, str(foreign))
    with pytest.raises(ValueError, match="not a vasepatch query statistics file"):
        query_stats.load_stats(foreign)


def test_a_rewritten_file_is_read_again(tmp_path):
    path, _ = _write(tmp_path / "s.safetensors", seed=0)
    first = query_stats.load_stats(path)
    _write(tmp_path / "s.safetensors", seed=1, scaling=torch.full((2,), 2.0))
    assert not torch.equal(query_stats.load_stats(path).scaling, first.scaling)


@pytest.mark.parametrize(
    ("name", "shape"), [("q_mean", (2, 6, 8, 3)), ("inv_freq", (2, 7)), ("scaling", (3,))]
)  # fmt: skip
def test_tensors_that_do_not_fit_together_are_refused_by_name(tmp_path, name, shape):
    with pytest.raises(ValueError, match=name):
        _write(tmp_path / "s.safetensors", **{name: torch.zeros(shape)})
    assert not (tmp_path / "s.safetensors").exists()
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        _write(tmp_path / "t.safetensors", kv_heads=4)


def test_a_bfloat16_rotary_is_undone_by_the_files_frequencies_rounded_alike(tmp_path):
    """A model cast to bfloat16 rotates its keys by its rounded frequencies: with `rotary_dtype="bfloat16"` the
    policy ranks as the reference does with those frequencies; with the exact ones it would rank otherwise."""
    q_mean = torch.randn(1, 3, 8, 2, generator=torch.Generator().manual_seed(4))
    stats = dict(layers=1, q_heads=3, kv_heads=1, dim=16, q_mean=q_mean, q_abs=q_mean.norm(dim=-1))  # no E term
    path, tensors = _write(tmp_path / "stats.safetensors", **stats)
    rounded = tensors["inv_freq"][0].to(torch.bfloat16).double()
    g = torch.Generator().manual_seed(5)
    positions = torch.arange(20000, 20040).view(1, 40)
    keys = rope(torch.randn(1, 40, 16, generator=g, dtype=torch.float64), positions, rounded, 1.0).float()
    now = 20040
    want = reference_scores(keys, positions, now, tensors["q_mean"][0].view(1, 3, 8, 2),
                            tensors["q_abs"][0].view(1, 3, 8), rounded, 1.0, 1024)  # fmt: skip
    z = (want - want.mean(-1, keepdim=True)) / want.std(-1, unbiased=False, keepdim=True)
    top = z.amax(1).topk(10, dim=-1).indices.sort(-1).values
    picks = {}
    for dtype in ("bfloat16", "float32"):
        policy = Policy("triattention", triattention.triattention, {"stats": str(path), "max_offset": 1024,
                                                                    "rotary_dtype": dtype})  # fmt: skip
        idx = policy.select(keys[None], keys[None], None, positions[None], torch.ones(1, 1, 40, dtype=torch.bool), 10,
                            head_ids=torch.tensor([[0]]), now=torch.full((1, 1), now))  # fmt: skip
        picks[dtype] = idx[0].sort(-1).values
    assert torch.equal(picks["bfloat16"], top) and not torch.equal(picks["float32"], top)


def test_exact_ties_are_broken_by_keyed_noise_the_same_way_whatever_the_sharding(tmp_path):
    """Two candidates z-score to exactly -1 and +1 for each query head: a KV head whose two query heads prefer
    different ones ties at +1. The keyed tie noise (the authors add 1e-6) breaks the tie by (global head, slot),
    so one process holding all four KV heads and two ranks holding two each keep the same slots."""
    from vasepatch.policies.keyed import KeyedGenerator

    path, _ = _write(tmp_path / "s.safetensors", layers=1, q_heads=8, kv_heads=4, dim=6, seed=5)
    g = torch.Generator().manual_seed(5)  # a case where topk breaks the tie one way on 4 heads, another on 2
    keys, positions = torch.randn(1, 4, 2, 6, generator=g), torch.tensor([0, 1]).expand(1, 4, 2)
    valid = torch.ones(1, 4, 2, dtype=torch.bool)
    policy = Policy("triattention", triattention.triattention, {"stats": str(path)})
    now = torch.full((1, 4), 5)

    def pick(heads: slice, offset: int) -> torch.Tensor:
        generator = KeyedGenerator(0, 0, 0, offset)
        ids = torch.arange(4)[heads].view(1, -1)
        return policy.select(keys[:, heads], keys[:, heads], None, positions[:, heads], valid[:, heads], 1,
                             generator, head_ids=ids, now=now[:, heads])  # fmt: skip

    whole = pick(slice(0, 4), 0)
    assert torch.equal(whole, torch.cat([pick(slice(0, 2), 0), pick(slice(2, 4), 2)], 1))
    bare = Policy("triattention", triattention.triattention, {"stats": str(path), "tie_noise": 0.0})
    tied = bare.priority(keys, positions, valid, torch.arange(4).view(1, 4), now, None, **bare.options)
    assert bool((tied[..., 0] == tied[..., 1]).any())  # the case has a tie for the noise to break


def test_a_file_that_is_not_safetensors_is_refused_by_name(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not tensors")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        query_stats.load_stats(text)
