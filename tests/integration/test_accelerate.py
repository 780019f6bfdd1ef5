"""accelerate's dispatch: a model loaded with a `device_map` (here CPU plus disk offload, so
accelerate's hooks really move weights in at each call, and offloaded weights sit on `meta`)
patches, generates what the undispatched patched model generates, keeps each layer's buffers
on that layer's execution device, and unpatches back to accelerate's own forwards."""

from __future__ import annotations

import pytest
import torch
import transformers

import vasepatch
from tests.conftest import greedy_with_logits, ragged_batch
from tests.tiny_models import VOCAB, tiny_model
from vasepatch.integration.distributed import execution_devices

pytest.importorskip("accelerate")

SETTINGS = dict(budget=16, window=4, sinks=2, seed=0)
STEPS = 48  # 12 eviction rounds
MAPS = {
    "one-layer-on-disk": {"model.layers.1": "disk", "lm_head": "disk"},
    "all-layers-on-disk": {"model.layers.0": "disk", "model.layers.1": "disk", "model.norm": "disk"},
}


def device_map(offloaded: dict[str, str]) -> dict[str, str]:
    parts = ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    return {part: offloaded.get(part, "cpu") for part in parts}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tiny_model(request.param, kv_heads=2).save_pretrained(folder / "model")
    return folder


def load(saved, name: str | None):
    kwargs = {} if name is None else {"device_map": device_map(MAPS[name]), "offload_folder": str(saved / name)}
    return transformers.AutoModelForCausalLM.from_pretrained(saved / "model", dtype=torch.float32, **kwargs).eval()


def forwards(model) -> dict:
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


@pytest.mark.parametrize("name", MAPS)
def test_dispatched_model_generates_like_the_undispatched_one(saved, name):
    dispatched, plain = load(saved, name), load(saved, None)
    assert any(p.device.type == "meta" for p in dispatched.parameters())  # the offload is real
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7))
    with vasepatch.patched(plain, **SETTINGS):
        want = greedy_with_logits(plain, ids, mask, STEPS)
    with vasepatch.patched(dispatched, **SETTINGS) as handle:
        got = greedy_with_logits(dispatched, ids, mask, STEPS)
        assert handle.stats()["evictions"] >= 10
        assert handle.attn_backend == "sdpa"  # chosen for the execution device, not `meta`
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"decode step {step}")


@pytest.mark.parametrize("name", MAPS)
def test_buffers_live_on_each_layers_execution_device(saved, name):
    model = load(saved, name)
    handle = vasepatch.patch(model, **SETTINGS)
    devices = execution_devices(model, handle.layout)
    assert [d.type for d in devices] == ["cpu", "cpu"]  # accelerate's hook, not the `meta` weights
    cache = handle.new_cache()
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: cache})
    assert [layer.keys.device for layer in cache.layers] == devices
    vasepatch.unpatch(model)


def test_unpatch_restores_accelerates_hooked_forwards(saved):
    model = load(saved, "one-layer-on-disk")
    before = forwards(model)
    assert before["model.layers.1.self_attn"] is not None  # accelerate replaced it on the instance
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7))
    with torch.no_grad():
        out_before = model(input_ids=ids, attention_mask=mask).logits
    vasepatch.patch(model, **SETTINGS)
    assert forwards(model)["model.layers.1.self_attn"] is not before["model.layers.1.self_attn"]
    vasepatch.unpatch(model)
    assert forwards(model) == before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, out_before)


def test_memory_check_counts_offloaded_layers(saved):
    """Weights on `meta` still say the dtype, and the layers' execution device says whose memory
    the buffers take: a budget no machine could hold is refused, naming `budget`, model unchanged."""
    model = load(saved, "all-layers-on-disk")
    before = forwards(model)
    with pytest.raises(ValueError, match=r"budget=.*physical memory"):
        vasepatch.patch(model, budget=2**31 - 8, window=4, sinks=2)  # 1 TiB of buffers
    assert forwards(model) == before and not vasepatch.is_patched(model)


def test_gpu_check_device_map_case_runs_on_cpu():
    """The `device_map` case of `benchmarks/gpu_check.py` (GPU + CPU offload on CUDA) in its CPU
    form: tiny-qwen3 with a layer on disk, patched, equal to the whole model."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", path)
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpu_check  # dataclasses look their module up
    try:
        spec.loader.exec_module(gpu_check)
        row = gpu_check.device_map_check(gpu_check.make_setup(torch.device("cpu"), None))
    finally:
        del sys.modules[spec.name]
    assert row["ok"], row
    assert row["device_map"]["model.layers.1"] == "disk" and row["meta_params"] > 0
    assert row["tokens_equal"] and row["max_logit_diff"] == 0.0 and row["evictions"] >= 4
    assert "| tiny-qwen3 | 2 | disk |" in "\n".join(gpu_check.device_map_markdown(row))


def test_execution_device_comes_from_the_nearest_hook():
    """A layer's execution device is its accelerate hook's (or its nearest hooked parent's; a
    `SequentialHook` holds several), not where its weights are: no CUDA is needed to read it."""
    from types import SimpleNamespace

    from vasepatch.integration.families import inspect_model

    model = tiny_model("llama")
    layout = inspect_model(model)
    assert execution_devices(model, layout) == [torch.device("cpu")] * 2  # no hooks: the weights' device
    model.model.layers[0]._hf_hook = SimpleNamespace(execution_device=1)  # accelerate's int = CUDA index
    model.model.layers[1]._hf_hook = SimpleNamespace(
        hooks=[SimpleNamespace(), SimpleNamespace(execution_device="meta")]
    )
    model.model.layers[1].self_attn._hf_hook = SimpleNamespace(execution_device=torch.device("cuda:2"))
    assert execution_devices(model, layout) == [torch.device("cuda:1"), torch.device("cuda:2")]
    del model.model.layers[1].self_attn._hf_hook
    assert execution_devices(model, layout)[1] == torch.device("meta")  # the sequential hook's
