#!/usr/bin/env bash
# Issue 15, point 5: the GPU path run for real, on a machine the workplace's `device` tool lends
# (one H100/H200, PyTorch 2.11 + CUDA, no vLLM, nothing downloadable). Prepared and tested on CPU;
# benchmarks/gpu/stage.sh packs what the machine lacks into .gpu/part1..N, one device call each.
# `stage` keeps the carried part on the machine; `run` copies the part it carries too, joins and
# checks everything staged (pack.py unpack), installs it into /tmp/site, and runs, each step under
# its own time limit, writing at most 8 files to $OUT. GPU_CHECK_PROFILE picks the steps:
#  hf (default; stage.sh hf):
#   env        torch/CUDA/versions, and where PolicyPair puts the models (parallel.compute_device)
#   collect    mlmt collect, arith level 2, 64 problems x 4 samples, HF engine on the GPU
#   lower      mlmt train-lower, 2 PPO iterations x 8 problems, HF engine
#   joint      mlmt train-joint, one round of configs/demo.yaml on the HF engine
#   throughput benchmarks/speed/train_lower_throughput.py --engines hf: ours against TRL's GRPOTrainer, both on the GPU
#   zero2      one train-lower iteration under torchrun with DeepSpeed ZeRO-2 (NCCL group of one)
#   accel      the same under `accelerate launch` with configs/accelerate/8gpu-zero2.yaml, one process:
#              the DeepSpeed JSON comes from accelerate's config (ACCELERATE_DEEPSPEED_CONFIG_FILE)
#  vllm (stage.sh vllm: vllm 0.26.0, the newest built for the image's torch 2.11):
#   env        as above, vLLM's version included
#   vcollect   mlmt collect 64 x 4 on engine.name=vllm (CUDA; multiprocess engine, weights by CUDA IPC handle)
#   vlower     mlmt train-lower, 2 PPO iterations x 8 problems on vLLM (lower/time/weight_sync: the
#              in-memory sync's seconds per iteration; lower/sync_route in runs.json: shared = the CUDA
#              IPC buffer ran, rpc = it fell back to bytes and the log says why; lower/engine_logprob_gap_max:
#              the sampler's log-probs of the batch against the trainer's: iteration 2 (after a sync) in the
#              range of iteration 1 (no sync yet, bf16 rounding only) where the sync delivered the trainer's
#              weights; benchmarks/speed/weight_sync.py times CPU engines and is not run here)
#   vbench     benchmarks/speed/collect_throughput.py 64 x 4: the three-turn loop against raw vLLM at its batch
#   vjoint     mlmt train-joint, one round of configs/demo.yaml on vLLM
#   vpair      mlmt collect with the writer on a base of its own (model.writer=tiny-random): two vLLM
#              engines on one GPU, the memory split by engine.vllm.writer_share (rollout/engines/vllm/pair.py)
#   vaccel     one train-lower iteration on vLLM under `accelerate launch` with
#              configs/accelerate/8gpu-ddp.yaml, one process: the colocated engine inside a launched rank
#   vcont      collect_throughput.py --continuous-ab 1 at 512 x 4: continuous episodes against batched
#              turns and raw vLLM, with more episodes than vLLM's max_num_seqs (rollout/continuous.py)
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
STAGE=$REPO/.gpu-stage
OUT=${OUT:-$REPO/.gpu-out}
W=${GPU_WORK:-/tmp/gpu-work}
mkdir -p "$STAGE" "$OUT"
PY=${PY:-python3}
carried() { compgen -G ".gpu/part*/manifest-part*.json" > /dev/null; }
case "${1:-}" in
  stage) carried || { echo "stage: this call carried no .gpu/partK" >&2; exit 2; }
         cp -r .gpu/part*/. "$STAGE"/ && ls -la "$STAGE"; exit $? ;;
  run) ;;
  *) echo "usage: bash benchmarks/gpu/check.sh stage|run" >&2; exit 2 ;;
esac
PROFILE=${GPU_CHECK_PROFILE:-hf}
[[ "$PROFILE" == hf || "$PROFILE" == vllm ]] || { echo "GPU_CHECK_PROFILE: hf or vllm, not $PROFILE" >&2; exit 2; }
# A rerun on the same warm machine starts from empty run folders (the stages refuse an --out that
# already holds a run).
rm -rf "$W" && mkdir -p "$W"
if carried; then
  cp -r .gpu/part*/. "$STAGE"/
  # every part of this pack staged and intact, or nothing is installed; trees (vLLM) go to /tmp/site
  "$PY" benchmarks/gpu/pack.py unpack "$STAGE" --site /tmp/site || exit 3
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $("$PY" benchmarks/gpu/pack.py wheels "$STAGE") || exit 4
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
# joint.upper_steps=3: one step past demo.yaml's two Q-only warm-up steps, which train-joint refuses
# to be all of the writer's steps
if [ "$SMALL" = 1 ]; then n=4; it=1; probs=2; joint=(--set joint.lower_iterations=1 --set joint.upper_steps=3
  --set lower.problems_per_iteration=2); else n=64; it=2; probs=8; joint=(); fi
# The HF engine's default of 32 prompts per generate call suits a CPU; on the GPU 64 x 4 samples
# in batches of 32 is 24 calls of eager decoding (the first GPU run's collect ran past 150 s), so
# the GPU collect decodes each turn in one call.
# accelerate's configs fix port 29500; GPU_CHECK_PORT moves it (tests run beside other launchers)
port=(--main_process_port "${GPU_CHECK_PORT:-29500}")
ACCEL=("$PY" -m accelerate.commands.launch --num_processes 1 "${port[@]}")
# what every train-lower step shares; each adds its engine, iterations and --out
LOWER=(train-lower --task arith --no-wandb --no-progress --set lower.problems_per_iteration="$probs" --set task.level=2)
hfb=$([ "$SMALL" = 1 ] && echo 32 || echo 256)
step env 120 "$PY" benchmarks/gpu/env_report.py "$OUT/env.json"
if [ "$PROFILE" = vllm ]; then
  # vLLM's GPU defaults (engine.vllm: gpu_memory_utilization 0.5, enforce_eager, weight_sync=memory,
  # rpc_transport=shared: the multiprocess engine's worker maps the trainer's staging buffer by a CUDA
  # IPC handle; where it cannot, the log says so and syncs go as safetensors bytes over collective_rpc)
  step vcollect 150 "${MLMT[@]}" collect --task arith --level 2 --limit "$n" --n-samples 4 --engine vllm \
    --no-wandb --no-progress --out "$W/vsnapshots"
  step vlower 150 "${MLMT[@]}" "${LOWER[@]}" --engine vllm --iterations "$it" --out "$W/vlower"
  step vbench 180 "$PY" -m benchmarks.speed.collect_throughput --limit "$n" --n-samples 4 --engines vllm --raw-n 4 \
    --raw-runs 1 --out "$OUT/collect_throughput-gpu.json"
  step vjoint 200 "${MLMT[@]}" train-joint -c configs/demo.yaml --engine vllm --rounds 1 --no-wandb --no-progress \
    --set joint.collect_problems="$probs" "${joint[@]}" --out "$W/vjoint"
  step vpair 120 "${MLMT[@]}" collect --task arith --level 2 --limit "$probs" --n-samples 4 --engine vllm \
    --set model.writer=tiny-random --no-wandb --no-progress --out "$W/vpair"
  step vaccel 150 "${ACCEL[@]}" --config_file configs/accelerate/8gpu-ddp.yaml -m tosca_mlmt.cli.main "${LOWER[@]}" \
    --engine vllm --iterations 1 --out "$W/vaccel"
  # more episodes than vLLM's max_num_seqs on an H100/H200 (1024), where batched turns pay a tail per turn
  step vcont 240 "$PY" -m benchmarks.speed.collect_throughput --limit "$([ "$SMALL" = 1 ] && echo 4 || echo 512)" --n-samples 4 --engines vllm --raw-n 4 \
    --raw-runs 0 --continuous on --continuous-ab 1 --out "$OUT/collect_throughput-continuous-gpu.json"
else
  step collect 180 "${MLMT[@]}" collect --task arith --level 2 --limit "$n" --n-samples 4 --engine hf \
    --set engine.batch_size="$hfb" --no-wandb --no-progress --out "$W/snapshots"
  step lower 150 "${MLMT[@]}" "${LOWER[@]}" --engine hf --iterations "$it" --out "$W/lower"
  step joint 200 "${MLMT[@]}" train-joint -c configs/demo.yaml --engine hf --rounds 1 --no-wandb --no-progress \
    --set joint.collect_problems="$probs" "${joint[@]}" --out "$W/joint"
  if [ "$SMALL" != 1 ]; then
    step throughput 240 "$PY" -m benchmarks.speed.train_lower_throughput --engines hf --problems 4 --group 4 \
      --max-new-tokens 32 --iterations 3 --workdir "$W/tl" --out "$OUT/train_lower_throughput-gpu.json"
  fi
  # NCCL and DeepSpeed on the GPU: one process under torchrun (one GPU cannot host two NCCL ranks);
  # with distributed.deepspeed set, the trainer joins a process group even for one process and
  # builds the ZeRO-2 engine, so the collective setup, ZeRO's gradient partitioning and the weight
  # push run on CUDA.
  step zero2 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m tosca_mlmt.cli.main "${LOWER[@]}" \
    --engine hf --iterations 1 --set distributed.deepspeed=configs/deepspeed/zero2.json --out "$W/zero2"
  step accel 240 "${ACCEL[@]}" --config_file configs/accelerate/8gpu-zero2.yaml -m tosca_mlmt.cli.main "${LOWER[@]}" \
    --engine hf --iterations 1 --out "$W/accel"
fi
"$PY" benchmarks/gpu/env_report.py --runs "$W" "$OUT/runs.json" >> "$LOG" 2>&1
cat "$OUT/steps.jsonl"
