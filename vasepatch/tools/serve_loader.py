"""The model loader of `vasepatch serve`: transformers serve's own `ModelLoader`, which patches each model it loads.

transformers serve (5.25) loads a model in a process of its own, started with `spawn`, from a copy of its loader.
`PatchingLoader` is importable by name, so the copy pickles by reference and the model's process imports vasepatch;
it carries the patch's settings (keyword arguments of `vasepatch.patch`) and patches the model right after
transformers loads it, before the server makes its continuous-batching manager. It also gives the `vasepatch` logger
a handler in that process, so what the patch logs (each finished request that evicted, `PagedEviction`) reaches
the server's stderr.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from transformers.cli.serving import model_manager
from transformers.cli.serving.model_manager import ModelLoader

import vasepatch

LOG_FORMAT = "%(message)s"


class PatchingLoader(ModelLoader):
    """transformers serve's `ModelLoader`, which applies `settings` (keyword arguments of `vasepatch.patch`) to every
    model it loads. Serve makes it with the stock loader's arguments while `installed` holds; each loader keeps a
    copy of the settings then given, which travels with it to the model's process."""

    pending: dict[str, Any] | None = None  # the settings of the loaders made now (`installed`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if PatchingLoader.pending is None:
            raise RuntimeError("PatchingLoader is made by transformers serve under vasepatch serve (`installed`)")
        super().__init__(*args, **kwargs)
        self.settings = dict(PatchingLoader.pending)

    def load_model_and_processor(self, model_id: str, on_progress: Callable | None = None) -> tuple[Any, Any]:
        model, processor = super().load_model_and_processor(model_id, on_progress)
        vasepatch.patch(model, **self.settings)
        show_logs()
        return model, processor


@contextlib.contextmanager
def installed(settings: dict[str, Any]) -> Iterator[None]:
    """While it holds, transformers serve makes `PatchingLoader`s with `settings` (its `__init__` reads
    `model_manager.ModelLoader` when it runs); both are restored on exit."""
    stock = model_manager.ModelLoader
    model_manager.ModelLoader, PatchingLoader.pending = PatchingLoader, dict(settings)
    try:
        yield
    finally:
        model_manager.ModelLoader, PatchingLoader.pending = stock, None


def show_logs() -> None:
    """The `vasepatch` logger's info lines on stderr, `vasepatch: ...`, unless something already handles them."""
    log = logging.getLogger("vasepatch")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
