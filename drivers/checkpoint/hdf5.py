"""Which HDF5 this h5py has: parallel (``driver='mpio'`` usable) or serial, and how checkpoints are written."""

from __future__ import annotations

import h5py


def parallel_hdf5() -> bool:
    """True when this h5py was built against parallel HDF5 (``driver='mpio'`` usable)."""
    return bool(h5py.get_config().mpi)


def hdf5_mode() -> str:
    """One line describing how checkpoints are written with this h5py."""
    if parallel_hdf5():
        return "parallel (driver='mpio', collective create, rank 0 writes the replicated data)"
    return "serial: rank 0 writes the file through os.pwrite (GuardedFile: I/O errors kept from HDF5), then fsync"
