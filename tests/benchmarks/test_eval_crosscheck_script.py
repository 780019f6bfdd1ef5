"""`benchmarks/eval_crosscheck.py`: where two engines' greedy answers part, and the model's top-two logit gap
there, on a tiny model and a character-level tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from tests.tiny_models import tiny_model
from tests.tiny_tokenizer import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("eval_crosscheck", ROOT / "benchmarks" / "eval_crosscheck.py")
crosscheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crosscheck)


def test_first_difference_is_the_first_differing_token_or_the_shorter_length():
    assert crosscheck.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert crosscheck.first_difference([5], [6, 7]) == 0
    assert crosscheck.first_difference([1, 2], [1, 2, 3]) == 2


def test_read_keys_records_by_problem_and_sample_and_skips_the_header(tmp_path):
    path = tmp_path / "run.jsonl"
    lines = [{"key": {"policy": "full"}}, {"id": "3", "sample": 1, "text": "a"}, {"id": "3", "text": "b"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert crosscheck.read(path) == {("3", 1): lines[1], ("3", 0): lines[2]}


def test_parting_reports_the_logits_where_two_answers_part():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    prompt, a, b = "<|user|>2+2<|end|><|assistant|>", "It is 4", "It is 5"
    row = crosscheck.parting(model, tokenizer, prompt, a, b)
    assert row["token"] == 6 and (row["a"], row["b"]) == ("4", "5")
    ids = tokenizer(prompt + "It is ", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert row["top2_gap"] == round(float(top[0] - top[1]), 4)
    four, five = (
        tokenizer("4", add_special_tokens=False)["input_ids"][0],
        tokenizer("5", add_special_tokens=False)["input_ids"][0],
    )
    assert row["gap_a_b"] == round(float(logits[four] - logits[five]), 4)
