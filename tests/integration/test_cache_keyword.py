"""vasepatch passes and reads the cache under transformers' current name (`cache`) where the model has it, and
under the old one (`past_key_values`) where it does not, so a patched model logs no "`past_key_values`/
`cache_params` are deprecated" line. CI runs these tests under the newest transformers and under 5.0.0."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

import vasepatch
from tests.conftest import ragged_batch
from tests.tiny_models import VOCAB
from vasepatch.integration.compat import cache_keyword, output_cache

OLD_NAMES = ("past_key_values", "cache_params")


@contextmanager
def transformers_log() -> Iterator[list[str]]:
    """The messages transformers logs inside the block, its `warning_once` memory cleared first (a line logged
    earlier in the session would otherwise not be logged again, and the check would pass for that reason)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    transformers.utils.logging.warning_once.cache_clear()
    logger, handler = logging.getLogger("transformers"), Collect(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def deprecation_lines(messages: list[str]) -> list[str]:
    return [m for m in messages if "deprecated" in m and any(name in m for name in OLD_NAMES)]


def test_the_keyword_is_read_from_the_forward_signature(make_model):
    def new(input_ids=None, cache=None, past_key_values=None): ...

    def old(input_ids=None, past_key_values=None): ...

    assert cache_keyword(new) == "cache" and cache_keyword(old) == "past_key_values"
    model = make_model("llama")
    has_cache = "cache" in inspect.signature(model.forward).parameters
    with vasepatch.patched(model, budget=16, window=4) as handle:
        assert handle.cache_keyword == ("cache" if has_cache else "past_key_values")


def test_output_cache_reads_the_name_the_output_declares():
    @dataclass
    class New:
        cache: object = None

    @dataclass
    class Old:
        past_key_values: object = None

    assert output_cache(New(cache="c")) == "c" and output_cache(Old(past_key_values="p")) == "p"
    assert output_cache((1, 2), default="d") == "d"
    out = CausalLMOutputWithPast(logits=torch.zeros(1))
    assert output_cache(out, default="d") is None  # the class declares a cache field, left empty


def test_a_patched_model_logs_no_deprecation_line(make_model):
    """generate (evicting, and returning its cache), a forward driven by hand under `handle.cache_keyword`, and a
    plain forward that gets transformers' own cache (warned, `NoEvictionWarning`): no deprecation line."""
    model = make_model("llama")
    ids, mask = ragged_batch(VOCAB)
    with transformers_log() as messages, vasepatch.patched(model, budget=16, window=4) as handle, torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True,
        )  # fmt: skip
        assert handle.stats()["evictions"] > 0
        assert isinstance(output_cache(out), vasepatch.VaSECache)
        cache = handle.new_cache()
        model(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: cache})
        with pytest.warns(vasepatch.NoEvictionWarning, match=f"{handle.cache_keyword}=handle.new_cache"):
            model(input_ids=ids, attention_mask=mask, use_cache=True)
    assert deprecation_lines(messages) == []


def test_the_log_check_sees_the_deprecation_line():
    """The check above can fail: on a release that renamed the cache, reading an output's old name logs the line."""
    if "past_key_values" in CausalLMOutputWithPast.__dataclass_fields__:
        pytest.skip(f"transformers {transformers.__version__} still calls the cache past_key_values: no line to see")
    out = CausalLMOutputWithPast(logits=torch.zeros(1))
    with transformers_log() as messages:
        _ = out.past_key_values
    assert len(deprecation_lines(messages)) == 1
