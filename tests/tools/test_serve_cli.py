"""`vasepatch serve`: transformers serve on a patched model. Its command line (what reaches transformers serve, what
is refused before the server starts), its loader (carried to the model's process, patches what it loads), and a
real server on SmolLM2 whose concurrent requests evict and answer as the patched `generate` does alone."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import vasepatch
from vasepatch.tools.cli import main

import_utils = pytest.importorskip("transformers.utils.import_utils")
if not getattr(import_utils, "is_serve_available", lambda: False)():
    pytest.skip("transformers serve's dependencies are not installed (vasepatch[serve])", allow_module_level=True)
model_manager = pytest.importorskip("transformers.cli.serving.model_manager")
if not hasattr(model_manager, "ModelLoader"):
    pytest.skip("this transformers serves in-process (no ModelLoader, < 5.25)", allow_module_level=True)

from vasepatch.integration import compat  # noqa: E402
from vasepatch.integration.handle import STATE_ATTR  # noqa: E402
from vasepatch.tools import serve  # noqa: E402
from vasepatch.tools.serve_loader import PatchingLoader, installed  # noqa: E402

needs_evicting_batching = pytest.mark.skipif(
    not compat.evicts_in_continuous_batching(), reason="continuous batching does not evict with this transformers"
)


@pytest.fixture
def launched(monkeypatch):
    """What `vasepatch serve` would start: transformers serve's command line and the patch's settings."""
    seen = []
    monkeypatch.setattr(serve, "launch", lambda argv, settings: seen.append((argv, settings)) or 0)
    return seen


@needs_evicting_batching
def test_the_words_after_the_separator_go_to_transformers_serve_as_they_are(model_dir, launched):
    argv = ["serve", str(model_dir), "--budget", "16", "--window", "4", "--policy", "snapkv", "--threads", "1"]
    assert main([*argv, "--", "--port", "8123", "--host", "127.0.0.1", "--cb-num-blocks", "40"]) == 0
    (served, settings), = launched  # fmt: skip
    assert served == [str(model_dir), "--continuous-batching", "--port", "8123", "--host", "127.0.0.1",
                      "--cb-num-blocks", "40"]  # fmt: skip
    config = settings["config"]
    assert (config.budget, config.window, config.policy, config.seed) == (16, 4, "snapkv", 0)


def test_a_serve_option_before_the_separator_is_refused_with_where_it_goes(model_dir, launched, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model_dir), "--port", "8000"])
    assert exit_info.value.code == 2 and not launched
    assert "unrecognized arguments: --port 8000 (another program's options go after --)" in capsys.readouterr().err


def test_continuous_batching_is_on_unless_the_options_say(model_dir, launched):
    assert main(["serve", str(model_dir), "--budget", "16", "--window", "4", "--", "--no-continuous-batching"]) == 0
    assert launched[0][0] == [str(model_dir), "--no-continuous-batching"]
    assert serve.serve_argv("m", []) == ["m", "--continuous-batching"]
    passed = ["--continuous-batching", "--port", "1"]
    assert serve.serve_argv("m", passed) == ["m", *passed]


def test_a_release_whose_batching_does_not_evict_is_refused_before_the_server_starts(
    model_dir, launched, monkeypatch, capsys
):
    monkeypatch.setattr(compat, "evicts_in_continuous_batching", lambda version=None: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model_dir), "--budget", "16", "--window", "4"])
    assert exit_info.value.code == 2 and not launched
    low, high = compat.CONTINUOUS_BATCHING
    assert f"continuous batching evicts with transformers >={low},<{high}" in capsys.readouterr().err
    assert main(["serve", str(model_dir), "--budget", "16", "--window", "4", "--", "--no-continuous-batching"]) == 0


@needs_evicting_batching
@pytest.mark.parametrize(
    ("passed", "message"),
    [
        (["--cb-use-cuda-graph"], r"option --cb-use-cuda-graph: CUDA graphs run steps ahead of the host"),
        (["--compile"], r"option --compile: compiled continuous batching is not supported"),
        (["--attn-implementation", "flash_attention_2"], r"--attn-implementation flash_attention_2: .* sdpa"),
        (["--attn-implementation=kernels-community/flash-attn3"], r"--attn-implementation kernels-community/flash"),
    ],
)
def test_serve_options_eviction_refuses_are_refused_before_the_server_starts(
    passed, message, model_dir, launched, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model_dir), "--budget", "16", "--window", "4", "--", *passed])
    assert exit_info.value.code == 2 and not launched
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


@needs_evicting_batching
def test_a_local_model_whose_layers_cannot_evict_is_refused_before_the_server_starts(tmp_path, launched, capsys):
    from tests import sliding_models
    from tests.tiny_tokenizer import tiny_tokenizer

    sliding_models.tiny(sliding_models.sliding_config("gemma3", window=48)).save_pretrained(tmp_path)
    tiny_tokenizer(sliding_models.VOCAB).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tmp_path), "--budget", "32", "--window", "8"])
    assert exit_info.value.code == 2 and not launched
    assert "sliding layers keep a window of 48 tokens, more than budget=32" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--budget", "48", "--window", "8"]) == 0  # a budget >= the window
    assert main(["serve", str(tmp_path), "--budget", "32", "--window", "8", "--", "--no-continuous-batching"]) == 0


def test_transformers_serves_own_usage_errors_are_one_line(model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model_dir), "--budget", "16", "--window", "4", "--", "--prot", "8000"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vasepatch: error: transformers serve: No such option '--prot'") and err.count("\n") == 1


def test_the_loader_carries_its_settings_to_the_models_process_and_patches_what_it_loads(model_dir):
    stock = model_manager.ModelLoader
    settings = serve.settings(main_args(["serve", str(model_dir), "--budget", "20", "--window", "3"]))
    with installed(settings):
        loader = model_manager.ModelLoader(device="cpu", dtype="auto")  # as transformers serve makes it
    assert model_manager.ModelLoader is stock and PatchingLoader.pending is None
    copy = pickle.loads(pickle.dumps(loader))  # what spawn hands the model's process
    model, _ = copy.load_model_and_processor(str(model_dir))
    try:
        assert vasepatch.is_patched(model)
        config = model.__dict__[STATE_ATTR].handle.config
        assert (config.budget, config.window) == (20, 3)
    finally:
        vasepatch.unpatch(model)
    with pytest.raises(RuntimeError, match="vasepatch serve"):
        PatchingLoader(device="cpu")


def main_args(argv: list[str]):
    from vasepatch.tools.cli import build_parser

    return build_parser().parse_args(argv)


# --- a real server ------------------------------------------------------------------------------------------------

PROMPTS = [  # of 7 to 19 tokens, each answered with at least TOKENS tokens (SmolLM2, greedy, no chat template)
    "Write a long story about a dragon who learns to count.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The history of the Roman Empire began",
]
BUDGET, WINDOW, TOKENS = 32, 8, 60


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(port: int, body: dict, timeout: float = 240) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_healthy(port: int, server: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server stopped (exit {server.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail("the server did not answer /health in time")


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_evicting_batching
def test_a_served_model_evicts_and_answers_as_the_patched_generate_alone(smollm2, tmp_path):
    from vasepatch import models

    model, tokenizer = smollm2
    folder, port, log = str(models.resolve("smollm2-135m")), _free_port(), tmp_path / "server.log"
    cli = "from vasepatch.tools.cli import main; raise SystemExit(main())"
    options = ["--budget", str(BUDGET), "--window", str(WINDOW), "--threads", "1"]
    passed = ["--host", "127.0.0.1", "--port", str(port), "--cb-block-size", "16", "--cb-num-blocks", "64",
              "--log-level", "warning"]  # fmt: skip
    command = [sys.executable, "-c", cli, "serve", "smollm2-135m", *options, "--", *passed]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(port, server, time.monotonic() + 300)
        bodies = [{"model": folder, "prompt": p, "max_tokens": TOKENS, "temperature": 0} for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:  # arriving at different times
            futures = [pool.submit(_post, port, body) for body in bodies if time.sleep(0.3) is None]
            answers = [f.result(timeout=600)["choices"][0]["text"] for f in futures]
        time.sleep(1)  # the last request's line
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
    line = r"vasepatch: request \S+ ended: (\d+) evictions, (\d+) tokens dropped, held at most (\d+) blocks"
    ended = re.findall(line, log.read_text(errors="replace"))
    assert len(ended) == len(PROMPTS), log.read_text(errors="replace")[-3000:]
    assert all(int(evictions) >= 1 and int(blocks) <= -(-(BUDGET + WINDOW) // 16) for evictions, _, blocks in ended)
    with vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0):
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            ids = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            assert answer == tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
