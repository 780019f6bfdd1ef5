"""How each benchmarked method builds its cache and runs forward steps.

A `Method` owns one model (module tree), one cache and the position of the
sequence in it: `start(prompt)` prefills, `advance_to(n, stream)` feeds tokens of
`stream` in multi-token chunks until `n` tokens are generated (chunks end where
one-token decoding would evict), and `step()` runs one greedy decode step.
Methods:

- `dense`: transformers' `DynamicCache` on the unpatched model;
- `static`: transformers' `StaticCache`, sized for the whole run;
- a vasepatch policy (or `full`, the never-evicting mode): `vasepatch.patch(model,
  config=settings.cache_config(spec))` and `handle.new_cache()`; its K/V bytes and
  eviction count come from `cache.stats()`;
- `floor`: the unpatched model with a `DynamicCache` holding a `budget`-token prompt (its own
  seeded ids), rewound to that prompt before every timed segment: what an ideal fixed-size
  cache of `budget` tokens costs (`floor+compile`: a `StaticCache` of `budget + max(steps,
  window) + 1` slots, so that the compiled graph keeps its shapes);
- `kvpress`: NVIDIA kvpress `DecodingPress(KnormPress())` over a `DynamicCache`,
  compressing to `cache.budget` every `cache.window` decode steps;
- `+compile` on any of them: `model.forward = torch.compile(model.forward, fullgraph=True)`
  for the decode steps (prefill and fast-forward stay eager).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from typing import Any

import torch

from vasepatch.bench.settings import BenchSettings, MethodSpec


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which `model.forward` takes a cache (`cache` or, before 5.x renamed it, `past_key_values`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def share_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree (config included) that shares its parameters and buffers,
    so that methods can patch or compile their own copy without duplicating weights."""
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def tensor_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors of a transformers cache (`DynamicCache`, `StaticCache`)."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


class Method:
    """One method on its own module tree (see the module docstring).

    `absolute_positions`: pass `cache_position` (the absolute positions of the new tokens)
    where the model takes it (transformers < 5.2x): a `StaticCache` otherwise derives them
    from the occupied slots, a data-dependent count that `fullgraph` compilation rejects.
    """

    absolute_positions = False

    def __init__(self, spec: MethodSpec, model: torch.nn.Module, settings: BenchSettings) -> None:
        self.spec = spec
        self.settings = settings
        self.model = model
        self.device = next(model.parameters()).device
        self.keyword = cache_keyword(model)
        self.takes_positions = "cache_position" in inspect.signature(model.forward).parameters
        self.prepare()
        self.use_mask = settings.mask_for(spec)
        self.eager_forward = model.forward
        self.compiled_forward = None
        if spec.compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            self.compiled_forward = torch.compile(model.forward, fullgraph=True, mode=mode)
            model.forward = self.compiled_forward
        self.cache: Any = None
        self.prompt_len = 0
        self.seen = 0
        self.next_token: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    # --- per-method parts ---------------------------------------------------------------------
    def prepare(self) -> None:
        """Patch or hook the model (once)."""

    def new_cache(self, batch: int, max_len: int) -> Any:
        raise NotImplementedError

    def chunk_limit(self) -> int:
        """Most tokens the next fast-forward chunk may hold."""
        return self.settings.cache.window

    def before_forward(self, n_tokens: int) -> None:
        """Called before each forward of `n_tokens` new tokens."""

    def after_forward(self) -> None:
        """Called after each forward."""

    def kv_bytes(self) -> int:
        """Bytes held by the cache's key and value tensors now."""
        return tensor_bytes(self.cache)

    def evictions(self) -> int | None:
        """Eviction rounds so far (`None`: the method never evicts)."""
        return None

    def close(self) -> None:
        """Undo `prepare`."""

    def before_segment(self) -> None:
        """Called (untimed) after the fast-forward, right before a segment's timed steps."""

    # --- driving the sequence -----------------------------------------------------------------
    @property
    def generated(self) -> int:
        """Tokens fed after the prompt."""
        return self.seen - self.prompt_len

    def start(self, prompt: torch.Tensor, max_generated: int) -> None:
        """A fresh cache for `prompt` (`[B, P]`), prefilled; room for `max_generated` more tokens."""
        b, p = prompt.shape
        self.cache = self.new_cache(b, p + max_generated)
        self.prompt_len, self.seen = p, 0
        self._mask = torch.ones((b, p + max_generated + 1), dtype=torch.long, device=self.device)
        self.next_token = self._forward(prompt, compiled=False, last_only=True).argmax(-1, keepdim=True)

    def advance_to(self, target: int, stream: torch.Tensor) -> None:
        """Feed `stream[:, generated:target]` in chunks of at most `chunk_limit()` tokens."""
        while self.generated < target:
            q = min(target - self.generated, self.chunk_limit())
            ids = stream[:, self.generated : self.generated + q]
            self.next_token = self._forward(ids, compiled=False, last_only=True).argmax(-1, keepdim=True)

    def step(self) -> None:
        """One greedy decode step: feed the pending token, keep the argmax of its logits."""
        self.next_token = self._forward(self.next_token, compiled=True, last_only=False).argmax(-1, keepdim=True)

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, *, compiled: bool, last_only: bool) -> torch.Tensor:
        b, q = ids.shape
        kwargs: dict[str, Any] = {
            self.keyword: self.cache,
            "use_cache": True,
            "position_ids": (torch.arange(q, device=self.device) + self.seen).expand(b, q),
        }
        if self.absolute_positions and self.takes_positions:
            kwargs["cache_position"] = torch.arange(q, device=self.device) + self.seen
        if self.use_mask:
            kwargs["attention_mask"] = self._mask[:, : self.seen + q]
        if last_only:
            kwargs["logits_to_keep"] = 1
        swap = self.compiled_forward is not None and not compiled
        if swap:
            self.model.forward = self.eager_forward
        try:
            self.before_forward(q)
            out = self.model(input_ids=ids, **kwargs)
            self.after_forward()
        finally:
            if swap:
                self.model.forward = self.compiled_forward
        self.seen += q
        return out.logits[:, -1]


class DenseMethod(Method):
    """transformers' `DynamicCache` (what `generate()` uses by default)."""

    def new_cache(self, batch: int, max_len: int) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


class StaticMethod(Method):
    """transformers' `StaticCache` of `prompt + max_generated` slots."""

    absolute_positions = True

    def new_cache(self, batch: int, max_len: int) -> Any:
        from transformers import StaticCache

        return StaticCache(config=self.model.config, max_cache_len=max_len)


def floor_prompt(settings: BenchSettings, batch: int, vocab: int) -> torch.Tensor:
    """The floor's seeded random prompt `[B, budget]` (its own generator stream: the other
    methods' inputs do not depend on whether a floor runs)."""
    g = torch.Generator().manual_seed(settings.cache.seed * 1009 + batch + 7_000_003)
    return torch.randint(vocab, (batch, settings.cache.budget), generator=g)


class FloorMethod(Method):
    """The dense model over a `budget`-token prompt, rewound to it before every timed segment.

    `start` ignores the shared prompt (it prefills `floor_prompt`), `advance_to` does nothing
    (there is nothing to fast-forward to) and `before_segment` rewinds the cache to the prompt,
    with the pending token the prefill chose: every segment times the first `steps` decode steps.
    """

    absolute_positions = True

    def new_cache(self, batch: int, max_len: int) -> Any:
        from transformers import DynamicCache, StaticCache

        if self.spec.compile:  # a compiled DynamicCache would recompile as it grows
            return StaticCache(config=self.model.config, max_cache_len=max_len)
        return DynamicCache(config=self.model.config)

    def start(self, prompt: torch.Tensor, max_generated: int) -> None:
        own = floor_prompt(self.settings, prompt.shape[0], self.model.config.vocab_size).to(self.device)
        super().start(own, self.settings.floor_generated)
        self.first_token = self.next_token.clone()

    def advance_to(self, target: int, stream: torch.Tensor) -> None:
        """Nothing: every floor segment starts from the prompt (see `before_segment`)."""

    def before_segment(self) -> None:
        self.rewind()

    def rewind(self) -> None:
        """Back to the state right after the prefill: the cache holds the prompt only."""
        extra = self.seen - self.prompt_len
        if extra > 0 and self.spec.compile:
            for layer in self.cache.layers:  # StaticLayer: clear the decoded slots
                layer.keys[:, :, self.prompt_len :].zero_()  # transformers 5.0 counts the non-zero slots
                layer.values[:, :, self.prompt_len :].zero_()
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):  # transformers >= 5.2x: a 0-d position tensor
                    length.fill_(self.prompt_len)
                elif length is not None:
                    layer.cumulative_length = self.prompt_len
        elif extra > 0:
            self.cache.crop(-extra)  # negative: remove `extra` tokens (transformers 5.0 and later)
        self.seen = self.prompt_len
        self.next_token = self.first_token.clone()


class PolicyMethod(Method):
    """A vasepatch policy: the patched model and a `VaSECache`."""

    def prepare(self) -> None:
        import vasepatch

        self.handle = vasepatch.patch(self.model, config=self.settings.cache_config(self.spec))
        self.keyword = self.handle.cache_keyword

    def new_cache(self, batch: int, max_len: int) -> Any:
        return self.handle.new_cache()

    def chunk_limit(self) -> int:
        # a chunk ends exactly where one-token decoding would evict
        return max(1, min(self.settings.cache.window, self.cache.tokens_until_eviction()))

    def kv_bytes(self) -> int:
        return int(self.cache.stats()["kv_bytes"])

    def evictions(self) -> int:
        return int(self.cache.stats()["evictions"])

    def close(self) -> None:
        if self.handle.active:
            self.handle.remove()


def kvpress_module() -> Any:
    """`import kvpress`, or a `RuntimeError` saying why it is not importable."""
    try:
        import kvpress
    except Exception as err:  # ImportError, or its own import-time failures
        import transformers

        raise RuntimeError(
            f"kvpress is not importable: {type(err).__name__}: {err}. kvpress 0.5.5 requires transformers>=4.56,<5.3 "
            f"(here: {transformers.__version__}); run it in its own venv (docs/performance.md)"
        ) from None
    return kvpress


class KVPressMethod(DenseMethod):
    """NVIDIA kvpress: `DecodingPress(KnormPress())` compressing a `DynamicCache` to `budget`
    every `window` decode steps (its hooks count forward calls, so fast-forward chunks
    advance its step counters by their length)."""

    def prepare(self) -> None:
        kvpress = kvpress_module()
        c = self.settings.cache
        self.press = kvpress.DecodingPress(
            base_press=kvpress.KnormPress(),
            compression_interval=c.window,
            target_size=c.budget,
            hidden_states_buffer_size=0,
        )
        self._hooks = self.press(self.model)
        self._hooks.__enter__()
        self.n_layers = self.model.config.num_hidden_layers
        self.compressions = 0

    def new_cache(self, batch: int, max_len: int) -> Any:
        self.press.reset()
        self.compressions = 0
        return super().new_cache(batch, max_len)

    def chunk_limit(self) -> int:
        window = self.settings.cache.window
        return min(window, window - self.press.layer_step_counts[0])

    def before_forward(self, n_tokens: int) -> None:
        if self.seen == 0:  # prefill: the press leaves it alone
            return
        for i in range(self.n_layers):  # its hook adds one step per forward
            self.press.layer_step_counts[i] += n_tokens - 1

    def after_forward(self) -> None:
        if self.seen > 0 and self.press.layer_step_counts[0] == 0:
            self.compressions += 1

    def evictions(self) -> int:
        return self.compressions

    def close(self) -> None:
        self._hooks.__exit__(None, None, None)


def build_method(spec: MethodSpec, model: torch.nn.Module, settings: BenchSettings) -> Method:
    """The `Method` for `spec` on `model` (patched / hooked / compiled in place)."""
    if spec.compile:
        import torch._dynamo

        # methods compiled in one process share the model class's forward code object
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 64))
    baselines = {"dense": DenseMethod, "static": StaticMethod, "kvpress": KVPressMethod, "floor": FloorMethod}
    cls = baselines.get(spec.base, PolicyMethod)
    return cls(spec, model, settings)
