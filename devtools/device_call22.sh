#!/usr/bin/env bash
# Device call 22 (2026-12-02, second session): issue 19's 16.0 ms as four scheduler slices. The CPU box's
# oversubscription plateaus are multiples of its 4.0 ms slice (two busy processes on one core alternate every
# 4.03 ms, devtools/cpu_slice.py); here: the slice of the H200 machine's VM, then two 12-rank jobs started at
# once with --bind-to core (each mpirun binds its ranks to cores 0-11 on its own, so every core runs a rank of
# each job), 16 KiB and 1 MiB. Run from the repository root with the carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_slice='taskset -c 3 python3 devtools/cpu_slice.py A & taskset -c 3 python3 devtools/cpu_slice.py B; wait'
export STEP_LIMIT_slice=20
export STEP_CMD_twojobs='for j in A B; do
  timeout 80 mpirun --bind-to core -n 12 -x PYTHONPATH python3 -m hpczeco bench scan --sizes 16K,1M --blocks 16 \
    --ring-big 0 --no-plot --out $HPCZECO_RESULTS/two-$j > $HPCZECO_RESULTS/two-$j.log 2>&1 &
done; wait; for j in A B; do echo "== job $j"; grep -E "calibrated|median" $HPCZECO_RESULTS/two-$j.log; done
python3 -c "
import json
for j in \"AB\":
    d = json.load(open(\"$HPCZECO_RESULTS/two-%s/scan_P12.json\" % j))
    for r in d[\"results\"]:
        if r[\"nbytes\"] <= 16384:
            print(j, r[\"label\"], [round(t * 1e3, 1) for t in r[\"times_s\"]])
"' STEP_LIMIT_twojobs=100
STEPS=${STEPS:-"slice twojobs"} TAIL=${TAIL:-60} exec bash devtools/device_round.sh
