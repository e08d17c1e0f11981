#!/usr/bin/env bash
# One GPU-machine session (2 x H200, 32 cores) in one call: the single-GPU GLA suite, the 2-GPU suite
# over CUDA-aware MPI, the DAAF GPU suite, and (in the background, on other cores) ZeCO weak scaling on
# host cores. Every step is bounded by `timeout`; results are packed into $OUT/results.tgz.
# Needs (carried): .whl/ (libucx-cu13, flash-linear-attention, fla-core wheels), .device/cuda-aware-mpi.sh.
# Usage from the repo root:  bash jobs/device_session.sh
set -u
OUT=${OUT:-runs/device-out}
R=runs/device
mkdir -p "$OUT" $R
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
T_GPU=${T_GPU:-300} T_MULTI=${T_MULTI:-80} T_DAAF=${T_DAAF:-95} T_CPU=${T_CPU:-290}
log() { echo "[$(date +%T)] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fla_core-*.whl \
  .whl/flash_linear_attention-*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
python3 -c 'import cupy; print("GPUs:", cupy.cuda.runtime.getDeviceCount())'; nproc
MPIRUN="mpirun --allow-run-as-root --bind-to none --oversubscribe --mca btl_vader_single_copy_mechanism cma"

# host-core ZeCO weak scaling in the background on cores 8-31 (the GPU steps use cores 0-7)
( export OMP_NUM_THREADS=1; for P in 8 16; do
    timeout $((T_CPU / 2)) taskset -c 8-31 $MPIRUN -n $P -x PYTHONPATH -x OMP_NUM_THREADS python3 -m hpczeco \
      bench zeco --tokens 16384 --H 4 --K 64 --V 64 --repeats 3 --warmup 1 --topologies ring,tree,allgather,serial \
      --out $R/zeco 2>&1 | tail -8
  done > $R/zeco.log 2>&1 ) &
cpu_pid=$!

log "single-GPU GLA suite"
timeout $T_GPU taskset -c 0-7 python3 -m hpczeco.drivers.gpu_suite --quick --out $R/gpu > $R/gpu.log 2>&1; echo "exit $?"
tail -30 $R/gpu.log
log "2-GPU suite over CUDA-aware MPI (UCX)"
( source .device/cuda-aware-mpi.sh && export HPCZECO_CUDA_AWARE=1 &&
  timeout $T_MULTI taskset -c 0-7 mpirun --allow-run-as-root --bind-to none -n 2 -x PYTHONPATH -x LD_LIBRARY_PATH \
    -x HPCZECO_CUDA_AWARE -x UCX_TLS -x NCCL_NVLS_ENABLE python3 -m hpczeco.drivers.gpu_suite --multi --out $R/gpu
) > $R/multi.log 2>&1; echo "exit $?"
tail -25 $R/multi.log
log "DAAF GPU suite"
timeout $T_DAAF taskset -c 0-7 python3 -m hpczeco.drivers.gpu_daaf_suite --out $R/daaf --seqs 32768 --reps 10 \
  > $R/daaf.log 2>&1; echo "exit $?"
tail -25 $R/daaf.log
wait $cpu_pid
log "ZeCO on host cores"; cat $R/zeco.log
tar czf "$OUT/results.tgz" runs/device 2>/dev/null
log "done"
