#!/usr/bin/env bash
# Start a private single-node Slurm (slurmctld + slurmd) for tests, everything under one folder.
#
#   tests/slurm/start_slurm.sh [--install] DIR
#
#   --install   apt-get install Debian's slurm-wlm first if sbatch is missing (needs root; Debian/Ubuntu)
#   DIR         folder for slurm.conf, state, spool, logs and pid files (created)
#
# Environment: SLURM_TEST_CPUS (CPUs the node advertises, default: nproc), SLURM_TEST_TASK_PLUGIN
# (default task/affinity: srun binds each task to its CPUs, `--cpu-bind=verbose` shows it; task/none
# where sched_setaffinity is not allowed), SLURM_TEST_CTLD_PORT /
# SLURM_TEST_SLURMD_PORT (default: two free ports), SLURM_TEST_WAIT (seconds to wait for the
# node to become idle, default 60).
#
# No munge: AuthType=auth/none and CredType=cred/none, so it must run as root (slurmd starts jobs
# as the submitting user) and only on a machine nobody else can reach. On success it prints
#   export SLURM_CONF=DIR/slurm.conf
# and exits 0; `tests/slurm/stop_slurm.sh DIR` stops exactly the daemons started here.
set -euo pipefail

install=0
if [[ "${1:-}" == "--install" ]]; then install=1; shift; fi
dir="${1:?usage: start_slurm.sh [--install] DIR}"

if ! command -v sbatch >/dev/null 2>&1; then
    if [[ $install == 1 ]]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends slurm-wlm >/dev/null
    else
        echo "start_slurm: sbatch not found (install Debian's slurm-wlm, or pass --install)" >&2
        exit 3
    fi
fi
if [[ $(id -u) != 0 ]]; then
    echo "start_slurm: must run as root (auth/none single-node test cluster)" >&2
    exit 3
fi

mkdir -p "$dir"/{state,spool,log}
dir=$(cd "$dir" && pwd)
host=$(hostname -s)
cpus=${SLURM_TEST_CPUS:-$(nproc)}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1]); s.close()'; }
ctld_port=${SLURM_TEST_CTLD_PORT:-$(free_port)}
slurmd_port=${SLURM_TEST_SLURMD_PORT:-$(free_port)}
mem_mb=$(awk '/MemTotal/ {print int($2/1024*0.8)}' /proc/meminfo)

cat >"$dir/slurm.conf" <<EOF
# written by tests/slurm/start_slurm.sh: private single-node test cluster
ClusterName=hpczeco-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/none
CredType=cred/none
# a job's credential stays revoked for cred_expire seconds after the job ends, and a requeued batch job that
# starts again before that is killed ("Job credential revoked"); Slurm holds requeued jobs for about that long
# (default 120 s: the requeue test waited ~160 s). tests/test_slurm.py releases the job once this has passed.
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=${SLURM_TEST_TASK_PLUGIN:-task/affinity}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
KillWait=5
InactiveLimit=0
MinJobAge=600
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF


export SLURM_CONF="$dir/slurm.conf"
slurmctld -c -f "$SLURM_CONF"   # daemonises; -c: fresh state
slurmd -f "$SLURM_CONF"

wait_s=${SLURM_TEST_WAIT:-60}
for ((i = 0; i < wait_s * 2; i++)); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null | head -n1 || true)
    if [[ "$state" == idle* ]]; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "start_slurm: node $host not idle after ${wait_s}s (state: '${state:-?}'); logs:" >&2
tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
"$(dirname "$0")/stop_slurm.sh" "$dir" >&2 || true
exit 1
