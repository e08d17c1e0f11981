#!/usr/bin/env bash
# Submit the ring-vs-tree sweep: for each rank count P (word i of SCAN_RANKS) one
# `sbatch --array=i --ntasks=P jobs/ring_vs_tree_array.sbatch`, so each element asks for exactly its P
# (one array shares one resource request: P=2 would otherwise wait for the cores of the largest P);
# all elements write into one folder, and a last job (`--dependency=afterok` on all of them) runs
# `hpczeco report` over it.
#
#   jobs/submit_scan_array.sh [sbatch options for every job, e.g. --partition=compute --account=proj]
#
# Environment: SCAN_RANKS, HPCZECO_CONFIG (default jobs/configs/scan_array.env), HPCZECO_REPO (default:
# this checkout), HPCZECO_OUT (default runs/hpczeco-scan-<date>), SCAN_REPORT=0 (no report job).
# Prints one line per job: "P=<P>: job <id>_<i> --ntasks=<P>", then "report: job <id> -> <folder>/report".
set -euo pipefail
HPCZECO_REPO=${HPCZECO_REPO:-$(cd "$(dirname "$0")/.." && pwd)}
HPCZECO_CONFIG=${HPCZECO_CONFIG:-$HPCZECO_REPO/jobs/configs/scan_array.env}
[[ -f "$HPCZECO_CONFIG" ]] || { echo "submit_scan_array: config $HPCZECO_CONFIG not found" >&2; exit 2; }
# shellcheck disable=SC1090
source "$HPCZECO_CONFIG"   # for SCAN_RANKS (each element sources it again itself)
HPCZECO_OUT=${HPCZECO_OUT:-$HPCZECO_REPO/runs/hpczeco-scan-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$HPCZECO_OUT"
HPCZECO_OUT=$(cd "$HPCZECO_OUT" && pwd)
export HPCZECO_REPO HPCZECO_CONFIG HPCZECO_OUT
ids=()
i=0
for P in $SCAN_RANKS; do
    id=$(sbatch --parsable --array="$i" --ntasks="$P" --export=ALL "$@" "$HPCZECO_REPO/jobs/ring_vs_tree_array.sbatch")
    id=${id%%;*}
    echo "P=$P: job ${id}_$i --ntasks=$P"
    ids+=("$id")
    i=$((i + 1))
done
if [[ "${SCAN_REPORT:-1}" == 1 && ${#ids[@]} -gt 0 ]]; then
    deps=$(IFS=:; echo "${ids[*]}")
    id=$(sbatch --parsable --dependency="afterok:$deps" --ntasks=1 --export=ALL "$@" \
         --job-name=hpczeco-scan-report --output="$HPCZECO_OUT/report-%j.out" "$HPCZECO_REPO/jobs/scan_report.sbatch")
    echo "report: job ${id%%;*} -> $HPCZECO_OUT/report"
fi
