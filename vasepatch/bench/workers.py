"""Where a method runs: `WorkerProxy` (its own spawned process, driven over a pipe) or
`LocalProxy` (this process). Both answer `ready()`, `call(command, *args)` and `close()`,
and turn any failure into a `MethodError`."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from vasepatch.bench.measure import MethodRunner
from vasepatch.bench.settings import BenchSettings, MethodSpec


class MethodError(RuntimeError):
    """A method failed (in its worker or here); the message says how, `details` where."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def describe(err: BaseException, limit: int = 600) -> str:
    """`Type: message`, shortened to `limit` characters."""
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _worker(conn: Connection, settings: BenchSettings, spec: MethodSpec) -> None:
    """Worker process: build the runner, then answer `(command, args)` until `close`."""
    try:
        runner = MethodRunner(settings, spec)
        conn.send(("ok", runner.info()))
    except Exception as err:
        conn.send(("error", describe(err), traceback.format_exc()))
        return
    while True:
        command, args = conn.recv()
        try:
            conn.send(("ok", getattr(runner, command)(*args)))
        except Exception as err:
            conn.send(("error", describe(err), traceback.format_exc()))
        if command == "close":
            return


class WorkerProxy:
    """A method in a spawned process, driven over a pipe. The process starts (and loads
    the model) at once; `ready()` waits for it."""

    def __init__(self, settings: BenchSettings, spec: MethodSpec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, settings, spec), daemon=True)
        self.process.start()
        child.close()

    def ready(self) -> dict[str, Any]:
        self.info = self._receive()
        return self.info

    def _receive(self) -> dict[str, Any]:
        try:
            reply = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise MethodError(f"worker process died (exit code {self.process.exitcode})") from None
        if reply[0] == "error":
            raise MethodError(reply[1], reply[2])
        return reply[1]

    def call(self, command: str, *args: Any) -> dict[str, Any]:
        self.conn.send((command, args))
        return self._receive()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(MethodError, OSError):
                self.call("close")
            self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


class LocalProxy:
    """A method in this process, on a weight-sharing copy of `model`."""

    def __init__(self, settings: BenchSettings, spec: MethodSpec, model: torch.nn.Module) -> None:
        try:
            self.runner = MethodRunner(settings, spec, model)
        except Exception as err:
            raise MethodError(describe(err), traceback.format_exc()) from err

    def ready(self) -> dict[str, Any]:
        return self.runner.info()

    def call(self, command: str, *args: Any) -> dict[str, Any]:
        try:
            return getattr(self.runner, command)(*args)
        except Exception as err:
            raise MethodError(describe(err), traceback.format_exc()) from err

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.runner.close()


Proxy = WorkerProxy | LocalProxy


def open_proxy(settings: BenchSettings, spec: MethodSpec, shared: torch.nn.Module | None) -> Proxy:
    """`spec` in a worker process (`shared is None`) or in this process on a copy of `shared`."""
    return WorkerProxy(settings, spec) if shared is None else LocalProxy(settings, spec, shared)
