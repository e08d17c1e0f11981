#!/usr/bin/env bash
# One call on the GPU machine: run the named steps, each under its own time limit, and pack every log
# and result file into $OUT/results.tgz (the device tool returns at most 8 files), plus the Triton /
# TorchInductor caches into $OUT/caches.tgz so the next call skips fla's autotuning (~150 s) and
# FlexAttention's compile. Carry `.whl` (wheels: fla) and `.device` (caches.tgz from the last call).
#
#   STEPS="smoke gputests gla daaf" bash devtools/device_round.sh
#   STEP_CMD_<name>="..."   overrides or adds a step; STEP_LIMIT_<name>=seconds
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
RES=/tmp/device-res
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
t_start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || echo "wheel install failed"
else
  export PYTHONPATH=$PWD
fi
export TRITON_CACHE_DIR=/tmp/caches/triton TRITON_CACHE_AUTOTUNING=1 TORCHINDUCTOR_CACHE_DIR=/tmp/caches/inductor
export CUPY_CACHE_DIR=/tmp/caches/cupy HPCZECO_RESULTS=$RES
mkdir -p /tmp/caches
[ -f .device/caches.tgz ] && tar -xzf .device/caches.tgz -C /tmp && echo "caches restored ($(du -sh /tmp/caches | cut -f1))"

declare -A CMD LIMIT
CMD[smoke]="nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv; python3 -c 'import cupy, torch, numpy; print(cupy.__version__, torch.__version__, numpy.__version__, cupy.cuda.runtime.getDeviceCount())'"
LIMIT[smoke]=60

summary=()
for step in ${STEPS:-smoke}; do
  var="STEP_CMD_$step"; lim="STEP_LIMIT_$step"
  cmd=${!var:-${CMD[$step]:-}}
  limit=${!lim:-${LIMIT[$step]:-300}}
  if [ -z "$cmd" ]; then echo "unknown step $step"; continue; fi
  s=$(date +%s)
  echo "=== $step (limit ${limit}s) $(date -u +%H:%M:%S) ==="
  timeout --kill-after=10 "$limit" bash -c "$cmd" > "$RES/$step.log" 2>&1
  rc=$?
  e=$(( $(date +%s) - s ))
  tail -n "${TAIL:-30}" "$RES/$step.log"
  summary+=("$step rc=$rc ${e}s")
  tar -czf "$OUT/results.tgz" -C /tmp device-res  # after every step: a call cut short still returns what ran
done
# keep the caches small (the tool returns files of at most 16 MiB): Triton's autotune results (not its
# binaries: with the results known only the winning configs compile) and CuPy's NVRTC binaries
(cd /tmp && { find caches/triton -name '*autotune*' 2>/dev/null; find caches/cupy -type f 2>/dev/null; } > /tmp/cachelist
 tar -czf "$OUT/caches.tgz" -T /tmp/cachelist 2>/dev/null
 if [ "$(stat -c %s "$OUT/caches.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
   grep -v '^caches/cupy' /tmp/cachelist > /tmp/cachelist2; tar -czf "$OUT/caches.tgz" -T /tmp/cachelist2; fi)
tar -czf "$OUT/results.tgz" -C /tmp device-res
echo "=== summary (total $(( $(date +%s) - t_start ))s) ==="
printf '%s\n' "${summary[@]}"
