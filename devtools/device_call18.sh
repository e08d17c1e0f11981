#!/usr/bin/env bash
# Device call 18 (2026-12-02, second session): issue 19, the ring's rugged stage cost at 4 MiB (calls 16-17:
# pieces of ~100-350 KiB bimodal, median up to 1.6x the minimum) under Open MPI's default single-copy (CMA)
# against vader's copy-in/copy-out (btl_vader_single_copy_mechanism none), P = 12 and 16, --bind-to core.
# Run from the repository root with the carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_copy='for v in "12 none" "12 cma" "16 none" "16 cma" "8 none"; do set -- $v
  echo "== P=$1 --bind-to core, single copy $2"
  timeout 60 mpirun --bind-to core -n $1 --mca btl_vader_single_copy_mechanism $2 -x PYTHONPATH python3 -m hpczeco \
    bench scan --sizes 16K,1M,4M,16M --blocks 16,24,32,48,64,96 --no-plot --out $HPCZECO_RESULTS/copy-$1-$2 2>&1 \
    | grep -E "calibrated|median|rror"
done' STEP_LIMIT_copy=320
STEPS=${STEPS:-"copy"} TAIL=${TAIL:-10} exec bash devtools/device_round.sh
