"""HDF5 checkpoints: atomic, checksummed, keep-last-N, never pickled, safe to load from elsewhere.

A checkpoint is one file ``ckpt_<step:08d>.h5`` in a folder:

* **datasets** — one per array, under nested names such as ``params/layer0/wq`` or ``adam/m/...``;
  each carries a ``sha256`` attribute (of dtype, shape and bytes);
* **root attributes** — ``format``, ``format_version``, ``step``, ``nranks`` (ranks that wrote it),
  ``created`` (UTC time), the caller's plain attributes (strings, numbers, booleans, numeric arrays,
  JSON-able dicts/lists such as the run config or an RNG state), ``_manifest`` (JSON: name -> shape,
  dtype, sha256 of every dataset), ``_attr_kinds`` (how each attribute is encoded) and
  ``_attrs_sha256`` (a checksum over all the attributes).

Writes are atomic: a hidden temporary file in the same folder, fsync'ed, then ``os.replace``'d onto its
final name and the folder fsync'ed; a crash leaves at worst a hidden temporary file, never a
half-written newest checkpoint (the next successful write removes such leftovers: only those no live process
holds locked). One job writes a folder at a time: the writer holds ``LOCK_NAME`` in it locked, and a second live
job's writer is refused with a ``CheckpointError`` naming the holder. HDF5 writes the
temporary through a Python file object (:class:`GuardedFile`: ordinary ``os.pwrite``) that keeps I/O
errors away from HDF5: a write that fails (a full disk) is remembered and its bytes kept in memory, so
HDF5 never fails half-way inside its caches (the PyPI h5py then crashed the process at exit, status
11); afterwards the error is one ``CheckpointError`` on every rank naming the folder and the space
needed, the partial temporary removed. Only the newest ``keep`` are kept.

Loading (:func:`load_latest`) takes the newest checkpoint that passes every check (readable HDF5,
format, step, every dataset's name/shape/dtype/checksum against the manifest, the attribute checksum,
the run config against ``expect_config``, the arrays against ``expect_arrays`` and the caller's
``validate``); a corrupt or mismatched one is reported with the reason and the previous one is used.
What is read is bounded before it is read: with ``expect_arrays`` exactly the expected names, shapes and
dtypes, and in any case only contiguous (or compact) datasets whose stored size equals their declared
size and whose sizes sum to at most the file's size (a chunked, never-written ``(10**12,)`` dataset is
refused, not allocated). Any error while loading a candidate (``MemoryError`` included) rejects it;
none escapes on one rank. Nothing is unpickled and no path read from a file is followed: dataset
names must be plain relative names (no leading ``/``, no ``.``/``..`` parts), and soft/external links,
external storage and virtual datasets (which point at other files) are refused.

Parallelism: parameters are replicated, so every rank passes the same arrays (checked by comparing
their checksums across ranks). With a parallel h5py (``h5py.get_config().mpi``) the file is opened
by every rank with ``driver='mpio'`` and rank 0 writes the data (``make phdf5`` builds such an h5py,
``make test-phdf5`` tests this path); with the serial PyPI wheels (the usual case) rank 0 writes the
file alone. Both paths write the same file contents.
Loading is done by rank 0 and broadcast, so a checkpoint written by P ranks loads on any number of
ranks. Every exchange honours ``$HPCZECO_COLLECTIVE_TIMEOUT`` (:mod:`hpczeco.collectives.timed`).

Modules: :mod:`.format` (names, attribute encoding, checksums, path rules; no h5py), :mod:`.write`
(:class:`CheckpointWriter`), :mod:`.guarded_file` (:class:`GuardedFile`), :mod:`.read`
(:func:`load_checkpoint`, :func:`load_latest`), :mod:`.hdf5` (parallel or serial h5py), :mod:`.faults`
(``$HPCZECO_FAULT_CKPT``, the reliability tests' crash points). Needs h5py (``pip install 'hpczeco[drivers]'``).
"""

from __future__ import annotations

from .faults import FAULT_ENV, FAULT_EXIT_CODE
from .format import (
    FORMAT,
    FORMAT_VERSION,
    LOCK_NAME,
    CheckpointError,
    array_sha256,
    check_name,
    checkpoint_name,
    list_checkpoints,
)
from .guarded_file import GuardedFile
from .hdf5 import hdf5_mode, parallel_hdf5
from .read import ExpectArrays, load_checkpoint, load_latest
from .write import CheckpointWriter, estimated_bytes

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "parallel_hdf5",
    "hdf5_mode",
    # the file format and the parts the tests and tools use
    "FORMAT",
    "FORMAT_VERSION",
    "LOCK_NAME",
    "FAULT_ENV",
    "FAULT_EXIT_CODE",
    "ExpectArrays",
    "GuardedFile",
    "array_sha256",
    "check_name",
    "checkpoint_name",
    "estimated_bytes",
]
