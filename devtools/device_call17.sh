#!/usr/bin/env bash
# Device call 17 (2026-12-02, second session): issue 19 on the H200 machine's 16 host cores.
#   sweep     the ring alone at 1, 2 and 4 MiB over a ladder of blocks (piece sizes 8-512 KiB), P = 8, 12, 16,
#             --bind-to core: the stage cost as a function of the piece size
#   mca       Open MPI's vader parameters, then P=12 scans at 16 KiB and 1 MiB over the TCP BTL (loopback) and
#             with vader's single-copy mechanism off: does either give the issue's 16.0 ms floor?
#   zeco8     ZeCO weak scaling at P=8 (16k tokens/rank, H=4, K=V=64, float32), --bind-to core, one BLAS thread
#   torch2    the torch GPU tests the first call's time limit cut (the ZeCO ones)
# Run from the repository root with the carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_sweep='for P in 12 8 16; do echo "== sweep P=$P --bind-to core"
  timeout 38 mpirun --bind-to core -n $P -x PYTHONPATH python3 -m hpczeco bench scan --sizes 1M,2M,4M \
    --topologies ring --blocks 2,4,8,12,16,20,24,28,32,36,40,48,53,64,80,96,128 --no-plot \
    --out $HPCZECO_RESULTS/sweep-$P 2>&1 | grep -E "calibrated|median"
done' STEP_LIMIT_sweep=120
export STEP_CMD_mca='ompi_info --param btl vader --level 9 2>/dev/null | grep -E "single_copy|eager_limit|max_send|rndv|fbox|poll" | head -20
ompi_info --param pml ob1 --level 9 2>/dev/null | grep -E "use_|limit" | head; ompi_info | grep -E "Open MPI:|btl|pml" | head -12
for v in "tcp --mca btl self,tcp" "nocopy --mca btl_vader_single_copy_mechanism none" "yield --mca mpi_yield_when_idle 1"; do
  set -- $v; n=$1; shift; echo "== P=12 --bind-to core $*"
  timeout 45 mpirun --bind-to core -n 12 "$@" -x PYTHONPATH python3 -m hpczeco bench scan --sizes 16K,1M --blocks 16 \
    --no-plot --out $HPCZECO_RESULTS/mca-$n 2>&1 | grep -E "calibrated|median|rror"
done' STEP_LIMIT_mca=150
export STEP_CMD_zeco8='OMP_NUM_THREADS=1 timeout 160 mpirun --bind-to core -n 8 -x PYTHONPATH -x OMP_NUM_THREADS python3 -m hpczeco \
  bench zeco --tokens 16384 --H 4 --K 64 --V 64 --repeats 5 --warmup 1 --out $HPCZECO_RESULTS/zeco8' STEP_LIMIT_zeco8=170
export STEP_CMD_torch2='timeout 90 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/test_torch_gpu.py -k zeco 2>&1 \
  | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|Error"' STEP_LIMIT_torch2=100
STEPS=${STEPS:-"sweep mca zeco8 torch2"} TAIL=${TAIL:-60} exec bash devtools/device_round.sh
