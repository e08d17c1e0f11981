"""MPI-aware pytest harness (see tests/README.md).

The same test files run in one process (``pytest``) and under ``mpiexec -n N python -m pytest``.
Under several ranks:

* every test's outcome is agreed collectively: if it fails on any rank it fails on every rank,
  and rank 0's report carries the other ranks' failure text ("failed on rank(s) [...]");
* only rank 0 prints; the others stay quiet (``HPCZECO_TEST_VERBOSE_RANKS=1``: every rank reports);
* a deadlocked test is ended by pytest-timeout (thread method: stacks are dumped, the process
  exits, and mpiexec tears the job down); ``MPIEXEC_TIMEOUT`` bounds the whole run as well.

Random inputs are fresh on every run: the seed comes from the clock on rank 0 and is broadcast,
printed with any failure, and can be fixed with ``HPCZECO_TEST_SEED``.
"""

from __future__ import annotations

import os
import time
import zlib

import numpy as np
import pytest

try:
    from mpi4py import MPI

    COMM = MPI.COMM_WORLD
except Exception:  # pragma: no cover - mpi4py is a hard dependency, but keep pytest usable
    COMM = None

RANK = COMM.Get_rank() if COMM is not None else 0
SIZE = COMM.Get_size() if COMM is not None else 1


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if SIZE > 1 and RANK != 0 and os.environ.get("HPCZECO_TEST_VERBOSE_RANKS") != "1":
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_collection_modifyitems(config, items):
    """Under several ranks run only tests marked ``mpi`` (the rest ran in the serial stage)."""
    if SIZE > 1:
        skip = pytest.mark.skip(reason="serial test: runs in the single-process stage")
        for item in items:
            if "mpi" not in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if SIZE == 1 or rep.when not in ("setup", "call") or "mpi" not in item.keywords:
        return
    mine = (bool(rep.failed), rep.longreprtext[-3000:] if rep.failed else "")
    everyone = COMM.allgather(mine)
    bad = [r for r, (failed, _) in enumerate(everyone) if failed]
    if not bad:
        return
    others = "\n".join(f"----- rank {r} -----\n{everyone[r][1]}" for r in bad if r != RANK)
    header = f"[{SIZE} ranks] failed on rank(s) {bad}"
    if rep.failed:
        if others:
            rep.sections.append((header, others))
    else:
        rep.outcome = "failed"
        rep.longrepr = f"{header}\n{others}"


def _test_seed() -> int:
    env = os.environ.get("HPCZECO_TEST_SEED")
    seed = int(env) if env else int(time.time_ns() % (2**31))
    if COMM is not None and SIZE > 1:
        seed = COMM.bcast(seed, root=0)
    return seed


@pytest.fixture
def comm():
    """``MPI.COMM_WORLD`` duplicated for the test (the caller owns the communicator)."""
    c = COMM.Dup()
    yield c
    c.Free()


@pytest.fixture
def rng(request):
    """A fresh numpy Generator, identical on every rank; the seed is shown when the test fails."""
    seed = _test_seed() + zlib.crc32(request.node.nodeid.encode()) % 100003  # stable across ranks
    request.node.user_properties.append(("seed", seed))
    request.node.add_report_section("setup", "seed", f"HPCZECO_TEST_SEED base for this run; test seed {seed}")
    return np.random.default_rng(seed)


def pytest_report_header(config):
    return f"hpczeco test harness: {SIZE} MPI rank(s)"
