"""A long decode with evictions holds its memory flat: RSS, gc-tracked objects, buffer
addresses, capacity and `kv_bytes` (the 100,000-step version is `benchmarks/soak.py`)."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

import vasepatch

STEPS = 3000
EVERY = 250
BUDGET, WINDOW, PROMPT = 32, 8, 20
RSS_TOLERANCE = 2 * 2**20  # bytes: allocator noise; a leak of one small tensor per step and layer exceeds it
OBJECT_TOLERANCE = 20


def _rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _buffers(cache) -> list[int]:
    return [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values, layer.positions, layer.valid)]


@pytest.fixture
def one_thread():
    """One intra-op thread (restored afterwards): a step this small only waits on a second one."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc (Linux)")
@pytest.mark.usefixtures("one_thread")
def test_thousands_of_decode_steps_keep_memory_flat(make_model):
    model = make_model("llama")
    ids = torch.randint(1, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    samples = []
    with torch.no_grad(), vasepatch.patched(model, budget=BUDGET, window=WINDOW, seed=0) as handle:
        cache = handle.new_cache()
        token = model(input_ids=ids, **{handle.cache_keyword: cache}).logits[:, -1:].argmax(-1)
        buffers = _buffers(cache)
        for done in range(1, STEPS + 1):
            token = model(input_ids=token, **{handle.cache_keyword: cache}).logits[:, -1:].argmax(-1)
            if done % EVERY == 0:
                gc.collect()
                stats = cache.stats()
                samples.append((_rss(), len(gc.get_objects()), stats["capacity"], stats["kv_bytes"]))
                assert _buffers(cache) == buffers  # never reallocated
    rss, objects, capacity, kv_bytes = zip(*samples, strict=True)
    assert set(capacity) == {BUDGET + WINDOW}
    assert len(set(kv_bytes)) == 1
    # the prompt fills 20 slots; evictions at 40 slots, then every WINDOW tokens
    assert stats["evictions"] == 1 + (PROMPT + STEPS - (BUDGET + WINDOW)) // WINDOW
    assert stats["tokens_seen"] == PROMPT + STEPS
    half = len(samples) // 2
    assert max(rss[half:]) - max(rss[:half]) <= RSS_TOLERANCE, [r / 2**20 for r in rss]
    assert max(objects[half:]) - max(objects[:half]) <= OBJECT_TOLERANCE, objects
