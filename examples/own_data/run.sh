#!/usr/bin/env bash
# examples/own_data: collect, train the solver, evaluate it. Run from the repository root:
#   bash examples/own_data/run.sh [extra mlmt options, passed to every command]
# Outputs go under $OUT (default runs/examples/own_data).
set -euo pipefail
CFG=examples/own_data/config.yaml
OUT=${OUT:-runs/examples/own_data}

# 1. episodes of the untrained pair on 4 training problems: one snapshot, the reward in its summary
mlmt collect -c "$CFG" --limit 4 --out "$OUT/snapshots" "$@"
# 2. PPO on the solver, online: each iteration draws 2 training problems and scores them with rewards.py
mlmt train-lower -c "$CFG" --out "$OUT/run" "$@"
# 3. the trained solver (and the untrained writer) on the held-out rows, greedily
mlmt eval -c "$CFG" --run "$OUT/run" --out "$OUT/eval" "$@"
