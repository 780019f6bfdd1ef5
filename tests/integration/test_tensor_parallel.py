"""Tensor parallelism: a model loaded with `tp_plan="auto"` on 2 (3) gloo processes patches,
each rank caches only its own KV heads, every rank generates the same tokens, and those are
the single-process patched model's tokens.

One run of this file's worker per world size does every family (the processes are plain
`python -m tests.integration.test_tensor_parallel` children with torch.distributed's env variables); each
process has a timeout (the parent kills it on overrun, and the worker exits itself via
`faulthandler` first), so nothing can hang.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

import vasepatch
from tests.conftest import greedy_with_logits, ragged_batch
from tests.tiny_models import FAMILIES, VOCAB, tiny_model

WORKER_TIMEOUT = 420  # seconds, per process; the worker dumps its stack and exits 10 s before
STEPS = 64  # decode steps of the tiny families: 14 eviction rounds (prompt 12, budget 16, window 4)
SMOLLM2_STEPS = 40  # SmolLM2 on 3 ranks: 8 eviction rounds
SETTINGS = dict(budget=16, window=4, sinks=2, seed=0)
ROOT = Path(__file__).resolve().parents[2]


def evictions(steps: int, prompt: int = 12) -> int:
    """Eviction rounds of a `steps`-token greedy run: the first when the `prompt + steps - 1` slots written
    reach budget + window, then one every window tokens."""
    budget, window = SETTINGS["budget"], SETTINGS["window"]
    return 1 + (prompt + steps - 1 - (budget + window)) // window


# --- the worker (one process of the group) -----------------------------------------------------
def _divergence(tp, ref) -> dict:
    """First step where the TP tokens differ from the single-process ones, and the reference's
    logit gap there between its token and the TP token (None when they agree)."""
    tokens, ref_tokens = tp.sequences, ref.sequences
    differ = (tokens != ref_tokens).any(dim=0).nonzero()
    if not len(differ):
        return {"step": None, "gap": None}
    col = int(differ[0])
    step = col - (tokens.shape[1] - len(ref.logits))
    row = int((tokens[:, col] != ref_tokens[:, col]).nonzero()[0])
    logits = ref.logits[step][row]
    gap = float(logits[ref_tokens[row, col]] - logits[tokens[row, col]])
    return {"step": step, "gap": gap}


def _run_family(path: str, policy: str, steps: int) -> dict:
    """TP run on every rank; the single-process reference on rank 0 only (it needs no peers)."""
    ids, mask = ragged_batch(VOCAB, lengths=(12, 7))
    tp = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    handle = vasepatch.patch(tp, policy=policy, **SETTINGS)
    out = greedy_with_logits(tp, ids, mask, steps, min_new_tokens=steps)
    stats = handle.stats()
    cache = handle.new_cache()
    with torch.no_grad():
        tp(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: cache})
    vasepatch.unpatch(tp)
    result = {
        "tokens": out.sequences.tolist(),
        "stats": stats,
        "cache_heads": [int(layer.keys.shape[1]) for layer in cache.layers],
        "head_offsets": [p.head_offset for p in handle.layout.layer_plans()],
        "config_kv_heads": tp.config.num_key_value_heads,
    }
    if torch.distributed.get_rank() == 0:
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with vasepatch.patched(ref, policy=policy, **SETTINGS):
            ref_out = greedy_with_logits(ref, ids, mask, steps, min_new_tokens=steps)
        result.update(ref_tokens=ref_out.sequences.tolist(), divergence=_divergence(out, ref_out))
    return result


def _run_uneven(path: str) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    before = {name: sorted(m.__dict__) for name, m in model.named_modules()}
    try:
        vasepatch.patch(model, **SETTINGS)
    except vasepatch.UnsupportedModelError as err:
        error = str(err)
    else:
        error = None
    after = {name: sorted(m.__dict__) for name, m in model.named_modules()}
    return {"error": error, "unchanged": before == after and not vasepatch.is_patched(model)}


def _kept_positions(model, handle, ids, mask) -> list:
    """Each layer's `[rows, KV heads, slots]` positions after a prefill that compresses the prompt."""
    cache = handle.new_cache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{handle.cache_keyword: cache})
    return [layer.positions.tolist() for layer in cache.layers]


def _run_many_heads(path: str) -> dict:
    """4 KV heads on 2 ranks (2 per rank): what `vase` keeps from a prompt longer than the budget (one
    sampled eviction per layer, drawn by global KV head) on each rank, and on rank 0 one process's picks."""
    ids, mask = ragged_batch(VOCAB, lengths=(40, 31))
    tp = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    handle = vasepatch.patch(tp, policy="vase", **SETTINGS)
    result = {"head_offsets": [p.head_offset for p in handle.layout.layer_plans()]}
    result["positions"] = _kept_positions(tp, handle, ids, mask)
    vasepatch.unpatch(tp)
    if torch.distributed.get_rank() == 0:
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with vasepatch.patched(ref, policy="vase", **SETTINGS) as ref_handle:
            result["ref_positions"] = _kept_positions(ref, ref_handle, ids, mask)
    return result


def worker(folder: str, out: str) -> None:
    import faulthandler
    from datetime import timedelta

    import torch.distributed as dist

    faulthandler.dump_traceback_later(WORKER_TIMEOUT - 10, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=WORKER_TIMEOUT - 20))
    results = {}
    spec = json.loads((Path(folder) / "spec.json").read_text())
    for name in spec["families"]:
        for policy in spec["policies"]:
            results[f"{name}/{policy}"] = _run_family(str(Path(folder) / name), policy, spec.get("steps", STEPS))
    if spec.get("uneven"):
        results["uneven"] = _run_uneven(str(Path(folder) / "uneven"))
    if spec.get("many_heads"):
        results["many_heads"] = _run_many_heads(str(Path(folder) / "many_heads"))
    Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


# --- the parent: launch, time out, collect ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(folder: Path, world: int) -> list[dict]:
    """Run the worker on `world` processes; all are killed (each its whole process group) once one
    fails or `WORKER_TIMEOUT` has passed since the start."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        command = [
            sys.executable,
            "-m",
            "tests.integration.test_tensor_parallel",
            str(folder),
            str(folder / f"rank{rank}.json"),
        ]
        log = open(folder / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (
                subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                ),
                log,
            )
        )
    failed, deadline = [], time.monotonic() + WORKER_TIMEOUT
    for rank, (proc, log) in enumerate(procs):
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            failed.append((rank, rc))
            for other, _ in procs:  # one rank down: the others would wait on it
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
        log.close()
    if failed:
        tail = (folder / f"rank{failed[0][0]}.log").read_text()[-4000:]
        pytest.fail(f"tensor-parallel worker(s) failed {failed}:\n{tail}")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def _tp_support() -> str | None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "torch.distributed with the gloo backend is not available"
    return None


pytestmark = pytest.mark.skipif(_tp_support() is not None, reason=str(_tp_support()))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict]:
    """The worker's results on 2 ranks: 4 tiny families (4 query, 2 KV heads: one per rank), a 1-KV-head
    model (refused), and a llama with 4 KV heads (two per rank)."""
    folder = tmp_path_factory.mktemp("tp2")
    for family in FAMILIES:
        tiny_model(family, kv_heads=2).save_pretrained(folder / family)
    tiny_model("llama", kv_heads=1).save_pretrained(folder / "uneven")
    tiny_model("llama", kv_heads=4).save_pretrained(folder / "many_heads")
    spec = {"families": list(FAMILIES), "policies": ["snapkv", "vase"], "uneven": True, "many_heads": True}
    (folder / "spec.json").write_text(json.dumps(spec))
    return launch(folder, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_ranks_generate_the_same_tokens(tp2, family):
    for policy in ("snapkv", "vase"):
        key = f"{family}/{policy}"
        assert tp2[0][key]["tokens"] == tp2[1][key]["tokens"], key
        assert len(tp2[0][key]["tokens"][0]) >= STEPS + 12


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_caches_its_own_heads(tp2, family):
    for rank, result in enumerate(tp2):
        got = result[f"{family}/snapkv"]
        assert got["config_kv_heads"] == 2  # the config keeps the global count ...
        assert got["cache_heads"] == [1, 1]  # ... the cache holds this rank's one head per layer
        assert got["head_offsets"] == [rank, rank]


@pytest.mark.parametrize("family", FAMILIES)
def test_stats_say_what_this_rank_and_all_ranks_hold(tp2, family):
    for rank, result in enumerate(tp2):
        stats = result[f"{family}/snapkv"]["stats"]
        assert stats["world_size"] == 2 and stats["rank"] == rank
        assert stats["evictions"] == evictions(STEPS) == 14
        head_dim = 16
        local = 2 * stats["layers"] * 2 * 1 * stats["capacity"] * head_dim * 4  # K+V, layers, rows, 1 head, fp32
        assert stats["kv_bytes"] == local
        assert stats["kv_bytes_total"] == 2 * local


@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_policy_matches_one_process(tp2, family):
    """snapkv keeps the same slots on a rank as on one process (its choice is per head, no
    randomness), so greedy tokens over 64 steps with 14 evictions equal the single-process run's,
    unless a near-tie flips under TP's different summation order (then the gap must be tiny)."""
    got = tp2[0][f"{family}/snapkv"]
    step, gap = got["divergence"]["step"], got["divergence"]["gap"]
    assert got["tokens"] == got["ref_tokens"], f"first divergence at decode step {step}, logit gap {gap}"


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_policy_matches_one_process(tp2, family):
    """vase samples: its eviction draws are keyed by (seed, layer, round, row, global KV head), so 2 ranks
    holding half the heads each keep what one process keeps (greedy tokens over 64 steps, 14 evictions)."""
    got = tp2[0][f"{family}/vase"]
    assert got["tokens"] == got["ref_tokens"], got["divergence"]


def test_several_kv_heads_per_rank_draw_by_global_head(tp2):
    """With one KV head per rank, `rank` and `rank x local KV heads` are the same head offset (a mutation
    computing the first was caught by no test). With 4 KV heads on 2 ranks, rank 1 holds global heads 2 and
    3: its offset is 2, and the slots it keeps after a sampled eviction are those one process keeps for
    heads 2 and 3 (the noise is keyed by global head, so a wrong offset draws another head's noise)."""
    ref = tp2[0]["many_heads"]["ref_positions"]
    for rank, result in enumerate(tp2):
        got = result["many_heads"]
        assert got["head_offsets"] == [2 * rank] * len(ref)
        for layer, (local, full) in enumerate(zip(got["positions"], ref, strict=True)):
            assert len(local[0]) == 2, "each rank caches 2 of the 4 KV heads"
            mine = [row[2 * rank : 2 * rank + 2] for row in full]
            assert local == mine, f"rank {rank}, layer {layer}: kept other slots than one process"
    assert ref[0][0][0] != ref[0][0][2], "the heads keep different slots (the check can tell heads apart)"


def test_heads_that_do_not_divide_the_world_size_are_refused(tp2):
    """transformers loads a 1-KV-head model on 2 ranks (each gets half a head) and fails only at
    the first forward; vasepatch refuses it at patch time, leaving the model unchanged."""
    for result in tp2:
        uneven = result["uneven"]
        assert (
            uneven["error"] is not None and "1 KV heads" in uneven["error"] and "2 tensor-parallel" in uneven["error"]
        )
        assert uneven["unchanged"]


@pytest.mark.slow
def test_smollm2_on_three_ranks(tmp_path, smollm2):
    """SmolLM2-135M (9 query, 3 KV heads) on 3 ranks: one KV head each, same tokens everywhere,
    equal to one process under vase (keyed eviction randomness)."""
    from vasepatch import models

    os.symlink(models.resolve("smollm2-135m"), tmp_path / "smollm2")
    spec = {"families": ["smollm2"], "policies": ["vase"], "steps": SMOLLM2_STEPS}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    results = launch(tmp_path, 3)
    for rank, result in enumerate(results):
        got = result["smollm2/vase"]
        assert got["tokens"] == results[0]["smollm2/vase"]["tokens"]
        assert got["cache_heads"] == [1] * 30 and got["head_offsets"] == [rank] * 30
        assert got["stats"]["world_size"] == 3 and got["stats"]["kv_bytes_total"] == 3 * got["stats"]["kv_bytes"]
        assert got["stats"]["evictions"] == evictions(SMOLLM2_STEPS) == 8
    got = results[0]["smollm2/vase"]
    assert got["tokens"] == got["ref_tokens"], got["divergence"]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
