#!/usr/bin/env bash
# Device call 21 (2026-12-02, second session): a second sample of call 20 (the cost model with the big-state
# stage cost, run as code) at P = 12 and 16 on the H200 machine's host cores: --bind-to core under the machine's
# single copy (none) and under CMA, and --bind-to none. Run from the repository root with the carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_model2='for v in "12 none core" "12 cma core" "12 none none" "16 cma core"; do set -- $v
  echo "== P=$1 --bind-to $3, single copy $2"
  timeout 70 mpirun --bind-to $3 -n $1 --mca btl_vader_single_copy_mechanism $2 -x PYTHONPATH python3 -m hpczeco \
    bench scan --sizes 16K,64K,1M,4M,16M --blocks 16,48 --no-plot --out $HPCZECO_RESULTS/model2-$1-$2-$3 2>&1 \
    | grep -E "calibrated|median|rror"
done' STEP_LIMIT_model2=300
STEPS=${STEPS:-"model2"} TAIL=${TAIL:-8} exec bash devtools/device_round.sh
