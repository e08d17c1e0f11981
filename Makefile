# hpczeco: `make run` (the main job) and `make test` (the whole suite) each bootstrap everything:
# a virtual environment in .venv, an MPI, mpi4py, and the package in editable mode.
#
#   MPI=wheel  (default) MPICH from PyPI: works unprivileged and oversubscribed on any Linux box.
#   MPI=system use the MPI already on PATH (mpicc/mpiexec, as on clusters): mpi4py is built
#              from source against it, and tests/jobs use that mpiexec.
#   NP=4       ranks for `make run`.

PYTHON ?= python3
VENV   ?= .venv
MPI    ?= wheel
NP     ?= 4
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.hpczeco-installed-$(MPI)
ifeq ($(MPI),system)
MPIEXEC ?= mpiexec
else
MPIEXEC ?= $(abspath $(VENV))/bin/mpiexec
endif
export MPIEXEC
# settings for oversubscribed runs (harmless where not needed)
export HYDRA_LAUNCHER ?= fork
export MPIR_CVAR_CH4_PROGRESS_THROTTLE ?= true
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
export PRTE_MCA_rmaps_default_mapping_policy ?= :oversubscribe
# one BLAS thread per process: ranks and tests parallelise themselves (threaded BLAS thrashes oversubscribed cores)
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1

.PHONY: all run test install lint gpu-check clean help

help:
	@echo "make run    - the main job: $(NP)-rank demo under mpiexec (bootstraps .venv)"
	@echo "make test   - the whole test suite, serial and under mpiexec -n 2..5 (bootstraps .venv)"
	@echo "make lint   - ruff"
	@echo "make gpu-check - GPU tests (on a machine with CuPy and a CUDA GPU)"
	@echo "options: MPI=wheel|system  NP=4  PYTHON=python3"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -U pip 'setuptools>=68' wheel
ifeq ($(MPI),system)
	$(VPY) -m pip install -q --no-binary=mpi4py mpi4py
else
	$(VPY) -m pip install -q mpich mpi4py
endif
	$(VPY) -m pip install -q -e '.[test]'
	@rm -f $(VENV)/.hpczeco-installed-*
	@touch $@

install: $(STAMP)

run: $(STAMP)
	$(MPIEXEC) -n $(NP) $(VPY) -m hpczeco demo

test: $(STAMP)
	$(VPY) tests/run_suite.py

# on a GPU machine (CuPy + a CUDA GPU): the GPU tests, then the 2-rank transport tests
gpu-check: $(STAMP)
	$(VPY) -m pytest -q tests/test_cuda_build.py tests/test_gpu_gla.py tests/test_gpu_transport.py tests/test_gpu_daaf.py
	$(MPIEXEC) -n 2 $(VPY) -m pytest -q -m mpi tests/test_gpu_transport.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info runs .pytest_cache
