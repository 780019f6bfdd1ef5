#!/usr/bin/env bash
# Mutation check with mutmut 3, of one of two targets (TARGET in the environment):
#   core (the default): the cache, the policies and the attention step (issue 12), options in setup.cfg,
#     run in .venv, results in docs/results/mutation;
#   plugin: the vLLM plugin, vasepatch/vllm/*.py (issue 40), options in plugin.cfg, run in the vLLM venv
#     .venv-vllm (it needs hypothesis there too, for test_plugin_parts.py), results in
#     docs/results/mutation-plugin. Only the plugin's tests that start no vLLM engine are selected.
#
#   bash benchmarks/mutation/run.sh [EVERY] [WORKDIR]
#   TARGET=plugin bash benchmarks/mutation/run.sh [EVERY] [WORKDIR]
#
# EVERY (default 20): test every EVERY-th mutant, a deterministic sample (see report.py).
# WORKDIR (default: a new temporary folder): where the snapshot of the tree is made.
# OUT (environment, default: the target's results folder): where summary.json and survivors.md go.
# Needs mutmut in the venv (`pip install mutmut==3.8.1`); VENV overrides the venv folder.
# Verdicts on survivors of both targets are in verdicts.txt beside this script, keyed by mutant name.
#
# mutmut rewrites the tree it runs in, so this copies the working tree (no .git, no venvs, no local .hypothesis
# example database) to WORKDIR and runs there; the checkout is never touched. The mutated files, the tests and
# mutmut's options are in the target's .cfg beside this script, copied to WORKDIR/setup.cfg.
set -euo pipefail

every=${1:-20}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
here=$root/benchmarks/mutation
work=${2:-$(mktemp -d /tmp/vasepatch-mutation.XXXXXX)}
target=${TARGET:-core}
case $target in
    core) cfg=setup.cfg venv=.venv results=docs/results/mutation ;;
    plugin) cfg=plugin.cfg venv=.venv-vllm results=docs/results/mutation-plugin ;;
    *) echo "TARGET must be core or plugin, not $target" >&2; exit 2 ;;
esac
bin=${VENV:-$root/$venv}/bin
out=${OUT:-$root/$results}
test -x "$bin/mutmut" || { echo "mutmut is not installed in $bin (pip install mutmut==3.8.1)" >&2; exit 2; }
if [ "$target" = plugin ]; then
    "$bin/python" -c "import vllm, hypothesis" 2>/dev/null \
        || { echo "the plugin target needs vllm and hypothesis in $bin (pip install hypothesis)" >&2; exit 2; }
fi

mkdir -p "$work"
tar -C "$root" --exclude=./.git --exclude='./.venv*' --exclude=./mutants --exclude='__pycache__' \
    --exclude='*.egg-info' --exclude=./site --exclude=./.hypothesis -cf - . | tar -C "$work" -xf -
cp "$here/$cfg" "$work/setup.cfg"
cd "$work"
echo "snapshot in $work"

export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VASEPATCH_HYPOTHESIS_PROFILE=quick
start=$(date +%s)
# 1. Generate every mutant and record which tests reach which function. The filter matches no
#    mutant on purpose: mutmut then stops (with an assertion) instead of testing all of them.
"$bin/mutmut" run --max-children 2 "vasepatch.no_such_module*" > generate.log 2>&1 || true
test -s mutants/mutmut-stats.json || { tail -c 4000 generate.log >&2; exit 1; }
# 2. Test the sample.
"$bin/python" "$here/report.py" sample --every "$every" > sample.txt
echo "$(wc -l < sample.txt) mutants sampled (every ${every}th)"
# shellcheck disable=SC2046
"$bin/mutmut" run --max-children 2 $(cat sample.txt) > run.log 2>&1 || { tail -c 4000 run.log >&2; exit 1; }
runtime=$(( $(date +%s) - start ))
# 3. The score and the mutants not killed.
"$bin/python" "$here/report.py" report --every "$every" --runtime "$runtime" --out "$out" --target "$target"
