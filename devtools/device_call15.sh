#!/usr/bin/env bash
# Device call 15 (2026-12-02): the torch glue with its host breakdown and the fla value comparison (issue 18);
# the P=12 scans with the per-piece calibration, and the small-state stall with one busy process pinned to a
# core that a bound rank uses (issue 19). Run from the repository root with the carry [".whl", ".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_glue2="python3 -m hpczeco.torch --bench --profile --json \$HPCZECO_RESULTS/torch-glue.json" STEP_LIMIT_glue2=200
export STEP_CMD_scancal="timeout 100 mpirun --bind-to core -n 12 -x PYTHONPATH python3 -m hpczeco bench scan \
--sizes 16K,1M --blocks 10,16,32 --out \$HPCZECO_RESULTS/scancal" STEP_LIMIT_scancal=110
export STEP_CMD_stall='uname -a; grep -E "^CONFIG_HZ=|CONFIG_SCHED" /boot/config-$(uname -r) 2>/dev/null | head -5;
cat /sys/kernel/debug/sched/base_slice_ns /proc/sys/kernel/sched_min_granularity_ns 2>/dev/null; nproc;
for b in core none; do
  taskset -c 5 sh -c "while :; do :; done" & H=$!
  echo "== P=12 --bind-to $b, one busy process pinned to core 5"
  timeout 45 mpirun --bind-to $b -n 12 -x PYTHONPATH python3 -m hpczeco bench scan --sizes 16K --blocks 16 \
    --repeats 15 --no-plot --out $HPCZECO_RESULTS/stall-$b-hog 2>&1 | grep -E "median|calibrated"
  kill $H; wait $H 2>/dev/null
done
echo "== P=16 --bind-to core, nothing else"
timeout 45 mpirun --bind-to core -n 16 -x PYTHONPATH python3 -m hpczeco bench scan --sizes 16K --blocks 16 \
  --repeats 15 --no-plot --out $HPCZECO_RESULTS/stall-p16 2>&1 | grep -E "median|calibrated"' STEP_LIMIT_stall=160
STEPS=${STEPS:-"glue2 scancal stall"} TAIL=${TAIL:-60} exec bash devtools/device_round.sh
