"""Which models vasepatch can patch, found by what their attention modules do, and where they are.

A model is accepted when it is a decoder-only causal LM whose decoder layers each hold one
attention module that (1) takes the cache as `cache` or `past_key_values` and stores its new
keys and values with `cache.update(key, value, self.layer_idx, ...)`, (2) reaches attention
through transformers' attention interface (`ALL_ATTENTION_FUNCTIONS`, chosen by
`config._attn_implementation`), passing its `**kwargs` through, and (3) shares the decoder
stack's config. Every layer must be full or sliding-window causal attention. The checks read
the model instance (module classes, their `forward` source and signature, their attributes,
the config); `model_type` only names the model in messages. Anything else raises
`UnsupportedModelError` with one reason (see `REASONS`), before the model is touched.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from vasepatch.cache.plan import LayerPlan, default_plans
from vasepatch.errors import UnsupportedModelError

# The kinds of refusal, each with the start of its message.
REASONS = {
    "not-generative": "it is not a generative causal LM (no generate())",
    "encoder-decoder": "it is an encoder-decoder model",
    "non-causal": "its attention is bidirectional (config.is_causal / use_bidirectional_attention)",
    "cross-attention": "its decoder layers have cross-attention",
    "mla": "it uses multi-head latent attention (MLA)",
    "linear-attention": "it has linear-attention or state-space layers",
    "chunked": "it has chunked-attention layers",
    "kv-sharing": "some layers reuse another layer's keys and values",
    "no-decoder": "no decoder stack of layers was found",
    "no-kv-cache": "its attention modules keep no KV cache",
    "no-interface": "it does not dispatch attention and masks through transformers' interfaces",
    "layout": "its attention modules do not match the decoder stack",
}

_STACK_PATHS = ("model", "model.language_model", "language_model", "model.text_model", "transformer", "decoder")
_LAYER_LISTS = ("layers", "h", "blocks", "block")
_ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")
_CROSS_NAMES = ("cross_attn", "encoder_attn", "crossattention", "cross_attention", "encoder_attention")
_CACHE_ARGS = ("cache", "past_key_values")  # what `wrappers.find_cache` looks for
_OTHER_CACHE_ARGS = ("past_key_value", "layer_past")
_LINEAR_CLASS = re.compile(
    r"mamba|mixer|linearattention|lightning|deltanet|rwkv|retention|shortconv|recurrent|xlstm|mlstm", re.IGNORECASE
)
_MASKS = re.compile(r"create_(causal|sliding_window_causal|chunked_causal)_mask|create_masks_for_generate")
_LINEAR_TYPES = ("linear_attention", "linear", "mamba", "mamba2", "conv", "ssm", "recurrent", "deltanet")


@dataclass(frozen=True)
class ModelLayout:
    """The parts of a supported causal LM that a patch touches."""

    model_type: str
    base_model: torch.nn.Module  # the decoder stack (e.g. `LlamaModel`); builds the masks
    attention_modules: tuple[torch.nn.Module, ...]  # one per decoder layer, in order
    num_query_heads: int  # of layer 0, as held on this process (fewer under tensor parallelism)
    num_kv_heads: int
    head_dim: int
    plans: tuple[LayerPlan, ...] = field(default=())  # one per decoder layer; empty: global layers on one device

    def layer_plans(self) -> tuple[LayerPlan, ...]:
        return self.plans or default_plans(len(self.attention_modules))


class _Refusal:
    """Builds the one-line `UnsupportedModelError` for a model."""

    def __init__(self, model: torch.nn.Module, model_type: str | None) -> None:
        self.where = f"{type(model).__name__}, model type {model_type!r}"

    def __call__(self, kind: str, detail: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"vasepatch cannot patch {self.where}: {REASONS[kind]}: {detail}")


def _get(obj: object, path: str) -> object:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _layer_list(stack: object) -> torch.nn.ModuleList | None:
    for name in _LAYER_LISTS:
        layers = getattr(stack, name, None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return layers
    return None


def text_config(config: object) -> object:
    """The decoder's config: `config.get_text_config()` where it has one (a multimodal config), else `config`."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def find_decoder(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList] | None:
    """The decoder stack (the module that holds the decoder layers and builds the masks) and its layers."""
    candidates: list[object] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):  # some models raise when they have no separate decoder
            candidates.append(get_decoder())
    prefix = getattr(model, "base_model_prefix", "") or ""
    paths = (*_STACK_PATHS, prefix, f"{prefix}.language_model", f"{prefix}.decoder") if prefix else _STACK_PATHS
    candidates += [_get(model, path) for path in paths]
    for stack in candidates:
        if isinstance(stack, torch.nn.Module) and stack is not model and _layer_list(stack) is not None:
            return stack, _layer_list(stack)
    return None


def attention_module(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's self-attention module, or None."""
    for name in _ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


@lru_cache(maxsize=256)
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return ""


@lru_cache(maxsize=256)
def _forward_parameters(cls: type) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return ()


def _check_model(model: torch.nn.Module, config: object, refuse: _Refusal) -> None:
    """Refusals that the top-level model and its config decide."""
    if getattr(config, "is_encoder_decoder", False):
        raise refuse("encoder-decoder", "config.is_encoder_decoder is True; vasepatch patches decoder-only models")
    if not callable(getattr(model, "generate", None)):
        raise refuse("not-generative", f"load it with AutoModelForCausalLM, not as {type(model).__name__}")


def _check_config(config: object, refuse: _Refusal) -> None:
    """Refusals that the decoder stack's config decides."""
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", False):
        raise refuse("non-causal", "vasepatch needs causal attention")
    if getattr(config, "add_cross_attention", False):
        raise refuse("cross-attention", "config.add_cross_attention is True")
    for name in ("kv_lora_rank", "q_lora_rank"):
        try:
            rank = getattr(config, name, None)
        except Exception:  # transformers raises when the attribute differs across layers
            rank = "a per-layer value"
        if rank:
            raise refuse("mla", f"config.{name}={rank}; its cache holds a compressed latent")
    modes = getattr(config, "kv_sharing_modes", None) or ()
    if getattr(config, "num_kv_shared_layers", 0) or "reuse" in modes:
        raise refuse("kv-sharing", "config.num_kv_shared_layers / kv_sharing_modes ask for it")
    blocks = getattr(config, "layers_block_type", None) or getattr(config, "hybrid_override_pattern", None)
    if blocks and any(str(b).lower() not in ("attention", "full_attention", "*") for b in blocks):
        shown = str(list(blocks) if not isinstance(blocks, str) else blocks)
        raise refuse("linear-attention", f"config.layers_block_type / hybrid_override_pattern is {shown[:80]}")


def _check_layer(i: int, layer: torch.nn.Module, refuse: _Refusal) -> torch.nn.Module:
    """Layer `i`'s attention module, or the refusal that its structure calls for."""
    for name in _CROSS_NAMES:
        if isinstance(getattr(layer, name, None), torch.nn.Module):
            raise refuse("cross-attention", f"decoder layer {i} has `{name}`")
    linear = [f"{n}: {type(m).__name__}" for n, m in layer.named_children() if _LINEAR_CLASS.search(type(m).__name__)]
    if linear:
        raise refuse("linear-attention", f"decoder layer {i} holds {', '.join(linear)}")
    attn = attention_module(layer)
    named = [(n, type(m).__name__) for n, m in layer.named_children() if "attention" in type(m).__name__.lower()]
    if attn is None and named:
        name, cls = named[0]
        raise refuse("no-interface", f"decoder layer {i} reaches attention through `{name}` ({cls}), not `self_attn`")
    if attn is None:
        children = ", ".join(f"{n}: {type(m).__name__}" for n, m in layer.named_children())
        raise refuse("linear-attention", f"decoder layer {i} has no self-attention module ({children})")
    if getattr(attn, "is_kv_shared_layer", False) or getattr(attn, "kv_shared_layer_index", None) is not None:
        raise refuse("kv-sharing", f"layer {i}'s {type(attn).__name__} reads another layer's cache")
    if getattr(attn, "kv_a_proj_with_mqa", None) is not None or getattr(attn, "kv_lora_rank", None):
        raise refuse("mla", f"layer {i}'s {type(attn).__name__} projects keys and values through a latent")
    return attn


def _cache_argument(attn: torch.nn.Module, refuse: _Refusal) -> str:
    """The name under which `attn.forward` takes the cache (refusing any other)."""
    cls, params = type(attn), _forward_parameters(type(attn))
    found = [name for name in _CACHE_ARGS if name in params]
    if found:
        return found[0]
    other = [name for name in _OTHER_CACHE_ARGS if name in params]
    if other:
        raise refuse("no-kv-cache", f"{cls.__name__}.forward takes its cache as `{other[0]}`, not `cache`")
    raise refuse("no-kv-cache", f"{cls.__name__}.forward takes no cache argument")


def _check_dispatch(cls: type, source: str, base: torch.nn.Module, refuse: _Refusal) -> None:
    """The attention module and the decoder stack go through transformers' attention and mask interfaces."""
    if re.search(r"alibi", source, re.IGNORECASE):
        raise refuse("no-interface", f"{cls.__name__} adds an ALiBi position bias inside its own attention")
    at = source.find("ALL_ATTENTION_FUNCTIONS")
    if at < 0 or "_attn_implementation" not in source:
        raise refuse("no-interface", f"{cls.__name__}.forward computes attention itself (no ALL_ATTENTION_FUNCTIONS)")
    if "**kwargs" not in source[at:]:
        raise refuse("no-interface", f"{cls.__name__}.forward does not pass its **kwargs to the attention function")
    if not _MASKS.search(_forward_source(type(base))):
        raise refuse("no-interface", f"{type(base).__name__}.forward builds masks outside transformers' masking_utils")


def _check_cache_output_use(cls: type, source: str, update: re.Match, refuse: _Refusal) -> None:
    """The keys and values `cache.update` returns feed the attention call and nothing else: the
    vasepatch kernel reads its own buffers, so values derived from them (DiffLlama's split values,
    Doge's mask computed from them) or a second attention call would silently differ. A use is
    allowed only as an argument of the attention call (`_computes_attention`)."""
    calls = len(re.findall(r"\battention_interface\(", source))
    if calls > 1:
        raise refuse("no-interface", f"{cls.__name__}.forward calls the attention function {calls} times")
    line = source.count("\n", 0, update.start()) + 1
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return
    statement = next((n for n in ast.walk(tree) if isinstance(n, ast.Assign) and n.lineno == line), None)
    target = statement.targets[0] if statement is not None else None
    returned = {e.id for e in getattr(target, "elts", ()) if isinstance(e, ast.Name)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or hasattr(node, "body"):  # compound statements: their parts are walked
            continue
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in returned}
        if node.lineno <= line or not used or _computes_attention(node):
            continue
        raise refuse(
            "no-interface",
            f"{cls.__name__}.forward uses the `{sorted(used)[0]}` returned by the cache beyond the attention call "
            f"(line {node.lineno} of forward): the attention must read the cache's keys and values as they are",
        )


def _computes_attention(node: ast.stmt) -> bool:
    """Whether a statement is an attention call: `... = attention_interface(...)` (or a method of
    the module named for attention, such as GPT-2's `self._upcast_and_reordered_attn(...)`)."""
    call = getattr(node, "value", None)
    if not isinstance(node, ast.Assign) or not isinstance(call, ast.Call):
        return False
    name = getattr(call.func, "id", None) or getattr(call.func, "attr", "")
    return "attn" in name or "attention" in name


def _check_source(i: int, attn: torch.nn.Module, base: torch.nn.Module, refuse: _Refusal) -> None:
    """The attention module's forward dispatches through the interface and updates the cache."""
    cls = type(attn)
    source = _forward_source(cls)
    if not source:
        raise refuse("no-interface", f"the source of {cls.__name__}.forward cannot be read")
    _check_dispatch(cls, source, base, refuse)
    cache = _cache_argument(attn, refuse)
    names = "|".join({cache, *re.findall(rf"(\w+)\s*=\s*{cache}\b(?![.\[])", source)})  # `curr_cache = cache`
    update = re.search(rf"\b(?:{names})\.update\(\s*\w+\s*,\s*\w+\s*,\s*self\.layer_idx\b", source)
    if not update:
        raise refuse("no-kv-cache", f"{cls.__name__}.forward never calls {cache}.update(key, value, self.layer_idx)")
    _check_cache_output_use(cls, source, update, refuse)
    if getattr(attn, "layer_idx", None) != i:
        raise refuse("layout", f"layer {i}'s {cls.__name__} has layer_idx={getattr(attn, 'layer_idx', None)}")
    if getattr(attn, "config", None) is not base.config:
        raise refuse("layout", f"layer {i}'s {cls.__name__} does not share the decoder stack's config")


def _window(config: object, what: str, refuse: _Refusal) -> int:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise refuse("layout", f"{what} slides but config.sliding_window is {window!r}")
    return window


def _chunked_is_full(config: object) -> bool:
    """Chunked attention with chunks no shorter than the longest sequence is plain causal attention."""
    chunk, longest = getattr(config, "attention_chunk_size", None), getattr(config, "max_position_embeddings", None)
    return chunk is None or (isinstance(longest, int) and chunk >= longest)


def _layer_window(i: int, kind: str | None, config: object, slides: bool, refuse: _Refusal) -> int | None:
    """Layer `i`'s sliding window as transformers' masks apply it (a query at position p sees keys
    at positions > p - window), or None for a global layer."""
    if kind is None:
        return _window(config, "every layer", refuse) if slides else None
    if kind == "full_attention":
        return None
    if kind == "sliding_attention":
        return _window(config, f"layer {i}", refuse)
    if kind == "chunked_attention":
        if _chunked_is_full(config):
            return None
        raise refuse("chunked", f"layer {i} attends within chunks of {config.attention_chunk_size} tokens")
    if kind in _LINEAR_TYPES or "linear" in kind or "mamba" in kind:
        raise refuse("linear-attention", f"config.layer_types[{i}] is {kind!r}")
    raise refuse("layout", f"config.layer_types[{i}] is {kind!r}, a layer type vasepatch does not know")


@lru_cache(maxsize=256)
def _builds_sliding_mask(cls: type) -> bool:
    """Whether the decoder stack's forward can build a sliding-window mask."""
    return "sliding_window" in _forward_source(cls)


def layer_plans(base: torch.nn.Module, num_layers: int, refuse: _Refusal) -> tuple[LayerPlan, ...]:
    """One `LayerPlan` per decoder layer: its index and its sliding window (None: global)."""
    config = base.config
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and len(kinds) != num_layers:
        raise refuse("layout", f"config.layer_types has {len(kinds)} entries for {num_layers} decoder layers")
    if kinds is None and not _chunked_is_full(config):
        raise refuse("chunked", f"config.attention_chunk_size is {config.attention_chunk_size}")
    slides = (
        getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True) is not False
        and _builds_sliding_mask(type(base))
    )
    return tuple(
        LayerPlan(i, _layer_window(i, None if kinds is None else kinds[i], config, slides, refuse))
        for i in range(num_layers)
    )


def _local_rows(module: object) -> int | None:
    """Output features of a projection as held on this process (a tensor-parallel shard's own)."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return None
    weight = weight.to_local() if hasattr(weight, "to_local") else weight
    return int(weight.shape[0])


def _config_int(config: object, name: str) -> int | None:
    """`config.<name>` if it is one int for all layers, else None (some configs hold it per layer)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # transformers raises when the attribute differs across layers
        return None
    return value if isinstance(value, int) else None


def _module_int(module: object, *names: str) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _heads(attn: torch.nn.Module, config: object) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of one attention module as held on this process: read from
    its projections where it has separate ones (a tensor-parallel shard holds fewer rows), else from
    its attributes, else from the config."""
    configured = _config_int(config, "num_attention_heads") or 1
    head_dim = _module_int(attn, "head_dim") or _config_int(config, "head_dim") or config.hidden_size // configured
    groups = _module_int(attn, "num_key_value_groups")
    k_rows, q_rows = _local_rows(getattr(attn, "k_proj", None)), _local_rows(getattr(attn, "q_proj", None))
    n_kv = k_rows // head_dim if k_rows and k_rows % head_dim == 0 else None
    n_kv = n_kv or _module_int(attn, "num_key_value_heads", "num_kv_heads")
    if n_kv is None and groups is None:
        n_kv = _module_int(attn, "num_heads", "num_attention_heads")  # multi-head attention
    n_kv = n_kv or _config_int(config, "num_key_value_heads") or configured
    if groups is not None:
        return n_kv * groups, n_kv, head_dim
    n_q = q_rows // head_dim if q_rows and q_rows % head_dim == 0 else None
    return n_q or _module_int(attn, "num_heads", "num_attention_heads") or configured, n_kv, head_dim


def inspect_model(model: torch.nn.Module) -> ModelLayout:
    """Check that vasepatch can patch `model` and locate its attention modules and layer plans.

    Raises `UnsupportedModelError` (a `ValueError`) naming the model type and the reason;
    never modifies the model.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    refuse = _Refusal(model, model_type)
    _check_model(model, config, refuse)
    found = find_decoder(model)
    if found is None:
        raise refuse("no-decoder", "no list of decoder layers under model, language_model, transformer or decoder")
    base, layers = found
    text = getattr(base, "config", None) or config
    _check_config(text, refuse)
    plans = layer_plans(base, len(layers), refuse)
    attns = tuple(_check_layer(i, layer, refuse) for i, layer in enumerate(layers))
    for i, attn in enumerate(attns):
        _check_source(i, attn, base, refuse)
    n_q, n_kv, head_dim = _heads(attns[0], text)
    return ModelLayout(str(model_type), base, attns, n_q, n_kv, head_dim, plans)
