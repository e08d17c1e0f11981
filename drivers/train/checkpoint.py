"""The training state of ``hpczeco train`` in HDF5 checkpoints (:mod:`hpczeco.drivers.checkpoint`: arrays and
plain attributes, never pickle; atomic; checksummed), written synchronously or in the background.

Contents of ``ckpt_<step>.h5``:

- arrays ``params/<name>``, ``adam/m/<name>``, ``adam/v/<name>`` for every parameter (``<name>`` as in
  ``model.named_parameters()``, e.g. ``blocks.0.attn.q_proj.weight``): the weights and AdamW's two moments, in
  the parameter dtype (float32 master weights under bf16 autocast; float64 for float64 runs);
- attributes ``config`` (the run's model and optimisation settings: a resume with other ones is refused),
  ``adam_t`` (AdamW steps taken), ``data_pos`` (windows of the stream consumed, over all ranks), ``tokens_seen``,
  ``loss``, ``layout`` (``world``, ``sp``, ``dp`` of the run that wrote it), ``rng_torch_cpu`` and, on GPUs,
  ``rng_torch_cuda`` (generator states as uint8 arrays).

The parameters are replicated, so a checkpoint resumes onto any rank count and SP x DP layout: only the data
slicing depends on the layout, and it is a function of ``data_pos``.

:class:`Saver`, asynchronous (``--ckpt-async``, the default on GPUs): rank 0 copies the state into host buffers
preallocated once (pinned on CUDA; the copies are queued on a side stream after the step's work, so the GPU keeps
computing the next forward and backward; only the next optimizer step waits for them, on the GPU), then a
background thread writes the file (:class:`~hpczeco.drivers.checkpoint.CheckpointWriter` of one process) while
training goes on. A write's error reaches every rank, as the same ``CheckpointError``, at the next save or at the
end. Synchronous (``--ckpt-async off``, the default on CPUs): every rank passes the arrays to the collective
writer (parallel HDF5 where h5py has it; every rank's checksums compared), as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import CheckpointError, CheckpointWriter

__all__ = ["PREFIXES", "init_optimizer_state", "state_tensors", "expected_arrays", "make_validate", "restore",
           "rng_attrs", "Saver"]

#: the array groups of a checkpoint: weights, AdamW first and second moments
PREFIXES = ("params/", "adam/m/", "adam/v/")

#: :class:`Saver`'s default ``writer``: make rank 0's writer there
NEW_WRITER: Any = object()


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state (step 0, zero moments) for every parameter now, as ``torch.optim.AdamW`` would at its
    first step, so the state can be preallocated, saved and restored before any step."""
    for group in opt.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the live tensor (parameters and AdamW moments; :data:`PREFIXES`)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        out[f"params/{name}"] = p
        out[f"adam/m/{name}"] = st["exp_avg"]
        out[f"adam/v/{name}"] = st["exp_avg_sq"]
    return out


def expected_arrays(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``expect_arrays`` of :func:`~hpczeco.drivers.checkpoint.load_latest`: exactly these names, shapes, dtypes."""
    return {n: (tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch."))) for n, t in tensors.items()}


def make_validate(n_windows: int) -> Callable[[int, dict[str, np.ndarray], dict[str, Any]], None]:
    """The model-level checks of a candidate checkpoint (it is skipped for an older one when they fail):
    ``adam_t`` an int in ``[0, step]``, ``data_pos`` an int >= 0, every array finite, second moments >= 0."""

    def validate(step: int, arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> None:
        t = attrs.get("adam_t")
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"attribute adam_t is {type(t).__name__} {t!r}, expected an int")
        if not 0 <= t <= step:
            raise ValueError(f"attribute adam_t = {t} is outside [0, step {step}]")
        pos = attrs.get("data_pos")
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise ValueError(f"attribute data_pos is {type(pos).__name__} {pos!r}, expected an int >= 0")
        for name, a in arrays.items():
            if not np.isfinite(a).all():
                raise ValueError(f"array {name!r} holds NaN or Inf")
            if name.startswith("adam/v/") and (a < 0).any():
                raise ValueError(f"array {name!r} (Adam second moment) holds negative values")

    return validate


def rng_attrs(device: torch.device) -> dict[str, np.ndarray]:
    """The torch generator states as uint8 arrays (CPU, and the CUDA device's)."""
    out = {"rng_torch_cpu": torch.get_rng_state().numpy().copy()}
    if device.type == "cuda":
        out["rng_torch_cuda"] = torch.cuda.get_rng_state(device).numpy().copy()
    return out


@torch.no_grad()
def restore(tensors: dict[str, torch.Tensor], opt: torch.optim.Optimizer, arrays: dict[str, np.ndarray],
            attrs: dict[str, Any], device: torch.device) -> None:
    """Copy a loaded checkpoint into the live tensors, set AdamW's step and the torch generators."""
    for name, t in tensors.items():
        t.copy_(torch.from_numpy(arrays[name]))
    for st in opt.state.values():
        st["step"].fill_(float(attrs["adam_t"]))
    cpu = attrs.get("rng_torch_cpu")
    if isinstance(cpu, np.ndarray) and cpu.dtype == np.uint8:
        torch.set_rng_state(torch.from_numpy(cpu.copy()))
    cuda = attrs.get("rng_torch_cuda")
    if device.type == "cuda" and isinstance(cuda, np.ndarray) and cuda.dtype == np.uint8:
        torch.cuda.set_rng_state(torch.from_numpy(cuda.copy()), device)


class Saver:
    """Writes checkpoints of ``tensors`` (name -> live tensor, replicated on every rank of ``world``) into
    ``folder``, keeping the newest ``keep``. Every call is collective over ``world``.

    ``save(step, attrs)`` returns the seconds this rank was blocked; ``wait_for_copies()`` must precede the next
    in-place update of the tensors (the optimizer step); ``finish()`` waits for the last write. ``events``
    collects ``{"event": "checkpoint", ...}`` records (path, write seconds, copy seconds) as writes complete.

    ``writer``: rank 0's one-process :class:`~hpczeco.drivers.checkpoint.CheckpointWriter` of ``folder``, made
    before any work (it holds the folder's lock; ``hpczeco train`` keeps it for the whole run), passed on every
    rank (None on the others): the asynchronous saves write through it. By default (:data:`NEW_WRITER`) the
    writer is made here -- collectively, so a folder that another live job holds is the same ``CheckpointError``
    on every rank."""

    def __init__(self, folder: str | Path, world: Any, tensors: dict[str, torch.Tensor], keep: int,
                 asynchronous: bool, device: torch.device, writer: Any = NEW_WRITER):
        self.folder, self.world, self.tensors, self.keep = Path(folder), world, tensors, keep
        self.rank = world.Get_rank()
        self.asynchronous = asynchronous
        self.device = device
        self.events: list[dict[str, Any]] = []
        self.last_path: str | None = None
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._copied: Any = None
        if not asynchronous:
            self.writer = CheckpointWriter(self.folder, world, keep=keep)
            return
        if writer is NEW_WRITER:
            writer = _one_process_writer(self.folder, world, keep)
        self.writer = writer if self.rank == 0 else None
        self.host: dict[str, torch.Tensor] = {}
        if self.rank == 0:
            self._allocate()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and self.rank == 0 else None

    def _allocate(self) -> None:
        """One host buffer per dtype (pinned on CUDA), viewed per tensor: allocated once, reused by every save."""
        pin = self.device.type == "cuda"
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, t in self.tensors.items():
            by_dtype.setdefault(t.dtype, []).append(name)
        for dtype, names in by_dtype.items():
            flat = torch.empty(sum(self.tensors[n].numel() for n in names), dtype=dtype, pin_memory=pin)
            off = 0
            for n in names:
                k = self.tensors[n].numel()
                self.host[n] = flat[off:off + k].view(self.tensors[n].shape)
                off += k

    # -- collective pieces ------------------------------------------------------------------------------

    def _check_replicas(self) -> None:
        """Every rank's parameters are the same (a fingerprint of them compared over the world)."""
        from hpczeco.collectives import timed

        with torch.no_grad():
            vals = [t.detach().sum(dtype=torch.float64) for n, t in self.tensors.items() if n.startswith("params/")]
            mine = float(torch.stack(vals).sum().item()) if vals else 0.0
        everyone = timed.allgather(self.world, mine, "checkpoint save") if self.world.Get_size() > 1 else [mine]
        bad = [r for r, v in enumerate(everyone) if v != everyone[0]]
        if bad:
            raise ValueError(f"checkpoint save: the parameters of rank {bad[0]} differ from rank 0's (fingerprint "
                             f"{everyone[bad[0]]!r} vs {everyone[0]!r}); the replicas must be identical")

    def _collect(self) -> None:
        """Rank 0 waits for the write in flight; its outcome reaches every rank (the same ``CheckpointError``)."""
        from hpczeco.collectives import timed

        result = None
        if self.rank == 0 and self._thread is not None:
            self._thread.join()
            self._thread = None
            result, self._result = self._result, None
        if self.world.Get_size() > 1:
            result = timed.bcast(self.world, result, 0, "checkpoint save")
        if result is None:
            return
        if result.get("error"):
            raise CheckpointError(result["error"])
        self.last_path = result["path"]
        self.events.append({"event": "checkpoint", **result})

    # -- public -----------------------------------------------------------------------------------------

    def save(self, step: int, attrs: dict[str, Any]) -> float:
        """Checkpoint ``step`` with ``attrs`` (collective); the seconds this rank was blocked."""
        t0 = time.perf_counter()
        if not self.asynchronous:
            arrays = {n: t.detach().cpu().numpy() for n, t in self.tensors.items()}
            self.last_path = str(self.writer.save(step, arrays, attrs))
            blocked = time.perf_counter() - t0
            self.events.append({"event": "checkpoint", "step": step, "path": self.last_path, "write_s": blocked,
                                "async": False})
            return blocked
        self._check_replicas()
        self._collect()
        if self.rank == 0:
            self._snapshot()
            self._thread = threading.Thread(target=self._write, args=(step, dict(attrs), t0), daemon=True,
                                            name=f"hpczeco-ckpt-{step}")
            self._thread.start()
        return time.perf_counter() - t0

    def _snapshot(self) -> None:
        if self._stream is None:  # CPU: a plain copy, done when this returns
            for n, t in self.tensors.items():
                self.host[n].copy_(t.detach())
            self._copied = None
            return
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record(self._stream)
            for n, t in self.tensors.items():
                self.host[n].copy_(t.detach(), non_blocking=True)
            end.record(self._stream)
        self._copied = (start, end)

    def wait_for_copies(self) -> None:
        """Make the current stream wait (on the GPU) for the snapshot's copies before the tensors change."""
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied[1])

    def _write(self, step: int, attrs: dict[str, Any], t0: float) -> None:
        out: dict[str, Any] = {"step": step, "async": True}
        try:
            copy_s = None
            if self._copied is not None:
                start, end = self._copied
                end.synchronize()
                copy_s = start.elapsed_time(end) / 1e3
            arrays = {n: h.numpy() for n, h in self.host.items()}
            t_w = time.perf_counter()
            out["path"] = str(self.writer.save(step, arrays, attrs))
            out.update(write_s=time.perf_counter() - t_w, copy_s=copy_s, done_s=time.perf_counter() - t0)
        except (CheckpointError, ValueError, TypeError, OSError) as exc:
            out["error"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported on every rank at the next collect
            out["error"] = f"checkpoint {step}: {type(exc).__name__}: {exc}"
        self._result = out

    def finish(self) -> str | None:
        """Wait for the write in flight (collective); the newest checkpoint's path."""
        if self.asynchronous:
            self._collect()
            self._copied = None
        return self.last_path


def _one_process_writer(folder: Path, world: Any, keep: int) -> CheckpointWriter | None:
    """Rank 0's writer of ``folder`` for asynchronous saves (None elsewhere); collective over ``world``: its
    ``CheckpointError`` (another live job holds the folder) is raised on every rank."""
    from hpczeco.collectives import timed

    writer, err = None, None
    if world.Get_rank() == 0:
        try:
            writer = CheckpointWriter(folder, None, keep=keep)
        except (CheckpointError, ValueError) as exc:
            err = str(exc)
    if world.Get_size() > 1:
        err = timed.bcast(world, err, 0, "checkpoint writer (the folder's lock)")
    if err:
        raise CheckpointError(err)
    return writer
