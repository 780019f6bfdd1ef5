"""`PatchHandle` and the state a patch leaves on its model.

Everything a patch installs is plain data (objects holding references to the model's own
modules, no closures), so `copy.deepcopy` maps each piece to the copy's modules and the
copy carries a working patch of its own, and `pickle`/`torch.save` store the patch with
the model (it loads patched, with the same settings).

The state a patch leaves (`wrappers.PatchState`) also counts the `generate` and forward calls
in flight on the model, so that `unpatch` from another thread refuses with `ModelInUseError`
instead of pulling the patch from under a running generation.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch

from vasepatch import policies
from vasepatch.cache import CacheMonitor, VaSECache
from vasepatch.config import VaSEConfig
from vasepatch.errors import NotPatchedError
from vasepatch.integration import policy_stats
from vasepatch.integration.compat import cache_keyword
from vasepatch.integration.distributed import Sharding
from vasepatch.integration.families import ModelLayout

STATE_ATTR = "_vasepatch_state"


class _Missing:
    """Marks an attribute that the instance did not have before the patch (picklable singleton)."""

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING = _Missing()


class Restore:
    """Undo of one instance attribute set by the patch: put back `previous` (or delete it)."""

    def __init__(self, obj: Any, name: str, previous: Any) -> None:
        self.obj, self.name, self.previous = obj, name, previous

    def __call__(self) -> None:
        if self.previous is MISSING:
            self.obj.__dict__.pop(self.name, None)
        else:
            self.obj.__dict__[self.name] = self.previous


def set_instance_attr(obj: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> Any:
    """Set `obj.__dict__[name]` and record its undo; returns the previous value (or `MISSING`)."""
    previous = obj.__dict__.get(name, MISSING)
    obj.__dict__[name] = value
    undo.append(Restore(obj, name, previous))
    return previous


def policy_for(config: VaSEConfig) -> policies.Policy | None:
    """The policy a config asks for (ValueError naming an unknown one), or None for the
    never-evicting `"full"` mode."""
    return policies.for_config(config) if config.evicts else None


class PatchHandle:
    """What `patch` returns: statistics, a cache factory, and `remove()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: VaSEConfig,
        policy: policies.Policy | None,
        layout: ModelLayout,
        attn_backend: str = "sdpa",
        shard: Sharding | None = None,
    ):
        self.model = model
        self.config = config
        self.policy = policy
        self.layout = layout
        self.attn_backend = attn_backend
        """The attention backend chosen at patch time (see `VaSEConfig.attn_backend`)."""
        self.shard = shard or Sharding(1, 0, layout.num_kv_heads, layout.num_kv_heads)
        """Which KV heads this process holds (tensor parallelism splits them over ranks)."""
        self.monitor = CacheMonitor()
        self.cache_owner = uuid.uuid4().hex
        """Marks the caches this patch makes (`VaSECache.owner`): a cache of another model, or of
        an earlier patch of this one, is refused at its first use (`wrappers.check_cache`)."""
        self.cache_keyword = cache_keyword(model.forward)
        """The keyword under which the model takes a cache: `"cache"` where its `forward` has that
        parameter (recent transformers), else `"past_key_values"` (older 5.x releases)."""
        self.batching: Any = None
        """The eviction of the most recent continuous-batching processor (`integration.continuous`), or None."""

    def new_cache(self, config: VaSEConfig | None = None) -> VaSECache:
        """A fresh cache for one generation (what `generate()` gets automatically).

        Pass it to the model under `handle.cache_keyword` to drive it by hand:
        `model(input_ids, **{handle.cache_keyword: handle.new_cache()})`. With
        `config`, the cache follows those settings instead of the patch's (another
        policy or budget on the same patched model); `stats()` does not track it.
        """
        n_layers = len(self.layout.attention_modules)
        if config is None:
            cache = VaSECache(self.config, self.policy, n_layers, self.monitor, self.layout.layer_plans())
        elif not isinstance(config, VaSEConfig):
            raise ValueError(f"config must be a vasepatch.VaSEConfig, got {type(config).__name__}")
        else:
            config = policy_stats.with_stats(self.model, config)  # a policy that reads statistics: its file
            cache = VaSECache(config, policy_for(config), n_layers, plans=self.layout.layer_plans())
        cache.owner = self.cache_owner
        return cache

    def stats(self) -> dict[str, int]:
        """Counters of the most recent generation (the most recently started one, when
        threads share the model).

        `evictions` (eviction rounds), `evicted_tokens` (slots dropped per row and
        KV head), `tokens_seen` (sequence length incl. padding), `occupancy` (max
        over layers of slots in use), `budget`, `window`, `capacity` (slots
        allocated per layer, row and KV head), `pinned` (prompt slots that no eviction
        touches: the prompt with `prefill="pin"`, else 0), `kv_bytes` (K+V buffer bytes, all
        layers, held by this process), `layers`, `generations` (caches created by this
        patch); and across tensor-parallel ranks: `world_size` (ranks the KV heads are
        split over; 1 without tensor parallelism), `rank` (this one), `kv_bytes_total`
        (all ranks together: `kv_bytes x world_size`, since each rank holds an equal share
        of the heads; computed, no communication).
        """
        snapshot = self.monitor.snapshot(self.config.budget, self.config.window)
        return {**snapshot, **self.shard.stats(snapshot["kv_bytes"])}

    def batching_stats(self) -> dict[str, int]:
        """Counters of the most recent continuous batching of this patch (`generate_batch`, a manager from
        `init_continuous_batching`), all 0 before any: `evictions` (one per request evicted at a step),
        `evicted_tokens` (slots dropped, summed over requests: each of a request's layers and KV heads drops as
        many), `blocks_freed` (blocks given back to the paged cache's allocator) and `peak_blocks` (the most blocks a
        request held at a step after its first eviction: at most `ceil((budget + window) / page_size)` with
        `prefill="compress"`)."""
        if self.batching is None:
            return {"evictions": 0, "evicted_tokens": 0, "blocks_freed": 0, "peak_blocks": 0}
        return self.batching.stats()

    @property
    def active(self) -> bool:
        state = getattr(self.model, STATE_ATTR, None)
        return state is not None and state.handle is self

    def remove(self) -> None:
        """Same as `vasepatch.unpatch(model)`, for this handle's patch only: a handle whose
        patch is gone raises `NotPatchedError` and leaves any newer patch alone."""
        state = getattr(self.model, STATE_ATTR, None)
        if state is None:
            raise NotPatchedError("this handle's patch was already removed; the model is not patched")
        if state.handle is not self:
            raise NotPatchedError(
                "this handle is stale: its patch was already removed and the model has been patched again by "
                "another handle; call remove() on that handle (or vasepatch.unpatch(model))"
            )
        state.remove()

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self.remove()

    def __getstate__(self) -> dict[str, Any]:
        """A copy gets its own statistics (none yet) and caches (the original's caches are another
        model's); the policy is rebuilt from the config."""
        state = self.__dict__.copy()
        state["policy"] = None
        state["monitor"] = CacheMonitor()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.policy = policy_for(self.config)
        self.cache_owner = uuid.uuid4().hex

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PatchHandle(policy={c.policy!r}, budget={c.budget}, window={c.window}, "
            f"attn_backend={self.attn_backend!r}, active={self.active})"
        )
