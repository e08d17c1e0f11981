#!/usr/bin/env bash
# `hpczeco bench scan` across namespace hosts (tests/netns/netns.sh): P = 2, 3, 4 over plain TCP, then P = 4
# with every NIC limited to $RATE (a network slower than the machine), and `hpczeco report` of each set.
#
#   tests/netns/bench.sh [OUT]          # default OUT=runs/netns; PYTHON, MPIEXEC, PS, SIZES, RATE override
#
# Exit 77 (with the reason) where namespaces cannot be made. Each run is bounded by netns.sh --timeout.
set -u
cd "$(dirname "$0")/../.."
OUT=${1:-runs/netns}
PY=${PYTHON:-$(command -v python3)}
export PYTHON=$PY PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
bash tests/netns/netns.sh check || exit $?
SIZES=${SIZES:-4K,16K,64K,256K,1M,4M}
RATE=${RATE:-200mbit}
mkdir -p "$OUT"
rc=0
for P in ${PS:-2 3 4}; do
  echo "== tcp P=$P ($(cut -d' ' -f1-3 /proc/loadavg))"
  bash tests/netns/netns.sh -n "$P" --timeout 900 --stats "$OUT/tcp_P$P.nics.json" -- sh -c \
    "\$NETNS_MPIEXEC -n $P \$PYTHON -m hpczeco bench scan --sizes $SIZES --blocks 4,16 --repeats 21 --no-plot \
     --out $OUT/tcp" || rc=1
done
echo "== tcp P=4, $RATE per NIC ($(cut -d' ' -f1-3 /proc/loadavg))"
bash tests/netns/netns.sh -n 4 --rate "$RATE" --timeout 900 --stats "$OUT/rate_P4.nics.json" -- sh -c \
  "\$NETNS_MPIEXEC -n 4 \$PYTHON -m hpczeco bench scan --sizes 16K,256K,1M,4M --blocks 16,32,64 --repeats 15 \
   --time-limit 8 --no-plot --out $OUT/rate" || rc=1
for d in tcp rate; do "$PY" -m hpczeco report --in "$OUT/$d" --out "$OUT/report_$d" || rc=1; done
exit $rc
