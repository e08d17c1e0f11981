#!/usr/bin/env bash
# Device call 20 (2026-12-02, second session): issue 19, the cost model with the big-state stage cost
# (LinkParams.ring_beta_big, calibrated on 16 MiB) run as code: `bench scan` on the H200 machine's host cores at
# P = 8, 12, 16, --bind-to core, under the machine's own single copy (none) and under CMA.
# Run from the repository root with the carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_model='for v in "12 none 16K,64K,1M,4M,16M" "12 cma 16K,64K,1M,4M,16M" "8 cma 16K,1M,4M,16M" \
    "16 cma 16K,1M,4M,16M" "8 none 16K,1M,4M,16M" "16 none 16K,1M,4M,16M"; do set -- $v
  echo "== P=$1 --bind-to core, single copy $2"
  timeout 70 mpirun --bind-to core -n $1 --mca btl_vader_single_copy_mechanism $2 -x PYTHONPATH python3 -m hpczeco \
    bench scan --sizes $3 --blocks 16,48,96 --no-plot --out $HPCZECO_RESULTS/model-$1-$2 2>&1 \
    | grep -E "calibrated|note|median|rror"
done' STEP_LIMIT_model=420
STEPS=${STEPS:-"model"} TAIL=${TAIL:-12} exec bash devtools/device_round.sh
