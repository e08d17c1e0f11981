# hpczeco: `make run` (the main job) and `make test` (the whole suite) each bootstrap everything:
# a virtual environment in .venv, an MPI, mpi4py, and the package in editable mode.
#
#   MPI=wheel  (default) MPICH from PyPI: works unprivileged and oversubscribed on any Linux box.
#   MPI=system use the MPI already on PATH (mpicc/mpiexec, as on clusters after `module load`):
#              mpi4py is built from source against $(MPICC) (never from pip's cache) and checked
#              against it; tests and `make run` use $(MPIEXEC).
#              Two MPIs side by side (Debian's openmpi-bin + mpich): pick one per call with
#              MPICC=mpicc.openmpi MPIEXEC=mpiexec.openmpi (or mpicc.mpich / mpiexec.mpich).
#   NP=4       ranks for `make run`.
#   SUITE=...  options of tests/run_suite.py for `make test` (e.g. --no-emulation: the CPU emulation of the GPU
#              kernels left out of the serial stage; CI's Open MPI stage, the PyPI-MPICH stage ran them).
#   make phdf5 (MPI=system, Open MPI): h5py built against Debian's parallel HDF5 (libhdf5-openmpi-dev)
#              into the venv, so checkpoints use driver="mpio"; `make test-phdf5` tests that path.

PYTHON ?= python3
VENV   ?= .venv
MPI    ?= wheel
NP     ?= 4
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.hpczeco-installed-$(MPI)
ifeq ($(MPI),system)
MPICC   ?= mpicc
MPIEXEC ?= mpiexec
export MPICC
else
MPIEXEC ?= $(abspath $(VENV))/bin/mpiexec
endif
export MPIEXEC
# one BLAS thread per process: ranks and tests parallelise themselves (threaded BLAS thrashes oversubscribed cores)
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1
# single-node oversubscription / run-as-root settings (MPICH, Open MPI 4 and 5): hpczeco/drivers/mpienv.py
MPIRUN_ENV := $(VPY) -m hpczeco.drivers.mpienv run --
# parallel HDF5 for `make phdf5`: Debian's libhdf5-openmpi-dev (on a cluster: HDF5_DIR=<the module's prefix>)
HDF5_PKGCONFIG_NAME ?= hdf5-openmpi
PHDF5_STAMP := $(VENV)/.hpczeco-phdf5

.PHONY: all run test install check-mpi lint gpu-check test-net phdf5 test-phdf5 clean help

help:
	@echo "make run    - the main job: $(NP)-rank demo under mpiexec (bootstraps .venv)"
	@echo "make test   - the whole test suite, serial and under mpiexec -n 2..5 (bootstraps .venv)"
	@echo "make lint   - ruff"
	@echo "make phdf5  - h5py with parallel HDF5 in the venv (MPI=system, Open MPI; ~10 min build)"
	@echo "make test-phdf5 - the checkpoint tests with driver='mpio' at n = 2..4 (after make phdf5)"
	@echo "make gpu-check - GPU tests (on a machine with CuPy and a CUDA GPU)"
	@echo "make test-net - scans/ZeCO/train across 2-4 network namespaces over TCP (root), then the scan bench"
	@echo "options: MPI=wheel|system  MPICC=mpicc  MPIEXEC=mpiexec  NP=4  PYTHON=python3  VENV=.venv"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -U pip 'setuptools>=77' wheel
ifeq ($(MPI),system)
	@command -v $(MPICC) >/dev/null || { echo "MPI=system: no $(MPICC) on PATH (module load <mpi>, or apt-get install libopenmpi-dev)"; exit 2; }
	$(VPY) -m pip install -q --no-cache-dir --force-reinstall --no-binary=mpi4py mpi4py
else
	$(VPY) -m pip install -q mpich mpi4py
endif
	@# the package with its test extra, which includes the drivers extra (h5py, tqdm, matplotlib: the programs need
	@# them; the library needs only numpy, numba, mpi4py)
	$(VPY) -m pip install -q -e '.[test]'
	@# PyTorch for the tests of the optional torch extra, pinned here only (2.13.0 is a local CPU build on these
	@# machines; another version would download a multi-GB CUDA build); where it is missing those tests skip
	$(VPY) -m pip install -q torch==2.13.0 || echo "torch==2.13.0 not installed: the PyTorch tests will skip"
ifeq ($(MPI),system)
	$(VPY) -m hpczeco.drivers.mpienv check-mpicc
endif
	@rm -f $(VENV)/.hpczeco-installed-*
	@touch $@

install: $(STAMP)

# mpi4py's library is MPICC's (MPI=system), and $(MPIEXEC) starts 2 ranks that see each other
check-mpi: $(STAMP)
ifeq ($(MPI),system)
	@$(VPY) -m hpczeco.drivers.mpienv check-mpicc
endif
	@$(MPIRUN_ENV) $(MPIEXEC) -n 2 $(VPY) -m hpczeco info >/dev/null || { \
	  echo "check-mpi: '$(MPIEXEC) -n 2 hpczeco info' failed: is $(MPIEXEC) the launcher of mpi4py's MPI?"; exit 2; }

run: check-mpi
	$(MPIRUN_ENV) $(MPIEXEC) -n $(NP) $(VPY) -m hpczeco demo

test: check-mpi
	$(VPY) tests/run_suite.py $(SUITE)

$(PHDF5_STAMP): $(STAMP)
	@test "$(MPI)" = system || { echo "make phdf5: needs MPI=system (h5py must link the MPI that mpi4py uses)"; exit 2; }
	@pkg-config --exists $(HDF5_PKGCONFIG_NAME) || [ -n "$$HDF5_DIR" ] || { echo "make phdf5: no parallel HDF5:" \
	  "apt-get install --no-install-recommends libhdf5-openmpi-dev pkg-config (or set HDF5_DIR)"; exit 2; }
	$(VPY) -m pip install -q 'setuptools>=77' packaging wheel cython pkgconfig numpy
	H5PY_SETUP_REQUIRES=0 CC=$(MPICC) HDF5_MPI=ON HDF5_PKGCONFIG_NAME=$(HDF5_PKGCONFIG_NAME) \
	  $(VPY) -m pip install -q --no-cache-dir --no-build-isolation --no-binary=h5py --no-deps --force-reinstall h5py
	$(VPY) -c "import h5py; assert h5py.get_config().mpi, 'h5py has no MPI'; print('h5py', h5py.version.version, 'parallel HDF5', h5py.version.hdf5_version)"
	@touch $@

phdf5: $(PHDF5_STAMP)

# the parallel h5py must still be there (tests/test_checkpoint_mpio.py skips without it): the drivers extra's h5py
# requirement is met by it, so `pip install -e '.[test]'` keeps it, and a rebuilt $(STAMP) rebuilds $(PHDF5_STAMP)
test-phdf5: $(PHDF5_STAMP) check-mpi
	@$(VPY) -c "import h5py, sys; h5py.get_config().mpi or sys.exit('make test-phdf5: the h5py in $(VENV) has no' \
	  ' parallel HDF5 (replaced since make phdf5?): rm $(PHDF5_STAMP) and run make phdf5 again')"
	HPCZECO_TEST_RANKS="2 3 4" $(VPY) tests/run_suite.py tests/test_checkpoint.py tests/test_checkpoint_mpio.py

# on a GPU machine (CuPy + a CUDA GPU): the GPU tests, then the 2-rank device tests
gpu-check: $(STAMP)
	$(VPY) -m pytest -q -m gpu tests/
	$(MPIRUN_ENV) $(MPIEXEC) -n 2 $(VPY) -m pytest -q -m "mpi and gpu" tests/

# scans, ZeCO and train/resume across 2-4 network namespaces over TCP (root; MPICH and Open MPI), then the
# scan benchmark there (tests/README.md, docs/benchmarks/network.md)
test-net: $(STAMP)
	HPCZECO_NETNS_HOSTS="2 3 4" HPCZECO_NETNS_MPI="mpich openmpi" $(VPY) -m pytest -v tests/test_netns.py
	PYTHON=$(abspath $(VPY)) tests/netns/bench.sh runs/netns

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info runs .pytest_cache
