#!/usr/bin/env bash
# Device call 16 (2026-12-02, second session): issue 19 on the H200 machine's 16 host cores.
#   oldstall  the code the issue's 16.0 ms was measured on (b521ce1, unpacked into .device/old by
#             `git archive b521ce1 collectives drivers gpu hpczeco pyproject.toml | tar -x -C .device/old`),
#             the issue's command at P=12, with and without $HPCZECO_COLLECTIVE_TIMEOUT, --bind-to core and none
#   scannew   HEAD's `bench scan` (ring_beta calibration) at P = 8, 12, 16, --bind-to core, and P=12 --bind-to none
#   torch     the PyTorch GPU tests (the saved-tensor hooks test and the cached views after a9dc9f7)
# Run from the repository root with the carry [".device"].
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STEP_CMD_oldstall='cd .device/old && export PYTHONPATH=$PWD && for v in "core -" "core 120" "none -"; do
  set -- $v; b=$1; t=$2; x=""; [ "$t" != - ] && x="-x HPCZECO_COLLECTIVE_TIMEOUT=$t"
  echo "== b521ce1, --bind-to $b, timeout $t"
  timeout 70 mpirun --bind-to $b -n 12 -x PYTHONPATH $x python3 -m hpczeco bench scan --sizes 16K,1M,16M \
    --blocks 16 --no-plot --out $HPCZECO_RESULTS/old-$b-$t 2>&1 | grep -vE "^\s*$"
done' STEP_LIMIT_oldstall=220
export STEP_CMD_scannew='for v in "12 core" "8 core" "16 core" "12 none"; do set -- $v
  echo "== HEAD, P=$1 --bind-to $2"
  timeout 75 mpirun --bind-to $2 -n $1 -x PYTHONPATH python3 -m hpczeco bench scan --sizes 16K,64K,1M,4M \
    --blocks 16,32,53 --no-plot --out $HPCZECO_RESULTS/new-$1-$2 2>&1 | grep -vE "^\s*$"
done' STEP_LIMIT_scannew=240
export STEP_CMD_torch='timeout 110 python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu tests/test_torch_gpu.py 2>&1 \
  | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|Error"' STEP_LIMIT_torch=120
STEPS=${STEPS:-"oldstall scannew torch"} TAIL=${TAIL:-200} exec bash devtools/device_round.sh
