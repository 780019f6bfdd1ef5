"""The `attn_backend` option end to end: choice at patch time, and the varlen paths
wired into a patched model, run on CPU through the reference kernels.

The real FlashAttention kernels need CUDA; here the CUDA-only availability check
is lifted and the kernels are replaced by `tests/reference_kernels.py` (same call
signatures), so the whole decode and prefill packing of a real generation runs
and is compared with the SDPA backend.
"""

from __future__ import annotations

import pytest
import torch

import vasepatch
from tests import reference_kernels as ref
from tests.conftest import ragged_batch
from tests.integration.test_patching import fingerprint
from tests.tiny_models import VOCAB
from vasepatch.kernels import backends as bk
from vasepatch.kernels.backends import availability, flash_attn, torch_varlen


@pytest.fixture
def cpu_varlen(monkeypatch):
    """Make `flash_attn` and `torch_varlen` available on CPU, backed by the reference kernels (flash-attn's
    decode op gets its CPU kernel from importing `tests.reference_kernels`)."""
    monkeypatch.setattr(availability, "_cuda_problem", lambda name, device, dtype: None)
    monkeypatch.setattr(availability, "_flash_attn_problem", lambda: None)
    monkeypatch.setattr(availability, "_torch_varlen_problem", lambda: None)
    monkeypatch.setattr(torch_varlen, "default_kernel", lambda: ref.varlen_attn)
    monkeypatch.setattr(flash_attn, "default_varlen_kernel", lambda: ref.flash_attn_varlen_func)


@pytest.fixture
def varlen_calls(cpu_varlen, monkeypatch):
    """Count the calls that reach the varlen entry points (eager runs only: the count is
    Python state, which a compiled graph would specialise on)."""
    calls = {"decode": 0, "prefill": 0}
    decode, prefill = bk.decode_attention, bk.prefill_attention

    def counting_decode(*args, **kwargs):
        calls["decode"] += 1
        return decode(*args, **kwargs)

    def counting_prefill(*args, **kwargs):
        calls["prefill"] += 1
        return prefill(*args, **kwargs)

    monkeypatch.setattr(bk, "decode_attention", counting_decode)
    monkeypatch.setattr(bk, "prefill_attention", counting_prefill)
    return calls


def _generate(model, backend, **settings):
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7, 3))
    with vasepatch.patched(model, budget=16, window=4, seed=0, attn_backend=backend, **settings) as handle:
        assert handle.attn_backend == backend
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=40,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert handle.stats()["evictions"] >= 4
    return out


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
@pytest.mark.parametrize(("family", "kv_heads"), [("qwen3", 2), ("llama", 4)])
def test_varlen_backends_match_sdpa_through_evictions(make_model, varlen_calls, backend, family, kv_heads):
    model = make_model(family, kv_heads=kv_heads)
    expected = _generate(model, "sdpa")
    assert varlen_calls == {"decode": 0, "prefill": 0}
    out = _generate(model, backend)
    layers = model.config.num_hidden_layers
    assert varlen_calls["prefill"] == layers and varlen_calls["decode"] == 39 * layers
    assert torch.equal(out.sequences, expected.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(out.logits, expected.logits, strict=True))
    assert diff < 1e-4


def test_auto_picks_sdpa_on_cpu_and_eager_for_an_eager_model(make_model):
    for attn, expected in (("sdpa", "sdpa"), ("eager", "eager")):
        model = make_model("qwen2", attn=attn)
        with vasepatch.patched(model, budget=32, window=4) as handle:
            assert handle.attn_backend == expected
    model = make_model("qwen2")
    with vasepatch.patched(model, budget=32, window=4, attn_backend="eager") as handle:
        assert handle.attn_backend == "eager"


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_unavailable_backend_is_a_clear_error_and_the_model_is_untouched(make_model, backend):
    model = make_model("qwen3")
    before = fingerprint(model)
    with pytest.raises(ValueError, match=rf"attn_backend='{backend}' is not available: .*"):
        vasepatch.patch(model, budget=128, attn_backend=backend)
    assert fingerprint(model) == before and not vasepatch.is_patched(model)


def test_unknown_backend_is_rejected_at_patch_time(make_model):
    """`VaSEConfig` (a leaf) takes any name; `patch` checks it against the backends before touching the model."""
    config = vasepatch.VaSEConfig(budget=128, attn_backend="flash")
    model = make_model("qwen3")
    before = fingerprint(model)
    with pytest.raises(ValueError, match=r"attn_backend='flash' is not available: unknown backend; choose one of"):
        vasepatch.patch(model, config=config)
    assert fingerprint(model) == before and not vasepatch.is_patched(model)


def test_compiled_varlen_decode_is_one_graph(make_model, cpu_varlen):
    """Under `torch.compile` the varlen decode traces into the one decode graph (the
    compiled prefill falls back to the masked kernel: unpadding has data-dependent shapes)."""
    from torch._dynamo.utils import counters

    model = make_model("qwen3")
    expected = _generate(model, "torch_varlen").sequences
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    try:
        out = _generate(model, "torch_varlen").sequences
    finally:
        del model.forward
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert torch.equal(out, expected)
