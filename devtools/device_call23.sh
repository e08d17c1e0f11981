#!/usr/bin/env bash
# Device call 23 (2026-12-02, second session): the final code on the H200 machine's host cores: one 12-rank job
# (--bind-to core; the cost model with every ring term, the core-sharing check silent), then two 12-rank jobs at
# once on the same cores (the check must name the shared cores). Run from the repository root, carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_final='timeout 70 mpirun --bind-to core -n 12 -x PYTHONPATH python3 -m hpczeco bench scan \
  --sizes 16K,1M,4M,16M --blocks 16,48 --no-plot --out $HPCZECO_RESULTS/final-12 2>&1 | grep -E "warning|calibrated|median|rror"' \
  STEP_LIMIT_final=80
export STEP_CMD_shared='for j in A B; do
  timeout 40 mpirun --bind-to core -n 12 -x PYTHONPATH python3 -m hpczeco bench scan --sizes 16K --blocks 16 \
    --no-calibrate --repeats 5 --no-plot --out $HPCZECO_RESULTS/shared-$j > $HPCZECO_RESULTS/shared-$j.log 2>&1 &
done; wait; for j in A B; do echo "== job $j"; grep -E "warning|median|scan time" $HPCZECO_RESULTS/shared-$j.log; done' \
  STEP_LIMIT_shared=50
STEPS=${STEPS:-"final shared"} TAIL=${TAIL:-40} exec bash devtools/device_round.sh
