#!/usr/bin/env bash
# Profile every role of a real `primerl rl` run with py-spy (issue 12, "measure where the time goes"):
#
#   bench/profile_roles.sh runs/demo/sft/weights/step_1000 [OUT_DIR]      # DUR=20 seconds of samples per role
#   .venv/bin/python bench/pyspy_summary.py OUT_DIR/primerl-trainer.txt --root TrainerRunner.run \
#       --phase backward --phase forward --phase Queue.get --phase Optimizer
#
# Starts the demo's RL run from the given model, waits for the trainer's 3rd step, then records DUR seconds of
# raw (collapsed) stacks at 100 Hz from the trainer, orchestrator, inference and broker daemons (with native
# frames: OpenMP/BLAS show up) and from the env worker, then stops the run. Sampling pauses the processes a
# little: the step times of a profiled run are not the bench's. Where a request's CPU goes in a role:
#   .venv/bin/python bench/pyspy_summary.py OUT_DIR/env_worker.txt --active --inclusive --top 40
# The run without the per-request trims (docs/performance.md, "Per-request CPU"), for a before/after:
#   PRIMERL_ENV_WORKER_LEAN=0 bench/profile_roles.sh MODEL_DIR runs/profile-before
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: bench/profile_roles.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-runs/profile}
DUR=${DUR:-20}
PYSPY=.venv/bin/py-spy
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PRIMERL_ENV_PYTHON=${PRIMERL_ENV_PYTHON:-$PWD/.venv-envs/bin/python}
rm -rf "$OUT"; mkdir -p "$OUT"
.venv/bin/primerl rl @ examples/reverse_text_rl.toml --model.name "$MODEL" --output-dir "$OUT/run" \
    --max-steps 1000 > "$OUT/rl.log" 2>&1 &
RL=$!
trap 'kill -INT $RL 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    steps=$(grep -c '"role": "trainer"' "$OUT/run/metrics.jsonl" 2>/dev/null || true)
    [ "${steps:-0}" -ge 3 ] && break
    kill -0 $RL 2>/dev/null || { echo "the run ended early: see $OUT/rl.log"; exit 1; }
    sleep 1
done
recorders=()
for role in trainer orchestrator infer broker; do
    pid=$(pgrep -P $RL -f "primerl-$role" | head -1 || true)
    [ -z "$pid" ] && { echo "no primerl-$role process under the run"; continue; }
    echo "primerl-$role: pid $pid"
    $PYSPY record --pid "$pid" --duration "$DUR" --rate 100 --format raw --native -o "$OUT/primerl-$role.txt" \
        > "$OUT/primerl-$role.pyspy.log" 2>&1 &
    recorders+=($!)
done
orchestrator=$(pgrep -P $RL -f primerl-orchestrator | head -1 || true)
worker=$( [ -n "$orchestrator" ] && pgrep -P "$orchestrator" -f classic_worker | head -1 || true)
if [ -n "$worker" ]; then
    echo "env worker: pid $worker"
    $PYSPY record --pid "$worker" --duration "$DUR" --rate 100 --format raw -o "$OUT/env_worker.txt" \
        > "$OUT/env_worker.pyspy.log" 2>&1 &
    recorders+=($!)
fi
wait "${recorders[@]}" || true
echo "profiles in $OUT (summaries: bench/pyspy_summary.py)"
