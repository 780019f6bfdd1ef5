"""The teacher-forced half of `vasepatch eval fidelity --shared-heads both` on SmolLM2: a reference
sampled from the full cache, then KL / top-1 agreement / NLL delta of every cache driven in lockstep
with it. The free runs (loop rate, first divergence) are left out: they cost ~6x the rest, more CPU
time than the session that measured this had. Same code as the command (`fidelity.sample`,
`fidelity.force_metrics`, `fidelity._Tally`) and the settings of docs/results/smollm2-fidelity
(budget 192, window 64, 768 tokens, seed 0), on fewer prompts.

usage: python benchmarks/teacher_forced.py PROMPTS BATCH OUT [PROTECT [POLICIES]]
  e.g. python benchmarks/teacher_forced.py gsm8k:4 4 docs/results/shared-heads/fidelity
"""

import sys
import time
from pathlib import Path

import vasepatch
from vasepatch import models
from vasepatch.config import FULL, VaSEConfig
from vasepatch.eval import data, fidelity, report
from vasepatch.eval.fidelity_settings import FidelitySettings

prompts, batch, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
protect = int(sys.argv[4]) if len(sys.argv) > 4 else None  # default: budget // 4
names = sys.argv[5].split(",") if len(sys.argv) > 5 else ["vase", "snapkv", "rkv"]
start = time.time()
settings = FidelitySettings(
    model="smollm2-135m",
    config=VaSEConfig(budget=192, window=64, protect=protect, seed=0),
    policies=["full", *names],
    prompts=prompts,
    tokens=768,
    batch_size=batch,
    shared_heads="both",
)
model, tokenizer = models.load(settings.model)
examples = data.load_examples(settings.prompts, None)
texts = data.chat_prompts(tokenizer, [e.question for e in examples])
batches = [data.encode(tokenizer, texts[i : i + batch]) for i in range(0, len(texts), batch)]
configs = settings.configs()
tally = fidelity._Tally(settings.policies)
pad_id, suppress = tokenizer.pad_token_id, fidelity._end_ids(model, tokenizer)
for b, (ids, mask) in enumerate(batches):
    with vasepatch.patched(model, config=configs[FULL]):
        reference = fidelity.sample(model, ids, mask, settings, settings.seed + b, pad_id, suppress)
    print(f"batch {b}: reference done at {time.time() - start:.0f} s", flush=True)
    tally.add_forced(*fidelity.force_metrics(model, configs, ids, mask, reference), rows=ids.shape[0])
    print(f"batch {b}: forced done at {time.time() - start:.0f} s", flush=True)
results = []
for name in settings.policies:
    row = tally.summary(name)
    for k in ("loop_rate", "first_divergence"):
        row.pop(k)
    results.append(row)
header = settings.header(model)
longest = max(int(m.sum(-1).max()) for _, m in batches) + settings.tokens
header.update(
    n_prompts=len(texts),
    free_runs="not run",
    longest_sequence=longest,
    compression=round(longest / settings.config.budget, 2),
    wall_s=round(time.time() - start),
)
columns = ("policy", "kl", "kl_stderr", "top1_agreement", "top1_stderr", "nll_delta", "n_prompts", "n_tokens")
report.write(
    out, "fidelity", header, results, columns, "Fidelity to the full cache, teacher-forced (no free runs)", echo=True
)
