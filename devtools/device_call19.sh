#!/usr/bin/env bash
# Device call 19 (2026-12-02, second session): issue 19's 16.0 ms, in the one configuration not yet tried: the
# code of the issue's day (b521ce1, in .device/old; see device_call16.sh) with vader's single copy by CMA, which
# jobs/device_session.sh sets (the machine's environment sets it to none); --bind-to core (the issue's
# command) and jobs/device_session.sh's own `--bind-to none --oversubscribe`; then HEAD the same way.
# Run from the repository root with the carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_oldcma='env | grep -E "^OMPI_MCA|^PMIX_MCA|^OMPI_" | sort; R=$HPCZECO_RESULTS; for code in old head; do
  if [ $code = old ]; then cd .device/old; export PYTHONPATH=$PWD; fi
  for b in "core" "none --oversubscribe"; do
    echo "== $code --bind-to $b --mca btl_vader_single_copy_mechanism cma"
    timeout 50 mpirun --bind-to $b --mca btl_vader_single_copy_mechanism cma -n 12 -x PYTHONPATH python3 -m hpczeco \
      bench scan --sizes 16K,1M,16M --blocks 16 --no-plot --out $R/cma-$code-${b%% *} 2>&1 | grep -E "calibrated|median|rror"
  done
  [ $code = old ] && { cd ../..; export PYTHONPATH=$PWD; }
done' STEP_LIMIT_oldcma=230
STEPS=${STEPS:-"oldcma"} TAIL=${TAIL:-80} exec bash devtools/device_round.sh
