#!/usr/bin/env bash
# The GPU steps the open issues still need, for one call of devtools/device_round.sh on one H200 (16 cores):
#   gla      (issue 13) the GLA GPU test files, each in its own process, -v to its log
#   daaf     (issue 13) the DAAF / device-planner / Hopper GPU test files, the same way
#   torch    (issue 13) the PyTorch GPU tests (without the fla cross-check)
#   torchfla (issue 18) the same tests' bf16 cases against fla too (HPCZECO_TEST_FLA=1: fla autotunes each new shape)
#   mpigpu   (issue 13) the 2-rank GPU tests under mpirun -n 2 (one GPU, two ranks)
#   glue     (issue 18) `python3 -m hpczeco.torch --bench`: the autograd glue's overhead over the raw kernels
#   glueprof (issue 18) the same without fla (its timings are in `shapes`), with the in-a-row timings and cProfile
#   grid     (issue 14) the accuracy grid against fla at the (K, V) and lengths whose fla autotuning is cached
#   glatc    (issue 14) the chunk-parallel tensor-core cases of test_gpu_gla_checks.py and the output-kernel tests
#   glafast  (issue 14) `hpczeco bench gpu-gla` at the three shapes, the former output kernel (out1) side by side
#   gridtc   (issue 14) the accuracy grid at the tensor-core head sizes (GRID_KV, GRID_T, GRID_LIMIT: defaults below)
#   shapes   (issue 14) `hpczeco bench gpu-gla --shapes 1,2` and the accuracy grid (`--grid`)
#   scan12   (issue 19) the 12-rank scan on host cores (the 16 ms stall seen once), ring vs allgather, with the
#            cgroup's CPU quota and throttling counters before and after (a 16.0 ms floor could be CFS bandwidth
#            throttling of the container: nr_throttled / throttled_usec tell)
# Run from the repository root with the carry [".whl", ".device"] (fla wheels; .device/caches.tgz holds
# fla's autotune results, so `glue` and `shapes` skip the ~150 s first call):
#   STEPS="gla torch mpigpu" bash devtools/device_open_items.sh   # one call is at most 600 s, so three calls:
#   STEPS="daaf glue" ...;  STEPS="shapes scan12" ...  (each step's limit below; the sums stay under 600 s)
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PYTEST="python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu"
files() {  # each file in its own process (a poisoned CUDA context stays in its file), bounded
  local f
  for f in "$@"; do echo "== $f"; timeout 170 $PYTEST "$f" 2>&1 | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed"; done
}
export -f files
export PYTEST
export STEP_CMD_gla="files tests/test_gpu_gla.py tests/test_gpu_gla_checks.py" STEP_LIMIT_gla=300
export STEP_CMD_daaf="files tests/test_gpu_daaf.py tests/test_gpu_daaf_checks.py tests/test_daaf_device_api.py \
tests/test_daaf_hopper_emu.py" STEP_LIMIT_daaf=330
export STEP_CMD_torch="files tests/test_torch_gpu.py" STEP_LIMIT_torch=120
export STEP_CMD_torchfla="HPCZECO_TEST_FLA=1 timeout 400 \$PYTEST tests/test_torch_gpu.py -k bfloat16 2>&1 \
| grep -E 'PASS|FAIL|ERROR|SKIP|passed|failed'" STEP_LIMIT_torchfla=420
export STEP_CMD_mpigpu="timeout 150 mpirun --bind-to none -n 2 -x PYTHONPATH python3 -m pytest -q -p no:cacheprovider \
-m 'mpi and gpu' tests/test_gpu_transport.py tests/test_gpu_zeco.py tests/test_torch_gpu.py" STEP_LIMIT_mpigpu=160
export STEP_CMD_glue="python3 -m hpczeco.torch --bench --json \$HPCZECO_RESULTS/torch-glue.json" STEP_LIMIT_glue=260
export STEP_CMD_glueprof="python3 -m hpczeco.torch --bench --no-fla --profile --json \$HPCZECO_RESULTS/torch-glue-prof.json" \
  STEP_LIMIT_glueprof=90
export STEP_CMD_grid="python3 -m hpczeco bench gpu-gla --shapes 0 --grid --grid-kv 60x64,128x128 \
--grid-t 777,1000,1024,2048 --out \$HPCZECO_RESULTS/grid" STEP_LIMIT_grid=120
export STEP_CMD_glatc="timeout 200 \$PYTEST tests/test_gpu_gla_checks.py -k 'tc-chunk or chunk_parallel or every_kernel or backward_matches_reference' 2>&1 \
| grep -E 'PASS|FAIL|ERROR|passed|failed'" STEP_LIMIT_glatc=210
export STEP_CMD_glafast="python3 -m hpczeco bench gpu-gla --shapes 0,1,2 --variants out1 --out \$HPCZECO_RESULTS/gla \
&& python3 -m hpczeco bench gpu-gla --shapes 2,1 --variants out2 --no-fla --out \$HPCZECO_RESULTS/gla21" STEP_LIMIT_glafast=300
export STEP_CMD_gridtc="python3 -m hpczeco bench gpu-gla --shapes 0 --grid --grid-kv \${GRID_KV:-128x128,64x64} \
--grid-t \${GRID_T:-1,63,777,1000,1024,2048} --out \$HPCZECO_RESULTS/gridtc" STEP_LIMIT_gridtc=${GRID_LIMIT:-280}
export STEP_CMD_shapes="python3 -m hpczeco bench gpu-gla --shapes 1,2 --variants walk1 --out \$HPCZECO_RESULTS/gla \
&& python3 -m hpczeco bench gpu-gla --shapes 0 --grid --out \$HPCZECO_RESULTS/grid" STEP_LIMIT_shapes=360
export CG="/sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu.stat /sys/fs/cgroup/cpu/cpu.cfs_quota_us \
/sys/fs/cgroup/cpu/cpu.cfs_period_us /sys/fs/cgroup/cpu/cpu.stat"  # cgroup v2, then v1
export STEP_CMD_scan12="cg() { echo \"-- cgroup \$1:\"; cat \$CG 2>/dev/null | tr '\\n' ' '; echo; }; cg before; for b in core none; do echo \"== --bind-to \$b\"; timeout 90 mpirun --bind-to \$b -n 12 \
-x PYTHONPATH python3 -m hpczeco bench scan --sizes 16K,1M --blocks 16 --out \$HPCZECO_RESULTS/scan12-\$b; cg \"after \$b\"; done" \
  STEP_LIMIT_scan12=220
STEPS=${STEPS:-"gla torch mpigpu"} TAIL=${TAIL:-40} exec bash devtools/device_round.sh
