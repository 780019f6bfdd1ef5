"""Bad input never gives a silent wrong result: a policy's output is checked at every eviction,
every setting is checked before any work, and every setting reaches the policy."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Annotated

import numpy as np
import pytest
import torch

import vasepatch
from tests.conftest import ragged_batch
from tests.integration.test_patching import fingerprint, logits
from tests.tiny_models import VOCAB, tiny_model
from vasepatch import VaSEConfig, policies
from vasepatch.cache import VaSECache
from vasepatch.policies import PolicyOutputError, scoring
from vasepatch.policies.base import kept_slots
from vasepatch.policies.options import Between

# --- a policy's output is checked --------------------------------------------------------------

B, H, N_CAND, WINDOW, BUDGET = 3, 2, 12, 2, 10  # keep = BUDGET - WINDOW = 8 of 12 candidates
KEEP = BUDGET - WINDOW


def _eviction_case():
    """Candidates of 3 rows x 2 KV heads; row 1 has 2 padding slots (valid: 10 >= keep),
    row 2 has 6 (valid: 6 < keep)."""
    g = torch.Generator().manual_seed(0)
    n = N_CAND + WINDOW
    keys, values = torch.randn(B, H, n, 4, generator=g), torch.randn(B, H, n, 4, generator=g)
    valid = torch.ones(B, H, n, dtype=torch.bool)
    valid[1, :, :2] = False
    valid[2, :, :6] = False
    positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
    queries = torch.randn(B, 2 * H, WINDOW, 4, generator=g)
    return keys, values, positions, valid, queries, n


class Rewritten(policies.Policy):
    """`streaming`, with its picks passed through `rewrite` (a policy with a bug)."""

    def __init__(self, rewrite, check_output: bool = True) -> None:
        base = policies.get("streaming", sinks=0)
        super().__init__("mypolicy", base.priority, base.options, check_output=check_output)
        self.rewrite = rewrite

    def select(self, keys, values, queries, positions, valid, n_keep, generator=None):
        return self.rewrite(super().select(keys, values, queries, positions, valid, n_keep, generator), valid)


def _first_pad_over_real(idx, valid):
    """Row 1 has 10 valid candidates for 8 slots (streaming keeps slots 4..11): swap a kept
    real token for slot 0, a padding slot."""
    idx = idx.clone()
    idx[1, 0, 0] = 0
    return idx


def _duplicate(idx, valid):
    idx = idx.clone()
    idx[0, 1, 1] = idx[0, 1, 0]
    return idx


def _out_of_range(value):
    def rewrite(idx, valid):
        idx = idx.clone()
        idx[2, 0, 3] = value
        return idx

    return rewrite


BAD_OUTPUTS = [
    ("batch 1 for 3", lambda i, v: i[:1], r"policy 'mypolicy' returned indices of shape \[1, 2, 8\]; "
     r"expected \[3, 2, 8\] \(batch, kv_heads, keep\)"),
    ("one too few", lambda i, v: i[..., :-1], r"shape \[3, 2, 7\]; expected \[3, 2, 8\]"),
    ("one too many", lambda i, v: torch.cat([i, i[..., :1]], -1), r"shape \[3, 2, 9\]; expected \[3, 2, 8\]"),
    ("float", lambda i, v: i.float(), r"policy 'mypolicy' returned indices of dtype torch.float32; expected "
     r"torch.int64"),
    ("int32", lambda i, v: i.int(), r"dtype torch.int32; expected torch.int64"),
    ("not a tensor", lambda i, v: i.tolist(), r"policy 'mypolicy' returned list instead of a tensor of indices"),
    ("index = candidates", _out_of_range(N_CAND), r"policy 'mypolicy' returned index 12 .* outside \[0, 12\)"),
    ("negative index", _out_of_range(-1), r"policy 'mypolicy' returned index -1 .* outside \[0, 12\)"),
    ("duplicate", _duplicate, r"policy 'mypolicy' returned candidate \d+ twice \(row 0, KV head 1\)"),
    ("padding over real", _first_pad_over_real, r"policy 'mypolicy' kept 7 real tokens \(row 1, KV head 0, "
     r"which has 10 real candidates\): it must keep min\(keep=8, real candidates\) = 8"),
]  # fmt: skip


def _kept(policy):
    keys, values, positions, valid, queries, n = _eviction_case()
    return kept_slots(policy, keys, values, positions, valid, queries, n, BUDGET, WINDOW)


def test_a_correct_policy_passes_the_checks():
    kept = _kept(Rewritten(lambda i, v: i))
    assert kept.shape == (B, H, BUDGET)


@pytest.mark.parametrize(("bug", "rewrite", "message"), BAD_OUTPUTS, ids=[b[0] for b in BAD_OUTPUTS])
def test_each_bad_output_is_named(bug, rewrite, message):
    with pytest.raises(PolicyOutputError, match=message):
        _kept(Rewritten(rewrite))


@pytest.mark.parametrize("bug", ["duplicate", "padding over real"])
def test_data_checks_can_be_switched_off(bug):
    """With `check_output=False` the data-dependent checks (range, duplicates, padding) do not
    run: the bad picks go through (here they are in range, so no torch error either)."""
    rewrite = {b[0]: b[1] for b in BAD_OUTPUTS}[bug]
    kept = _kept(Rewritten(rewrite, check_output=False))
    assert kept.shape == (B, H, BUDGET)


def test_the_config_switch_reaches_the_policy():
    assert policies.for_config(VaSEConfig(budget=16, window=4)).check_output is True
    assert policies.for_config(VaSEConfig(budget=16, window=4, check_policy_output=False)).check_output is False
    with pytest.raises(ValueError, match="check_policy_output must be a bool, got 'no'"):
        VaSEConfig(budget=16, window=4, check_policy_output="no")


def _priority_one_row(positions, valid, *, sinks: int = 0):
    """A priority function that returns one row for the whole batch (it would broadcast)."""
    return positions[:1].float()


def _priority_int(positions, valid):
    return positions


def _priority_minus_inf(positions, valid):
    """Real tokens at even positions get -inf: they must still beat padding."""
    return torch.where(positions % 2 == 0, float("-inf"), positions.float())


@contextmanager
def _registered(name, fn):
    policies.register(name, fn)
    try:
        yield
    finally:
        policies._REGISTRY.pop(name)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_priority_one_row, r"policy 'test-bad' returned a priority of shape \[1, 2, 12\]; expected \[3, 2, 12\]"),
        (_priority_int, r"policy 'test-bad' returned a priority of dtype torch.int64; expected a floating-point"),
    ],
)
def test_bad_priorities_are_named(fn, message):
    keys, values, positions, valid, queries, n = _eviction_case()
    with _registered("test-bad", fn), pytest.raises(PolicyOutputError, match=message):
        kept_slots(policies.get("test-bad"), keys, values, positions, valid, queries, n, BUDGET, WINDOW)


def test_minus_inf_priorities_of_real_tokens_still_beat_padding():
    """6 real tokens then 6 empty slots, keep 8: every real token is kept, even those the
    policy scores -inf (which ties with padding in `topk`)."""
    n = 12
    valid = (torch.arange(n) < 6).view(1, 1, n)
    positions = torch.arange(n).masked_fill(~valid.flatten(), -1).view(1, 1, n)
    keys = torch.zeros(1, 1, n, 2)
    with _registered("test-minus-inf", _priority_minus_inf):
        idx = policies.get("test-minus-inf").select(keys, keys, None, positions, valid, 8)
    assert valid.gather(-1, idx).sum() == 6


def test_nan_priorities_rank_below_every_finite_one_and_above_padding():
    """NaN (which `torch.topk` ranks above `+inf`) never displaces a protected candidate."""
    keys, values, positions, valid, queries, _ = _eviction_case()

    def nan_but_the_first(positions, valid):
        return torch.where(positions == 0, float("inf"), float("nan"))

    with _registered("test-nan", nan_but_the_first):
        idx = policies.get("test-nan").select(keys[..., :N_CAND, :], values[..., :N_CAND, :], queries,
                                              positions[..., :N_CAND], valid[..., :N_CAND], 1)  # fmt: skip
    assert torch.equal(idx.flatten(), torch.tensor([0, 0, 2, 2, 6, 6]))  # each row's position 0


def test_a_bad_policy_fails_the_generation_with_its_name(make_model):
    """End to end: a batch of 3, a registered priority that returns one row (which would
    broadcast row 0's choice into every row), and a user `Policy` that keeps a token twice."""
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(20, 14, 9))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with _registered("test-one-row", _priority_one_row):
        handle = vasepatch.patch(model, budget=12, window=4, policy="test-one-row", protect=0, sinks=0)
        with pytest.raises(PolicyOutputError, match=r"policy 'test-one-row' returned a priority of shape \[1, "):
            model.generate(**kwargs)
        cache = VaSECache(handle.config, Rewritten(_duplicate), len(model.model.layers))
        with pytest.raises(PolicyOutputError, match="policy 'mypolicy' returned candidate"):
            model.generate(**kwargs, **{handle.cache_keyword: cache})
        handle.remove()


# --- every setting is checked before any work --------------------------------------------------

BAD_CONFIGS = [
    (dict(budget=128, seed=2**64), "seed", r"seed must be None or an int in \[-2\*\*63, 2\*\*64 - 1\]"),
    (dict(budget=128, seed=-(2**63) - 1), "seed", r"seed must be None or an int in \[-2\*\*63, 2\*\*64 - 1\]"),
    (dict(budget=128, smooth=2**40), "smooth", r"smooth must be an odd int in \[1, 255\] \(the width of a centred "
     r"average pool"),
    (dict(budget=128, smooth=257), "smooth", r"smooth must be an odd int in \[1, 255\]"),
    (dict(budget=128, smooth=4), "smooth", r"smooth must be an odd int in \[1, 255\] .*an even width has no centre"),
    (dict(budget=128, smooth=True), "smooth", r"smooth must be an odd int in \[1, 255\] .*got True"),
    (dict(budget=128, smooth=5.0), "smooth", r"smooth must be an odd int in \[1, 255\] .*got 5\.0"),
    (dict(budget=2**40), "budget", r"budget \+ window must be at most 2\*\*31 - 1 = 2147483647 slots"),
    (dict(budget=2**31 - 64), "budget", r"budget \+ window must be at most 2\*\*31 - 1"),
    (dict(budget=128, temperature=1e-300), "temperature", r"temperature must be a finite number >= 1e-06"),
    (dict(budget=128, temperature=1e-7), "temperature", r"temperature must be a finite number >= 1e-06"),
    (dict(budget=128, temperature=float("nan")), "temperature", r"temperature must be a finite number >= 1e-06"),
    (dict(budget=128, temperature=float("inf")), "temperature", r"temperature must be a finite number >= 1e-06"),
    (dict(budget=128, temperature=np.float32("nan")), "temperature", r"temperature must be a finite number >= "
     r"1e-06 .*got nan"),
    (dict(budget=np.bool_(True)), "budget", r"budget must be an int >= 2, got True"),
    (dict(budget=128.0), "budget", r"budget must be an int >= 2, got 128\.0"),
    (dict(budget=torch.tensor([128])), "budget", r"budget must be an int >= 2, got tensor\(\[128\]\)"),
    (dict(budget=128, sinks=True), "sinks", r"sinks must be an int >= 0, got True"),
    (dict(budget=128, seed=1.5), "seed", r"seed must be None or an int in \[-2\*\*63, 2\*\*64 - 1\], got 1\.5"),
    (dict(budget=128, policy_options="sample=False"), "policy_options", r"policy_options must be a mapping \(a "
     r"dict\) of option names to values, got str 'sample=False'"),
    (dict(budget=8, window=7), "budget", r"budget=8 is too small for window=7 and sinks=4: .* need budget >= "
     r"window \+ sinks = 11"),
    (dict(budget=12, window=4), "protect", r"protect defaults to budget // 4 = 3, fewer than sinks=4; "
     r"pass protect in \[4, 8\]"),
    (dict(budget=64, window=60, sinks=2), "protect", r"protect defaults to budget // 4 = 16, more than the 4 slots"),
]  # fmt: skip


def _config_cases():
    for i, (settings, param, message) in enumerate(BAD_CONFIGS):
        yield pytest.param(settings, param, message, id=f"{param}-{i}")


@pytest.mark.parametrize(("settings", "param", "message"), list(_config_cases()))
def test_bad_settings_are_named_at_config_and_patch_time(make_model, settings, param, message):
    with pytest.raises(ValueError, match=message) as info:
        VaSEConfig(**settings)
    assert "allowed range [4, 1]" not in str(info.value)
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    before, out_before = fingerprint(model), logits(model, ids, mask)
    with pytest.raises(ValueError, match=message):
        vasepatch.patch(model, **settings)
    assert fingerprint(model) == before and not vasepatch.is_patched(model)
    assert torch.equal(logits(model, ids, mask), out_before)


def test_an_int_too_large_for_a_float_is_not_a_number(make_model):
    """`temperature=10**400` passed (an int compares with floats) and failed at the first eviction with
    "OverflowError: int too large to convert to float"; `policies.get(..., temperature=10**400)` raised it."""
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 1e-06 .*got 1000000"):
        VaSEConfig(budget=128, temperature=10**400)
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 1e-06"):
        vasepatch.patch(make_model("llama"), budget=64, window=8, temperature=10**400)
    with pytest.raises(ValueError, match=r"policy 'rkv': option lam must be a number in \[0, 1\], got 1000000"):
        policies.for_config(VaSEConfig(budget=128, policy="rkv", policy_options={"lam": 10**400}))
    assert VaSEConfig(budget=128, temperature=10**300).temperature == 10**300  # large, but a float: uniform scores


def test_the_bounds_themselves_are_accepted():
    VaSEConfig(budget=128, seed=2**64 - 1)
    VaSEConfig(budget=128, seed=-(2**63))
    VaSEConfig(budget=128, smooth=255)
    VaSEConfig(budget=128, temperature=1e-6)
    VaSEConfig(budget=11, window=7, protect=4)  # window + sinks = 11
    VaSEConfig(budget=2**31 - 65, window=64, protect=4)


def test_a_budget_whose_buffers_cannot_fit_is_named():
    """`check_fits` (for `patch`, which knows the model and device): SmolLM2's 46,080 bytes per
    slot (2 x 30 layers x 3 KV heads x 64 x fp32) at budget 2**30 need 45 TiB per sequence."""
    config = VaSEConfig(budget=2**30)
    with pytest.raises(ValueError, match=r"budget=1073741824 needs 46080\.0 GiB of KV buffers per sequence .* "
                                         r"more than the 128\.0 GiB of the device; lower budget"):  # fmt: skip
        config.check_fits(bytes_per_slot=2 * 30 * 3 * 64 * 4, available=128 * 2**30)
    VaSEConfig(budget=4096).check_fits(bytes_per_slot=2 * 30 * 3 * 64 * 4, available=128 * 2**30)


def test_patch_refuses_a_budget_the_device_cannot_hold_before_any_work(make_model):
    """The allocation used to be attempted inside `generate` (422 TB for budget=2**40)."""
    model = make_model("llama")
    before = fingerprint(model)
    with pytest.raises(ValueError, match=r"budget=1073741824 needs .* GiB of KV buffers per sequence .*lower budget"):
        vasepatch.patch(model, budget=2**30)
    assert fingerprint(model) == before and not vasepatch.is_patched(model)


def test_patch_keywords_policy_options_and_check_switch_reach_the_policy(make_model):
    model = make_model("llama")
    with vasepatch.patched(model, budget=64, window=8, policy="rkv", policy_options={"lam": 0.25}) as handle:
        assert handle.config.policy_options == {"lam": 0.25} and handle.policy.options["lam"] == 0.25
    with vasepatch.patched(model, budget=64, window=8, check_policy_output=False) as handle:
        assert handle.policy.check_output is False
    with pytest.raises(ValueError, match=r"not both \(got config and \['policy_options'\]\)"):
        vasepatch.patch(model, config=VaSEConfig(budget=64, window=8), policy_options={"lam": 0.25})
    assert not vasepatch.is_patched(model)


BAD_POLICY_OPTIONS = [
    (dict(policy_options={"sample": "no"}), r"policy 'vase': option sample must be a bool, got 'no'"),
    (dict(policy_options={"smaple": False}), r"policy 'vase' has no option\(s\) smaple; its options are: .*sample"),
    (dict(policy="rkv", policy_options={"lam": "x"}), r"policy 'rkv': option lam must be a number in \[0, 1\]"),
    (dict(policy="rkv", policy_options={"lam": 1.5}), r"policy 'rkv': option lam must be a number in \[0, 1\]"),
    (dict(policy="cur", policy_options={"seed": 2**64}), r"policy 'cur': option seed must be an int in"),
    (dict(policy="cur", policy_options={"rank": 10**30}), r"policy 'cur': option rank must be an int in \[1, 256\], "
     r"got 1000000000000000000000000000000"),
    (dict(policy="vase-dkv", policy_options={"rank": 2**40}), r"policy 'vase-dkv': option rank must be an int in "
     r"\[1, 256\]"),
    (dict(policy="cur", policy_options={"rank": True}), r"policy 'cur': option rank must be an int in \[1, 256\], "
     r"got True"),
    (dict(policy="cur", policy_options={"seed": np.bool_(False)}), r"policy 'cur': option seed must be an int in"),
    (dict(policy="rkv", policy_options={"lam": float("nan")}), r"policy 'rkv': option lam must be a number in "
     r"\[0, 1\], got nan"),
    (dict(policy="vase-topk", policy_options={"sample": np.int64(1)}), r"policy 'vase-topk': option sample must be "
     r"a bool, got np\.int64\(1\)"),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "message"), BAD_POLICY_OPTIONS)
def test_bad_policy_options_are_named_at_patch_time(make_model, settings, message):
    model = make_model("llama")
    before = fingerprint(model)
    config = VaSEConfig(budget=64, window=8, **settings)
    with pytest.raises(ValueError, match=message):
        vasepatch.patch(model, config=config)
    assert fingerprint(model) == before and not vasepatch.is_patched(model)


def test_policy_options_that_the_config_itself_refuses():
    with pytest.raises(ValueError, match=r"policy_options must be empty for policy='full'.*got \{'sample': 'no'\}"):
        VaSEConfig(budget=128, policy="full", policy_options={"sample": "no"})
    with pytest.raises(ValueError, match=r"policy_options keys must be option names \(strings\), got 1"):
        VaSEConfig(budget=128, policy_options={1: 2})


def test_a_constraint_that_cannot_compare_is_a_value_error():
    """A user option annotated with a type vasepatch does not know still gets a named error."""

    def odd(valid, *, lam: Annotated[complex, Between(0, 1)] = 0):
        return valid.float()

    message = r"policy 'test-odd': option lam must be in \[0, 1\], got 'x'"
    with _registered("test-odd", odd), pytest.raises(ValueError, match=message):
        policies.get("test-odd", lam="x")


def test_policy_level_bounds_match_the_config():
    with pytest.raises(ValueError, match=r"option temperature must be a number finite and >= 1e-06, got 1e-300"):
        policies.get("vase", temperature=1e-300)
    with pytest.raises(ValueError, match=r"option smooth must be an odd int in \[1, 2147483647\]"):
        policies.get("snapkv", smooth=2**40)
    with pytest.raises(ValueError, match=r"option smooth must be an odd int in \[1, 2147483647\], got 4"):
        policies.get("snapkv", smooth=4)
    with pytest.raises(ValueError, match=r"option sinks must be an int in \[0, 2147483647\]"):
        policies.get("streaming", sinks=2**70)


def test_temperature_at_its_bound_still_ranks_by_attention():
    """At the smallest temperature the softmax is one-hot on each query's argmax: the most
    attended candidate is kept, not a uniform draw."""
    keys = torch.arange(6.0).view(1, 1, 6, 1)
    queries = torch.ones(1, 1, 1, 1)
    valid = torch.ones(1, 1, 6, dtype=torch.bool)
    scores = scoring.window_attention(keys, queries, valid, temperature=1e-6, smooth=1)
    assert torch.equal(scores.flatten(), torch.tensor([0.0, 0, 0, 0, 0, 1]))


# --- numpy scalars and 0-d tensors are numbers ----------------------------------------------------

# (setting, numpy / 0-d tensor value, the plain value it stands for)
SCALAR_SETTINGS = [
    ("budget", np.int64(128), 128),
    ("window", np.int32(8), 8),
    ("protect", np.uint16(16), 16),
    ("sinks", torch.tensor(4), 4),
    ("temperature", np.float32(0.5), 0.5),
    ("temperature", np.int64(2), 2),
    ("temperature", torch.tensor(0.25, dtype=torch.float64), 0.25),
    ("smooth", np.int64(5), 5),
    ("seed", np.uint64(2**64 - 1), 2**64 - 1),
    ("seed", torch.tensor(-(2**63)), -(2**63)),
    ("check_policy_output", np.bool_(False), False),
    ("shared_heads", torch.tensor(True), True),
]


@pytest.mark.parametrize(("field", "value", "plain"), SCALAR_SETTINGS, ids=[f"{c[0]}-{type(c[1]).__name__}" for c in
                                                                         SCALAR_SETTINGS])  # fmt: skip
def test_numpy_and_0d_tensor_scalars_are_accepted_as_plain_numbers(field, value, plain):
    """`np.float32(0.3)` and `np.int64(5)` were refused while `np.float64` passed: every numpy scalar and
    0-d tensor of the right kind is accepted, and the config holds the plain Python value."""
    settings = {"budget": 128, "window": 8, field: value}
    config = VaSEConfig(**settings)
    got = getattr(config, field)
    assert type(got) is type(plain) and got == pytest.approx(plain), (got, plain)
    assert config == VaSEConfig(**{**settings, field: plain})


def test_numpy_and_0d_tensor_policy_options_are_accepted_as_plain_values():
    rkv = policies.get("rkv", lam=np.float32(0.25), temperature=np.float32(0.5), smooth=np.int64(3))
    assert dict(rkv.options) == {"lam": 0.25, "temperature": 0.5, "smooth": 3}
    assert all(type(v) in (int, float) for v in rkv.options.values())
    cur = policies.get("cur", rank=np.int64(5), seed=torch.tensor(7), resample=np.bool_(False))
    assert (cur.options["rank"], cur.options["seed"], cur.options["resample"]) == (5, 7, False)
    assert type(cur.options["rank"]) is int and type(cur.options["resample"]) is bool
    assert policies.get("vase", sample=torch.tensor(False)).options["sample"] is False
    assert policies.get("vase", shared_heads=np.bool_(True)).shared_heads is True


NOT_SCALARS = [
    ("rkv", {"lam": np.bool_(True)}, r"option lam must be a number in \[0, 1\], got np\.True_"),
    ("rkv", {"lam": torch.tensor([0.5])}, r"option lam must be a number in \[0, 1\], got tensor\(\[0\.5000\]\)"),
    ("rkv", {"lam": np.array([0.5, 0.5])}, r"option lam must be a number in \[0, 1\]"),
    ("rkv", {"lam": np.complex64(0.5)}, r"option lam must be a number in \[0, 1\]"),
    ("cur", {"rank": np.float32(5)}, r"option rank must be an int in \[1, 256\], got np\.float32\(5\.0\)"),
    ("cur", {"rank": torch.tensor(5.0)}, r"option rank must be an int in \[1, 256\], got tensor\(5\.\)"),
    ("cur", {"rank": torch.tensor(True)}, r"option rank must be an int in \[1, 256\], got tensor\(True\)"),
    ("vase", {"sample": torch.tensor(1)}, r"option sample must be a bool, got tensor\(1\)"),
    ("vase", {"temperature": np.float64("inf")}, r"option temperature must be a number finite and >= 1e-06"),
    ("vase", {"temperature": 10**400}, r"option temperature must be a number finite and >= 1e-06"),
    ("vase", {"protect": np.bool_(True)}, r"option protect must be an int in \[0, 2147483647\], got np\.True_"),
]


@pytest.mark.parametrize(("name", "options", "message"), NOT_SCALARS)
def test_values_that_are_not_scalars_of_the_right_kind_are_refused(name, options, message):
    """Bools stay refused where an int or a number is expected (numpy and tensor bools included), floats where
    an int is, and tensors of more than one element anywhere."""
    with pytest.raises(ValueError, match=f"policy '{name}': {message}"):
        policies.get(name, **options)


def test_a_patch_with_numpy_settings_generates_like_plain_ones(make_model):
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB, lengths=(20, 14, 9))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    plain = dict(budget=12, window=4, sinks=2, temperature=0.5, smooth=3, seed=3)
    numpy = dict(budget=np.int64(12), window=np.int32(4), sinks=np.int8(2), temperature=np.float32(0.5),
                 smooth=torch.tensor(3), seed=np.uint8(3))  # fmt: skip
    plain.update(policy="rkv", policy_options={"lam": 0.25})
    numpy.update(policy="rkv", policy_options={"lam": np.float32(0.25)})
    outs = []
    for settings in (plain, numpy):
        with vasepatch.patched(model, **settings) as handle:
            outs.append(model.generate(**kwargs))
            assert handle.stats()["evictions"] > 0
            assert handle.config == VaSEConfig(**plain) and dict(handle.policy.options)["lam"] == 0.25
    assert torch.equal(outs[0], outs[1])


def test_policy_options_must_be_a_mapping():
    """A string used to fail inside `dict()` ("dictionary update sequence element #0 has length 1")."""
    for given in ("sample=False", [("sample", False)], ("sample",), 0):
        with pytest.raises(ValueError, match=r"policy_options must be a mapping \(a dict\) of option names to "
                                             r"values, got "):  # fmt: skip
            VaSEConfig(budget=128, policy_options=given)


def test_the_config_holds_its_own_copy_of_policy_options():
    given = {"lam": 0.25}
    config = VaSEConfig(budget=128, policy="rkv", policy_options=given)
    given["lam"] = 7  # a later change of the caller's dict does not reach the checked config
    assert config.policy_options == {"lam": 0.25}
    assert policies.for_config(config).options["lam"] == 0.25


def test_patch_refuses_policy_options_that_are_not_a_mapping(make_model):
    model = make_model("llama")
    for given in ("sample=False", ""):  # "" used to be read as no options at all
        with pytest.raises(ValueError, match=r"policy_options must be a mapping \(a dict\)"):
            vasepatch.patch(model, budget=64, window=8, policy_options=given)
    assert not vasepatch.is_patched(model)


# --- every VaSEConfig field reaches the policy ---------------------------------------------------

BASE = VaSEConfig(budget=12, window=4, protect=5, sinks=2, temperature=0.7, smooth=3, seed=11)


@contextmanager
def _spy(name):
    """Record the options and inputs the registered priority function `name` is called with."""
    priority, declared, preset = policies._REGISTRY[name]
    names = policies.inputs_of(priority)
    calls = []

    @functools.wraps(priority)
    def spy(*args, **options):
        given = dict(zip(names, args, strict=True))
        record = dict(options)
        if "queries" in given:
            record["window"] = given["queries"].shape[2]
        if "n_keep" in given:
            record["n_keep"] = given["n_keep"]
        generator = given.get("generator")
        if isinstance(generator, torch.Generator):
            record["seed"] = generator.initial_seed()
        elif generator is not None:  # the cache's KeyedGenerator: keyed by the config's seed
            record["seed"] = generator.seed
        calls.append(record)
        return priority(*args, **options)

    policies._REGISTRY[name] = (spy, declared, preset)
    try:
        yield calls
    finally:
        policies._REGISTRY[name] = (priority, declared, preset)


@pytest.fixture(scope="module")
def sharp():
    """A tiny model whose attention logits are large, so that temperature and smoothing matter,
    and its run with `BASE` (shared by the tests of this section; each run patches and unpatches)."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(25)
            layer.self_attn.k_proj.weight.mul_(25)
    return model, _run(model, BASE)


def _run(model, config, global_seed=0):
    """Generate with `config` (sampling inside the policy only), the global RNG held at
    `global_seed`; returns the kept positions of every layer and the spied policy calls."""
    ids, mask = ragged_batch(VOCAB, lengths=(30, 22, 16))
    with _spy(config.policy) as calls, vasepatch.patched(model, config=config):
        torch.manual_seed(global_seed)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=13, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True)  # fmt: skip
    cache = out.past_key_values
    kept = torch.stack([layer.positions[:, :, : config.budget] for layer in cache.layers])
    return kept, calls


CHANGES = [
    ("temperature", 0.05),
    ("smooth", 1),
    ("protect", 8),
    ("sinks", 4),
    ("seed", 12),
    ("window", 6),
    ("budget", 14),
]


@pytest.mark.parametrize(("field", "value"), CHANGES, ids=[c[0] for c in CHANGES])
def test_every_field_reaches_the_policy(sharp, field, value):
    """Each field arrives at the priority function with the config's value, and changing it
    changes the picks (global RNG held fixed)."""
    model, (kept_base, calls_base) = sharp
    changed = BASE.replace(**{field: value})
    kept_changed, calls_changed = _run(model, changed)
    for config, calls in ((BASE, calls_base), (changed, calls_changed)):
        assert calls, "the policy never ran"
        for call in calls:
            assert call["temperature"] == config.temperature and call["smooth"] == config.smooth
            assert call["protect"] == config.n_protect and call["sinks"] == config.sinks
            assert call["seed"] == config.seed and call["window"] == config.window
            assert call["n_keep"] == config.budget - config.window
    assert not torch.equal(kept_base[:, :, :, :8], kept_changed[:, :, :, :8]), f"{field} changed nothing"


def test_policy_options_reach_the_policy(sharp):
    model, _ = sharp
    runs = {lam: _run(model, BASE.replace(policy="rkv", policy_options={"lam": lam})) for lam in (0.1, 0.9)}
    for lam, (_, calls) in runs.items():
        assert calls and all(c["lam"] == lam and c["temperature"] == 0.7 and c["smooth"] == 3 for c in calls)
    assert not torch.equal(runs[0.1][0], runs[0.9][0])


def test_seed_decides_the_picks_not_the_global_rng(sharp):
    """Global RNG held fixed: seeds 11 and 12 differ; seed 11 twice, under different global
    seeds, gives identical picks."""
    model, (a, _) = sharp  # seed 11, global seed 0
    b, _ = _run(model, BASE.replace(seed=12), global_seed=0)
    c, _ = _run(model, BASE, global_seed=123)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def test_the_check_switch_reaches_the_eviction(make_model, monkeypatch):
    model = make_model("llama")
    counted = []
    original = policies.base.check_picks
    monkeypatch.setattr(policies.base, "check_picks", lambda *a, **k: counted.append(k["data"]) or original(*a, **k))
    ids, mask = ragged_batch(VOCAB, lengths=(20, 14, 9))
    for flag in (True, False):
        counted.clear()
        with vasepatch.patched(
            model, config=VaSEConfig(budget=12, window=4, sinks=2, check_policy_output=flag)
        ) as handle:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
            assert handle.stats()["evictions"] > 0
        assert counted and set(counted) == {flag}
