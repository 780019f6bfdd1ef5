"""The vLLM plugin and a policy that reads calibrated statistics (`triattention`), without vLLM: the engine-only
`stats` key, copied into the options of every request whose policy reads it (`settings.resolve`), and checked
against the model's config when the engine starts (`requirements.check_stats`). The engine end to end:
`test_vllm_eviction.py::test_triattention_tokens_equal_the_transformers_cache`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import VOCAB, tiny_config, tiny_model
from vasepatch.integration import calibration
from vasepatch.vllm import requirements, settings

STATS_KEY = "additional_config['vasepatch']['stats']"
OPTIONS_KEY = "additional_config['vasepatch']['policy_options']"
ASKS = {"vasepatch_budget": 64, "vasepatch_window": 16, "vasepatch_policy": "triattention"}


@pytest.fixture(scope="module")
def stats(tmp_path_factory) -> str:
    """A calibration of the tiny llama (`tiny_config("llama")`: 2 layers, 4 query and 2 KV heads, head size 16)."""
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("stats") / "tiny.safetensors"
    return str(calibration.calibrate(tiny_model("llama"), ids, path=path))


def _engine(**given) -> dict:
    return {"vasepatch": given}


@pytest.mark.parametrize("where", ["request", "engine"])
def test_a_policy_that_reads_statistics_on_an_engine_without_them_is_refused_naming_the_key(where):
    request, engine = dict(ASKS), {}
    if where == "engine":
        request, engine = {}, _engine(policy="triattention", budget=64, window=16)
    with pytest.raises(
        settings.SettingsError, match=r"reads the model's calibrated query statistics, .*\['stats'\]"
    ) as err:
        settings.resolve(engine, request, None)
    assert err.value.parameter == (
        "vasepatch_policy" if where == "request" else "additional_config['vasepatch']['policy']"
    )


def test_the_engines_file_reaches_every_request_whose_policy_reads_one_and_no_other(stats):
    engine = _engine(stats=stats)
    config = settings.resolve(engine, ASKS, None)
    assert config.policy_options == {"rotary_dtype": "float32", "stats": stats}  # vLLM's rotary: float32 frequencies
    other = settings.resolve(engine, {**ASKS, "vasepatch_policy": "vase"}, None)
    assert other.policy_options == {}
    assert settings.resolve(engine, {}, None) is None  # the key alone turns no eviction on


@pytest.mark.parametrize(
    ("given", "parameter", "message"),
    [
        ({"stats": ""}, STATS_KEY, "must be the path of a query statistics file"),
        ({"stats": 3}, STATS_KEY, "must be the path"),
        ({"stats": "x", "budget": 64, "policy_options": {"stats": "y"}}, OPTIONS_KEY, "name the statistics file in"),
    ],
    ids=["empty", "not-a-path", "in-policy-options"],
)  # fmt: skip
def test_a_bad_stats_setting_is_refused_by_name(given, parameter, message):
    with pytest.raises(settings.SettingsError, match=message) as err:
        settings.resolve(_engine(**given), ASKS, None)
    assert err.value.parameter == parameter


def test_a_request_cannot_name_a_file():
    with pytest.raises(settings.SettingsError, match="unknown request setting 'vasepatch_stats'"):
        settings.resolve(_engine(stats="x"), {**ASKS, "vasepatch_stats": "/etc/passwd"}, None)


def _vllm_config(stats: str | None, **overrides) -> SimpleNamespace:
    """What `check_stats` reads of vLLM's config: `additional_config`, the model's text config and its KV heads."""
    text = tiny_config("llama", 2, "sdpa", **overrides)
    model = SimpleNamespace(hf_text_config=text, get_total_num_kv_heads=lambda: text.num_key_value_heads)
    return SimpleNamespace(additional_config=_engine(stats=stats) if stats else {}, model_config=model)


def test_the_engine_checks_its_file_against_its_model_when_it_starts(stats, tmp_path):
    requirements.check_stats(_vllm_config(None))  # no file named: nothing to check
    requirements.check_stats(_vllm_config(stats))
    bad = {
        "absent": (_vllm_config(str(tmp_path / "absent.safetensors")), "no query statistics file at"),
        "layers": (_vllm_config(stats, num_hidden_layers=3), "has 4 rows .* this model 6"),
        "kv-heads": (_vllm_config(stats, num_key_value_heads=1), "has 4 rows .* this model 2"),
        "q-heads": (_vllm_config(stats, num_attention_heads=8, head_dim=16), "2 query heads per KV head, this model 4"),
        "head-size": (_vllm_config(stats, head_dim=8), "has 8 frequency pairs, this model 4"),
        "theta": (_vllm_config(stats, rope_parameters={"rope_type": "default", "rope_theta": 500.0}), "another rotary"),
        "dynamic": (
            _vllm_config(stats, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "triattention cannot calibrate .*'dynamic'",
        ),
    }
    (tmp_path / "text.safetensors").write_text("not safetensors")
    bad["foreign"] = (_vllm_config(str(tmp_path / "text.safetensors")), "is not a safetensors file")
    for case, (config, message) in bad.items():
        with pytest.raises(settings.SettingsError, match=message) as err:
            requirements.check_stats(config)
        assert err.value.parameter == STATS_KEY, case
        assert str(err.value).startswith(STATS_KEY), case
