"""GPU check of the attention backends, written for one short run on a CUDA machine.

    python benchmarks/gpu_check.py OUT_DIR               # CUDA: bf16, Qwen3-4B/14B attention shapes (~4.5 min)
    python benchmarks/gpu_check.py OUT_DIR --long        # CUDA: the long throughput tables too (~9 min)
    python benchmarks/gpu_check.py OUT_DIR --allow-cpu   # no CUDA: fp32, tiny shapes, reference kernels

Run it from a checkout: `--allow-cpu` runs the varlen paths through the CPU
stand-ins in `tests/reference_kernels.py`.

Part 1: every available backend (the varlen ones of
`vasepatch.kernels.backends`; `sdpa` and `eager` as the cache runs them,
`kernels.grouped_attention` over a slot mask) against `sdpa` in the same dtype
(and against an fp32 `sdpa` for scale), for decode over a static cache with
ragged per-(row, KV head) starts and for prefill of a ragged left-padded prompt
batch; plus the median time of each backend's decode (and prefill) call, with
CUDA events. Part 2: a compile check (generate's own compile route: one graph,
no graph break, no skipped CUDA graph, tokens agreeing with a truly eager run,
`disable_compile=True`), a `device_map` check (layers offloaded by accelerate,
patched, against the whole model) and the throughput of `vasepatch bench`
(`--part2 default|quick|skip`, or `--long`). `OUT_DIR/gpu_check.json` and
`OUT_DIR/gpu_check.md` are written after part 1 and after every check and
table of part 2, so a stopped run keeps what it measured; exits 1 if a check
fails, 2 without CUDA (and without `--allow-cpu`).

Time estimate (printed before each part; not a measurement). An H200 is taken
to reach 40% of its 989 TFLOP/s dense bf16 and 60% of its 4.8 TB/s. Per
throughput method: the chunked prefill to the longest length, FLOP-bound
(2 x parameters per token plus the attention, causal for dense, over
`budget + window` keys for the fixed-size caches), then `64 x (1 + 2 x lengths)`
decode steps, bandwidth-bound (the bf16 weights plus the KV read of batch 16);
90 s per `+compile`; 5 s per 1e9 parameters to build a model; fixed 30 s for
part 1, 150 s for the compile check (compiling a 4-layer model with CUDA
graphs), 30 s for the device_map check. Default: Qwen3-4B shapes at 4K and
16K (dense, vase, vase-dkv) ~50 s, whole run ~4.4 min (under the 6 min
aimed at). `--long`: Qwen3-4B at 2K-16K with 5 methods ~170 s, Qwen3-14B at
4K and 16K ~160 s, whole run ~9 min. Fixed costs dominate; they are guesses.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from vasepatch.cache import footprint
from vasepatch.kernels import backends as bk
from vasepatch.kernels.backends import torch_varlen
from vasepatch.kernels.grouped import causal_padding_mask, grouped_attention


@dataclass(frozen=True)
class Shape:
    """Attention geometry of one model: query heads, KV heads, head dim."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    shapes: list[Shape]
    batch: int
    capacity: int  # cache slots per row and KV head
    used: int  # slots in use (`end`)
    prompt: int  # padded prompt length
    iters: int
    tol: float
    reference_kernels: bool  # CPU: run the varlen paths through `reference_kernels`
    variants: dict[str, dict[str, Callable[..., torch.Tensor]]] = field(default_factory=dict)


GPU_SHAPES = [Shape("qwen3-4b", 32, 8, 128), Shape("qwen3-14b", 40, 8, 128)]
CPU_SHAPES = [Shape("tiny-gqa", 8, 2, 16), Shape("tiny-mha", 4, 4, 32)]


def make_setup(device: torch.device, iters: int | None) -> Setup:
    if device.type == "cuda":
        return Setup(device, torch.bfloat16, GPU_SHAPES, 16, 4160, 4096, 1024, iters or 100, 2e-2, False)
    return Setup(device, torch.float32, CPU_SHAPES, 3, 40, 33, 12, iters or 3, 1e-4, True)


def masked_decode(backend: str, query, keys, values, start, end: int, scale: float | None = None) -> torch.Tensor:
    """The `sdpa`/`eager` backends' decode step: `grouped_attention` over the slots `[start, end)` of each row
    and KV head (the mask the cache builds), reading only the first `end` slots."""
    slots = torch.arange(end, device=keys.device)
    mask = ((slots >= start[..., None]) & (slots < end)).unsqueeze(2)  # [B, Hkv, 1, end]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return grouped_attention(query, keys[:, :, :end], values[:, :, :end], mask, scale, backend)


def masked_prefill(backend: str, query, key, value, padding, scale: float | None = None) -> torch.Tensor:
    """The `sdpa`/`eager` backends' prefill: causal + padding mask, zeros at the padding (as the varlen ones)."""
    mask = causal_padding_mask(padding, query.shape[2], query.shape[2], query.device)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = grouped_attention(query, key, value, mask, scale, backend)
    return out if padding is None else out.masked_fill(~padding.bool()[:, :, None, None], 0.0)


def _decode_and_prefill(name: str, setup: Setup) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """`(decode, prefill)` of backend `name`, through the CPU stand-ins when `setup.reference_kernels`."""
    if name not in bk.VARLEN_BACKENDS:
        return functools.partial(masked_decode, name), functools.partial(masked_prefill, name)
    decode, prefill = bk.VARLEN[name].decode, bk.VARLEN[name].prefill
    if setup.reference_kernels:
        from tests import reference_kernels as ref  # the repository root is on sys.path (above)

        if name == "torch_varlen":
            decode = functools.partial(decode, kernel=ref.varlen_attn)
            prefill = functools.partial(prefill, kernel=ref.varlen_attn)
        else:
            decode = functools.partial(decode, kernel=ref.flash_attn_with_kvcache)
            prefill = functools.partial(prefill, kernel=ref.flash_attn_varlen_func)
    return decode, prefill


def variants(setup: Setup) -> tuple[dict[str, dict[str, Callable[..., torch.Tensor]]], dict[str, str]]:
    """`{label: {"backend", "decode", "prefill"}}` for every backend that can run, and why the others cannot."""
    names = list(bk.BACKENDS) if setup.reference_kernels else bk.available_backends(setup.device, setup.dtype)
    skipped = {n: bk.unavailable_reason(n, setup.device, setup.dtype) or "" for n in bk.BACKENDS if n not in names}
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        decode, prefill = _decode_and_prefill(name, setup)
        out[name] = {"backend": name, "decode": decode, "prefill": prefill}
        if name == "torch_varlen":  # both decode layouts: seqused_k (if this torch has it) and gap sequences
            kernel = decode.keywords["kernel"] if setup.reference_kernels else torch_varlen.default_kernel()
            if bk.varlen_spec(kernel).seqused_k:
                out[name]["decode"] = functools.partial(decode, use_seqused=True)
                out["torch_varlen[gaps]"] = {
                    "backend": name,
                    "decode": functools.partial(decode, use_seqused=False),
                    "prefill": None,
                }
    return out, skipped


def decode_inputs(shape: Shape, setup: Setup, gen: torch.Generator):
    b, dev, dt = setup.batch, setup.device, setup.dtype
    query = torch.randn(b, shape.heads, 1, shape.head_dim, generator=gen, device=dev, dtype=dt)
    keys, values = (
        torch.randn(b, shape.kv_heads, setup.capacity, shape.head_dim, generator=gen, device=dev, dtype=dt)
        for _ in range(2)
    )
    start = torch.randint(0, setup.used // 2, (b, shape.kv_heads), generator=gen, device=dev)  # ragged
    start[0, 0] = 0
    start[-1, -1] = setup.used - 1  # a single valid slot
    return query, keys, values, start, setup.used


def prefill_inputs(shape: Shape, setup: Setup, gen: torch.Generator):
    b, q, dev, dt = setup.batch, setup.prompt, setup.device, setup.dtype
    lengths = torch.randint(1, q + 1, (b,), generator=gen, device=dev)
    lengths[0] = q
    padding = torch.arange(q, device=dev)[None, :] >= (q - lengths)[:, None]  # left padding
    query = torch.randn(b, shape.heads, q, shape.head_dim, generator=gen, device=dev, dtype=dt)
    key, value = (torch.randn(b, shape.kv_heads, q, shape.head_dim, generator=gen, device=dev, dtype=dt) for _ in "kv")
    return query, key, value, padding


def median_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median wall time of `fn()` in ms: CUDA events around each call on GPU, perf_counter on CPU."""
    for _ in range(3 if device.type == "cuda" else 1):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def part1(setup: Setup) -> list[dict[str, Any]]:
    """Correctness against sdpa and timing of every backend, per shape and phase."""
    rows: list[dict[str, Any]] = []
    for shape in setup.shapes:
        gen = torch.Generator(device=setup.device).manual_seed(0)
        inputs = {"decode": decode_inputs(shape, setup, gen), "prefill": prefill_inputs(shape, setup, gen)}
        for phase, args in inputs.items():
            reference = functools.partial(masked_decode if phase == "decode" else masked_prefill, "sdpa")
            expected = reference(*args)
            fp32 = reference(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
            real = args[-1] if phase == "prefill" else None
            for label, v in setup.variants.items():
                fn = v[phase]
                if fn is None:
                    continue
                row = {"shape": shape.name, "phase": phase, "backend": v["backend"], "variant": label}
                try:
                    with torch.no_grad():
                        out = fn(*args)
                        row["max_abs_diff"] = _diff(out, expected)
                        row["max_abs_diff_fp32"] = _diff(out, fp32)
                        row["padding_zero"] = bool(real is None or not out[~real].any())
                        row["ms"] = median_ms(functools.partial(fn, *args), setup.device, setup.iters)
                    row["ok"] = row["max_abs_diff"] <= setup.tol and row["padding_zero"]
                except Exception as err:  # report and go on: one broken backend must not hide the others
                    row.update(ok=False, error=f"{type(err).__name__}: {err}")
                rows.append(row)
                print(_line(row), flush=True)
    return rows


# Token agreement the compiled run must reach against the eager one: exact in fp32 on CPU (aot_eager runs the
# same kernels); in bf16 on CUDA inductor fuses and reorders reductions, so a near-tie between two random-weight
# logits may flip and the rows diverge from there; 0.9 still catches a wrong cache or mask (agreement near 0).
MIN_AGREEMENT = {"cpu": 1.0, "cuda": 0.9}


def compile_ok(row: dict[str, Any]) -> bool:
    """The compile check passes: one graph, no graph breaks, no skipped CUDA graphs, >= 4 evictions, and the
    compiled tokens agree with the eager ones."""
    return (
        row["graphs"] == 1
        and row["graph_breaks"] == 0
        and row["cudagraph_skips"] == 0
        and row["evictions"] >= 4
        and row["token_agreement"] >= row["min_token_agreement"]
    )


def timed_generate(model: Any, kw: dict[str, Any], cuda: bool, compile_config: Any = None, **extra: Any):
    """`(model.generate(**kw, **extra), seconds)`. Without `compile_config` the run is eager: on CUDA
    transformers compiles `generate`'s decode forward by itself for any compileable cache that is not a
    DynamicCache (`_valid_auto_compile_criteria`), unless `disable_compile=True`, so it is passed."""
    if compile_config is None:
        extra["disable_compile"] = True
    else:
        extra["compile_config"] = compile_config
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**kw, **extra)
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _compile_model(setup: Setup) -> torch.nn.Module:
    """Qwen3-4B's layer shape with 4 layers on CUDA (compiles in about a minute); tiny-qwen3 on CPU."""
    from transformers import AutoModelForCausalLM

    from vasepatch.bench.shapes import shape_config

    config = shape_config("qwen3-4b" if setup.device.type == "cuda" else "tiny-qwen3")
    if setup.device.type == "cuda":
        config.num_hidden_layers = 4
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=setup.dtype)
    return model.eval()


def compile_check(setup: Setup) -> dict[str, Any]:
    """generate's own compile route (`mode="reduce-overhead"`: CUDA graphs) on a patched model
    through >= 4 eviction rounds: graphs, graph breaks, CUDA-graph skips, tokens against
    eager, and the decode time of both."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    import vasepatch

    cuda = setup.device.type == "cuda"
    model = _compile_model(setup)
    budget, window, new = (256, 32, 512) if cuda else (16, 4, 40)
    lengths = (300, 220, 150, 100) if cuda else (12, 7, 3)
    width = max(lengths)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    kw = dict(
        input_ids=ids.to(setup.device),
        attention_mask=mask.to(setup.device),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    config = CompileConfig(fullgraph=True, mode="reduce-overhead") if cuda else CompileConfig(fullgraph=True)
    if not cuda:
        config.backend, config.mode = "aot_eager", None
    config._compile_all_devices = True  # on CPU generate compiles only when asked to

    row: dict[str, Any] = {"budget": budget, "window": window, "new_tokens": new, "prompt_lengths": list(lengths)}
    with vasepatch.patched(model, budget=budget, window=window, seed=0) as handle:
        row["attn_backend"] = handle.attn_backend
        eager, row["eager_s"] = timed_generate(model, kw, cuda)  # disable_compile=True: really eager
        row["evictions"] = handle.stats()["evictions"]
        torch._dynamo.reset()
        counters.clear()
        _, row["first_compiled_s"] = timed_generate(model, kw, cuda, config)  # compiles (and records CUDA graphs)
        compiled, row["compiled_s"] = timed_generate(model, kw, cuda, config)
        row["graphs"] = int(counters["stats"]["unique_graphs"])
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
        row["compiled_evictions"] = handle.stats()["evictions"]
    generated = slice(width, None)
    row["token_agreement"] = (eager[:, generated] == compiled[:, generated]).float().mean().item()
    row["first_divergence"] = int((eager[:, generated] != compiled[:, generated]).any(0).long().argmax().item())
    row["min_token_agreement"] = MIN_AGREEMENT[setup.device.type]
    row["speedup"] = row["eager_s"] / row["compiled_s"]
    row["ok"] = compile_ok(row)
    print(f"compile check: {row}", flush=True)
    return row


def _dispatch_plan(cuda: bool) -> tuple[str, int, dict[str, Any]]:
    """(shape, layers, device_map) of the device_map check: on CUDA Qwen3-4B's layer shape with 4
    layers, the last 2 offloaded to CPU (accelerate moves their weights in per call); on CPU
    tiny-qwen3 with its last layer offloaded to disk."""
    layers = 4 if cuda else 2
    main, offload = (0, "cpu") if cuda else ("cpu", "disk")
    parts = ["model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"]
    device_map = {part: main for part in parts}
    device_map.update({f"model.layers.{i}": main if i < layers // 2 else offload for i in range(layers)})
    return ("qwen3-4b" if cuda else "tiny-qwen3"), layers, device_map


_LOGITS = {"output_logits": True, "return_dict_in_generate": True}


def device_map_check(setup: Setup) -> dict[str, Any]:
    """A model loaded with a `device_map` that offloads layers (accelerate's hooks), patched:
    greedy tokens and logits against the same weights loaded whole on the device, both patched,
    over >= 4 eviction rounds; where each layer's KV buffers live (its execution device). Both runs are
    eager (`disable_compile=True`): the whole model would otherwise be compiled on CUDA and the
    offloaded one not."""
    import tempfile

    from transformers import AutoModelForCausalLM

    import vasepatch
    from vasepatch.bench.shapes import shape_config
    from vasepatch.integration.distributed import execution_devices

    cuda = setup.device.type == "cuda"
    shape, layers, device_map = _dispatch_plan(cuda)
    config = shape_config(shape)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):  # derived from the shape's layer count; must match on load
        config.layer_types = config.layer_types[:layers]
    budget, window, new = (256, 32, 256) if cuda else (16, 4, 40)
    lengths = (300, 220, 150, 100) if cuda else (12, 7, 3)
    width = max(lengths)
    ids = torch.randint(1, config.vocab_size, (len(lengths), width), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    kw = dict(input_ids=ids.to(setup.device), attention_mask=mask.to(setup.device), max_new_tokens=new)
    kw.update(min_new_tokens=new, do_sample=False, pad_token_id=0)
    row: dict[str, Any] = {"shape": shape, "layers": layers, "device_map": {k: str(v) for k, v in device_map.items()}}
    row.update(budget=budget, window=window, new_tokens=new)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=setup.dtype).save_pretrained(folder)
        load = functools.partial(AutoModelForCausalLM.from_pretrained, folder, dtype=setup.dtype)
        whole = load(device_map={"": setup.device.index or 0} if cuda else None).eval()
        with vasepatch.patched(whole, budget=budget, window=window, seed=0):
            want, row["whole_s"] = timed_generate(whole, kw, cuda, **_LOGITS)
        del whole
        dispatched = load(device_map=device_map, offload_folder=str(Path(folder) / "offload")).eval()
        row["meta_params"] = sum(p.device.type == "meta" for p in dispatched.parameters())
        with vasepatch.patched(dispatched, budget=budget, window=window, seed=0) as handle:
            got, row["dispatched_s"] = timed_generate(dispatched, kw, cuda, **_LOGITS)
            row["evictions"], row["attn_backend"] = handle.stats()["evictions"], handle.attn_backend
            cache = handle.new_cache()
            with torch.no_grad():
                dispatched(**{k: kw[k] for k in ("input_ids", "attention_mask")}, **{handle.cache_keyword: cache})
            row["buffer_devices"] = [str(layer.keys.device) for layer in cache.layers]
            row["execution_devices"] = [str(d) for d in execution_devices(dispatched, handle.layout)]
    row["tokens_equal"] = bool(torch.equal(got.sequences, want.sequences))
    row["max_logit_diff"] = max(
        float((a.float() - b.float()).abs().max()) for a, b in zip(got.logits, want.logits, strict=True)
    )
    row["ok"] = (
        row["tokens_equal"]
        and row["max_logit_diff"] <= setup.tol
        and row["evictions"] >= 4
        and row["meta_params"] > 0
        and row["buffer_devices"] == row["execution_devices"]
    )
    print(f"device_map check: {row}", flush=True)
    return row


# Throughput tables (`vasepatch bench`, batch 16, budget 4096, bf16): `(model, tokens, methods)` per part.
PLANS = {
    "default": [("shape:qwen3-4b", [4096, 16384], ["dense", "vase", "vase-dkv"])],
    "long": [
        ("shape:qwen3-4b", [2048, 4096, 8192, 16384], ["dense", "vase", "vase-dkv", "snapkv", "vase+compile"]),
        ("shape:qwen3-14b", [4096, 16384], ["dense", "vase", "vase-dkv"]),
    ],
    "quick": [("shape:qwen3-4b", [2048, 4096], ["dense", "vase"])],
}
GPU_BATCH, GPU_BUDGET, GPU_WINDOW, GPU_REPEATS = 16, 4096, 64, 2

# The time model behind the printed estimates (H200: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e), see the docstring.
H200_FLOPS, H200_BYTES_S = 0.4 * 989e12, 0.6 * 4.8e12  # assumed reachable: 40% of peak FLOPs, 60% of bandwidth
MODEL_SIZE = {"shape:qwen3-4b": (4.0e9, 36, 32, 8, 128), "shape:qwen3-14b": (14.8e9, 40, 40, 8, 128)}
BUILD_S_PER_PARAM, COMPILE_S = 5e-9, 90.0  # random init + move (5 s per 1e9 parameters); one compile
FIXED_S = {"part1": 30.0, "compile": 150.0, "device_map": 30.0}  # per check, on a CUDA machine


def estimate_method_s(model: str, tokens: list[int], method: str) -> float:
    """Seconds for one method of one throughput plan on an H200 (the time model above): the chunked
    prefill up to the longest length (FLOP-bound), then `window * (1 + repeats * lengths)` decode steps
    (bandwidth-bound: the weights plus the KV read), plus a compile for `+compile`."""
    params, layers, heads, kv_heads, head_dim = MODEL_SIZE[model]
    b, t = GPU_BATCH, max(tokens)
    seen = t if method.split("+")[0] == "dense" else min(t, GPU_BUDGET + GPU_WINDOW)  # keys one query sees
    attention = 4 * b * t * (seen if seen < t else t / 2) * layers * heads * head_dim
    prefill = (2 * params * b * t + attention) / H200_FLOPS
    kv_bytes = b * seen * footprint.kv_bytes_per_token(layers, kv_heads, head_dim, 2)  # bfloat16
    steps = GPU_WINDOW * (1 + GPU_REPEATS * len(tokens))
    decode = steps * (2 * params + kv_bytes) / H200_BYTES_S
    return prefill + decode + (COMPILE_S if method.endswith("+compile") else 0.0)


def estimate_plan_s(model: str, tokens: list[int], methods: list[str]) -> float:
    """Seconds for one throughput plan on an H200: building the model and every method."""
    return MODEL_SIZE[model][0] * BUILD_S_PER_PARAM + sum(estimate_method_s(model, tokens, m) for m in methods)


def estimate_run_s(mode: str) -> float:
    """Seconds for a whole CUDA run with `--part2 mode` (`default`, `long`, `quick` or `skip`)."""
    if mode == "skip":
        return FIXED_S["part1"]
    return sum(FIXED_S.values()) + sum(estimate_plan_s(*plan) for plan in PLANS[mode])


def announce(part: str, seconds: float | None) -> None:
    """Print what runs next and how long it should take (`None`: tiny CPU shapes, no estimate)."""
    when = "tiny CPU shapes" if seconds is None else f"estimated {seconds / 60:.1f} min on an H200"
    print(f"gpu_check: {part} ({when})", flush=True)


def throughput_plan(setup: Setup, model: str, tokens: list[int], methods: list[str]) -> dict[str, Any]:
    """`vasepatch bench` of one model, all methods in one process (CUDA memory per method from
    `max_memory_allocated`); an error is reported, not raised."""
    from vasepatch import VaSEConfig
    from vasepatch.bench.runner import run_benchmark
    from vasepatch.bench.settings import BenchSettings as Settings

    if setup.device.type == "cuda":
        cache = VaSEConfig(budget=GPU_BUDGET, window=GPU_WINDOW, seed=0)
        common = dict(cache=cache, batch=[GPU_BATCH], repeats=GPU_REPEATS, device="cuda", dtype="bfloat16")
    else:
        common = dict(cache=VaSEConfig(budget=16, window=4, seed=0), batch=[2], repeats=2, prompt_len=8)
    settings = Settings(model=model, tokens=tokens, methods=methods, isolate="none", progress=False, **common)
    try:
        result = run_benchmark(settings)
    except Exception as err:  # keep what the other shapes measured
        run = {"model": model, "error": f"{type(err).__name__}: {err}"}
    else:
        run = {"model": model, **{k: result[k] for k in ("results", "errors", "warmups", "wall_s")}}
    print(f"throughput {model}: {run['error'] if 'error' in run else str(len(run['results'])) + ' rows'}")
    return run


def _guarded(check: Callable[[Setup], dict[str, Any]], setup: Setup) -> dict[str, Any]:
    try:
        return check(setup)
    except Exception as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}


def part2(setup: Setup, report: dict[str, Any], save: Callable[[], None], mode: str = "default") -> None:
    """Part 2 into `report["part2"]`: the compile/CUDA-graphs check, the device_map check and the
    throughput tables (`mode` default|long|quick|skip), calling `save()` after each, so that a run
    stopped half-way keeps what it measured."""
    if mode == "skip":
        return
    cuda = setup.device.type == "cuda"
    out: dict[str, Any] = {"mode": mode, "throughput": []}
    report["part2"] = out
    for key, check in (("compile", compile_check), ("device_map", device_map_check)):
        announce(f"{key} check", FIXED_S[key] if cuda else None)
        out[key] = _guarded(check, setup)
        save()
    plans = PLANS[mode] if cuda else [("shape:tiny-qwen3", [32, 64], ["dense", "vase"])]
    for model, tokens, methods in plans:
        announce(
            f"throughput {model} at {tokens} ({', '.join(methods)})",
            estimate_plan_s(model, tokens, methods) if cuda else None,
        )
        out["throughput"].append(throughput_plan(setup, model, tokens, methods))
        save()


def environment(setup: Setup) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "reference_kernels": setup.reference_kernels,
    }
    if setup.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(setup.device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(setup.device)))
    try:
        import flash_attn

        env["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception as err:
        env["flash_attn"] = f"unavailable ({type(err).__name__})"
    try:
        from torch.nn.attention.varlen import varlen_attn

        env["varlen_attn_keywords"] = bk.varlen_spec(varlen_attn)._asdict()
    except ImportError:
        env["varlen_attn_keywords"] = None
    return env


def part2_markdown(part: dict[str, Any]) -> list[str]:
    from vasepatch.bench.report import batch_table

    c = part.get("compile")
    lines = ["", "## Compile check (generate's own compile route, CUDA graphs on GPU)", ""]
    if c is None:
        lines.append("not run yet")
    elif "error" in c:
        lines.append(f"error: {c['error']}")
    else:
        lines += [
            "| backend | evictions | graphs | graph breaks | CUDA-graph skips | token agreement (min) | eager s "
            "| compiled s | speed-up | ok |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {c['attn_backend']} | {c['evictions']} | {c['graphs']} | {c['graph_breaks']} | {c['cudagraph_skips']} "
            f"| {c['token_agreement']:.3f} ({c['min_token_agreement']}) | {c['eager_s']:.2f} | {c['compiled_s']:.2f} "
            f"| {c['speedup']:.2f} | {'yes' if c['ok'] else '**no**'} |",
            "",
            "The eager run passes `disable_compile=True` (transformers would otherwise compile it on CUDA).",
        ]
    lines += device_map_markdown(part.get("device_map"))
    for run in part.get("throughput", []):
        lines += ["", f"## Throughput: `{run['model']}` (random weights)", ""]
        if "error" in run:
            lines.append(f"error: {run['error']}")
            continue
        lines.append(batch_table(run["results"]))
        lines += [f"- `{e['method']}` failed ({e['stage']}): {e['error']}" for e in run["errors"]]
    return lines


def device_map_markdown(d: dict[str, Any] | None) -> list[str]:
    if d is None:
        return []
    lines = ["", "## device_map check (accelerate offload, patched, against the whole model)", ""]
    if "error" in d:
        return [*lines, f"error: {d['error']}"]
    offloaded = sorted({v for v in d["device_map"].values()} - {d["execution_devices"][0]})
    return [
        *lines,
        "| shape | layers | offload | evictions | tokens equal | max logit diff | buffers on | whole s | dispatched s "
        "| ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {d['shape']} | {d['layers']} | {', '.join(offloaded)} | {d['evictions']} | {d['tokens_equal']} "
        f"| {d['max_logit_diff']:.2e} | {', '.join(sorted(set(d['buffer_devices'])))} | {d['whole_s']:.2f} "
        f"| {d['dispatched_s']:.2f} | {'yes' if d['ok'] else '**no**'} |",
    ]


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['shape']:<10} {row['phase']:<8} {row['variant']:<20} ERROR {row['error']}"
    return (
        f"{row['shape']:<10} {row['phase']:<8} {row['variant']:<20} diff {row['max_abs_diff']:.2e} "
        f"(fp32 {row['max_abs_diff_fp32']:.2e}) {row['ms']:8.3f} ms {'ok' if row['ok'] else 'FAIL'}"
    )


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [
        "# Attention backends: GPU check",
        "",
        f"Device `{env.get('gpu', report['device'])}`, torch {env['torch']}, CUDA {env['cuda']}, "
        f"{env['dtype']}, flash_attn {env['flash_attn']}"
        + (", varlen paths through the CPU reference kernels" if env["reference_kernels"] else "")
        + ".",
        f"Batch {report['setup']['batch']}, capacity {report['setup']['capacity']}, "
        f"{report['setup']['used']} slots in use with ragged starts; prompts of {report['setup']['prompt']} "
        f"tokens, left-padded to ragged lengths. Differences are max |out - sdpa| in {env['dtype']} "
        f"(tolerance {report['setup']['tol']}) and against an fp32 SDPA; times are medians of "
        f"{report['setup']['iters']} calls.",
        "",
        "| shape | phase | backend | variant | max abs diff | vs fp32 | median ms | ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["checks"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['phase']} | {r['backend']} | {r['variant']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['phase']} | {r['backend']} | {r['variant']} | {r['max_abs_diff']:.2e} "
            f"| {r['max_abs_diff_fp32']:.2e} | {r['ms']:.3f} | {'yes' if r['ok'] else '**no**'} |"
        )
    if report["unavailable"]:
        lines += ["", "Not run: " + "; ".join(f"`{k}`: {v}" for k, v in report["unavailable"].items()) + "."]
    if report["part2"] is not None:
        lines += part2_markdown(report["part2"])
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, report: dict[str, Any]) -> None:
    """Write `gpu_check.json` and `gpu_check.md` (called after every part: a stopped run keeps what it measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "gpu_check.md").write_text(markdown(report))


def failures(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The failed part-1 rows and part-2 checks."""
    failed = [r for r in report["checks"] if not r["ok"]]
    if report["part2"] is not None:
        failed += [report["part2"][k] for k in ("compile", "device_map") if not report["part2"][k].get("ok")]
    return failed


def main(out_dir: Path | str, *, allow_cpu: bool = False, iters: int | None = None, part2_mode: str = "default") -> int:
    out_dir = Path(out_dir)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif allow_cpu:
        device = torch.device("cpu")
    else:
        print("gpu_check: no CUDA device; pass --allow-cpu to run the same checks on CPU (fp32, tiny shapes)")
        return 2
    cuda = device.type == "cuda"
    if cuda:
        print(f"gpu_check: whole run estimated {estimate_run_s(part2_mode) / 60:.1f} min on an H200", flush=True)
    setup = make_setup(device, iters)
    setup.variants, skipped = variants(setup)
    announce("part 1: backends against sdpa", FIXED_S["part1"] if cuda else None)
    report = {
        "device": device.type,
        "env": environment(setup),
        "setup": {k: getattr(setup, k) for k in ("batch", "capacity", "used", "prompt", "iters", "tol")},
        "shapes": [asdict(s) for s in setup.shapes],
        "backends": sorted({v["backend"] for v in setup.variants.values()}, key=bk.BACKENDS.index),
        "unavailable": skipped,
        "checks": part1(setup),
        "part2": None,
    }
    write_report(out_dir, report)
    part2(setup, report, functools.partial(write_report, out_dir, report), part2_mode)
    failed, rows = failures(report), report["checks"]
    print(f"gpu_check: {len(rows) - len(failed)}/{len(rows)} checks ok; wrote {out_dir}/gpu_check.{{json,md}}")
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run fp32 tiny shapes on CPU")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per backend (default 100 GPU, 3 CPU)")
    parser.add_argument(
        "--part2",
        choices=("default", "quick", "skip", "full"),
        default="default",
        help="compile and device_map checks and throughput tables (default: Qwen3-4B at 4K and 16K, ~4 min)",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="the long throughput tables instead: Qwen3-4B at 2K-16K with 5 methods, then Qwen3-14B (~9 min)",
    )
    args = parser.parse_args(argv)
    if args.long or args.part2 == "full":  # `full`: the long tables (the old default)
        args.part2 = "long"
    return args


if __name__ == "__main__":
    args = parse_args()
    sys.exit(main(args.out_dir, allow_cpu=args.allow_cpu, iters=args.iters, part2_mode=args.part2))
