"""Checkpoint write path, old against new, in one run (docs/RELIABILITY.md, "Disk full").

Usage: python ckpt_write_bench.py FOLDER [REPEATS]
For a few checkpoint sizes (arrays of float32 like a model's parameters and Adam moments) it times, after
one warm-up each, alternating:

* old: ``h5py.File(tmp, 'w')`` on the disk, datasets written, ``flush``, ``fsync``;
* core: the same file built in memory with h5py's core driver (no backing store, one allocation), its
  image written with ``os.write`` and ``fsync`` (the fix the issue suggested; not used: slower);
* new: h5py writing through :class:`hpczeco.drivers.checkpoint.GuardedFile` (``os.pwrite``, I/O errors
  kept from HDF5), then ``fsync`` (what ``CheckpointWriter`` does).

Each then renames the file into place and fsyncs the folder, as ``CheckpointWriter.save`` does. Prints
the median seconds of each and the ratios to old.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import h5py
import numpy as np
from hpczeco.drivers.checkpoint import CheckpointWriter, GuardedFile, array_sha256
from hpczeco.drivers.checkpoint.write import _fsync_path


def _arrays(total_bytes: int, n: int = 24) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    each = max(1, total_bytes // (4 * n))
    return {f"params/p{i:02d}": rng.standard_normal(each).astype(np.float32) for i in range(n)}


def _old(path: Path, host, manifest, stored, root_attrs) -> None:
    with h5py.File(path, "w") as f:
        CheckpointWriter._fill(f, host, manifest, stored, root_attrs, write_data=True)
        f.flush()
    _fsync_path(path)


def _core(path: Path, host, manifest, stored, root_attrs) -> None:
    block = sum(a.nbytes for a in host.values()) + (1 << 20)
    with h5py.File(f"bench-{os.getpid()}.h5", "w", driver="core", backing_store=False, block_size=block) as f:
        CheckpointWriter._fill(f, host, manifest, stored, root_attrs, write_data=True)
        f.flush()
        image = memoryview(f.id.get_file_image())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        done = 0
        while done < len(image):
            done += os.write(fd, image[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _new(path: Path, host, manifest, stored, root_attrs) -> None:
    with GuardedFile(path) as guarded:
        with h5py.File(guarded, "w") as f:
            CheckpointWriter._fill(f, host, manifest, stored, root_attrs, write_data=True)
            f.flush()
        guarded.sync()
    assert guarded.error is None, guarded.error


def main() -> None:
    folder = Path(sys.argv[1])
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    folder.mkdir(parents=True, exist_ok=True)
    print("| checkpoint | old: h5py to disk | core image + write | core / old | new: GuardedFile | new / old |")
    print("|---|---|---|---|---|---|")
    for mib in (1, 16, 128):
        host = _arrays(mib << 20)
        manifest = {n: {"shape": list(a.shape), "dtype": a.dtype.str, "sha256": array_sha256(a)}
                    for n, a in host.items()}
        root_attrs = {"format": "hpczeco-checkpoint", "format_version": np.int64(1), "step": np.int64(1),
                      "nranks": np.int64(1), "created": "now", "_manifest": "{}", "_attr_kinds": "{}",
                      "_attrs_sha256": ""}  # fmt: skip
        times: dict[str, list[float]] = {"old": [], "core": [], "new": []}
        for i in range(repeats + 1):
            for name, fn in (("old", _old), ("core", _core), ("new", _new)):
                tmp, final = folder / f".bench.tmp-{name}", folder / f"bench_{name}.h5"
                t0 = time.perf_counter()
                fn(tmp, host, manifest, {}, root_attrs)
                os.replace(tmp, final)
                _fsync_path(folder, directory=True)
                if i:  # the first round is the warm-up
                    times[name].append(time.perf_counter() - t0)
        old, core, new = (float(np.median(times[k])) for k in ("old", "core", "new"))
        size = (folder / "bench_new.h5").stat().st_size
        print(f"| {size / 2**20:.1f} MiB | {old:.4f} s | {core:.4f} s | {core / old:.2f} | {new:.4f} s "
              f"| {new / old:.2f} |")
        for name in ("old", "core", "new"):
            (folder / f"bench_{name}.h5").unlink()


if __name__ == "__main__":
    main()
