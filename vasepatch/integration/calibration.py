"""Calibration for the `triattention` policy: the statistics of each (layer, query head)'s pre-RoPE queries.

`calibrate(model, input_ids)` runs the model over a calibration text and writes the file that
`vasepatch.policies.query_stats.load_stats` reads (format, tensors and shapes: that module's docstring), by
default to `stats_path(model)`: `cache_dir()/triattention/<model_key>.safetensors`.

- The pre-RoPE query is captured with forward hooks: the output of the attention's `q_norm` where it has one
  (Qwen3, Gemma 3, OLMo 2: the query as RoPE receives it), else of `q_proj` (else the query rows of a fused
  `qkv_proj`, Phi-3). No rotary is inverted, so no rounding of cos/sin enters the statistics.
- Frequency pairs are half-split, as transformers' `rotate_half` pairs them: pair `f` of a head is
  `q[f] + i q[f + F]`, `F = D / 2`.
- The text is read in independent windows of `chunk` tokens (default `DEFAULT_CHUNK`, at most the model's
  `max_position_embeddings`), each a fresh forward pass without a cache, every window starting at position 0.
  A query's pre-RoPE value depends on its position only through the context it has seen, so a window's
  first tokens see less context than they would in one long pass.
- `rotary_of` refuses, with a ValueError naming the policy, any model whose RoPE the policy cannot invert:
  no rotary (ALiBi, absolute positions), partial rotary, interleaved pairs (GPT-J's `rotate_every_two`,
  Cohere), rope types other than `rope.ROPE_TYPES` (dynamic NTK, longrope, mrope), and layers without RoPE.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vasepatch.integration.families import attention_module, find_decoder, text_config
from vasepatch.policies import rope
from vasepatch.policies.rope import POLICY
from vasepatch.policies.rope import refusal as _refusal

DEFAULT_CHUNK = 4096
"""Tokens per independent calibration window."""
VOLATILE_CONFIG = frozenset(
    {"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache", "return_dict",
     "output_attentions", "output_hidden_states", "tie_encoder_decoder", "chunk_size_feed_forward"}
)  # fmt: skip
"""Config fields left out of `model_key` (with every field whose name starts with `_`, such as
`_attn_implementation`): where the model was read from, the transformers that wrote it, the head classes
(`architectures`, which `save_pretrained` fills in), the dtype it was loaded in, and run-time switches. None of
them changes the queries of a given set of weights."""


def check_rope(config: Any) -> None:
    """`rope.check_rope` on the model's text config (a multimodal model's `text_config`): ValueError naming why the
    policy cannot invert the config's RoPE, from the config alone, before any weight loads."""
    rope.check_rope(text_config(config))


def _check_half_split(attn: torch.nn.Module, config: Any) -> None:
    """ValueError unless the attention's modeling module pairs dimensions half-split (`rotate_half`)."""
    rotate_half = getattr(sys.modules.get(type(attn).__module__), "rotate_half", None)
    if not callable(rotate_half):
        raise _refusal(config, f"{type(attn).__name__}'s module has no rotate_half: its RoPE pairing is unknown")
    x = torch.arange(1.0, 9.0)
    if not torch.equal(rotate_half(x), torch.cat((-x[4:], x[:4]))):
        raise _refusal(config, "its RoPE is interleaved (pairs x[2i], x[2i+1]), not half-split")


def _rotary(stack: torch.nn.Module, config: Any) -> torch.nn.Module:
    rotary = getattr(stack, "rotary_emb", None)
    if not isinstance(rotary, torch.nn.Module):
        raise _refusal(config, f"{type(stack).__name__} has no rotary_emb module to read its frequencies from")
    return rotary


def _decoder(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList, Any]:
    config = text_config(model.config)
    found = find_decoder(model)
    if found is None:
        raise _refusal(config, f"no decoder layers found in {type(model).__name__}")
    return found[0], found[1], config


def rotary_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's rotary keeps its inverse frequencies in: float32, unless the model was cast whole
    (`model.to(torch.bfloat16)` rounds them, and RoPE then rotates by the rounded frequencies)."""
    stack, _, config = _decoder(model)
    buffers = [b for name, b in _rotary(stack, config).named_buffers() if name.endswith("inv_freq")]
    return buffers[0].dtype if buffers else torch.float32


def rotary_of(model: torch.nn.Module) -> tuple[Tensor, Tensor]:
    """Each decoder layer's rotary inverse frequencies `[L, F]` float32 (after the rotary's scaling: linear,
    llama3, YaRN) and attention scaling `[L]` float32, read from the model's rotary embedding module (Gemma 3:
    the local or global one by layer type). ValueError naming `triattention` and why for a RoPE it cannot
    invert (see the module's docstring)."""
    stack, layers, config = _decoder(model)
    check_rope(config)
    rotary = _rotary(stack, config)
    params = getattr(config, "rope_parameters", {}) or {}
    per_type = all(isinstance(v, dict) for v in params.values())
    freqs, scales = [], []
    for i, layer in enumerate(layers):
        prefix = f"{config.layer_types[i]}_" if per_type else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        if not isinstance(inv_freq, Tensor):
            raise _refusal(config, f"its rotary module has no {prefix}inv_freq for layer {i}")
        attn = attention_module(layer)
        head_dim = _head_dim(attn, config)
        if 2 * inv_freq.numel() != head_dim:
            raise _refusal(config, f"its rotary covers {2 * inv_freq.numel()} of the {head_dim} dims of a head")
        _check_half_split(attn, config)
        freqs.append(inv_freq.detach().float().cpu())
        scales.append(float(getattr(rotary, f"{prefix}attention_scaling", 1.0) or 1.0))
    return torch.stack(freqs), torch.tensor(scales, dtype=torch.float32)


def _head_dim(attn: torch.nn.Module | None, config: Any) -> int:
    value = getattr(attn, "head_dim", None)
    if isinstance(value, int) and value > 0:
        return value
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def query_sites(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Per layer, the module whose output is the pre-RoPE query and how many of its output features are the
    query (`Hq * D`): `q_norm` where the attention has one, else `q_proj`, else a fused `qkv_proj`."""
    _, layers, config = _decoder(model)
    sites = []
    for i, layer in enumerate(layers):
        attn = attention_module(layer)
        width = config.num_attention_heads * _head_dim(attn, config)
        found = _query_module(attn)
        if found is None:
            raise _refusal(config, f"layer {i}'s attention has no q_norm, q_proj or qkv_proj to read queries from")
        sites.append((found[1], width))
    return sites


def _query_module(attn: torch.nn.Module | None) -> tuple[str, torch.nn.Module] | None:
    """`(name, module)`: the attention's `q_norm` (not an Identity), else `q_proj`, else `qkv_proj`; or None."""
    for name in ("q_norm", "q_proj", "qkv_proj"):
        module = getattr(attn, name, None)
        if isinstance(module, torch.nn.Module) and not isinstance(module, torch.nn.Identity):
            return name, module
    return None


def model_key(model: torch.nn.Module) -> str:
    """32 hex digits (blake2b, 16 bytes) identifying the model's queries: its config (as JSON with sorted keys,
    less `VOLATILE_CONFIG` and every `_`-prefixed field) and, layer by layer, the name, shape and bytes of every
    parameter of its query modules (`q_proj`, its bias, `q_norm`; `qkv_proj`) rounded to bfloat16. The same
    checkpoint gives the same key in any process and loaded in float32 or bfloat16 (a model calibrated in float32
    and served in bfloat16 finds its statistics; float16 flushes small weights, so it may not); weights that
    differ only below bfloat16's precision, or only outside the query modules, share a key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(_stable(model.config.to_dict()), sort_keys=True, default=str).encode())
    _, layers, _ = _decoder(model)
    for i, layer in enumerate(layers):
        attn = attention_module(layer)
        for name in ("q_proj", "q_norm", "qkv_proj"):
            module = getattr(attn, name, None)
            if not isinstance(module, torch.nn.Module):
                continue
            for pname, param in sorted(module.named_parameters()):
                h.update(f"{i}.{name}.{pname}:{tuple(param.shape)};".encode())
                rounded = param.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
                h.update(rounded.numpy().tobytes())
    return h.hexdigest()


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE_CONFIG and not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    return value


def stats_path(model: torch.nn.Module) -> Path:
    """Where `model`'s statistics are cached: `cache_dir()/triattention/<model_key>.safetensors`."""
    return _path_for(model_key(model))


def _path_for(key: str) -> Path:
    from vasepatch.config import cache_dir

    return cache_dir() / POLICY / f"{key}.safetensors"


def check_input_ids(input_ids: Any, vocab_size: int | None, chunk: Any = DEFAULT_CHUNK) -> None:
    """ValueError naming the parameter unless `input_ids` is an integer tensor `[1, T]`, `T >= 1`, of ids in
    `[0, vocab_size)`, and `chunk` an int >= 1."""
    if not isinstance(input_ids, Tensor) or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer torch.Tensor [1, T], got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape [1, T] with T >= 1, got {list(input_ids.shape)}")
    if vocab_size and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(f"input_ids must lie in [0, {vocab_size}) (the model's vocabulary)")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1 (tokens per window), got {chunk!r}")


class _Sums:
    """Running sums over tokens, per (layer, query head, pair), of the pre-RoPE query's half-split pairs
    (`pair` `[L, Hq, F, 2]` float64: real, imaginary) and of their magnitudes (`magnitude` `[L, Hq, F]`
    float64), with the tokens each layer has seen (`tokens` `[L]`)."""

    def __init__(self, layers: int, heads: int, head_dim: int) -> None:
        self.heads, self.head_dim, self.pairs = heads, head_dim, head_dim // 2
        self.pair = torch.zeros(layers, heads, self.pairs, 2, dtype=torch.float64)
        self.magnitude = torch.zeros(layers, heads, self.pairs, dtype=torch.float64)
        self.tokens = [0] * layers

    def hook(self, layer: int):
        """A forward hook adding a query module's output (`[B, T, Hq * D (+ more)]` or `[B, T, Hq, D]`)."""
        width = self.heads * self.head_dim

        def record(module: torch.nn.Module, args: Any, output: Tensor) -> None:
            count = output.shape[0] * output.shape[1]
            q = output.reshape(count, -1)[:, :width].float().reshape(count, self.heads, self.head_dim)
            re, im = q[..., : self.pairs], q[..., self.pairs :]  # [N, Hq, F] each
            self.pair[layer, ..., 0] += re.sum(0).double().cpu()
            self.pair[layer, ..., 1] += im.sum(0).double().cpu()
            self.magnitude[layer] += torch.sqrt(re * re + im * im).sum(0).double().cpu()
            self.tokens[layer] += count

        return record

    def means(self, expected: int) -> dict[str, Tensor]:
        """`q_mean` `[L, Hq, F, 2]` and `q_abs` `[L, Hq, F]` float32, once every layer has seen `expected` tokens."""
        if any(n != expected for n in self.tokens):
            raise RuntimeError(f"query hooks saw {self.tokens} tokens per layer, expected {expected} each")
        return {"q_mean": (self.pair / expected).float(), "q_abs": (self.magnitude / expected).float()}


def _chunk_for(config: Any, chunk: int) -> int:
    limit = getattr(config, "max_position_embeddings", None)
    return min(chunk, limit) if isinstance(limit, int) and limit > 0 else chunk


def collect(
    model: torch.nn.Module,
    input_ids: Tensor,
    chunk: int = DEFAULT_CHUNK,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Tensor]:
    """The calibration tensors of `model` over `input_ids` `[1, T]`: `q_mean` `[L, Hq, F, 2]` (mean over tokens
    of each pre-RoPE query pair, real and imaginary), `q_abs` `[L, Hq, F]` (mean of the pair's magnitude),
    `inv_freq` `[L, F]` and `scaling` `[L]` (`rotary_of`), all float32 on the CPU. The ids are read in
    independent windows of `chunk` tokens (at most `max_position_embeddings`), each its own forward pass
    without a cache; `progress(done, total)` is called with the tokens read after each. The hooks are removed
    afterwards, also on error."""
    config = text_config(model.config)
    check_input_ids(input_ids, getattr(config, "vocab_size", None), chunk)
    inv_freq, scaling = rotary_of(model)  # refuses an unsupported RoPE before any forward pass
    stack, layers, _ = _decoder(model)
    sites = query_sites(model)
    sums = _Sums(len(layers), config.num_attention_heads, 2 * inv_freq.shape[1])
    window = _chunk_for(config, chunk)
    device = next(model.parameters()).device
    handles = [module.register_forward_hook(sums.hook(i)) for i, (module, _) in enumerate(sites)]
    try:
        with torch.no_grad():
            for start in range(0, input_ids.shape[1], window):
                ids = input_ids[:, start : start + window].to(device)
                stack(input_ids=ids, use_cache=False)
                if progress is not None:
                    progress(start + ids.shape[1], input_ids.shape[1])
    finally:
        for handle in handles:
            handle.remove()
    return {**sums.means(input_ids.shape[1]), "inv_freq": inv_freq, "scaling": scaling}


RESERVED_METADATA = ("format", "kv_heads", "model_key")


def calibrate(
    model: torch.nn.Module,
    input_ids: Tensor,
    *,
    path: str | Path | None = None,
    metadata: dict[str, Any] | None = None,
    chunk: int = DEFAULT_CHUNK,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """`collect` the statistics of `model` over `input_ids` `[1, T]` and write them (`save_stats`) to `path`,
    default `stats_path(model)`; then read the file back (`load_stats`) and check it holds what was computed.
    The metadata records the model, its key, the tokens, the window, whether `q_norm` was applied, the
    versions, and `text_source`/`text_sha256` (default: the ids themselves); `metadata` adds to it or
    replaces those entries (not `format`, `kv_heads`, `model_key`); `progress`: as `collect`'s. Returns the path
    written."""
    from vasepatch.policies.query_stats import TENSORS, QueryStats, load_stats, save_stats

    bad = [k for k in metadata or {} if k in RESERVED_METADATA]
    if bad:
        raise ValueError(f"metadata must not set {', '.join(bad)} (calibrate writes {', '.join(RESERVED_METADATA)})")
    tensors = collect(model, input_ids, chunk, progress)
    key = model_key(model)
    config = text_config(model.config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    meta = {**_metadata(model, input_ids, key, _chunk_for(config, chunk)), **(metadata or {})}
    target = save_stats(Path(path) if path is not None else _path_for(key), tensors, kv_heads, meta)
    expected = QueryStats.from_layers(*(tensors[k] for k in TENSORS), kv_heads=kv_heads)
    loaded = load_stats(target)
    for name in ("q_mean", "q_abs", "inv_freq", "scaling"):
        if not torch.equal(getattr(loaded, name), getattr(expected, name)):
            raise RuntimeError(f"{target}: {name} read back differs from what was written")
    return target


def _metadata(model: torch.nn.Module, input_ids: Tensor, key: str, chunk: int) -> dict[str, str]:
    from importlib.metadata import version  # vasepatch's own, without importing the package from inside it

    import transformers

    ids = input_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    q_norm = any((_query_module(attention_module(layer)) or ("",))[0] == "q_norm" for layer in _decoder(model)[1])
    return {
        "model": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
        "model_key": key,
        "tokens": str(input_ids.shape[1]),
        "chunk": str(chunk),
        "text_source": "input_ids",
        "text_sha256": hashlib.sha256(ids).hexdigest(),
        "input_ids_sha256": hashlib.sha256(ids).hexdigest(),
        "q_norm_applied": "true" if q_norm else "false",
        "rope_style": "half",
        "transformers_version": transformers.__version__,
        "vasepatch_version": version("vasepatch"),
    }
