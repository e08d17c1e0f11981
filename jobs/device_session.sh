#!/usr/bin/env bash
# One GPU-machine session (2 x H200, 32 cores) in one bounded call. Steps, in the order of $STEPS:
#   multi  the 2-GPU suite over CUDA-aware MPI (UCX) + staged + NCCL;
#   mpitest  the 2-rank GPU pytest file (per-rank logs);  tests  the 1-GPU pytest files, whole, in file order;
#   par    side by side: the single-GPU GLA suite on GPU 0 (cores 0-7); on GPU 1 (cores 8-15) the DAAF GPU
#          suite (DAAF=1) and the 1-GPU pytest files (TESTS=1); ZeCO weak scaling on host cores 16-31 (CPU_ZECO=1).
# Every step is bounded by `timeout`; the logs and JSON are packed into $OUT/results.tgz.
# Needs (carried): .whl/ (libucx-cu13, flash-linear-attention, fla-core wheels), .device/cuda-aware-mpi.sh.
# Usage from the repo root:  bash jobs/device_session.sh
#   seconds: T_GPU (GLA suite), T_DAAF, T_MULTI, T_TEST, T_CPU; DAAF_SEQS, DAAF_ARGS; STEPS="multi par".
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

step_multi() {
  log "2-GPU suite (cuda-aware, staged, nccl)"
  ( source .device/cuda-aware-mpi.sh && export HPCZECO_CUDA_AWARE=1 &&
    timeout $T_MULTI taskset -c 0-15 mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x LD_LIBRARY_PATH \
      -x HPCZECO_CUDA_AWARE -x UCX_TLS -x NCCL_NVLS_ENABLE python3 -m hpczeco.drivers.gpu_suite --multi --out $R/gpu $MULTI_ARGS
  ) > $R/multi.log 2>&1; echo "multi exit $?"
  tail -70 $R/multi.log
}

step_mpitest() {
  log "GPU pytest file under mpirun -n 2 (per-rank output in $R/pytest_mpi/)"
  ( source .device/cuda-aware-mpi.sh && export HPCZECO_CUDA_AWARE=1 HPCZECO_TEST_VERBOSE_RANKS=1 &&
    timeout $T_MPITEST mpirun --allow-run-as-root --bind-to none -n 2 --output-filename $R/pytest_mpi \
      -x PYTHONPATH -x LD_LIBRARY_PATH -x HPCZECO_CUDA_AWARE -x UCX_TLS -x HPCZECO_TEST_VERBOSE_RANKS \
      $PYTEST -x -v -o faulthandler_timeout=40 -m mpi tests/test_gpu_transport.py ) > $R/pytest_mpi.log 2>&1
  echo "exit $?"; tail -5 $R/pytest_mpi.log
  for f in $(find $R/pytest_mpi -type f | sort); do echo "== $f"; grep -v "^$" "$f" | tail -60; done
}

step_tests() {
  log "GPU pytest files, whole files in file order (1 GPU)"
  timeout $T_TEST $PYTEST -x tests/test_gpu_gla.py tests/test_gpu_transport.py tests/test_gpu_daaf.py \
    > $R/pytest.log 2>&1; echo "exit $?"; grep -v "Warning\|warn(\|NAT = \|^  \|^$" $R/pytest.log | tail -40
}

step_par() {
  log "side by side: GLA suite (GPU 0) | DAAF suite + pytest (GPU 1) | host ZeCO (cores 16-31)"
  if [ "$CPU_ZECO" = 1 ]; then
    ( export OMP_NUM_THREADS=1; for P in 8 16; do
        timeout $((T_CPU / 2)) taskset -c 16-31 $MPIRUN -n $P -x PYTHONPATH -x OMP_NUM_THREADS python3 -m hpczeco \
          bench zeco --tokens 16384 --H 4 --K 64 --V 64 --repeats 3 --warmup 1 --topologies ring,tree,allgather,serial \
          --out $R/zeco 2>&1 | tail -8
      done > $R/zeco.log 2>&1 ) &
  fi
  ( CUDA_VISIBLE_DEVICES=0 timeout $T_GPU taskset -c 0-7 python3 -m hpczeco.drivers.gpu_suite --quick --out $R/gpu \
      > $R/gpu.log 2>&1; echo "gpu_suite exit $?" >> $R/gpu.log ) &
  ( export CUDA_VISIBLE_DEVICES=1
    if [ "$TESTS" = 1 ]; then
      timeout $T_TEST taskset -c 8-15 $PYTEST -m gpu tests/test_gpu_gla.py tests/test_gpu_transport.py \
        tests/test_gpu_daaf.py > $R/pytest.log 2>&1; echo "pytest exit $?" >> $R/pytest.log
    fi
    if [ "$DAAF" = 1 ]; then
      timeout $T_DAAF taskset -c 8-15 python3 -m hpczeco.drivers.gpu_daaf_suite --out $R/daaf --seqs "$DAAF_SEQS" \
        --reps 10 $DAAF_ARGS > $R/daaf.log 2>&1; echo "gpu_daaf_suite exit $?" >> $R/daaf.log
    fi ) &
  wait
  log "GLA suite"; tail -80 $R/gpu.log
  [ "$TESTS" = 1 ] && { log "pytest (1 GPU)"; tail -40 $R/pytest.log; }
  [ "$DAAF" = 1 ] && { log "DAAF suite"; tail -40 $R/daaf.log; }
  [ "$CPU_ZECO" = 1 ] && { log "ZeCO on host cores"; cat $R/zeco.log; }
}

for s in $STEPS; do "step_$s"; done
tar czf "$OUT/results.tgz" runs/device 2>/dev/null
log "done"
