# Shared by the batch scripts in jobs/ (sourced, not run). Everything is a variable with a default,
# so a site adapts the scripts by setting variables (sbatch --export=ALL,VAR=..., qsub -v VAR=...)
# rather than editing them. See jobs/README.md.
#
#   HPCZECO_REPO      repository checkout (default: the folder the job was submitted from)
#   HPCZECO_VENV      virtual environment (default: $HPCZECO_REPO/.venv; `make install` makes it)
#   HPCZECO_PYTHON    python to use when there is no venv (default: python3 on PATH)
#   HPCZECO_CONFIG    config file to source (default: jobs/configs/<the script's default>.env)
#   HPCZECO_MODULES   modules to `module load` first, e.g. "gcc/12 openmpi/4.1 cuda/12.4"
#   HPCZECO_LAUNCHER  srun (default inside a Slurm job) | mpiexec (default elsewhere) | mpirun
#   HPCZECO_MPIEXEC   the mpiexec to use (default: the venv's, i.e. the MPICH wheel, else the one beside
#                     the python, else mpiexec on PATH)
#   HPCZECO_MPIEXEC_ARGS, HPCZECO_SRUN_ARGS   extra launcher arguments
#   HPCZECO_CPU_BIND  srun --cpu-bind= (default cores: each rank on its own --cpus-per-task cores;
#                     verbose,cores also prints each task's mask; empty: the site's default)
#   HPCZECO_SRUN_MPI  srun --mpi= plugin (default: chosen from the MPI mpi4py uses: pmi2 for MPICH-like
#                     MPIs, pmix for Open MPI; without a fitting plugin the job falls back to mpiexec)
#   HPCZECO_THREADS   BLAS/OpenMP threads per rank (default: the job's --cpus-per-task, else 1); it
#                     sets OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS
#   HPCZECO_OUT       output folder (default: $HPCZECO_REPO/runs/<job name>-<job id>)

hz_die() { echo "hpczeco job: $*" >&2; exit 2; }

hz_job_id() {
    if [[ -n "${SLURM_ARRAY_JOB_ID:-}" ]]; then echo "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    elif [[ -n "${SLURM_JOB_ID:-}" ]]; then echo "$SLURM_JOB_ID"
    elif [[ -n "${PBS_JOBID:-}" ]]; then echo "${PBS_JOBID%%.*}"
    else echo "local-$$"; fi
}

hz_job_name() { echo "${SLURM_JOB_NAME:-${PBS_JOBNAME:-hpczeco}}"; }

# hz_choose_launcher: HPCZECO_LAUNCHER (srun inside Slurm), HPCZECO_SRUN_MPI, HPCZECO_MPIEXEC, SRUN_CPUS_PER_TASK.
hz_choose_launcher() {
    local given=${HPCZECO_LAUNCHER:-}
    if [[ -z "$given" ]]; then
        if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v srun >/dev/null 2>&1; then HPCZECO_LAUNCHER=srun
        else HPCZECO_LAUNCHER=mpiexec; fi
    fi
    if [[ -z "${HPCZECO_MPIEXEC:-}" ]]; then
        if [[ -x "$HPCZECO_VENV/bin/mpiexec" ]]; then HPCZECO_MPIEXEC="$HPCZECO_VENV/bin/mpiexec"
        elif [[ -x "$(dirname "$HZ_PY")/mpiexec" ]]; then HPCZECO_MPIEXEC="$(dirname "$HZ_PY")/mpiexec"
        else HPCZECO_MPIEXEC=$(command -v mpiexec || command -v mpirun || echo mpiexec); fi
    fi
    if [[ "$HPCZECO_LAUNCHER" == srun && -z "${HPCZECO_SRUN_MPI:-}" ]]; then
        local why errfile
        errfile=$(mktemp)
        if ! HPCZECO_SRUN_MPI=$("$HZ_PY" -m hpczeco.drivers.mpienv srun-mpi 2>"$errfile"); then
            why=$(tail -n 1 "$errfile"); HPCZECO_SRUN_MPI=; rm -f "$errfile"
            [[ -n "$given" ]] && hz_die "HPCZECO_LAUNCHER=srun, but: $why (set HPCZECO_SRUN_MPI to force a plugin)"
            echo "  (srun not used: $why)"
            HPCZECO_LAUNCHER=mpiexec
        fi
        rm -f "$errfile"
    fi
    HPCZECO_CPU_BIND=${HPCZECO_CPU_BIND-cores}
    # Slurm >= 22.05: srun no longer inherits the job's --cpus-per-task; pass it on explicitly
    if [[ "$HPCZECO_LAUNCHER" == srun && -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
        export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}
    fi
}

# hz_setup DEFAULT_CONFIG_NAME: modules, python, config, output folder, launcher, threads; prints them.
hz_setup() {
    local default_config=$1
    HPCZECO_REPO=$(cd "${HPCZECO_REPO:?}" && pwd)
    if [[ -n "${HPCZECO_MODULES:-}" ]]; then
        command -v module >/dev/null 2>&1 || hz_die "HPCZECO_MODULES is set but there is no 'module' command"
        # shellcheck disable=SC2086
        module load $HPCZECO_MODULES
    fi
    HPCZECO_VENV=${HPCZECO_VENV:-$HPCZECO_REPO/.venv}
    if [[ -x "$HPCZECO_VENV/bin/python" ]]; then
        HZ_PY="$HPCZECO_VENV/bin/python"
    else
        HZ_PY=$(command -v "${HPCZECO_PYTHON:-python3}") || hz_die "no python (set HPCZECO_VENV or HPCZECO_PYTHON)"
    fi
    "$HZ_PY" -c "import hpczeco" 2>/dev/null || hz_die "$HZ_PY cannot import hpczeco (run 'make install' in $HPCZECO_REPO)"
    HPCZECO_CONFIG=${HPCZECO_CONFIG:-$HPCZECO_REPO/jobs/configs/$default_config.env}
    # a relative config path is taken from the submit folder, else from the repository
    [[ -f "$HPCZECO_CONFIG" || "$HPCZECO_CONFIG" == /* ]] || HPCZECO_CONFIG="$HPCZECO_REPO/$HPCZECO_CONFIG"
    [[ -f "$HPCZECO_CONFIG" ]] || hz_die "config $HPCZECO_CONFIG not found"
    # shellcheck disable=SC1090
    source "$HPCZECO_CONFIG"
    HPCZECO_OUT=${HPCZECO_OUT:-$HPCZECO_REPO/runs/$(hz_job_name)-$(hz_job_id)}
    mkdir -p "$HPCZECO_OUT"
    HPCZECO_OUT=$(cd "$HPCZECO_OUT" && pwd)
    echo "hpczeco job $(hz_job_name) $(hz_job_id) on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    hz_choose_launcher
    # BLAS/OpenMP threads per rank: HPCZECO_THREADS, else the cores Slurm gives each task, else 1
    local from
    if [[ -n "${HPCZECO_THREADS:-}" ]]; then HZ_THREADS=$HPCZECO_THREADS; from="HPCZECO_THREADS"
    elif [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then HZ_THREADS=$SLURM_CPUS_PER_TASK; from="--cpus-per-task"
    else HZ_THREADS=1; from="default"; fi
    export OMP_NUM_THREADS=$HZ_THREADS OPENBLAS_NUM_THREADS=$HZ_THREADS MKL_NUM_THREADS=$HZ_THREADS
    export PYTHONUNBUFFERED=1
    echo "  repo      $HPCZECO_REPO"
    echo "  python    $HZ_PY"
    echo "  config    $HPCZECO_CONFIG"
    if [[ $HPCZECO_LAUNCHER == srun ]]; then
        echo "  launcher  srun (--mpi=$HPCZECO_SRUN_MPI${SRUN_CPUS_PER_TASK:+, --cpus-per-task=$SRUN_CPUS_PER_TASK}${HPCZECO_CPU_BIND:+, --cpu-bind=$HPCZECO_CPU_BIND})"
    else
        echo "  launcher  $HPCZECO_LAUNCHER ($HPCZECO_MPIEXEC)"
    fi
    echo "  threads   $HZ_THREADS per rank (from $from)"
    echo "  outputs   $HPCZECO_OUT"
}

# hz_launch_cmd NP COMMAND...: the launcher command line for COMMAND on NP ranks, into the array HZ_CMD.
hz_launch_cmd() {
    local np=$1; shift
    local extra
    case "$HPCZECO_LAUNCHER" in
        srun)
            read -r -a extra <<<"${HPCZECO_SRUN_ARGS:-}"
            HZ_CMD=(srun --ntasks="$np" --mpi="$HPCZECO_SRUN_MPI"
                    ${SRUN_CPUS_PER_TASK:+--cpus-per-task="$SRUN_CPUS_PER_TASK"}
                    ${HPCZECO_CPU_BIND:+--cpu-bind="$HPCZECO_CPU_BIND"} ${extra[@]+"${extra[@]}"} "$@") ;;
        mpiexec|mpirun)
            read -r -a extra <<<"${HPCZECO_MPIEXEC_ARGS:-}"
            HZ_CMD=("$HPCZECO_MPIEXEC" -n "$np" ${extra[@]+"${extra[@]}"} "$@") ;;
        *) hz_die "HPCZECO_LAUNCHER must be mpiexec, mpirun or srun, got '$HPCZECO_LAUNCHER'" ;;
    esac
}

# hz_launch NP COMMAND...: run COMMAND on NP ranks with the chosen launcher.
hz_launch() {
    hz_launch_cmd "$@"
    "${HZ_CMD[@]}"
}

# hz_launch_checkpointable NP COMMAND...: hz_launch with the launcher in the background. On SIGUSR1
# (Slurm's `--signal=B:USR1@120` shortly before the walltime, or `scancel --signal=USR1 --batch JOB`)
# the signal is forwarded to the launcher, which passes it to every rank (srun, Hydra and Open MPI's
# mpiexec all do): `hpczeco train` then finishes its step, writes a checkpoint and exits 0.
# Sets HZ_SIGNALLED=1 when that happened.
hz_launch_checkpointable() {
    HZ_SIGNALLED=0
    hz_launch_cmd "$@"
    "${HZ_CMD[@]}" &
    local pid=$! rc
    # shellcheck disable=SC2064
    trap "HZ_SIGNALLED=1; echo '== SIGUSR1: walltime near; the ranks checkpoint and stop'; kill -USR1 $pid 2>/dev/null" USR1
    while :; do
        rc=0; wait "$pid" || rc=$?
        kill -0 "$pid" 2>/dev/null || break   # else `wait` was interrupted by the trap: keep waiting
    done
    if (( rc > 128 )) && [[ $HZ_SIGNALLED == 1 ]]; then rc=0; wait "$pid" || rc=$?; fi
    trap - USR1
    return "$rc"
}

# hz_requeue: put this job back in the queue (it restarts with the same id and output folder and
# resumes from its newest checkpoint). Needs `#SBATCH --requeue` (Slurm) / `#PBS -r y` (PBS).
hz_requeue() {
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        echo "== requeue: scontrol requeue $SLURM_JOB_ID (restarts, resumes from $HPCZECO_OUT/ckpt)"
        scontrol requeue "$SLURM_JOB_ID"
    elif [[ -n "${PBS_JOBID:-}" ]]; then
        echo "== requeue: qrerun $PBS_JOBID (restarts, resumes from $HPCZECO_OUT/ckpt)"
        qrerun "$PBS_JOBID"
    else
        echo "== not in a batch job: rerun the same command to resume from $HPCZECO_OUT/ckpt"
    fi
}

# hz_train NP [extra train args]: `hpczeco info`, then `hpczeco train` with the config's settings;
# on SIGUSR1 the run checkpoints and the job requeues itself (TRAIN_REQUEUE=0: it just ends).
hz_train() {
    local np=$1; shift
    local args=(${TRAIN_CONFIG:+--config "$TRAIN_CONFIG"} --steps "$TRAIN_STEPS" --seq "$TRAIN_SEQ"
                --batch "$TRAIN_BATCH" --dtype "$TRAIN_DTYPE"
                --topology "$TRAIN_TOPOLOGY" --corpus-bytes "$TRAIN_CORPUS_BYTES" --blas-threads "$HZ_THREADS"
                --log "$HPCZECO_OUT/train.jsonl" --ckpt-dir "$HPCZECO_OUT/ckpt" --ckpt-every "$TRAIN_CKPT_EVERY"
                --no-progress)
    [[ -n "${TRAIN_TEXT:-}" ]] && args+=(--text "$TRAIN_TEXT")
    [[ "${TRAIN_RESUME:-1}" == 1 ]] && args+=(--resume)
    echo "== hpczeco info ($np ranks) -> $HPCZECO_OUT/info.txt"
    hz_launch "$np" "$HZ_PY" -m hpczeco info | tee "$HPCZECO_OUT/info.txt"
    echo "== hpczeco train ($np ranks): log $HPCZECO_OUT/train.jsonl, checkpoints $HPCZECO_OUT/ckpt"
    # shellcheck disable=SC2086
    hz_launch_checkpointable "$np" "$HZ_PY" -m hpczeco train "${args[@]}" ${TRAIN_EXTRA:-} "$@"
    if [[ $HZ_SIGNALLED == 1 && "${TRAIN_REQUEUE:-1}" == 1 ]]; then
        hz_requeue
        return 0
    fi
    echo "== done: log $HPCZECO_OUT/train.jsonl, checkpoints $HPCZECO_OUT/ckpt, info $HPCZECO_OUT/info.txt"
}
