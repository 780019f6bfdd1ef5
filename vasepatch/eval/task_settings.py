"""`TaskSettings`: what `vasepatch eval task` runs (its flags, validated), for the data sets
(`vasepatch.eval.task`) and for pass-key retrieval (`vasepatch.eval.passkey`), with the per-task
defaults and the run key that a resumed run must match."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vasepatch.config import FULL, VaSEConfig
from vasepatch.eval import answers, cli_options, grading, paired

PASSKEY = "passkey"  # the task of `vasepatch.eval.passkey`; every other task is a data set of math problems
TASKS = sorted(grading.GRADERS)
# Per kind of task, the defaults of the settings left as None.
TASK_DEFAULTS = {
    "math": {"samples": 1, "sample_temperature": 0.6, "max_new_tokens": 1024},
    PASSKEY: {"samples": 10, "sample_temperature": 0.0, "max_new_tokens": 12},
}
ENGINES = ("transformers", "vllm")  # who generates the answers: `vasepatch.eval.answers`, `vasepatch.eval.vllm_answers`
VLLM_DTYPES = ("float32", "bfloat16")


def check_passkey(context_lengths: list[int], depths: list[float]) -> None:
    """Raise `ValueError` unless there are positive pass-key lengths and depths in [0, 1]."""
    if not context_lengths or any(not isinstance(n, int) or n < 1 for n in context_lengths):
        raise ValueError(f"context_lengths must be positive ints, got {context_lengths}")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {depths}")


@dataclass
class TaskSettings:
    """What `vasepatch eval task` runs (the CLI flags, validated): the cache settings
    `config` (one per policy: `config.replace(policy=name)`) and the eval's own.
    `samples`, `sample_temperature` and `max_new_tokens` default per task (`TASK_DEFAULTS`);
    `limit` and `data_dir` are for the data sets, `context_lengths` and `depths` for `passkey`."""

    model: str = "qwen2.5-coder-0.5b"
    task: str = "gsm8k"
    config: VaSEConfig = field(default_factory=cli_options.default_config)
    policies: list[str] = field(default_factory=lambda: [FULL, "vase"])
    limit: int = 50
    samples: int | None = None
    sample_temperature: float | None = None
    top_p: float = 0.95
    max_new_tokens: int | None = None
    batch_size: int = 8
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    data_dir: str | None = None
    out: str = "task-results"
    engine: str = "transformers"
    dtype: str = "float32"  # the weights' and KV cache's dtype under vLLM (the transformers path: float32)
    max_num_seqs: int = 64  # vLLM: requests in flight at once
    against: list[str] = field(default_factory=lambda: list(paired.REFERENCES))  # the paired table's references

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        for name, value in TASK_DEFAULTS[self.kind].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        cli_options.check_run(self.config, self.policies)
        for name in ("limit", "samples", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.sample_temperature < float("inf") or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need sample_temperature >= 0 and 0 < top_p <= 1, got {self.sample_temperature}, {self.top_p}"
            )
        if self.kind == PASSKEY:
            check_passkey(self.context_lengths, self.depths)
        self._check_engine()
        known = cli_options.policy_names()
        unknown = [name for name in self.against if name not in known]
        if unknown or not self.against:
            raise ValueError(f"against: unknown policies {unknown}; known: {', '.join(known)}")

    def _check_engine(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "transformers":
            if self.dtype != "float32":
                raise ValueError(f"dtype {self.dtype!r} needs engine='vllm' (the transformers path runs float32)")
            return
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(VLLM_DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.config.prefill not in ("compress", "pin"):
            raise ValueError(
                f"prefill {self.config.prefill!r} is not available with engine='vllm': choose compress or pin "
                "(a paged pool has no buffer sized by the prompt)"
            )

    @property
    def kind(self) -> str:
        return PASSKEY if self.task == PASSKEY else "math"

    def decoding(self) -> answers.Decoding:
        return answers.Decoding(self.max_new_tokens, self.sample_temperature, self.top_p)

    def _own(self) -> dict[str, Any]:
        """The eval's own settings that the answers depend on."""
        own: dict[str, Any] = {"model": self.model, "task": self.task, "samples": self.samples}
        if self.kind == PASSKEY:
            own["depths"] = self.depths
        own.update(
            sample_temperature=self.sample_temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            seed=self.config.seed,
            batch_size=self.batch_size,
        )
        if self.engine == "vllm":  # vLLM batches the requests itself; its answers depend on the dtype
            own.update(batch_size=None, engine="vllm", dtype=self.dtype)
        return own

    def run_key(self, name: str, model_class: str) -> dict[str, Any]:
        """What the records of policy `name` depend on; a resumed run must match it exactly
        (`full` never evicts, so the cache settings do not matter to it)."""
        key = {"policy": name, "model_class": model_class, **self._own()}
        if name != FULL:
            cache = cli_options.cache_header(self.run_config(name))
            key.update({k: v for k, v in cache.items() if k != "seed"})
        return key

    def run_config(self, name: str) -> VaSEConfig:
        """The cache config of run `name` (`vase`, `vase@64`: see `cli_options.run_config`)."""
        return cli_options.run_config(self.config, name)

    def header(self, model) -> dict[str, Any]:
        """The settings actually used, as written beside the results."""
        head: dict[str, Any] = {"policies": self.policies, **self._own()}
        if self.kind == PASSKEY:
            head["context_lengths"] = self.context_lengths
        else:
            head["limit"] = self.limit
        return {**head, **cli_options.cache_header(self.config), **cli_options.environment(model)}

    def policy_run(self, name: str, model, make_record, ident) -> answers.PolicyRun:
        """The answers of policy `name`: `<out>/<task>-<name>.jsonl`, resumable. `model`: the model, or the
        name of its class (the vLLM path, which holds no model object)."""
        return answers.PolicyRun(
            path=Path(self.out) / f"{self.task}-{name}.jsonl",
            key=self.run_key(name, model if isinstance(model, str) else type(model).__name__),
            config=self.run_config(name),
            decoding=self.decoding(),
            ident=ident,
            make_record=make_record,
        )
