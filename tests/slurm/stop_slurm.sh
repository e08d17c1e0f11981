#!/usr/bin/env bash
# Stop the test Slurm started by tests/slurm/start_slurm.sh DIR: cancel its jobs, then end exactly
# the slurmctld/slurmd whose pids it wrote into DIR (never by name).
set -uo pipefail
dir="${1:?usage: stop_slurm.sh DIR}"
export SLURM_CONF="$dir/slurm.conf"
[[ -f "$SLURM_CONF" ]] && scancel --full --quiet --user="$(id -un)" 2>/dev/null
for name in slurmd slurmctld; do
    pidfile="$dir/$name.pid"
    [[ -f "$pidfile" ]] || continue
    pid=$(cat "$pidfile")
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
done
exit 0
