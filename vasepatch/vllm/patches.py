"""What the plugin changes in vLLM 0.32.0, and nothing else: written against that version only.

vLLM has no extension point for a request whose slot count falls while its positions keep counting,
for giving a running request's tail blocks back, or for per-request side buffers of an attention
backend (docs/vllm.md, "What is patched"). So the plugin wraps sixteen functions of the pinned version,
each wrapper calling the original:

| vLLM function | process | the wrapper |
|---|---|---|
| `EngineArgs.create_engine_config` | API server / `LLM` | check the engine's settings and what they need |
| `InputProcessor._validate_params` | API server / `LLM` | check a request's settings (HTTP 400 naming the key) |
| `Scheduler.schedule` | EngineCore | issue the due orders, free the tail blocks, ship the step |
| `Scheduler._preempt_request` | EngineCore | a preempted request starts over |
| `KVCacheManager.allocate_slots` | EngineCore | physical block math; admission by blocks held and the rings' limit |
| `KVCacheManager.get_computed_blocks` | EngineCore | an evicting request shares no cached block past its prompt |
| `KVCacheCoordinator.cache_blocks` | EngineCore | ... and publishes none (compaction rewrites them) |
| `Scheduler.update_from_output` | EngineCore | the worker's report in; stats and finished requests' numbers out |
| `GPUModelRunner._update_states` | worker | carry out the orders before new blocks are appended |
| `GPUModelRunner._prepare_inputs` | worker | physical `seq_lens` and slot mapping; plan the query rings |
| `GPUModelRunner._on_request_state_removed` | worker | free a finished request's side state |
| `GPUModelRunner._sample` | worker | a discarded sample leaves a seeded CPU generator as it was |
| `GPUModelRunner._bookkeeping_sync` | worker | ... instead of vLLM's offset rewind, which CPU generators lack |
| `CPUAttentionBackendImpl.forward` | worker | record the queries (after RoPE) |
| `GPUModelRunner.execute_model` | worker | an output it returns (an empty step's) carries the worker's report |
| `GPUModelRunner.sample_tokens` | worker | ... and so does every other step's output (`metrics`) |

Where these wraps hold, vLLM's `SchedulerStats` dataclass also gets one field, `vasepatch` (`metrics.STATS_FIELD`),
in every process: the plugin's numbers travel in it to the frontend's stat logger (`stat_logger`).

Each row has a contract (`contracts.CONTRACTS`): the parameters the wrapper was written for and what the
plugin reads or writes on vLLM's objects around it. `install()` is idempotent, and checks them first:

- on 0.32.0 itself, and on another 0.32.x release (a pre-release or dev build too), the contracts are
  checked against the classes found; every one holds: all sixteen are wrapped (on a release other than
  0.32.0, with one warning line naming it and the contracts checked); any mismatch: inert, one warning
  line per mismatch, naming the function and what changed;
- on any other version (another minor): inert, unchecked.

Inert: it wraps none of the last fourteen, and the first two only to refuse VaSE settings (`inactive`): vLLM
starts and serves as if the plugin were absent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vasepatch.vllm import LOG, contracts, inactive, metrics, requirements, scheduler_side, settings
from vasepatch.vllm import engine_access as access
from vasepatch.vllm.worker_side import WorkerEviction

VLLM_VERSION = contracts.WRITTEN_FOR
_INSTALLED: list[tuple[Any, str, Callable]] = []  # (owner, name, original): the undo list
_INACTIVE: list[str] = []  # the vLLM version found where the plugin is inert (once it has been warned about)


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Wrap `owner.name` (calling the original) and note it on the undo list; False where there is none."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(owner, name, wrapper)
    _INSTALLED.append((owner, name, original))
    return True


def supported(found: str) -> bool:
    """Whether these patches were written against vLLM `found` (a local build tag such as `+cpu` aside)."""
    return contracts.exact(found)


def install() -> None:
    """Wrap the functions in the module's table (once per process) where the vLLM found is of the minor version
    written for and every contract holds; elsewhere, only `inactive`'s guards."""
    if _INSTALLED or _INACTIVE:
        return
    import vllm

    found = getattr(vllm, "__version__", "unknown")
    if not contracts.same_minor(found):
        _INACTIVE.append(found)
        inactive.install(VLLM_VERSION, found, _wrap)
        return
    broken = contracts.check()
    if broken:
        _INACTIVE.append(found)
        inactive.install(VLLM_VERSION, found, _wrap, [str(m) for m in broken])
        return
    if not supported(found):
        LOG.warning(
            "vasepatch's vLLM plugin is active on vLLM %s, a release it was not written for (%s): its %s were "
            "checked and hold (python -m vasepatch.vllm.contracts lists them).",
            found,
            VLLM_VERSION,
            contracts.summary(),
        )
    _patch_front()
    _patch_scheduler()
    _patch_runner()
    _patch_metrics()


def active() -> bool:
    """Whether the plugin's wraps are installed in this process (a supported vLLM, every contract holding)."""
    return bool(_INSTALLED)


def uninstall() -> None:
    """Put every original back (tests)."""
    _INACTIVE.clear()
    while _INSTALLED:
        owner, name, original = _INSTALLED.pop()
        setattr(owner, name, original)


def _patch_front() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    def create_engine_config(original):
        def wrapper(self, *args, **kwargs):
            config = original(self, *args, **kwargs)
            requirements.check_engine(config)
            requirements.log_active(config)
            return config

        return wrapper

    def validate_params(original):
        def wrapper(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)
            if isinstance(params, SamplingParams):
                try:
                    requirements.check_request(self.vllm_config, params)
                except settings.SettingsError as exc:
                    raise VLLMValidationError(str(exc), parameter=exc.parameter) from None
            return result

        return wrapper

    _wrap(EngineArgs, "create_engine_config", create_engine_config)
    _wrap(InputProcessor, "_validate_params", validate_params)


def _patch_scheduler() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def schedule(original):
        def wrapper(self, *args, **kwargs):
            step = scheduler_side.plan(self)
            output = original(self, *args, **kwargs)
            setattr(output, scheduler_side.STEP_ATTR, scheduler_side.finish(self, step))
            return output

        return wrapper

    def preempt(original):
        def wrapper(self, request, *args, **kwargs):
            original(self, request, *args, **kwargs)
            scheduler_side.preempted(request)

        return wrapper

    def allocate_slots(original):
        def wrapper(self, request, *args, **kwargs):
            if not scheduler_side.rings_admit(self, request):  # it waits, as for blocks
                return None
            blocks = None
            if kwargs.get("full_sequence_must_fit"):  # an admission: count what the request will hold
                blocks = scheduler_side.admission_blocks(request, access.block_size(self))
            with scheduler_side.physical(request), access.admission_capped(self, blocks):
                got = original(self, request, *args, **kwargs)
            if got is not None:
                scheduler_side.rings_taken(self, request)
            return got

        return wrapper

    def cache_blocks(original):
        def wrapper(self, request, num_computed_tokens, *args, **kwargs):
            cap = scheduler_side.cacheable(request)
            tokens = num_computed_tokens if cap is None else min(num_computed_tokens, cap)
            return original(self, request, tokens, *args, **kwargs)

        return wrapper

    def computed_blocks(original):
        def wrapper(self, request, *args, **kwargs):
            found = original(self, request, *args, **kwargs)
            cap = scheduler_side.cacheable(request)
            return found if cap is None else access.capped_hit(self, found, cap)

        return wrapper

    _wrap(Scheduler, "schedule", schedule)
    _wrap(Scheduler, "_preempt_request", preempt)
    _wrap(KVCacheManager, "allocate_slots", allocate_slots)
    _wrap(KVCacheManager, "get_computed_blocks", computed_blocks)
    _wrap(KVCacheCoordinator, "cache_blocks", cache_blocks)


def _worker(runner: Any) -> WorkerEviction:
    state = getattr(runner, "vasepatch", None)
    if state is None:
        from vllm.distributed import get_tensor_model_parallel_rank

        heads = runner.model_config.get_num_kv_heads(runner.parallel_config)
        total = runner.model_config.get_total_num_kv_heads()
        state = WorkerEviction(get_tensor_model_parallel_rank(), heads, total)
        runner.vasepatch = state
        global _CURRENT
        _CURRENT = state
    return state


_CURRENT: WorkerEviction | None = None  # the worker of this process, for the attention wrapper


def _patch_runner() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def update_states(original):
        def wrapper(self, scheduler_output, *args, **kwargs):
            _worker(self).before_update(self, scheduler_output)
            return original(self, scheduler_output, *args, **kwargs)

        return wrapper

    def prepare_inputs(original):
        def wrapper(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
            result = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
            _worker(self).after_prepare(self, num_scheduled_tokens)
            return result

        return wrapper

    def removed(original):
        def wrapper(self, req_id, req_state, *args, **kwargs):
            _worker(self).removed(req_id)
            return original(self, req_id, req_state, *args, **kwargs)

        return wrapper

    def forward(original):
        def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            if _CURRENT is not None and attn_metadata is not None:
                _CURRENT.record(layer.layer_name, query, attn_metadata.num_actual_tokens)
            return original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

        return wrapper

    def sample(original):
        def wrapper(self, *args, **kwargs):
            with access.discarded_samples_undone(self) as undone:
                _worker(self).generators_restored += undone
                return original(self, *args, **kwargs)

        return wrapper

    def bookkeeping(original):
        def wrapper(self, *args, **kwargs):
            _worker(self).rings.clear_plan()  # the step's queries are recorded: no later forward reuses its plan
            with access.generators_hidden(self, list(access.discarded_generators(self))):
                return original(self, *args, **kwargs)

        return wrapper

    _wrap(GPUModelRunner, "_sample", sample)
    _wrap(GPUModelRunner, "_bookkeeping_sync", bookkeeping)
    _wrap(GPUModelRunner, "_update_states", update_states)
    _wrap(GPUModelRunner, "_prepare_inputs", prepare_inputs)
    _wrap(GPUModelRunner, "_on_request_state_removed", removed)
    _wrap(CPUAttentionBackendImpl, "forward", forward)


def _patch_metrics() -> None:
    """The metrics' way from the worker to the scheduler and on to the frontend (`metrics`)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def update_from_output(original):
        def wrapper(self, scheduler_output, model_runner_output, *args, **kwargs):
            states = metrics.before_update(self, model_runner_output)
            outputs = original(self, scheduler_output, model_runner_output, *args, **kwargs)
            metrics.after_update(self, outputs, states)
            return outputs

        return wrapper

    def reported(original):  # execute_model (an empty step's output) and sample_tokens (every other step's)
        def wrapper(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            return access.with_report(output, metrics.WORKER_ATTR, _worker(self).report)

        return wrapper

    _wrap(Scheduler, "update_from_output", update_from_output)
    _wrap(GPUModelRunner, "execute_model", reported)
    _wrap(GPUModelRunner, "sample_tokens", reported)
    access.add_stats_field(metrics.STATS_FIELD)
