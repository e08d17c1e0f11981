#!/usr/bin/env bash
# One GPU-machine session (2 x H200, 32 cores) in one bounded call. Steps, in the order of $STEPS:
#   multi    `hpczeco bench gpu-multi` on 2 GPUs over CUDA-aware MPI (UCX) + staged + NCCL;
#   mpitest  the 2-rank GPU pytest files (tests/test_gpu_transport.py, tests/test_gpu_zeco.py; per-rank logs);
#   tests    the 1-GPU pytest files (`-m gpu`), each file in its own process, in file order;
#   par      side by side: on GPU 0 (cores 0-7) the GLA GPU tests (TESTS=1) then `hpczeco bench gpu-gla --quick`;
#            on GPU 1 (cores 8-15) the DAAF and transport GPU tests (TESTS=1) then `hpczeco bench gpu-daaf`
#            (DAAF=1); ZeCO weak scaling on host cores 16-31 (CPU_ZECO=1).
# Tests check, benches measure: the checks are pytest files (-m gpu), the timings `hpczeco bench gpu-*`.
# Each pytest file runs in its own process, so a kernel fault (a poisoned CUDA context) stays in its file.
# Every step is bounded by `timeout`; the logs, JUnit XML and JSON are packed into $OUT/results.tgz.
# Needs (carried): .whl/ (libucx-cu13, flash-linear-attention, fla-core wheels), .device/cuda-aware-mpi.sh.
# Usage from the repo root:  bash jobs/device_session.sh
#   seconds: T_GPU (GLA bench), T_DAAF (DAAF bench), T_MULTI, T_TEST (per pytest file), T_MPITEST, T_CPU;
#   DAAF_SEQS, DAAF_ARGS (more `bench gpu-daaf` options); MULTI_ARGS (`bench gpu-multi` options, e.g.
#   --zeco-only); STEPS="multi par".
set -u
OUT=${OUT:-runs/device-out}
R=runs/device
mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
T_GPU=${T_GPU:-300} T_DAAF=${T_DAAF:-300} T_MULTI=${T_MULTI:-150} T_TEST=${T_TEST:-150} T_CPU=${T_CPU:-280} T_MPITEST=${T_MPITEST:-90}
DAAF_SEQS=${DAAF_SEQS:-8192,32768,131072} DAAF_ARGS=${DAAF_ARGS:-} STEPS=${STEPS:-"multi mpitest par"}
DAAF=${DAAF:-1} TESTS=${TESTS:-1} CPU_ZECO=${CPU_ZECO:-1} MULTI_ARGS=${MULTI_ARGS:-}
log() { echo "[$(date +%T)] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-*.whl \
  .whl/flash_linear_attention-*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -c 'import cupy; print("GPUs:", cupy.cuda.runtime.getDeviceCount())'; nproc
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
MPIRUN="mpirun --allow-run-as-root --bind-to none --oversubscribe --mca btl_vader_single_copy_mechanism cma"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"

GLA_TESTS="tests/test_gpu_gla.py tests/test_gpu_gla_checks.py"
DAAF_TESTS="tests/test_gpu_daaf.py tests/test_gpu_daaf_checks.py tests/test_gpu_transport.py"

pytest_files() {  # LOG-PREFIX FILE...: `pytest -m gpu` on each file in its own bounded process
  local pre=$1; shift
  for f in "$@"; do
    local name=$(basename "$f" .py)
    timeout $T_TEST $PYTEST -m gpu --junitxml=$R/$pre-$name.xml "$f" > $R/$pre-$name.log 2>&1
    echo "$f exit $?"
    grep -v "Warning\|warn(\|NAT = \|^  \|^$" $R/$pre-$name.log | tail -15
  done
}

step_multi() {
  log "bench gpu-multi on 2 GPUs (cuda-aware, staged, nccl)"
  ( source .device/cuda-aware-mpi.sh && export HPCZECO_CUDA_AWARE=1 &&
    timeout $T_MULTI taskset -c 0-15 mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x LD_LIBRARY_PATH \
      -x HPCZECO_CUDA_AWARE -x UCX_TLS -x NCCL_NVLS_ENABLE python3 -m hpczeco bench gpu-multi --out $R/gpu $MULTI_ARGS
  ) > $R/multi.log 2>&1; echo "multi exit $?"
  tail -70 $R/multi.log
}

step_mpitest() {
  log "2-rank GPU pytest files under mpirun -n 2 (per-rank output in $R/pytest_mpi/)"
  ( source .device/cuda-aware-mpi.sh && export HPCZECO_CUDA_AWARE=1 HPCZECO_TEST_VERBOSE_RANKS=1 &&
    timeout $T_MPITEST mpirun --allow-run-as-root --bind-to none -n 2 --output-filename $R/pytest_mpi \
      -x PYTHONPATH -x LD_LIBRARY_PATH -x HPCZECO_CUDA_AWARE -x UCX_TLS -x HPCZECO_TEST_VERBOSE_RANKS \
      $PYTEST -x -v -o faulthandler_timeout=40 -m mpi tests/test_gpu_transport.py tests/test_gpu_zeco.py
  ) > $R/pytest_mpi.log 2>&1
  echo "exit $?"; tail -5 $R/pytest_mpi.log
  for f in $(find $R/pytest_mpi -type f | sort); do echo "== $f"; grep -v "^$" "$f" | tail -60; done
}

step_tests() {
  log "1-GPU pytest files (-m gpu), each in its own process"
  pytest_files pytest $GLA_TESTS $DAAF_TESTS
}

step_par() {
  log "side by side: GLA tests + bench (GPU 0) | DAAF tests + bench (GPU 1) | host ZeCO (cores 16-31)"
  if [ "$CPU_ZECO" = 1 ]; then
    ( export OMP_NUM_THREADS=1; for P in 8 16; do
        timeout $((T_CPU / 2)) taskset -c 16-31 $MPIRUN -n $P -x PYTHONPATH -x OMP_NUM_THREADS python3 -m hpczeco \
          bench zeco --tokens 16384 --H 4 --K 64 --V 64 --repeats 3 --warmup 1 --topologies ring,tree,allgather,serial \
          --out $R/zeco 2>&1 | tail -10
      done > $R/zeco.log 2>&1 ) &
  fi
  ( export CUDA_VISIBLE_DEVICES=0; taskset -cp 0-7 $BASHPID > /dev/null
    [ "$TESTS" = 1 ] && pytest_files pytest0 $GLA_TESTS > $R/pytest0.log 2>&1
    timeout $T_GPU python3 -m hpczeco bench gpu-gla --quick --out $R/gpu > $R/gpu.log 2>&1
    echo "bench gpu-gla exit $?" >> $R/gpu.log ) &
  ( export CUDA_VISIBLE_DEVICES=1; taskset -cp 8-15 $BASHPID > /dev/null
    [ "$TESTS" = 1 ] && pytest_files pytest1 $DAAF_TESTS > $R/pytest1.log 2>&1
    if [ "$DAAF" = 1 ]; then
      timeout $T_DAAF python3 -m hpczeco bench gpu-daaf --out $R/daaf --seqs "$DAAF_SEQS" --reps 10 $DAAF_ARGS \
        > $R/daaf.log 2>&1; echo "bench gpu-daaf exit $?" >> $R/daaf.log
    fi ) &
  wait
  [ "$TESTS" = 1 ] && { log "GLA GPU tests (GPU 0)"; cat $R/pytest0.log
                        log "DAAF + transport GPU tests (GPU 1)"; cat $R/pytest1.log; }
  log "bench gpu-gla"; tail -80 $R/gpu.log
  [ "$DAAF" = 1 ] && { log "bench gpu-daaf"; tail -40 $R/daaf.log; }
  [ "$CPU_ZECO" = 1 ] && { log "ZeCO on host cores"; cat $R/zeco.log; }
}

for s in $STEPS; do "step_$s"; done
tar czf "$OUT/results.tgz" runs/device 2>/dev/null
log "done"
