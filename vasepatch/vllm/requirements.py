"""What an engine must be for its requests to evict, checked before any request runs.

Eviction rewrites a request's blocks in place and gives some back, so nothing else may read or share
them by position. The prefix cache (blocks published under a hash of the tokens before them) may share
only a pinned prompt's blocks, so with it on only `prefill="pin"` evicts. Speculative decoding
(rollbacks and the drafter's own slots), KV connectors (positional blocks), pipeline parallelism, and
any cache layout but the ones the plugin reads (vLLM's x86 CPU backend, `vec`, `vec16` and `amx`: not
the GPU's, not ARM's `neon`, not fp8) are refused with an error naming the setting to change. So are models whose
layers are not all full attention (one block table for every layer; sliding-window layers free blocks
of their own), models with an ALiBi bias (vLLM's CPU kernel computes it from slot positions, which
compaction moves), more tensor-parallel ranks than KV heads (replicated KV heads would need their
scores summed across ranks), and `shared_heads` on more than one rank (its one set per layer would
combine only the rank's own heads, so the tokens would depend on the number of ranks).

`check_engine` runs when the engine's config is made (`LLM(...)`, the server's start); `check_request`
when a request arrives, so a bad setting, or one over the operator's caps (`settings.Limits`), is an
HTTP 400 naming its key.
"""

from __future__ import annotations

from typing import Any

import torch

from vasepatch.policies import query_stats, rope
from vasepatch.vllm import LOG, paged_layout, settings
from vasepatch.vllm import engine_access as access


def problems(vllm_config: Any) -> list[str]:
    """What in the engine's configuration rules out eviction (empty when nothing does)."""
    found = []
    if vllm_config.speculative_config is not None:
        found.append("speculative decoding is on: leave speculative_config unset")
    if vllm_config.kv_transfer_config is not None:
        found.append("a KV connector is set: leave kv_transfer_config unset")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        found.append("pipeline parallelism is on: use pipeline_parallel_size=1")
    found.extend(_layout_problems(vllm_config))
    model = vllm_config.model_config
    if model.get_sliding_window() is not None or _mixed_layers(model.hf_text_config):
        found.append("the model has sliding-window or other non-full-attention layers: only full attention works")
    if uses_alibi(model.hf_config):
        found.append(
            "the model adds an ALiBi bias, which vLLM's CPU kernel computes from slot positions: use a RoPE model"
        )
    heads = model.get_total_num_kv_heads()
    if parallel.tensor_parallel_size > heads:
        found.append(
            f"tensor_parallel_size={parallel.tensor_parallel_size} exceeds the model's {heads} KV heads: "
            "replicated KV heads are not supported"
        )
    return found


def _layout_problems(vllm_config: Any) -> list[str]:
    """The plugin reads and writes vLLM's x86 CPU cache layouts only: `vec`, `vec16`, `amx` (`paged_layout`)."""
    if vllm_config.device_config.device_type != "cpu":
        return ["the plugin supports vLLM's CPU backend only (its paged layout, its attention): serve on the CPU"]
    if vllm_config.cache_config.cache_dtype != "auto":
        return [f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r}: only the model's own dtype ('auto') works"]
    model, block = vllm_config.model_config, vllm_config.cache_config.block_size
    isa = access.attention_isa(vllm_config)
    if isa not in paged_layout.SUPPORTED_ISAS:
        layouts = ", ".join(paged_layout.SUPPORTED_ISAS)
        return [
            f"vLLM's CPU attention would use its {isa!r} cache layout (dtype {model.dtype}, block_size {block}), "
            f"and the plugin reads only its x86 layouts ({layouts}): serve on an x86 CPU"
        ]
    return []


ALIBI_ARCHITECTURES = {"Step1ForCausalLM", "BaichuanForCausalLM"}  # always ALiBi (Baichuan's 7B: BaiChuan...)


def uses_alibi(hf_config: Any) -> bool:
    """Whether a model's attention adds an ALiBi bias, read from its Hugging Face config as vLLM's models
    read it: BLOOM always; Falcon's `alibi`; Step1 always. Also MPT's `attn_config.alibi`, JAIS's
    `position_embedding_type` and Baichuan-13B, which vLLM 0.32 no longer serves but an engine may. The
    worker checks the attention layers themselves before its first eviction, for a model this misses."""
    if getattr(hf_config, "model_type", None) == "bloom" or getattr(hf_config, "alibi", False) is True:
        return True
    attn = getattr(hf_config, "attn_config", None)
    if (attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)) is True:
        return True
    if getattr(hf_config, "position_embedding_type", None) == "alibi":
        return True
    return bool(ALIBI_ARCHITECTURES & set(getattr(hf_config, "architectures", None) or []))


def config_problems(vllm_config: Any, config: Any) -> dict[str, str]:
    """What rules out one request's (or the engine's) VaSE settings on this engine, by the setting to change."""
    found = {}
    ranks = vllm_config.parallel_config.tensor_parallel_size
    if config.shared_heads and ranks > 1:
        found["shared_heads"] = (
            f"shared_heads=True with tensor_parallel_size={ranks}: a rank sees only its own KV heads, so one "
            "set per layer cannot combine them all; use shared_heads=False or one rank"
        )
    per_token, ring_bytes = ring_limit(vllm_config)
    if config.window * per_token > ring_bytes:
        found["window"] = (
            f"window={config.window} needs {config.window * per_token / 2**20:.1f} MiB of query rings per rank, over "
            f"this engine's limit of {ring_bytes / 2**20:.1f} MiB for all requests in flight "
            f"({settings.ENGINE_WHERE}['max_ring_mib'])"
        )
    if config.prefill == "compress" and access.prefix_caching(vllm_config):
        found["prefill"] = (
            "prefill='compress' with prefix caching on: compaction would rewrite the prompt's blocks, which the "
            "prefix cache publishes and shares; set prefill to 'pin' (the default with prefix caching on: it keeps "
            "the prompt and evicts what is generated), or turn prefix caching off (enable_prefix_caching=False; "
            "--no-enable-prefix-caching on the server)"
        )
    return found


def _mixed_layers(hf_config: Any) -> bool:
    types = getattr(hf_config, "layer_types", None) or []
    return any(t != "full_attention" for t in types)


def check_engine(vllm_config: Any) -> None:
    """The engine's own settings (`additional_config["vasepatch"]`) and, when it has some, the engine."""
    additional = vllm_config.additional_config
    try:
        config = engine_default(vllm_config)  # every value, as VaSEConfig checks it
    except settings.SettingsError as exc:
        raise settings.SettingsError(
            f"{exc.parameter}: {exc}{_defaults_named(str(exc), additional)}", exc.parameter
        ) from None
    limits(vllm_config)  # the operator's caps, checked whether or not the engine evicts by default
    settings.evictions_per_step(additional)
    check_stats(vllm_config)  # the statistics file, whether or not the engine's own policy reads it
    if config is None:  # no defaults, or policy "full": checked when a request asks for eviction
        return
    engine, by_setting = problems(vllm_config), config_problems(vllm_config, config)
    if engine or by_setting:  # named by the setting to change, where one setting is the whole problem
        where = settings.ENGINE_WHERE if engine else f"{settings.ENGINE_WHERE}[{next(iter(by_setting))!r}]"
        raise settings.SettingsError(
            f"{where}: additional_config['vasepatch'] asks for eviction, which this engine cannot do as set: "
            + "; ".join(engine + list(by_setting.values())),
            where,
        )


def check_stats(vllm_config: Any) -> None:
    """The engine's query statistics file (`settings.engine_stats`), when it names one, is for its model: a file
    `load_stats` reads, with the model's layers, query heads per KV head and frequency pairs, and its rotary (from
    the model's config, `rope.config_rotary`, which also refuses a RoPE the policies cannot invert).
    SettingsError naming the key. The query weights it was calibrated on cannot be checked here: the operator's
    file is taken as the model's."""
    path = settings.engine_stats(vllm_config.additional_config)
    if path is None:
        return
    model, where = vllm_config.model_config, settings.STATS_WHERE
    config = model.hf_text_config
    try:
        stats = query_stats.load_stats(path)
        inv_freq, scaling = rope.config_rotary(config)
        shape = (inv_freq.shape[0], config.num_attention_heads, model.get_total_num_kv_heads())
        query_stats.check_fits(stats, shape, inv_freq, scaling, f"{where}: {path!r}")
    except ValueError as exc:
        message = str(exc) if str(exc).startswith(where) else f"{where}: {exc}"
        raise settings.SettingsError(message, where) from None


def engine_default(vllm_config: Any) -> Any:
    """The `VaSEConfig` a request of this engine evicts with when it sets nothing itself; None when the engine
    does not evict by default (no settings, or policy "full")."""
    return settings.resolve(vllm_config.additional_config, None, None, access.prefix_caching(vllm_config))


def limits(vllm_config: Any) -> settings.Limits:
    """The engine's caps on what a request may ask for (`settings.engine_limits`)."""
    return settings.engine_limits(vllm_config.additional_config, vllm_config.model_config.max_model_len)


def _defaults_named(message: str, additional: Any) -> str:
    """Which values a message names that the engine did not set (so they are VaSEConfig's defaults)."""
    defaults = settings.defaults_named(message, settings.engine_settings(additional), settings.ENGINE_FIELDS)
    if not defaults:
        return ""
    names = ", ".join(defaults)
    return f" ({names}: the default, not set in additional_config['vasepatch']; set it there to change it)"


def check_request(vllm_config: Any, params: Any) -> None:
    """A request's settings against the operator's caps, and the engine when the request is the one asking
    for eviction."""
    caching = access.prefix_caching(vllm_config)
    config = settings.resolve(vllm_config.additional_config, params.extra_args, params.seed, caching)
    own = settings.request_settings(params.extra_args)
    limits(vllm_config).check(config, own)
    if config is None:
        return
    by_setting = config_problems(vllm_config, config)
    found = list(by_setting.values())
    if engine_default(vllm_config) is None:  # else the engine was checked when it started
        found = problems(vllm_config) + found
    if found:
        named = [f for f in by_setting if f in own]
        raise settings.SettingsError(
            "this request asks for eviction, which this engine cannot do as set: " + "; ".join(found),
            settings.REQUEST_PREFIX + (named[0] if named else "budget"),
        )


def query_bytes(vllm_config: Any) -> int:
    """Bytes of one recorded query, every layer of one rank: a query ring's row holds `window` of them."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    heads = model.get_num_attention_heads(parallel)
    element = torch.tensor([], dtype=model.dtype).element_size()
    return model.get_num_layers(parallel) * heads * model.get_head_size() * element


def ring_limit(vllm_config: Any) -> tuple[int, int]:
    """`(bytes per window token, limit in bytes)` of the query rings of one rank: `max_ring_mib` where the operator
    set it, else what `max_num_seqs` requests at the window cap need (so by default it only states the bound)."""
    per_token, caps = query_bytes(vllm_config), limits(vllm_config)
    if caps.ring_mib is not None:
        return per_token, int(caps.ring_mib * 2**20)
    return per_token, vllm_config.scheduler_config.max_num_seqs * caps.window * per_token


def active_line(vllm_config: Any) -> str:
    """The one log line that says the plugin is active, with the engine's settings, caps and ring sizes, and
    what rules out eviction on this engine, if anything does."""
    import vllm

    own = settings.engine_settings(vllm_config.additional_config)
    caps = limits(vllm_config)
    per_token, seqs = query_bytes(vllm_config), vllm_config.scheduler_config.max_num_seqs
    if engine_default(vllm_config) is None and not caps.requests_allowed:
        return (
            f"vasepatch VaSE plugin active on vLLM {vllm.__version__}, but this engine never evicts: no engine "
            f"budget and no per-request settings; set {settings.ENGINE_WHERE}['budget'], or 'request_settings' true"
        )
    evicts = f"engine settings {own}" if own else "no engine settings (requests opt in with vasepatch_* keys)"
    caching = access.prefix_caching(vllm_config)
    prefill = settings.default_prefill(caching)
    evicts += f"; prefill {prefill!r} unless set (prefix caching {'on' if caching else 'off'})"
    per_step = settings.evictions_per_step(vllm_config.additional_config)
    evicts += "; every request evicts when due" if per_step is None else f"; evictions spread, {per_step} per step"
    chunk, capped = access.largest_chunk(vllm_config), vllm_config.scheduler_config.long_prefill_token_threshold > 0
    evicts += f"; prompts and recomputes compressed in chunks of up to {chunk} tokens" + (
        "" if capped else " (set long_prefill_token_threshold to lower it)"
    )
    asks = f"requests capped at budget {caps.budget}, window {caps.window}"
    if not caps.requests_allowed:
        asks = "no per-request settings"
    found = problems(vllm_config)
    refused = f"; requests asking for eviction are refused here: {'; '.join(found)}" if found else ""
    _, ring_bytes = ring_limit(vllm_config)
    whose = "max_ring_mib" if caps.ring_mib is not None else f"max_num_seqs={seqs} such requests"
    return (
        f"vasepatch VaSE plugin active on vLLM {vllm.__version__}: {evicts}; {asks}; query rings "
        f"{per_token / 2**10:.1f} KiB per window token of an evicting request, at most "
        f"{caps.window * per_token / 2**20:.1f} MiB per request at the window cap and "
        f"{ring_bytes / 2**30:.2f} GiB for the requests in flight ({whose}), per rank{refused}"
    )


def log_active(vllm_config: Any) -> None:
    """Log `active_line`; a line that cannot be made never stops an engine."""
    try:
        LOG.info("%s", active_line(vllm_config))
    except Exception as exc:  # a log line only
        LOG.warning("vasepatch VaSE plugin active; its settings line failed: %r", exc)
