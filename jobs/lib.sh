# Shared by the batch scripts in jobs/ (sourced, not run). Everything is a variable with a default,
# so a site adapts the scripts by setting variables (sbatch --export=ALL,VAR=..., qsub -v VAR=...)
# rather than editing them. See jobs/README.md.
#
#   HPCZECO_REPO      repository checkout (default: the folder the job was submitted from)
#   HPCZECO_VENV      virtual environment (default: $HPCZECO_REPO/.venv; `make install` makes it)
#   HPCZECO_PYTHON    python to use when there is no venv (default: python3 on PATH)
#   HPCZECO_CONFIG    config file to source (default: jobs/configs/<the script's default>.env)
#   HPCZECO_MODULES   modules to `module load` first, e.g. "gcc/12 openmpi/4.1 cuda/12.4"
#   HPCZECO_LAUNCHER  mpiexec (default) | srun | mpirun
#   HPCZECO_MPIEXEC   the mpiexec to use (default: the venv's, i.e. the MPICH wheel, else mpiexec on PATH)
#   HPCZECO_MPIEXEC_ARGS, HPCZECO_SRUN_ARGS   extra launcher arguments
#   HPCZECO_SRUN_MPI  srun --mpi= plugin (default pmi2; pmix for Open MPI 5 builds with PMIx)
#   HPCZECO_OUT       output folder (default: $HPCZECO_REPO/runs/<job name>-<job id>)

hz_die() { echo "hpczeco job: $*" >&2; exit 2; }

hz_job_id() {
    if [[ -n "${SLURM_ARRAY_JOB_ID:-}" ]]; then echo "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    elif [[ -n "${SLURM_JOB_ID:-}" ]]; then echo "$SLURM_JOB_ID"
    elif [[ -n "${PBS_JOBID:-}" ]]; then echo "${PBS_JOBID%%.*}"
    else echo "local-$$"; fi
}

hz_job_name() { echo "${SLURM_JOB_NAME:-${PBS_JOBNAME:-hpczeco}}"; }

# hz_setup DEFAULT_CONFIG_NAME: modules, python, config, output folder, threads; prints them.
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
    HPCZECO_LAUNCHER=${HPCZECO_LAUNCHER:-mpiexec}
    if [[ -z "${HPCZECO_MPIEXEC:-}" ]]; then
        if [[ -x "$HPCZECO_VENV/bin/mpiexec" ]]; then HPCZECO_MPIEXEC="$HPCZECO_VENV/bin/mpiexec"
        else HPCZECO_MPIEXEC=$(command -v mpiexec || command -v mpirun || echo mpiexec); fi
    fi
    HPCZECO_SRUN_MPI=${HPCZECO_SRUN_MPI:-pmi2}
    HPCZECO_OUT=${HPCZECO_OUT:-$HPCZECO_REPO/runs/$(hz_job_name)-$(hz_job_id)}
    mkdir -p "$HPCZECO_OUT"
    HPCZECO_OUT=$(cd "$HPCZECO_OUT" && pwd)
    # one BLAS/OpenMP thread per core the rank owns (several ranks per node must not oversubscribe)
    HZ_THREADS=${SLURM_CPUS_PER_TASK:-${HPCZECO_THREADS:-1}}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$HZ_THREADS}
    export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$HZ_THREADS}
    export MKL_NUM_THREADS=${MKL_NUM_THREADS:-$HZ_THREADS}
    export PYTHONUNBUFFERED=1
    echo "hpczeco job $(hz_job_name) $(hz_job_id) on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "  repo      $HPCZECO_REPO"
    echo "  python    $HZ_PY"
    echo "  config    $HPCZECO_CONFIG"
    echo "  launcher  $HPCZECO_LAUNCHER ($( [[ $HPCZECO_LAUNCHER == srun ]] && echo "--mpi=$HPCZECO_SRUN_MPI" || echo "$HPCZECO_MPIEXEC"))"
    echo "  outputs   $HPCZECO_OUT"
}

# hz_launch NP COMMAND...: run COMMAND on NP ranks with the chosen launcher.
hz_launch() {
    local np=$1; shift
    case "$HPCZECO_LAUNCHER" in
        srun)
            # shellcheck disable=SC2086
            srun --ntasks="$np" --mpi="$HPCZECO_SRUN_MPI" ${HPCZECO_SRUN_ARGS:-} "$@" ;;
        mpiexec|mpirun)
            # shellcheck disable=SC2086
            "$HPCZECO_MPIEXEC" -n "$np" ${HPCZECO_MPIEXEC_ARGS:-} "$@" ;;
        *) hz_die "HPCZECO_LAUNCHER must be mpiexec, mpirun or srun, got '$HPCZECO_LAUNCHER'" ;;
    esac
}

# hz_train NP [extra train args]: `hpczeco info` then `hpczeco train` with the config's settings.
hz_train() {
    local np=$1; shift
    local args=(--steps "$TRAIN_STEPS" --seq "$TRAIN_SEQ" --batch "$TRAIN_BATCH" --dtype "$TRAIN_DTYPE"
                --scan "$TRAIN_SCAN" --corpus-bytes "$TRAIN_CORPUS_BYTES" --blas-threads "$HZ_THREADS"
                --log "$HPCZECO_OUT/train.jsonl" --ckpt-dir "$HPCZECO_OUT/ckpt" --ckpt-every "$TRAIN_CKPT_EVERY"
                --no-progress)
    [[ -n "${TRAIN_TEXT:-}" ]] && args+=(--text "$TRAIN_TEXT")
    [[ "${TRAIN_RESUME:-1}" == 1 ]] && args+=(--resume)
    echo "== hpczeco info ($np ranks) -> $HPCZECO_OUT/info.txt"
    hz_launch "$np" "$HZ_PY" -m hpczeco info | tee "$HPCZECO_OUT/info.txt"
    echo "== hpczeco train ($np ranks): log $HPCZECO_OUT/train.jsonl, checkpoints $HPCZECO_OUT/ckpt"
    # shellcheck disable=SC2086
    hz_launch "$np" "$HZ_PY" -m hpczeco train "${args[@]}" ${TRAIN_EXTRA:-} "$@"
    echo "== done: log $HPCZECO_OUT/train.jsonl, checkpoints $HPCZECO_OUT/ckpt, info $HPCZECO_OUT/info.txt"
}
