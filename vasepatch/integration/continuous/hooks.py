"""transformers' continuous batching on a patched model: the hooks that make its batch processors evict.

`patch` sets `InitContinuousBatching` as the model's `init_continuous_batching`, the one way to a
`ContinuousBatchingManager`: `generate_batch`, `continuous_batching_context_manager`, a manager made by hand, and
`transformers serve --continuous-batching` on a model patched in the serving process (`vasepatch serve`) all go
through it. It

- checks what eviction cannot do before any work (`refusal`): a model without full-attention layers or with layers
  other than full and sliding-window ones, a sliding window larger than the budget, a latent (MLA) cache, tensor
  parallelism, a flash attention (transformers' flash path reads the attention implementation from the module's
  config, which the patch sets to its own), CUDA graphs, compiled forwards and asynchronous batching asked for;
- gives the manager a copy of its continuous-batching config with asynchronous batching and CUDA graphs off (both
  run steps ahead of the host, which evicts between steps), no switch to a flash attention, and, unless
  `prefill="pin"`, prefix sharing off (an eviction rewrites a request's blocks, which sharing would hand to others);
- instruments the manager (`instrument`): each batch processor it makes gets a `PagedEviction` (its scheduler's
  `schedule_batch` and `finish_request` and its inputs' `prepare_batch_tensors` wrapped on the instance, a
  sliding-window group's ring indices made logical), and its generation thread
  counts as a call in flight from `start` until it ends, so `unpatch` waits for it.

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

import torch

from vasepatch.integration import attention
from vasepatch.integration.continuous.eviction import PagedEviction
from vasepatch.integration.handle import MISSING
from vasepatch.integration.wrappers import PatchState, original_method

LOG = logging.getLogger("vasepatch")
FINISHED = 3  # transformers' RequestStatus.FINISHED (FAILED is 4)
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
        given = given_config(self.model, generation_config, continuous_batching_config)
        problem = problem or refusal(self.model, given, self.state.handle.config.budget)
        if problem:
            raise ValueError(f"vasepatch cannot evict inside this continuous batching: {problem}")
        manager = original(generation_config, evicting_config(given, self.state), workload_hints)
        instrument(manager, self.state)
        return manager


def given_config(model: Any, generation_config: Any, cb_config: Any) -> Any:
    """The continuous-batching config the manager would use: the one given, else the generation config's
    (deprecated), else the default."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if cb_config is None:
        given = getattr(generation_config if generation_config is not None else model.generation_config,
                        "continuous_batching_config", None)  # fmt: skip
        cb_config = given if isinstance(given, ContinuousBatchingConfig) else ContinuousBatchingConfig()
    return cb_config


def refusal(model: Any, cb_config: Any, budget: int) -> str:
    """What rules eviction out for this model and config ('' when nothing does), naming the setting."""
    problem = layers_refusal(model.config.get_text_config(), budget)
    if problem:
        return problem
    if getattr(model, "_device_mesh", None) is not None:
        return "the model is sharded by tensor parallelism (a device mesh); continuous batching evicts on one device"
    for name in ("use_cuda_graph", "use_async_batching"):
        if getattr(cb_config, name, None):
            return f"continuous_batching_config.{name}=True runs steps ahead of the host, which evicts between steps"
    compiled = [n for n in ("varlen_compile_config", "decode_compile_config") if getattr(cb_config, n, None)]
    if compiled or getattr(cb_config, "default_compile_level", 0) or getattr(model.config, "compile_config", None):
        where = f"continuous_batching_config.{compiled[0]}" if compiled else "a compile level or compile_config"
        return f"{where} asks for compiled forwards: compiled continuous batching is not supported"
    implementation = str(model.config._attn_implementation or "")
    if "flash" in implementation:
        return (
            f"the model runs {implementation!r}; continuous batching evicts with its sdpa or eager attention (load "
            "the model with attn_implementation='sdpa')"
        )
    return ""


def layers_refusal(text: Any, budget: int) -> str:
    """What in a model's (text) config rules eviction out ('' when nothing does): layers other than full-attention
    ones and sliding-window ones that keep at most `budget` tokens, or a latent (MLA) cache."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    try:
        groups = set(group_layers_by_attn_type(text))
    except ValueError:  # a layer type transformers' paged cache has no allocator for
        groups = set(getattr(text, "layer_types", None) or ())
    if "full_attention" not in groups or not groups <= {"full_attention", "sliding_attention"}:
        return (
            f"the model's layers are {sorted(groups)}; continuous batching evicts from full-attention layers (beside "
            "sliding-window ones, whose ring transformers already bounds by the window)"
        )
    window = getattr(text, "sliding_window", None)
    if "sliding_attention" in groups and not (isinstance(window, int) and window <= budget):
        return (
            f"the model's sliding layers keep a window of {window} tokens, more than budget={budget}: a policy would "
            f"choose inside transformers' ring of {window} slots (a budget >= {window} keeps the sliding layers as "
            "the model defines them)"
        )
    if getattr(text, "kv_lora_rank", None):
        return "the model caches compressed latents (MLA), not per-head keys and values"
    return ""


def evicting_config(cb_config: Any, state: PatchState) -> Any:
    """A copy of `cb_config` with asynchronous batching, CUDA graphs and the switch to a flash attention off and,
    unless `prefill="pin"`, prefix sharing off (logged)."""
    config = copy.deepcopy(cb_config)
    config.use_async_batching, config.use_cuda_graph, config.auto_switch_to_flash = False, False, False
    if config.allow_block_sharing and state.handle.config.prefill != "pin":
        LOG.info(
            "vasepatch: prefix sharing is off in this continuous batching: with prefill=%r an eviction rewrites "
            "a request's prompt blocks, which sharing would hand to other requests (prefill='pin' keeps it)",
            state.handle.config.prefill,
        )
        config.allow_block_sharing = False
    return config


def instrument(manager: Any, state: PatchState) -> None:
    """Make `manager` evict for `state`'s patch (once): its batch processors (`attach`), and its generation thread
    counted as a call in flight from `start` until the thread ends (after `stop`, or on an error)."""
    if manager.__dict__.get(MANAGER_ATTR) is state:
        return
    manager.__dict__[MANAGER_ATTR] = state
    create, start, loop = (manager.__dict__.get(n, MISSING) for n in ("_create_batch_processor", "start",
                                                                     "_run_generation_loop"))  # fmt: skip
    held: list[Callable[[], None]] = []

    def create_processor() -> Any:
        processor = original_method(manager, "_create_batch_processor", create)()
        attach(processor, state)
        return processor

    def started(*args: Any, **kwargs: Any) -> Any:
        thread = manager._generation_thread
        held.append(state.hold())  # before the thread starts: `unpatch` cannot slip in between
        try:
            return original_method(manager, "start", start)(*args, **kwargs)
        finally:
            if manager._generation_thread is thread:  # already running: no new thread, no new hold
                held.pop()()

    def run_loop(*args: Any, **kwargs: Any) -> Any:
        try:
            return original_method(manager, "_run_generation_loop", loop)(*args, **kwargs)
        finally:
            if held:
                held.pop(0)()

    manager.__dict__.update(_create_batch_processor=create_processor, start=started, _run_generation_loop=run_loop)


def attach(processor: Any, state: PatchState) -> None:
    """Give `processor` its `PagedEviction` (a reused processor's is reset) and wrap, on the instances, its
    scheduler's `schedule_batch` (evict before it) and `finish_request` (a request that ended is forgotten), and its
    inputs' `prepare_batch_tensors` (positions after it)."""
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
    for group in eviction.sliding:
        logical_ring(group, eviction)
    scheduler, io = processor.scheduler, processor.inputs_and_outputs
    offloading = getattr(processor, "offloading_manager", None)
    schedule, prepare, finish = scheduler.schedule_batch, io.prepare_batch_tensors, scheduler.finish_request
    stream = getattr(io, "compute_stream", None)  # an accelerator's: the forward's stream

    def schedule_batch(*args: Any, **kwargs: Any) -> Any:
        if not state.removed:
            eviction.before_schedule(scheduler)
            ordered_before(stream)
        return schedule(*args, **kwargs)

    def prepare_batch_tensors(requests_in_batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        past = [future.state.position_offset for future in requests_in_batch]
        out = prepare(requests_in_batch, *args, **kwargs)
        if not state.removed:
            eviction.after_prepare(io, requests_in_batch, past)
            ordered_before(stream)
        return out

    def finish_request(request_id: str, *args: Any, **kwargs: Any) -> Any:
        request = scheduler.active_requests.get(request_id)
        out = finish(request_id, *args, **kwargs)
        if request is not None and int(request.status) >= FINISHED and request_id in eviction.requests:
            eviction.ended(request_id)  # finished or failed (an offload finishes it too: not while offloading)
        return out

    def offload_requests(*args: Any, **kwargs: Any) -> Any:
        finished, scheduler.finish_request = scheduler.finish_request, finish  # it queues what it finishes again
        try:
            return offload(*args, **kwargs)
        finally:
            scheduler.finish_request = finished

    scheduler.schedule_batch, io.prepare_batch_tensors = schedule_batch, prepare_batch_tensors
    scheduler.finish_request = finish_request
    if offloading is not None:
        offload = offloading.offload_requests
        offloading.offload_requests = offload_requests


def ordered_before(stream: Any) -> None:
    """Make the forward's `stream` (None on the CPU) wait for what the current stream has queued: an eviction's
    writes to the cache and the position ids' shift run on the current stream, and the forward reads both. (The
    cache the eviction reads is the last forward's, which the host has waited for: synchronous batching.)"""
    if stream is not None:
        stream.wait_stream(torch.get_device_module().current_stream())


def check_cache(cache: Any) -> None:
    """The paged cache holds one group of full-attention layers, laid out as `layout` reads it, and at most one of
    sliding-window layers, a ring indexed by position (RuntimeError naming what differs: the internals of a
    transformers release the hooks were not written for)."""
    kinds = {kind: getattr(group, "layer_type", None) for kind, group in cache.cache_allocators.items()}
    if "full_attention" not in kinds.values() or not set(kinds.values()) <= {"full_attention", "sliding_attention"}:
        raise RuntimeError(f"vasepatch: paged cache allocators {kinds}; full attention (and sliding) expected")
    needed = {
        "full_attention": ("_kv_token_views", "block_table", "ledger", "pool", "block_physical_stride",
                           "tokens_per_page"),
        "sliding_attention": ("get_read_indices", "get_write_indices", "sliding_window"),
    }  # fmt: skip
    for group in cache.cache_allocators.values():
        for name in needed[group.layer_type]:
            if not hasattr(group, name):
                raise RuntimeError(f"vasepatch: transformers' {group.layer_type} cache allocator has no {name!r}")


def pinned_hashing(cache: Any, eviction: PagedEviction) -> None:
    """With prefix sharing on and `prefill="pin"`: an evicting request's blocks are hashed for sharing only as far
    as its prompt (never written by an eviction), so no block past it is shared."""
    allocator = eviction.allocator  # the full-attention group (a sliding group never shares)
    mark = allocator.mark_complete_blocks

    def mark_complete_blocks(request_id: str, token_ids: list[int], new_blocks: int) -> Any:
        request = eviction.requests.get(request_id)
        return mark(request_id, token_ids if request is None else token_ids[: request.pinned], new_blocks)

    allocator.mark_complete_blocks = mark_complete_blocks


def logical_ring(allocator: Any, eviction: PagedEviction) -> None:
    """A sliding-window group's ring holds the token at position `p` in slot `p % sliding_window`; its indices are
    computed from the request's `position_offset`, which after an eviction counts the slots the request holds in the
    full-attention group. So they get back the tokens the request dropped. (The ring's length and blocks, which read
    the same offset, are the same either way: both counts are at least the window after an eviction, as the window
    is at most the budget.)"""
    for name in ("get_read_indices", "get_write_indices"):
        method = getattr(allocator, name)

        def logical(request_id: str, past_length: int, query_length: int, method: Any = method) -> Any:
            request = eviction.requests.get(request_id)
            return method(request_id, past_length + (0 if request is None else request.dropped), query_length)

        setattr(allocator, name, logical)
