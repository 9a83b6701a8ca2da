#!/usr/bin/env bash
# examples/custom_task: a task class named by path. Run from the repository root:
#   bash examples/custom_task/run.sh [extra mlmt options, passed to every command]
# Outputs go under $OUT (default runs/examples/custom_task).
set -euo pipefail
CFG=examples/custom_task/config.yaml
OUT=${OUT:-runs/examples/custom_task}

# 1. episodes of the untrained pair on 4 generated lists; the writer reads SortTask's checker message
mlmt collect -c "$CFG" --limit 4 --out "$OUT/snapshots" "$@"
# 2. PPO on the solver, online, with SortTask's partial credit (up to 0.5 for the right numbers in the wrong order)
mlmt train-lower -c "$CFG" --out "$OUT/run" "$@"
# 3. the trained solver on 20 held-out lists, greedily
mlmt eval -c "$CFG" --run "$OUT/run" --out "$OUT/eval" --limit 20 "$@"
