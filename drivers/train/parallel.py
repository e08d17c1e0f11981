"""The parallel layout of ``hpczeco train`` and its gradient all-reduce.

Layout (:func:`make_layout`, collective over the MPI world of ``P`` ranks): ``--sp S`` consecutive ranks hold one
group of sequences, each rank a contiguous slice of every sequence (ZeCO over ``world.Split``); ``D = P / S``
such groups share the global batch of ``B`` sequences (data parallel), group ``d`` taking the sequences
``slice_bounds(B, D, d)``. Every rank reads its rows and columns of the same global batch, so the P-rank step
equals a one-rank step over the whole batch. One GPU per rank: ``local rank % visible GPUs``.

Gradients (:class:`GradReducer`): every parameter's ``.grad`` is a view into one flat buffer (three more slots
carry the loss share, the "stop" flag and the "output failed" flag), summed over the world once per step, in
buckets:

- ``nccl``: ``torch.distributed`` (NCCL) on the GPU buffers, bootstrapped from the MPI world (rank 0 picks a free
  TCP port and broadcasts ``host:port``; ``$MASTER_ADDR`` overrides the host). One rank per GPU only: NCCL
  refuses two ranks on one GPU.
- ``ipc``: every rank of the world on one GPU (e.g. SP ranks sharing it): the buffers are mapped into each other
  by CUDA IPC and reduced on the GPU, rank r summing bucket part r of every buffer in rank order, then every rank
  copying the others' parts (MPI barriers between the phases).
- ``mpi``: MPI ``Allreduce`` (the timed collective ``gradient sum``): on host memory directly (CPU), on device
  memory with a CUDA-aware MPI (``hpczeco.collectives.device.cuda_aware_known``), else staged through pinned
  host buckets (device -> host copies of bucket i+1 overlap the MPI sum of bucket i).

``auto``: ``nccl`` when every rank has a GPU of its own (and torch has NCCL), ``ipc`` when all ranks share one
GPU, ``mpi`` otherwise (CPU, several ranks on some GPUs but not all on one). Each path gives the same sum on every
rank (the replicas stay equal); with MPI and NCCL the order of the additions is the library's.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..data import slice_bounds

__all__ = ["Layout", "make_layout", "select_device", "GradReducer", "GRAD_COMMS", "resolve_grad_comm"]

GRAD_COMMS = ("auto", "nccl", "ipc", "mpi")


@dataclass
class Layout:
    """Who holds what: ranks of the world, the SP group (ZeCO communicator) and the DP group index."""

    world: Any
    rank: int
    size: int
    sp: int
    dp: int
    sp_rank: int
    dp_rank: int
    sp_comm: Any
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    gpu: str = ""  # "GPU i of n" (+ sharing) on this rank; "" on the CPU
    gpu_ids: list[str] = field(default_factory=list)  # every rank's GPU identity (host:bus id), CUDA only
    local_size: int = 1  # ranks on this node

    @property
    def n_gpus(self) -> int:
        """Distinct GPUs of the job (0 on the CPU)."""
        return len(set(self.gpu_ids))

    def rows(self, batch: int) -> tuple[int, int]:
        """This rank's sequences ``[a, b)`` of a global batch of ``batch``."""
        return slice_bounds(batch, self.dp, self.dp_rank)

    def cols(self, seq: int) -> tuple[int, int]:
        """This rank's token positions ``[a, b)`` of a sequence of ``seq``."""
        return slice_bounds(seq, self.sp, self.sp_rank)

    def describe(self) -> str:
        return f"{self.size} rank(s) = SP {self.sp} x DP {self.dp}"

    def to_dict(self) -> dict[str, int]:
        return {"world": self.size, "sp": self.sp, "dp": self.dp}

    def free(self) -> None:
        if self.sp_comm is not None and self.sp > 1:
            self.sp_comm.Free()
            self.sp_comm = None


def select_device(world: Any, kind: str) -> tuple[torch.device, str, list[str], int]:
    """``(device, description, every rank's GPU id, ranks on this node)`` for ``kind`` "cpu" or "gpu" (collective:
    a rank without a usable GPU raises the same ``ValueError`` on every rank). GPU ``local rank % visible GPUs``."""
    from hpczeco.collectives import timed
    from hpczeco.collectives.agree import collective_check
    from hpczeco.collectives.lifeline import guard
    from mpi4py import MPI

    with guard(world, "hpczeco train: the ranks of each node (MPI_Comm_split_type)"):
        local = world.Split_type(MPI.COMM_TYPE_SHARED)
    lrank, lsize = local.Get_rank(), local.Get_size()
    local.Free()
    if kind == "cpu":
        return torch.device("cpu"), "", [], lsize
    err, n = None, 0
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 1:
            err = ValueError("--device gpu: no CUDA device visible to PyTorch on this rank")
    except Exception as exc:  # noqa: BLE001 - reported collectively
        err = ValueError(f"--device gpu: CUDA unavailable ({type(exc).__name__}: {exc})")
    collective_check(world, "hpczeco train --device gpu", err)
    dev = lrank % n
    torch.cuda.set_device(dev)
    try:
        import cupy

        cupy.cuda.Device(dev).use()
    except ImportError:
        pass
    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    ident = str(uuid) if uuid is not None else f"{socket.gethostname()}:{dev}"
    ids = timed.allgather(world, ident, "hpczeco train: every rank's GPU")
    sharing = ids.count(ident)
    share = f" (shared by {sharing} ranks)" if sharing > 1 else ""
    return torch.device("cuda", dev), f"GPU {dev} of {n}{share}", ids, lsize


def make_layout(world: Any, sp: int, device: str) -> Layout:
    """The SP x DP layout of ``world`` (``sp`` must divide its size; checked by the caller) on ``device``
    ("cpu" or "gpu"). Collective: splits ``world`` into the SP groups (consecutive ranks)."""
    from hpczeco.collectives.lifeline import guard

    rank, size = world.Get_rank(), world.Get_size()
    dp = size // sp
    sp_comm = None
    if sp > 1:
        with guard(world, "hpczeco train: the sequence-parallel groups (MPI_Comm_split)"):
            sp_comm = world.Split(color=rank // sp, key=rank)
    dev, desc, ids, lsize = select_device(world, device)
    return Layout(world=world, rank=rank, size=size, sp=sp, dp=dp, sp_rank=rank % sp, dp_rank=rank // sp,
                  sp_comm=sp_comm, device=dev, gpu=desc, gpu_ids=ids, local_size=lsize)


def resolve_grad_comm(layout: Layout, kind: str) -> str:
    """``kind`` with "auto" resolved (module docstring); ``ValueError`` for a kind this layout cannot use."""
    cuda = layout.device.type == "cuda"
    distinct = len(set(layout.gpu_ids)) == layout.size
    one_gpu = cuda and len(set(layout.gpu_ids)) == 1
    if kind == "auto":
        if not cuda or layout.size == 1:
            return "mpi"
        if distinct and torch.distributed.is_available() and torch.distributed.is_nccl_available():
            return "nccl"
        return "ipc" if one_gpu else "mpi"
    if kind == "nccl":
        if not cuda:
            raise ValueError("--grad-comm nccl needs --device gpu")
        if not distinct:
            raise ValueError("--grad-comm nccl needs one GPU per rank (NCCL refuses two ranks on one GPU); "
                             "use --grad-comm ipc (all ranks on one GPU) or mpi")
        if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
            raise ValueError("--grad-comm nccl: this PyTorch has no NCCL")
    if kind == "ipc" and not one_gpu:
        raise ValueError("--grad-comm ipc needs every rank on one and the same GPU")
    return kind


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _host_address() -> str:
    """Where the other ranks reach rank 0: ``$MASTER_ADDR``, else this host's address (its name where that
    resolves to a loopback address, as Debian's /etc/hosts does)."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return name
    return socket.getfqdn(name) if addr.startswith("127.") else addr


class GradReducer:
    """One flat gradient buffer (``params``' dtype) whose views are the parameters' ``.grad``, plus three slots
    (loss share, stop flag, output-failed flag); :meth:`allreduce` sums it over the world (collective).

    ``kind``: "nccl", "ipc" or "mpi" (resolved, :func:`resolve_grad_comm`); ``bucket_bytes``: the size of the
    pieces that are reduced (and, for staged MPI, copied) one after the other."""

    def __init__(self, params: list[torch.nn.Parameter], layout: Layout, kind: str, bucket_bytes: int = 256 << 20):
        self.layout, self.kind = layout, kind
        self.params = params
        dtype, dev = params[0].dtype, params[0].device
        self.n = sum(p.numel() for p in params)
        total = self.n + 3
        self._peer_mem: list[Any] = []
        if kind == "ipc" and layout.size > 1:
            self.flat, self._peers = self._ipc_buffers(total, dtype, dev)
        else:
            self.flat, self._peers = torch.zeros(total, dtype=dtype, device=dev), []
        off = 0
        for p in params:
            p.grad = self.flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        per = max(1, bucket_bytes // self.flat.element_size())
        self.buckets = [(a, min(a + per, total)) for a in range(0, total, per)]
        self._pg = None
        self._cuda_aware = False
        self._host: torch.Tensor | None = None
        if layout.size > 1 and kind == "nccl":
            self._pg = self._init_nccl()
        elif layout.size > 1 and kind == "mpi" and dev.type == "cuda":
            from hpczeco.collectives.device import cuda_aware_known

            self._cuda_aware = bool(cuda_aware_known())
            if not self._cuda_aware:
                self._host = torch.empty(total, dtype=dtype, pin_memory=True)
                self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))

    # -- setup ------------------------------------------------------------------------------------------

    def _init_nccl(self) -> Any:
        import torch.distributed as dist

        world = self.layout.world
        addr = f"{_host_address()}:{_free_port()}" if self.layout.rank == 0 else None
        from hpczeco.collectives import timed

        addr = timed.bcast(world, addr, 0, "hpczeco train: NCCL's address (rank 0's host and port)")
        dist.init_process_group(backend="nccl", init_method=f"tcp://{addr}", rank=self.layout.rank,
                                world_size=self.layout.size, device_id=self.layout.device)
        return dist.group.WORLD

    def _ipc_buffers(self, total: int, dtype: torch.dtype, dev: torch.device) -> tuple[torch.Tensor, list]:
        """This rank's buffer (its own ``cudaMalloc``) and every rank's, mapped here by CUDA IPC (rank order)."""
        import cupy

        nbytes = total * torch.empty((), dtype=dtype).element_size()
        mem = cupy.cuda.Memory(nbytes)  # a plain cudaMalloc: its IPC handle maps this allocation exactly
        self._peer_mem.append(mem)
        cp_dtype = {torch.float32: np.float32, torch.float64: np.float64}[dtype]
        mine = torch.from_dlpack(cupy.ndarray((total,), cp_dtype, cupy.cuda.MemoryPointer(mem, 0)))
        mine.zero_()
        from hpczeco.collectives import timed

        handles = timed.allgather(self.layout.world, cupy.cuda.runtime.ipcGetMemHandle(mem.ptr),
                                  "hpczeco train: the gradient buffers' CUDA IPC handles")
        views = []
        for r, h in enumerate(handles):
            if r == self.layout.rank:
                views.append(mine)
                continue
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(h)
            um = cupy.cuda.UnownedMemory(ptr, nbytes, self)
            self._peer_mem.append(ptr)
            views.append(torch.from_dlpack(cupy.ndarray((total,), cp_dtype, cupy.cuda.MemoryPointer(um, 0))))
        return mine, views

    # -- per step ---------------------------------------------------------------------------------------

    def zero(self) -> None:
        self.flat.zero_()

    def allreduce(self, loss_share: torch.Tensor, stop: bool, failed: bool = False) -> None:
        """Put the loss share and the flags into the last three slots and sum the buffer over the world."""
        self.flat[self.n].copy_(loss_share.detach())
        self.flat[self.n + 1].fill_(1.0 if stop else 0.0)
        self.flat[self.n + 2].fill_(1.0 if failed else 0.0)
        if self.layout.size == 1:
            return
        if self.kind == "nccl":
            import torch.distributed as dist

            works = [dist.all_reduce(self.flat[a:b], async_op=True) for a, b in self.buckets]
            for w in works:
                w.wait()
        elif self.kind == "ipc":
            self._allreduce_ipc()
        elif self.flat.device.type == "cpu":
            self._allreduce_mpi_host(self.flat)
        elif self._cuda_aware:
            torch.cuda.current_stream().synchronize()
            for a, b in self.buckets:
                self._mpi_sum(self.flat[a:b])
        else:
            self._allreduce_staged()

    def loss_and_flags(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The summed loss (a 0-d tensor on the device), stop flag (> 0: some rank asked to stop) and output-failed
        flag (> 0: rank 0 could not write its output, e.g. the log)."""
        return self.flat[self.n], self.flat[self.n + 1], self.flat[self.n + 2]

    def _mpi_sum(self, t: torch.Tensor) -> None:
        from hpczeco.collectives import timed
        from mpi4py import MPI

        buf = t.numpy() if t.device.type == "cpu" else t
        timed.Allreduce(self.layout.world, buf, MPI.SUM, "gradient sum")

    def _allreduce_mpi_host(self, flat: torch.Tensor) -> None:
        for a, b in self.buckets:
            self._mpi_sum(flat[a:b])

    def _allreduce_staged(self) -> None:
        """device -> pinned host (side stream, bucket by bucket) | MPI sum on the host | host -> device."""
        assert self._host is not None
        main = torch.cuda.current_stream()
        side, back = self._streams
        side.wait_stream(main)
        done = []
        with torch.cuda.stream(side):
            for a, b in self.buckets:
                self._host[a:b].copy_(self.flat[a:b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
                done.append(ev)
        for (a, b), ev in zip(self.buckets, done):
            ev.synchronize()
            self._mpi_sum(self._host[a:b])
            with torch.cuda.stream(back):
                self.flat[a:b].copy_(self._host[a:b], non_blocking=True)
        main.wait_stream(back)  # (the next step's copies into the host buckets come after this on `side`)

    def _allreduce_ipc(self) -> None:
        """All ranks on one GPU: reduce-scatter then all-gather through the IPC-mapped buffers (module docstring)."""
        from hpczeco.collectives import timed

        world, P, r = self.layout.world, self.layout.size, self.layout.rank
        parts = [slice_bounds(self.flat.numel(), P, q) for q in range(P)]
        torch.cuda.current_stream().synchronize()
        timed.allgather(world, None, "gradient sum")  # every rank's gradients are complete
        a, b = parts[r]
        if b > a:
            acc = self._peers[0][a:b].clone()
            for q in range(1, P):
                acc += self._peers[q][a:b]
            self.flat[a:b].copy_(acc)
        torch.cuda.current_stream().synchronize()
        timed.allgather(world, None, "gradient sum")  # every part is reduced in its owner's buffer
        for q in range(P):
            qa, qb = parts[q]
            if q != r and qb > qa:
                self.flat[qa:qb].copy_(self._peers[q][qa:qb])
        torch.cuda.current_stream().synchronize()
        timed.allgather(world, None, "gradient sum")  # nobody reads a peer buffer any more

    def close(self) -> None:
        """Release the process group / IPC mappings (collective for nccl)."""
        if self._pg is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._pg = None
        if self.kind == "ipc" and self._peer_mem:
            import cupy

            self._peers = []
            for ptr in self._peer_mem[1:]:
                try:
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
                except Exception:  # noqa: BLE001 - best effort at exit
                    pass
            self._peer_mem = self._peer_mem[:1]
