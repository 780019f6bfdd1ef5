"""transformers' continuous batching on a patched model: the hooks that make its batch processors evict.

`patch` sets `InitContinuousBatching` as the model's `init_continuous_batching`, the one way to a
`ContinuousBatchingManager`: `generate_batch`, `continuous_batching_context_manager`, a manager made by hand, and
`transformers serve --continuous-batching` on a model patched in the serving process all go through it. It

- checks what eviction cannot do before any work (`refusal`): a model whose layers are not all full attention, a
  latent (MLA) cache, tensor parallelism, CUDA graphs, compiled forwards and asynchronous batching asked for;
- gives the manager a copy of its continuous-batching config with asynchronous batching and CUDA graphs off (both
  run steps ahead of the host, which evicts between steps) and, unless `prefill="pin"`, prefix sharing off (an
  eviction rewrites a request's blocks, which sharing would hand to others);
- instruments the manager (`instrument`): each batch processor it makes gets a `PagedEviction` (its scheduler's
  `schedule_batch` and its inputs' `prepare_batch_tensors` wrapped on the instance), and a running manager counts
  as a call in flight, so `unpatch` waits for `stop`.

With `prefill="pin"` prefix sharing stays as the config sets it: only a request's prompt blocks are hashed for
sharing (`pinned_hashing`), and the prompt is never written.

The hooks read transformers' private continuous-batching internals, which changed shape five times in 25 minor
releases; `compat.CONTINUOUS_BATCHING` is the range they were written and tested for. Outside it no hook is
installed: the batched path runs transformers' own full cache, and the patch warns that it evicts nothing.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from typing import Any

from vasepatch.integration import attention
from vasepatch.integration.continuous.eviction import PagedEviction
from vasepatch.integration.handle import MISSING
from vasepatch.integration.wrappers import PatchState, original_method

LOG = logging.getLogger("vasepatch")
MANAGER_ATTR = "_vasepatch_state"  # on an instrumented manager: the patch it evicts for


class InitContinuousBatching:
    """`init_continuous_batching` of a patched model (see the module's docstring)."""

    def __init__(self, model: Any, state: PatchState, previous: Any) -> None:
        self.model, self.state, self.previous = model, state, previous

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(original_method(self.model, "init_continuous_batching", self.previous))

    def __call__(
        self, generation_config: Any = None, continuous_batching_config: Any = None, workload_hints: Any = None
    ) -> Any:
        original = original_method(self.model, "init_continuous_batching", self.previous)
        cached = getattr(self.model, "_cached_continuous_batching_manager", None)
        if cached is not None and cached.__dict__.get(MANAGER_ATTR) is self.state:
            return original(generation_config, continuous_batching_config, workload_hints)
        problem = "" if cached is None else (
            "the model holds a manager cached before this patch (persistent_manager=True), made with settings "
            "eviction cannot take; call model.destroy_cached_continuous_batching_manager() first"
        )  # fmt: skip
        problem = problem or refusal(self.model, continuous_batching_config)
        if problem:
            raise ValueError(f"vasepatch cannot evict inside this continuous batching: {problem}")
        config = evicting_config(self.model, generation_config, continuous_batching_config, self.state)
        manager = original(generation_config, config, workload_hints)
        instrument(manager, self.state)
        return manager


def refusal(model: Any, cb_config: Any) -> str:
    """What rules eviction out for this model and config ('' when nothing does), naming the setting."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    text = model.config.get_text_config()
    groups = group_layers_by_attn_type(text)
    if set(groups) != {"full_attention"}:
        return f"the model's layers are {sorted(groups)}; continuous batching evicts from full-attention layers only"
    if getattr(text, "kv_lora_rank", None):
        return "the model caches compressed latents (MLA), not per-head keys and values"
    if getattr(model, "_device_mesh", None) is not None:
        return "the model is sharded by tensor parallelism (a device mesh); continuous batching evicts on one device"
    for name in ("use_cuda_graph", "use_async_batching"):
        if getattr(cb_config, name, None):
            return f"continuous_batching_config.{name}=True runs steps ahead of the host, which evicts between steps"
    for name in ("varlen_compile_config", "decode_compile_config"):
        if getattr(cb_config, name, None) is not None:
            return f"continuous_batching_config.{name} is set: compiled continuous batching is not supported"
    return ""


def evicting_config(model: Any, generation_config: Any, cb_config: Any, state: PatchState) -> Any:
    """A copy of the continuous-batching config the manager would use (the given one, else the generation
    config's, else the default), with asynchronous batching and CUDA graphs off and, unless `prefill="pin"`,
    prefix sharing off (logged)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if cb_config is None:
        given = getattr(generation_config if generation_config is not None else model.generation_config,
                        "continuous_batching_config", None)  # fmt: skip
        cb_config = given if isinstance(given, ContinuousBatchingConfig) else ContinuousBatchingConfig()
    config = copy.deepcopy(cb_config)
    config.use_async_batching, config.use_cuda_graph = False, False
    if config.allow_block_sharing and state.handle.config.prefill != "pin":
        LOG.info(
            "vasepatch: prefix sharing is off in this continuous batching: with prefill=%r an eviction rewrites "
            "a request's prompt blocks, which sharing would hand to other requests (prefill='pin' keeps it)",
            state.handle.config.prefill,
        )
        config.allow_block_sharing = False
    return config


def instrument(manager: Any, state: PatchState) -> None:
    """Make `manager` evict for `state`'s patch (once): its batch processors (`attach`), and its run counted as a
    call in flight from `start` to `stop` (or `destroy`)."""
    if manager.__dict__.get(MANAGER_ATTR) is state:
        return
    manager.__dict__[MANAGER_ATTR] = state
    create, start, stop = (manager.__dict__.get(n, MISSING) for n in ("_create_batch_processor", "start", "stop"))
    held: list[Callable[[], None]] = []

    def create_processor() -> Any:
        processor = original_method(manager, "_create_batch_processor", create)()
        attach(processor, state)
        return processor

    def started(*args: Any, **kwargs: Any) -> Any:
        if not held:
            held.append(state.hold())
        return original_method(manager, "start", start)(*args, **kwargs)

    def stopped(*args: Any, **kwargs: Any) -> Any:
        try:
            return original_method(manager, "stop", stop)(*args, **kwargs)
        finally:
            while held:
                held.pop()()

    manager.__dict__.update(_create_batch_processor=create_processor, start=started, stop=stopped)


def attach(processor: Any, state: PatchState) -> None:
    """Give `processor` its `PagedEviction` (a reused processor's is reset) and wrap, on the instances, its
    scheduler's `schedule_batch` (evict before it) and its inputs' `prepare_batch_tensors` (positions after it)."""
    cache = processor.cache
    known = cache.__dict__.get(attention.PAGED_ATTR)
    if known is not None:
        known.reset()
        state.handle.batching = known
        return
    check_cache(cache)
    eviction = PagedEviction(state.handle.config, cache)
    cache.__dict__[attention.PAGED_ATTR] = eviction
    state.handle.batching = eviction
    if state.handle.config.prefill == "pin":
        pinned_hashing(cache, eviction)
    scheduler, io = processor.scheduler, processor.inputs_and_outputs
    schedule, prepare = scheduler.schedule_batch, io.prepare_batch_tensors

    def schedule_batch(*args: Any, **kwargs: Any) -> Any:
        if not state.removed:
            eviction.before_schedule(scheduler)
        return schedule(*args, **kwargs)

    def prepare_batch_tensors(requests_in_batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        past = [future.state.position_offset for future in requests_in_batch]
        out = prepare(requests_in_batch, *args, **kwargs)
        if not state.removed:
            eviction.after_prepare(io, requests_in_batch, past)
        return out

    scheduler.schedule_batch, io.prepare_batch_tensors = schedule_batch, prepare_batch_tensors


def check_cache(cache: Any) -> None:
    """The paged cache holds one group of full-attention layers, laid out as `layout` reads it (RuntimeError
    naming what differs: the internals of a transformers release the hooks were not written for)."""
    groups = list(cache.cache_allocators.values())
    if len(groups) != 1 or getattr(groups[0], "layer_type", None) != "full_attention":
        raise RuntimeError(
            f"vasepatch: a paged cache of {len(groups)} allocator groups; one of full attention expected"
        )
    for name in ("_kv_token_views", "block_table", "ledger", "pool", "block_physical_stride", "tokens_per_page"):
        if not hasattr(groups[0], name):
            raise RuntimeError(f"vasepatch: transformers' paged cache allocator has no {name!r}")


def pinned_hashing(cache: Any, eviction: PagedEviction) -> None:
    """With prefix sharing on and `prefill="pin"`: an evicting request's blocks are hashed for sharing only as far
    as its prompt (never written by an eviction), so no block past it is shared."""
    allocator = next(iter(cache.cache_allocators.values()))
    mark = allocator.mark_complete_blocks

    def mark_complete_blocks(request_id: str, token_ids: list[int], new_blocks: int) -> Any:
        request = eviction.requests.get(request_id)
        return mark(request_id, token_ids if request is None else token_ids[: request.pinned], new_blocks)

    allocator.mark_complete_blocks = mark_complete_blocks
