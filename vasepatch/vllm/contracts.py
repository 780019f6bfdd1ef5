"""What the plugin relies on in vLLM's private code, written down, and a check of it against the vLLM found.

The plugin wraps private functions of vLLM (`patches`) and reads and writes private state through
`engine_access`. A vLLM release can rename a parameter, add one, or drop an attribute, and nothing in vLLM
says so. So each wrapped function has a contract here: the parameters it was written for (names, kinds,
which have defaults) and what its wrapper, and what the wrapper calls, reads or writes on vLLM's objects
(request fields, block pool and block manager attributes, the runner's buffers, config fields), each as
`Class.attribute` or, for what the plugin calls with arguments, `Class.method(parameters)`.

`check()` compares them with the classes of the installed vLLM, without an engine: a parameter list is
compared as written for; an attribute counts as present where the class (or a base class of the same
package) has it, declares it in its body (dataclass and config fields) or assigns `self.<name>` in any of
its methods (read from its source). It returns one line per mismatch, naming the wrapped function and what
changed. It checks shapes, not meaning: a function that kept its parameters but changed what it does is
caught by the vLLM tests, not here.

The policy (`patches.install`), for the vLLM version found:

- `WRITTEN_FOR` (0.32.0; a local build tag such as `+cpu` aside): contracts checked; any mismatch: inert.
- another release of the same minor (0.32.x, its pre-releases and dev builds): contracts checked; active
  only if every one holds, with a warning naming the release and how many contracts were checked.
- any other version: inert, unchecked (a new minor changes enough that a port is due: docs/vllm.md,
  "Porting to a new vLLM").

Adding a wrapped function is one `Contract` line in `CONTRACTS` (and its classes in `WHERE`); a test checks
that every function `patches` wraps has one. `python -m vasepatch.vllm.contracts` prints every contract and
whether it holds on the installed vLLM.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

WRITTEN_FOR = "0.32.0"

# Where each class or module-level function a contract names lives, in the vLLM written for.
WHERE = {
    "EngineArgs": "vllm.engine.arg_utils",
    "VllmConfig": "vllm.config",
    "ModelConfig": "vllm.config",
    "CacheConfig": "vllm.config",
    "ParallelConfig": "vllm.config",
    "SchedulerConfig": "vllm.config",
    "DeviceConfig": "vllm.config",
    "CompilationConfig": "vllm.config",
    "InputProcessor": "vllm.v1.engine.input_processor",
    "SamplingParams": "vllm.sampling_params",
    "VLLMValidationError": "vllm.exceptions",
    "Scheduler": "vllm.v1.core.sched.scheduler",
    "SchedulerOutput": "vllm.v1.core.sched.output",
    "Request": "vllm.v1.request",
    "KVCacheManager": "vllm.v1.core.kv_cache_manager",
    "KVCacheCoordinator": "vllm.v1.core.kv_cache_coordinator",
    "SingleTypeKVCacheManager": "vllm.v1.core.single_type_kv_cache_manager",
    "BlockPool": "vllm.v1.core.block_pool",
    "GPUModelRunner": "vllm.v1.worker.gpu_model_runner",
    "CachedRequestState": "vllm.v1.worker.gpu_input_batch",
    "InputBatch": "vllm.v1.worker.gpu_input_batch",
    "MultiGroupBlockTable": "vllm.v1.worker.block_table",
    "BlockTable": "vllm.v1.worker.block_table",
    "CpuGpuBuffer": "vllm.v1.utils",
    "KVCacheConfig": "vllm.v1.kv_cache_interface",
    "KVCacheGroupSpec": "vllm.v1.kv_cache_interface",
    "KVCacheSpec": "vllm.v1.kv_cache_interface",
    "Attention": "vllm.model_executor.layers.attention",
    "CPUAttentionBackendImpl": "vllm.v1.attention.backends.cpu_attn",
    "CPUAttentionMetadata": "vllm.v1.attention.backends.cpu_attn",
    "_get_attn_isa": "vllm.v1.attention.backends.cpu_attn",
    "get_tensor_model_parallel_rank": "vllm.distributed",
    "EngineCoreOutputs": "vllm.v1.engine",
    "EngineCoreOutput": "vllm.v1.engine",
    "SchedulerStats": "vllm.v1.metrics.stats",
    "ModelRunnerOutput": "vllm.v1.outputs",
}


@dataclass(frozen=True)
class Contract:
    """A wrapped function (`Class.method`), its parameters as written for, and what its side of the plugin uses."""

    function: str
    parameters: str
    uses: tuple[str, ...] = ()
    why: str = ""


_RUNNER_BATCH = ("GPUModelRunner.input_batch", "InputBatch.num_reqs", "InputBatch.req_ids")
CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "EngineArgs.create_engine_config", "self, usage_context=, headless=",
        ("VllmConfig.additional_config", "VllmConfig.speculative_config", "VllmConfig.kv_transfer_config",
         "VllmConfig.parallel_config", "VllmConfig.model_config", "VllmConfig.cache_config",
         "VllmConfig.device_config", "VllmConfig.scheduler_config", "ParallelConfig.pipeline_parallel_size",
         "ParallelConfig.tensor_parallel_size", "ModelConfig.max_model_len", "ModelConfig.dtype",
         "ModelConfig.hf_config", "ModelConfig.hf_text_config", "ModelConfig.get_sliding_window(self)",
         "ModelConfig.get_total_num_kv_heads(self)", "ModelConfig.get_head_size(self)",
         "ModelConfig.get_num_attention_heads(self, parallel_config, arch_config=)",
         "ModelConfig.get_num_layers(self, parallel_config)", "CacheConfig.cache_dtype", "CacheConfig.block_size",
         "CacheConfig.enable_prefix_caching", "DeviceConfig.device_type", "SchedulerConfig.max_num_seqs",
         "SchedulerConfig.max_num_batched_tokens", "SchedulerConfig.long_prefill_token_threshold",
         "_get_attn_isa(dtype, block_size, head_size=, kv_cache_dtype=)"),
        "checks the engine's settings and what they need",
    ),
    Contract(
        "InputProcessor._validate_params", "self, params, supported_tasks",
        ("InputProcessor.vllm_config", "SamplingParams.extra_args", "SamplingParams.seed",
         "VLLMValidationError(self, message, *, parameter=, value=)"),
        "checks a request's settings (HTTP 400 naming the key)",
    ),
    Contract(
        "Scheduler.schedule", "self, throttle_prefills=",
        ("Scheduler.running", "Scheduler.waiting", "Scheduler.kv_holding_waiting", "Scheduler.kv_cache_manager",
         "Scheduler.vllm_config", "Request.request_id", "Request.sampling_params", "Request.num_output_tokens",
         "Request.is_prefill_chunk", "Request.num_prompt_tokens", "Request.num_computed_tokens",
         "KVCacheManager.coordinator", "KVCacheCoordinator.single_type_managers",
         "SingleTypeKVCacheManager.req_to_blocks", "SingleTypeKVCacheManager.num_cached_block",
         "SingleTypeKVCacheManager.block_size", "SingleTypeKVCacheManager.block_pool",
         "BlockPool.free_blocks(self, ordered_blocks)"),
        "issues the due orders, frees the tail blocks, ships the step",
    ),
    Contract("Scheduler._preempt_request", "self, request, timestamp, drop_stale_output=", (),
             "a preempted request starts over"),
    Contract(
        "KVCacheManager.allocate_slots",
        "self, request, num_new_tokens, num_new_computed_tokens=, new_computed_blocks=, num_lookahead_tokens=, "
        "num_external_computed_tokens=, delay_cache_blocks=, num_encoder_tokens=, full_sequence_must_fit=, "
        "reserved_blocks=, has_scheduled_reqs=, skip_zeroing_group_ids=",
        ("Request.num_computed_tokens", "KVCacheManager.coordinator", "KVCacheCoordinator.single_type_managers",
         "SingleTypeKVCacheManager.block_size", "SingleTypeKVCacheManager.max_admission_blocks_per_request"),
        "physical block math; admission by blocks held and the rings' limit",
    ),
    Contract(
        "KVCacheManager.get_computed_blocks", "self, request",
        ("KVCacheManager.truncate_computed_blocks(self, blocks, num_computed_tokens)", "KVCacheManager.coordinator",
         "KVCacheCoordinator.single_type_managers", "SingleTypeKVCacheManager.block_size"),
        "an evicting request shares no cached block past its prompt",
    ),
    Contract("KVCacheCoordinator.cache_blocks", "self, request, num_computed_tokens", (),
             "... and publishes none (compaction rewrites them)"),
    Contract(
        "GPUModelRunner._update_states", "self, scheduler_output",
        ("SchedulerOutput.preempted_req_ids", "GPUModelRunner.requests", "GPUModelRunner.vllm_config",
         "GPUModelRunner.model_config", "GPUModelRunner.parallel_config", "ModelConfig.get_num_kv_heads(self, "
         "parallel_config, arch_config=)", "ModelConfig.get_total_num_kv_heads(self)",
         "get_tensor_model_parallel_rank()", "CachedRequestState.sampling_params",
         "CachedRequestState.block_ids", "GPUModelRunner.compilation_config", "GPUModelRunner.kv_cache_config",
         "CompilationConfig.static_forward_context", "KVCacheConfig.kv_cache_groups", "KVCacheGroupSpec.layer_names",
         "KVCacheGroupSpec.kv_cache_spec", "KVCacheSpec.block_size", "Attention.kv_cache", "Attention.impl",
         "CPUAttentionBackendImpl.alibi_slopes", "GPUModelRunner.input_batch", "InputBatch.req_id_to_index",
         "InputBatch.block_table", "MultiGroupBlockTable.block_tables", "BlockTable.block_table",
         "BlockTable.num_blocks_per_row", "CpuGpuBuffer.np"),
        "carries out the orders before new blocks are appended",
    ),
    Contract(
        "GPUModelRunner._prepare_inputs", "self, scheduler_output, num_scheduled_tokens",
        (*_RUNNER_BATCH, "InputBatch.num_computed_tokens_cpu", "GPUModelRunner.query_start_loc",
         "GPUModelRunner.seq_lens", "GPUModelRunner.positions", "GPUModelRunner.req_indices", "CpuGpuBuffer.gpu",
         "InputBatch.block_table", "MultiGroupBlockTable.compute_slot_mapping(self, num_reqs, query_start_loc, "
         "positions)"),
        "physical seq_lens and slot mapping; plans the query rings",
    ),
    Contract("GPUModelRunner._on_request_state_removed", "self, req_id, req_state", (),
             "frees a finished request's side state"),
    Contract(
        "GPUModelRunner._sample", "self, logits, spec_decode_metadata",
        (*_RUNNER_BATCH, "GPUModelRunner.discard_request_mask", "InputBatch.generators", "CpuGpuBuffer.np"),
        "a discarded sample leaves a seeded CPU generator as it was",
    ),
    Contract(
        "GPUModelRunner._bookkeeping_sync",
        "self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens",
        (*_RUNNER_BATCH, "GPUModelRunner.discard_request_mask", "InputBatch.generators"),
        "... instead of vLLM's offset rewind, which CPU generators lack",
    ),
    Contract(
        "CPUAttentionBackendImpl.forward",
        "self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=, output_block_scale=",
        ("Attention.layer_name", "CPUAttentionMetadata.num_actual_tokens"),
        "records the queries (after RoPE)",
    ),
    Contract(
        "Scheduler.update_from_output", "self, scheduler_output, model_runner_output",
        ("Scheduler.log_stats", "Scheduler.running", "EngineCoreOutputs.outputs", "EngineCoreOutputs.scheduler_stats",
         "EngineCoreOutput.request_id", "EngineCoreOutput.finish_reason", "EngineCoreOutput.kv_transfer_params",
         "SchedulerStats.__dataclass_fields__"),
        "the worker's report in; the stats' payload and finished requests' numbers out (metrics)",
    ),
    Contract("GPUModelRunner.execute_model", "self, scheduler_output, intermediate_tensors=", (),
             "an output it returns (an empty step's) carries the worker's report (metrics)"),
    Contract("GPUModelRunner.sample_tokens", "self, grammar_output", (),
             "... and so does every step's sampled output"),
)  # fmt: skip


@dataclass(frozen=True)
class Mismatch:
    """One thing a contract expects that the vLLM found does not have."""

    function: str  # the wrapped function whose contract it breaks
    what: str

    def __str__(self) -> str:
        return f"{self.function}: {self.what}"


Resolve = Callable[[str], Any]


def check(contracts: Iterable[Contract] | None = None, resolve: Resolve | None = None) -> list[Mismatch]:
    """Every mismatch between `contracts` (all of `CONTRACTS` by default) and the vLLM found (empty when all
    hold). `resolve(name)` gives the class or function named in `WHERE` (or raises); by default it imports it
    from the installed vLLM."""
    resolve = resolve or _import
    found: list[Mismatch] = []
    for contract in CONTRACTS if contracts is None else contracts:
        try:
            found.extend(_check_one(contract, resolve))
        except Exception as exc:  # a check that cannot run is a contract that does not hold: vLLM must still start
            found.append(Mismatch(contract.function, f"the check itself failed ({type(exc).__name__}: {exc})"))
    return found


def _check_one(contract: Contract, resolve: Resolve) -> list[Mismatch]:
    owner, name = contract.function.split(".")
    problem = _callable(f"{owner}.{name}({contract.parameters})", resolve)
    found = [Mismatch(contract.function, problem)] if problem else []
    for use in contract.uses:
        problem = _callable(use, resolve) if use.endswith(")") else _attribute(use, resolve)
        if problem:
            found.append(Mismatch(contract.function, problem))
    return found


def _import(name: str) -> Any:
    """The class or function `name` of the installed vLLM, from its module in `WHERE`."""
    module = importlib.import_module(WHERE[name])
    return getattr(module, name)


def _lookup(name: str, resolve: Resolve) -> tuple[Any, str | None]:
    try:
        return resolve(name), None
    except Exception as exc:  # an import that fails, a class moved or renamed
        return None, f"{name} is not found in {WHERE.get(name, 'vLLM')} ({type(exc).__name__}: {exc})"


def _attribute(use: str, resolve: Resolve) -> str | None:
    owner, attr = use.split(".")
    cls, problem = _lookup(owner, resolve)
    if problem:
        return problem
    if defines(cls, attr):
        return None
    return f"uses {use}, which {cls.__module__}.{cls.__qualname__} no longer has"


def _callable(use: str, resolve: Resolve) -> str | None:
    """A `Class.method(parameters)` or `function(parameters)` use: it exists and takes the parameters written for."""
    target, expected = use[:-1].split("(", 1)
    owner, _, attr = target.partition(".")
    found, problem = _lookup(owner, resolve)
    if problem:
        return problem
    if attr:
        found = getattr(found, attr, None)
        if found is None:
            return f"{target} is gone from {WHERE.get(owner, 'vLLM')}"
    if isinstance(found, type):
        found = found.__init__
    actual = parameters(found)
    if actual == _normal(expected):
        return None
    change = _difference(expected, actual)
    return f"{target}'s parameters changed: written for ({_normal(expected)}), found ({actual}){change}"


def parameters(function: Callable) -> str:
    """A function's parameter list as contracts write it: names, `=` after those with a default, `*` before
    keyword-only ones, `/` after positional-only ones, `*args` and `**kwargs`. Annotations are left out."""
    try:
        found = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return "?"
    parts: list[str] = []
    star = False
    for p in found:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
        parts.append(text + ("=" if p.default is not p.empty else ""))
        if p.kind is p.POSITIONAL_ONLY and all(q.kind is not p.POSITIONAL_ONLY for q in _after(found, p)):
            parts.append("/")
    return ", ".join(parts)


def _after(every: Iterable[inspect.Parameter], p: inspect.Parameter) -> list[inspect.Parameter]:
    listed = list(every)
    return listed[listed.index(p) + 1 :]


def _normal(text: str) -> str:
    return ", ".join(part.strip() for part in text.split(",") if part.strip())


def _names(text: str) -> list[str]:
    return [re.sub(r"[*=]", "", part).strip() for part in text.split(",") if part.strip() not in ("*", "/", "")]


def _difference(expected: str, actual: str) -> str:
    """`: new x; gone y` (or the kinds or order changed) between two parameter lists."""
    before, after = _names(expected), _names(actual)
    new = [n for n in after if n not in before]
    gone = [n for n in before if n not in after]
    said = [f"new {', '.join(new)}"] * bool(new) + [f"gone {', '.join(gone)}"] * bool(gone)
    return ": " + ("; ".join(said) if said else "a default, kind or the order changed")


def defines(cls: type, name: str) -> bool:
    """Whether instances of `cls` have attribute `name`: the class or a base has it (methods, properties,
    class attributes, fields with defaults), or a class of its MRO from the same package declares it in its
    body or assigns `self.<name>` in one of its methods."""
    if hasattr(cls, name):
        return True
    package = cls.__module__.split(".")[0]
    return any(name in _declared(k) for k in cls.__mro__ if k.__module__.split(".")[0] == package)


@functools.cache
def _declared(cls: type) -> frozenset[str]:
    """The names `cls`'s own source declares in its class body or assigns as `self.<name>` (empty without
    source). Read as text, not parsed: the classes checked span thousands of lines, and a check runs in
    every process vLLM starts."""
    try:
        text = _source(inspect.getsourcefile(cls) or "")
    except TypeError:  # a built-in class
        return frozenset()
    found = re.search(rf"^([ \t]*)class {re.escape(cls.__name__)}\b.*$", text, re.MULTILINE)
    if found is None:
        return frozenset()
    indent, lines = len(found[1]), []
    rest = text[found.start() :].splitlines()
    header = next((i for i, line in enumerate(rest) if line.split("#")[0].rstrip().endswith(":")), len(rest))
    for line in rest[header + 1 :]:
        if line.strip() and not line.lstrip().startswith("#") and len(line) - len(line.lstrip()) <= indent:
            break  # the class body ends at the first line no deeper than `class`
        lines.append(line)
    block = "\n".join(lines)
    assigned = re.findall(r"\bself\.(\w+)\s*(?::[^=\n]+)?=(?!=)", block)
    body = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=indent + 4)
    fields = re.findall(rf"^[ \t]{{{body}}}(\w+)\s*(?::|=(?!=))", block, re.MULTILINE)
    return frozenset(assigned) | frozenset(fields)


@functools.cache
def _source(filename: str) -> str:
    try:
        with open(filename, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return ""


# --- the version policy ---------------------------------------------------------------------------------------


def release(version: str) -> tuple[int, int, int] | None:
    """`(major, minor, patch)` of a version string (`0.32.1`, `0.32.0+cpu`, `0.32.1rc1`, `0.32.1.dev3+g1a2b`);
    None where it has none."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return None if found is None else (int(found[1]), int(found[2]), int(found[3]))


def same_minor(version: str) -> bool:
    """Whether `version` is a release of the minor version written for (whose contracts are then checked)."""
    found, written = release(version), release(WRITTEN_FOR)
    return found is not None and written is not None and found[:2] == written[:2]


def exact(version: str) -> bool:
    """Whether `version` is the release written for (a local build tag such as `+cpu` aside)."""
    return version.split("+")[0] == WRITTEN_FOR


def summary(contracts: Iterable[Contract] | None = None) -> str:
    """`13 contracts (the parameters of 13 wrapped functions, 108 uses of vLLM's classes)`: what a check covers."""
    listed = list(CONTRACTS if contracts is None else contracts)
    uses = sum(len(c.uses) for c in listed)
    return f"{len(listed)} contracts (the parameters of {len(listed)} wrapped functions, {uses} uses of vLLM's classes)"


def report(contracts: Iterable[Contract] | None = None, resolve: Resolve | None = None) -> tuple[list[str], int]:
    """One line per contract, `OK` or `MISMATCH` with what changed below it, and how many mismatches."""
    lines, broken = [], 0
    for contract in CONTRACTS if contracts is None else contracts:
        found = check([contract], resolve)
        broken += len(found)
        state = "OK      " if not found else "MISMATCH"
        lines.append(f"{state} {contract.function}({contract.parameters}) and {len(contract.uses)} uses")
        lines.extend(f"           {m.what}" for m in found)
    return lines, broken


def main() -> int:
    """`python -m vasepatch.vllm.contracts`: each contract against the installed vLLM, and the verdict."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    print(f"vasepatch's vLLM plugin, written for vLLM {WRITTEN_FOR}; found vLLM {version}: {summary()}")
    lines, broken = report()
    print("\n".join(lines))
    if not same_minor(version):
        verdict = f"inert: {version} is not a {WRITTEN_FOR.rsplit('.', 1)[0]}.x release (contracts not consulted)"
    elif broken:
        verdict = f"inert: {broken} mismatches"
    else:
        verdict = "active: every contract holds"
    print(f"verdict at install: {verdict}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
