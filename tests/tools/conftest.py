"""Fixtures shared by the command-line tests."""

from __future__ import annotations

import pytest

from tests.tiny_models import VOCAB, tiny_model
from tests.tiny_tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (1,024 positions) with the offline character tokenizer (chat template included), saved as an
    HF directory: what a command takes as a local model."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer(VOCAB).save_pretrained(path)
    return path
