"""Offline compile check of the CUDA sources in this folder with ``nvcc`` (no GPU needed).

``python -m hpczeco.gpu.build [--arch sm_90] [--ptx] [FILES]`` compiles every ``gpu/*.cu`` with its
template instantiations (``-DGLA_INSTANTIATE``) and prints, per kernel, the registers, spills, stack and
static shared memory that ``ptxas -v`` reports. :func:`start` / :func:`finish` run the compiles as
background processes so a test can overlap them with other work.

Compile cache: a successful compile's report (exit status and nvcc/ptxas output; not the object file) is
kept under ``$HPCZECO_NVCC_CACHE`` (default ``$XDG_CACHE_HOME/hpczeco/nvcc``, i.e. ``~/.cache/hpczeco/nvcc``),
keyed by the nvcc version, the command's flags (not its paths) and the bytes of the source and of
every ``.cu``/``.cuh``/``.h`` in this folder; the same compile again reads the report instead of running
nvcc. ``HPCZECO_NVCC_CACHE=0`` turns it off. Failures are never cached.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE_ENV = "HPCZECO_NVCC_CACHE"
NVCC_CANDIDATES = ("nvcc", "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")


def nvcc_path() -> str | None:
    """The nvcc to use: ``$NVCC``, else the first found on PATH or in the usual places."""
    env = os.environ.get("NVCC")
    if env:
        return env if shutil.which(env) else None
    for c in NVCC_CANDIDATES:
        p = shutil.which(c)
        if p:
            return p
    return None


def cu_files() -> list[Path]:
    return sorted(HERE.glob("*.cu"))


@dataclass
class KernelInfo:
    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0


@dataclass
class Result:
    path: Path
    returncode: int
    output: str
    cmd: list[str]
    kernels: list[KernelInfo] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def command(path: Path, arch: str = "sm_90", ptx: bool = False, out: str | None = None, fast: bool = False):
    """nvcc command line; ``fast`` instantiates one type per template (``-DGLA_INSTANTIATE_FAST``)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set $NVCC)")
    out = out or os.path.join(tempfile.mkdtemp(prefix="hpczeco-nvcc-"), path.stem + (".ptx" if ptx else ".o"))
    cmd = [nvcc, f"-arch={arch}", "-std=c++17", "-DGLA_INSTANTIATE", f"-I{HERE}"]
    if fast:
        cmd.append("-DGLA_INSTANTIATE_FAST")
    cmd += ["--ptx"] if ptx else ["-c", "-Xptxas", "-v"]
    return cmd + [str(path), "-o", out]


def parse_ptxas(text: str) -> list[KernelInfo]:
    """Per-kernel resources from ``ptxas -v`` output."""
    out: list[KernelInfo] = []
    cur: KernelInfo | None = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = KernelInfo(m.group(1))
            out.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.stack, cur.spill_stores, cur.spill_loads = (int(x) for x in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur.smem = int(s.group(1)) if s else 0
    return out


def cache_dir() -> Path | None:
    """Where compile reports are kept (None: ``$HPCZECO_NVCC_CACHE`` is 0/off/no/empty)."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpczeco" / "nvcc"


_VERSIONS: dict[str, str] = {}


def _cache_key(cmd: list[str], path: Path) -> str:
    nvcc = cmd[0]
    if nvcc not in _VERSIONS:
        _VERSIONS[nvcc] = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    h = hashlib.sha256(_VERSIONS[nvcc].encode())
    # the flags: not nvcc's path, "-I<this folder>", the source's path nor "-o OUT" (the bytes are hashed below)
    h.update(json.dumps([a for a in cmd[1:-3] if not a.startswith("-I")]).encode())
    for f in [Path(path), *sorted(p for ext in ("*.cu", "*.cuh", "*.h") for p in HERE.glob(ext))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:32]


class _Cached:
    """A finished compile read from the cache, in place of its ``Popen``."""

    returncode = 0

    def __init__(self, output: str):
        self.output = output

    def poll(self) -> int:
        return 0

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        return self.output, None

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 0


def start(path: Path, arch: str = "sm_90", ptx: bool = False, fast: bool = False):
    """Start nvcc on ``path`` in the background (or read its cached report); pass the result to :func:`finish`."""
    cmd = command(path, arch, ptx, fast=fast)
    folder = cache_dir()
    key = _cache_key(cmd, path) if folder is not None else None
    hit = folder / f"{key}.json" if key else None
    if hit is not None and hit.exists():
        try:
            return _Cached(json.loads(hit.read_text())["output"]), cmd, path, None
        except (OSError, ValueError, KeyError):
            pass  # unreadable: compile again
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, cmd, path, hit


def finish(started: tuple, timeout: float | None = None) -> Result:
    proc, cmd, path, hit = started
    out, _ = proc.communicate(timeout=timeout)
    if hit is not None and proc.returncode == 0:
        try:
            hit.parent.mkdir(parents=True, exist_ok=True)
            tmp = hit.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"cmd": cmd, "output": out}))
            os.replace(tmp, hit)
        except OSError:
            pass  # a read-only home: no cache
    return Result(path, proc.returncode, out, cmd, parse_ptxas(out))


def compile_check(path: Path, arch: str = "sm_90", ptx: bool = False, fast: bool = False) -> Result:
    return finish(start(path, arch, ptx, fast))


def main(argv: list[str] | None = None, prog: str = "python -m hpczeco.gpu.build") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Compile gpu/*.cu with nvcc and report kernel resources.")
    p.add_argument("files", nargs="*", help="files to compile (default: every gpu/*.cu)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--ptx", action="store_true", help="stop at PTX (faster, no resource report)")
    p.add_argument("--fast", action="store_true", help="one instantiation per template (-DGLA_INSTANTIATE_FAST)")
    a = p.parse_args(argv)
    if nvcc_path() is None:
        print("nvcc not found (set $NVCC)", file=sys.stderr)
        return 2
    files = [Path(f) for f in a.files] or cu_files()
    jobs = [start(f, a.arch, a.ptx, a.fast) for f in files]
    bad = 0
    for j in jobs:
        r = finish(j)
        print(f"{'OK  ' if r.ok else 'FAIL'} {r.path.name}")
        if not r.ok:
            bad += 1
            print(r.output[-4000:])
        for k in r.kernels:
            print(
                f"     {k.name[:70]:70s} regs {k.registers:3d}  spill {k.spill_stores}/{k.spill_loads} B  "
                f"stack {k.stack} B  smem {k.smem} B"
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
