"""ZeCO sequence parallelism for gated linear attention (arXiv 2507.01004).

One long sequence is split over the ranks of a communicator: rank p holds the contiguous slice
``[B, L_p, H, *]`` (slices may differ in length, including zero). Each rank needs only one
fixed-size state from the ranks before it, ``S_in^(p)``, the exclusive scan of
``(a_p, S_local^(p))`` under ``(a1, S1) o (a2, S2) = (a1 a2, a2 S1 + S2)`` (DESIGN.md).

Forward, in the paper's order of work::

    a_p, S_local              local decay and state from a zero state          (no communication)
    scan_start(a_p, S_local)  All-Scan in flight (ring / tree / baselines)
    o_local                   chunked GLA of the slice from a zero state       (overlaps the scan)
    S_in = wait()
    o = o_local + scale (q * exp(G)) S_in,    final = a_p S_in + S_local

Backward uses the same operator in the reverse direction: with
``U_p = scale sum_t (q_t exp(G_t))^T do_t`` the gradient reaching rank p's final state is
``D_p`` = reverse exclusive scan of ``(a_p, U_p)`` seeded with ``dht`` on the last rank. The
local backward (with ``initial_state = S_in``) overlaps that scan; the contribution of ``D_p`` is
added once it lands. Both directions talk to the split protocol of :mod:`hpczeco.gla.split` (``a``,
the local state, ``overlap(poll)``, ``finish``), implemented on numpy and CuPy (the device adapters over
:mod:`hpczeco.gpu.gla`), so each has one code path, and every scan topology runs through it. The
LASP-1 baseline ``"serial"`` is the scan's serial relay (:mod:`hpczeco.collectives.ring`, the ring in one
block): each rank waits for the combined state of the ranks before it, folds in its own ``(a_p, S_local)`` and
passes it on, while its local work overlaps the relay as with any other topology (the same states as a relay
that receives, computes the slice from the received state and sends its final state, to rounding).

Packed documents (``cu_seqlens``, :mod:`hpczeco.zeco_varlen`): the global offsets ``cu_seqlens [N + 1]`` (B == 1)
are given on every rank (the same array: agreed collectively, its end checked against the sum of the slice
lengths); documents may start, end or cross inside any slice. A document start inside a slice is a zero decay for
everything before it, so the scan element is ``a = 0`` and the last document's state there; the collectives are
unchanged. Per-document inputs (``initial_state``, ``dht``: ``[N, H, K, V]``) are the same on every rank (or
None on every rank), each rank reading the rows of the documents that start (end) in its slice; per-document
outputs are this rank's rows: ``final_state [len(documents.ends), H, K, V]``, ``dh0 [len(documents.starts), H,
K, V]``, with ``documents`` (:class:`~hpczeco.zeco_varlen.RankDocuments`) naming them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .base.backend import get_array_module
from .base.checks import check_chunk_size, check_scale
from .collectives import CollectiveInputError, timed
from .collectives.agree import agree_fast, local_error
from .collectives.names import check_blocks, check_topology
from .gla import validate_gla_inputs
from .gla.split import SplitWorkspace, split_backward, split_forward
from .gla.validate import check_cu_seqlens, check_document_states, raise_for_flags
from .zeco_varlen import RankDocuments, local_rows, owned_rows, rank_documents

__all__ = ["ZeCOGLA", "zeco_gla"]


def _state_dtype(x) -> Any:
    """float64 stays float64; everything else keeps states in float32."""
    return np.float64 if str(x.dtype) == "float64" else np.float32


@dataclass
class ZeCOTimings:
    """Seconds spent in the phases of the last forward/backward on this rank.

    Keys: ``checks`` (the collective validation), ``states`` (the local pass before the scan),
    ``scan_start``, ``overlap`` (compute done while the scan was in flight: the split's ``overlap``),
    ``wait`` (the time blocked in ``wait()`` afterwards, the part of the scan that was not hidden),
    ``correction`` (the split's ``finish``) and ``total`` (the same keys for every topology).
    """

    fwd: dict[str, float] = field(default_factory=dict)
    bwd: dict[str, float] = field(default_factory=dict)


class ZeCOGLA:
    """Sequence-parallel GLA layer over ``comm`` (ranks hold contiguous slices in rank order).

    Args:
        comm: the communicator (the caller owns it; every rank of it must call forward/backward). Every
            wait of the layer (the agreements, the scans) honours
            ``$HPCZECO_COLLECTIVE_TIMEOUT`` (agreed over ``comm``'s ranks on first use).
        topology: the scan's topology (:data:`hpczeco.collectives.TOPOLOGIES`): "ring" (pipelined All-Scan),
            "tree", "allgather" (LASP-2), "serial" (LASP-1), "exscan" (MPI_Exscan) or "auto" (the cost model's
            pick).
        blocks: pieces the ring splits the state into along K (None: cost model's choice).
        chunk_size: chunk length of the local chunked GLA.
        scale: query scale (default ``K ** -0.5``): a positive finite number (checked here).
        transport: device transport name or object for CuPy arrays (None: the communicator's, by detection or
            ``$HPCZECO_TRANSPORT``).
        check_values: scan q, k, v, g, do (and the states) for NaN/Inf and g for positive values on every call
            (shapes, dtypes and options are always agreed across ranks). ``False`` is for loops whose inputs
            are known good; a NaN then propagates instead of stopping every rank with an error.
        profile: synchronise the device at phase boundaries so that ``timings`` hold device time per
            phase (``checks``, ``states``, ``wait``, ``correction``); it costs the overlap of the phases,
            so use it to diagnose, not to benchmark.

    On numpy arrays the layer keeps the phase-split GLA's arrays between calls (a
    :class:`hpczeco.gla.split.SplitWorkspace`: chunk states, q-side operands, state gradients, each about
    ``B H T K`` values), so that a step touches warm pages; a forward overwrites them, so a backward belongs
    to the last forward (as before).
    """

    def __init__(self, comm, topology: str = "ring", blocks: int | None = None, chunk_size: int = 64,
                 scale: float | None = None, transport: Any = None, profile: bool = False,
                 check_values: bool = True):
        # each option by its one rule where it enters (blocks <= K is checked by the scan once K is known)
        check_topology(topology)
        check_blocks(blocks)
        check_scale(scale)
        self.comm = comm
        self.topology = topology
        self.blocks = blocks
        self.chunk_size = check_chunk_size(chunk_size)  # the GPU limit is checked when the arrays are known
        self.scale = scale
        self.transport = transport
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timings = ZeCOTimings()
        self.profile = bool(profile)
        self.check_values = bool(check_values)
        self._device = False
        self._side: tuple[int, Any] | None = None  # (device id, side stream of the value checks)
        self._saved: dict[str, Any] | None = None
        # the numpy split's arrays kept between its phases (chunk states, operands, state gradients), reused
        # from call to call so that a step touches warm pages; the forward's chunk states in it are the ones
        # the backward reads, so a forward invalidates the previous forward's saved values before reusing it
        self._workspace = SplitWorkspace()
        self._final_state = None
        self.documents: RankDocuments | None = None  # with cu_seqlens: this rank's share of the documents

    # ------------------------------------------------------------------ helpers
    def _start_value_flags(self, arrays: dict[str, Any], gate: str | None = None):
        """Queue the fused NaN/Inf/gate checks of CuPy ``arrays`` on this layer's side stream."""
        import cupy  # noqa: PLC0415

        from .gpu.checks import start_value_flags  # noqa: PLC0415

        dev = cupy.cuda.Device().id
        if self._side is None or self._side[0] != dev:
            self._side = (dev, cupy.cuda.Stream(non_blocking=True))
        return start_value_flags([(x, n == gate) for n, x in arrays.items()], stream=self._side[1])

    def _now(self) -> float:
        """perf_counter, after a device synchronisation in ``profile`` mode on CuPy arrays."""
        if self.profile and self._device:
            import cupy  # noqa: PLC0415

            cupy.cuda.get_current_stream().synchronize()
        return time.perf_counter()

    def _scan_kwargs(self) -> dict[str, Any]:
        # the layer validated q, k, v, g, do, initial_state and dht collectively: the scan need not scan
        # the derived states for NaN again (on device arrays each such scan synchronises the device)
        # and it agreed shapes, dtype, topology, blocks and transport across ranks: no second validation exchange
        return {"topology": self.topology, "blocks": self.blocks, "transport": self.transport, "check_values": False,
                "agreed": True}

    def _scan_overlapped(self, split, a, element, init, reverse: bool, tm: dict[str, float]):
        """Start the scan of ``(a, element)`` (reverse: the backward's), run ``split.overlap`` while it is in
        flight (polling it), and return its result; records ``scan_start``, ``overlap`` and ``wait`` in ``tm``."""
        from .collectives import scan_start

        t1 = self._now()
        handle = scan_start(a, element, self.comm, reverse=reverse, initial=init, **self._scan_kwargs())
        t2 = self._now()
        tm["scan_start"] = t2 - t1
        split.overlap(poll=handle.test)
        t3 = self._now()
        tm["overlap"] = t3 - t2
        result = handle.wait()
        tm["wait"] = self._now() - t3
        return result

    def _forward_agreement(self, err, shapes: dict[str, Any], q, **extra: Any) -> dict[str, Any]:
        """What every rank must agree on before the forward communicates (``extra``: the packed call's)."""
        agree = {
            "B,H,K,V": None if err else (shapes["B"], shapes["H"], shapes["K"], shapes["V"]),
            "dtype": str(getattr(q, "dtype", None)),
            "array module": get_array_module(q).__name__,
            "topology": self.topology,
            "blocks": self.blocks,
            "chunk_size": self.chunk_size,
            "scale": self.scale,
            "check_values": self.check_values,
            "transport": self.transport if self.transport is None or isinstance(self.transport, str)
            else type(self.transport).__name__,
            "cu_seqlens": None,
        }
        agree.update(extra)
        return agree

    @property
    def final_state(self):
        """State after this rank's slice ``[B, H, K, V]`` (on the last rank: the global final state). With
        ``cu_seqlens``: the final states of the documents that end in this slice, ``[len(documents.ends), H, K,
        V]`` (in the order of ``documents.ends``)."""
        if self._final_state is None:
            raise RuntimeError("final_state is set by forward(); call forward first")
        return self._final_state

    # ------------------------------------------------------------------ forward
    def forward(self, q, k, v, g, initial_state=None, cu_seqlens=None):
        """Output ``o [B, L_p, H, V]`` of this rank's slice. Collective over ``comm``.

        ``initial_state [B, H, K, V]`` is the global initial state: given on rank 0 only. With ``cu_seqlens``
        (the global document offsets ``[N + 1]``, the same on every rank, B == 1): packed documents;
        ``initial_state [N, H, K, V]`` is then given on every rank (or on none) -- see the module docstring.
        """

        if cu_seqlens is not None:
            return self._forward_packed(q, k, v, g, initial_state, cu_seqlens)
        self.documents = None
        shapes: dict[str, Any] = {}
        self._device = get_array_module(q) is not np
        t_in = self._now()

        prepared: list = []

        def check() -> None:
            if initial_state is not None and self.rank != 0:
                raise ValueError("initial_state is the global initial state: pass it on rank 0 only")
            B, T, H, K, V = validate_gla_inputs(q, k, v, g, initial_state=initial_state,
                                                check_values=self.check_values and not self._device)
            shapes.update(B=B, H=H, K=K, V=V)
            if self._device:
                check_chunk_size(self.chunk_size, device=True)
                # CuPy: the value checks reduce on a side stream while the local pass (which needs no
                # communication) runs; a bad value still stops every rank before the first message
                arrays = {"q": q, "k": k, "v": v, "g": g}
                if initial_state is not None:
                    arrays["initial_state"] = initial_state
                flags = self._start_value_flags(arrays, gate="g") if self.check_values else None
                prepared.append(split_forward(q, k, v, g, scale=check_scale(self.scale, K), chunk_size=self.chunk_size))
                if flags is not None:
                    raise_for_flags(arrays, flags.result())

        err = local_error(check)
        agree = self._forward_agreement(err, shapes, q)
        # one Allreduce when all is well (point to point with a collective timeout)
        agree_fast(self.comm, "ZeCOGLA.forward", err, agree)

        sdt = _state_dtype(q)
        scale = check_scale(self.scale, shapes["K"])
        t0 = self._now()
        tm: dict[str, float] = {"checks": t0 - t_in}

        init = initial_state.astype(sdt) if (self.rank == 0 and initial_state is not None) else None
        # one path for both backends (hpczeco.gla.split): the local pass (queued during the checks on the
        # device), the scan of (a, S_local), the state-independent work while it is in flight (on numpy every
        # product once, polling the scan), then the outputs with the incoming state
        self._saved = None  # its chunk states live in the workspace that this forward overwrites
        fs = prepared[0] if prepared else split_forward(q, k, v, g, scale=scale, chunk_size=self.chunk_size,
                                                         check_values=False, workspace=self._workspace)
        tm["states"] = self._now() - t0
        s_in = self._scan_overlapped(fs, fs.a, fs.S_local, init, False, tm)
        t4 = self._now()
        o, final = fs.finish(s_in)
        tm["correction"] = self._now() - t4
        self._finish_forward(q, k, v, g, fs.a, s_in, final, scale, tm, t0)
        self._saved["states"] = fs.states  # chunk states (numpy): the backward need not recompute them
        return o

    def _finish_forward(self, q, k, v, g, a, s_in, final, scale, tm, t0) -> None:
        tm["total"] = self._now() - t0 + tm.get("checks", 0.0)
        self.timings.fwd = tm
        self._final_state = final
        self._saved = dict(q=q, k=k, v=v, g=g, a=a, s_in=s_in, final=final, scale=scale)

    # ------------------------------------------------------------------ backward
    def backward(self, do, dht=None):
        """Gradients ``(dq, dk, dv, dg, dh0)`` of this rank's slice. Collective over ``comm``.

        ``do [B, L_p, H, V]``; ``dht [B, H, K, V]`` is the gradient into the global final state,
        given on the last rank only. ``dh0`` (gradient into the global initial state) is returned
        on rank 0 and ``None`` elsewhere. After a forward with ``cu_seqlens``: ``dht [N, H, K, V]`` (the gradients
        of every document's final state) on every rank or on none, and ``dh0 [len(documents.starts), H, K, V]``,
        the gradients of the initial states of the documents that start in this slice.
        """

        if self._saved is None:
            raise RuntimeError("backward() needs a forward() first")
        if self._saved.get("docs") is not None:
            return self._backward_packed(do, dht)
        sv = self._saved
        q, k, v, g, a, s_in, scale = (sv[n] for n in ("q", "k", "v", "g", "a", "s_in", "scale"))
        self._device = get_array_module(q) is not np
        t_in = self._now()
        B, L, H, K = q.shape
        V = v.shape[-1]
        last = self.size - 1

        def check() -> None:
            from .base.checks import check_array, check_finite, check_shape
            from .gla.validate import check_input_dtype

            check_array("do", do, ndim=4, float_only=False)
            check_input_dtype("do", do)  # floating, or raw bf16 bits (uint16) on CuPy
            check_shape("do", do, (B, L, H, V), "(like v)")
            if str(do.dtype) != str(q.dtype):
                raise TypeError(f"do must have the forward's dtype {q.dtype}, got {do.dtype}")
            if dht is not None:
                if self.rank != last:
                    raise ValueError("dht is the gradient of the global final state: pass it on the last rank only")
                check_array("dht", dht, ndim=4)
                check_shape("dht", dht, (B, H, K, V))
            values = {"do": do} if dht is None else {"do": do, "dht": dht}
            for name, x in values.items():
                if get_array_module(x) is not get_array_module(q):
                    raise TypeError(f"{name} must live where q does (a {get_array_module(q).__name__} array)")
            if get_array_module(do) is np:
                if self.check_values:
                    for name, x in values.items():
                        check_finite(name, x)
                return
            # CuPy: the value checks reduce on a side stream while the backward's state passes run
            flags = self._start_value_flags(values) if self.check_values else None
            prepared.append(split_backward(q, k, v, g, do, scale=scale, initial_state=s_in,
                                           chunk_size=self.chunk_size, states=sv.get("states")))
            if flags is not None:
                raise_for_flags(values, flags.result())

        prepared: list = []
        err = local_error(check)
        # like the forward: do's dtype, array module and shape agreed (its values checked locally above), and
        # whether the last rank passed dht, in one Allreduce
        agree = {"topology": self.topology, "B,H,K,V": (B, H, K, V), "check_values": self.check_values,
                 "do": None if err else (str(do.dtype), get_array_module(do).__name__, do.shape[0], do.shape[2],
                                         do.shape[3])}
        (has_dht,) = agree_fast(self.comm, "ZeCOGLA.backward", err, agree,
                                flags=(int(self.rank == last and dht is not None),))

        sdt = _state_dtype(q)
        t0 = self._now()
        tm: dict[str, float] = {"checks": t0 - t_in}

        init = dht.astype(sdt) if (self.rank == last and dht is not None) else None
        # one path for both backends, as the forward: the reverse scan of (a, U), the dht-independent work
        # while it is in flight, then the gradients with the incoming state gradient
        bs = prepared[0] if prepared else split_backward(q, k, v, g, do, scale=scale, initial_state=s_in,
                                                         chunk_size=self.chunk_size, states=sv.get("states"),
                                                         check_values=False, workspace=self._workspace)
        tm["states"] = self._now() - t0
        D = self._scan_overlapped(bs, a, bs.U, init, True, tm)
        t4 = self._now()
        dq, dk, dv, dg, dh0 = bs.finish(None if (self.rank == last and not has_dht) else D)
        tm["correction"] = self._now() - t4
        tm["total"] = self._now() - t_in
        self.timings.bwd = tm
        return dq, dk, dv, dg, (dh0 if self.rank == 0 else None)

    # ------------------------------------------------------------------ packed documents
    def _forward_packed(self, q, k, v, g, initial_state, cu_seqlens):
        """:meth:`forward` with ``cu_seqlens`` (module docstring; the bookkeeping is :mod:`hpczeco.zeco_varlen`)."""

        self._device = get_array_module(q) is not np
        t_in = self._now()
        shapes: dict[str, Any] = {}
        host_values = self.check_values and not self._device

        def check() -> None:
            B, T, H, K, V = validate_gla_inputs(q, k, v, g, check_values=host_values)
            shapes.update(B=B, T=T, H=H, K=K, V=V, cu=check_cu_seqlens(cu_seqlens, B))
            if initial_state is not None:
                check_document_states("initial_state", initial_state, len(shapes["cu"]) - 1, H, K, V, q,
                                      check_values=host_values)
            if self._device:
                check_chunk_size(self.chunk_size, device=True)
                if self.check_values:
                    arrays = {"q": q, "k": k, "v": v, "g": g}
                    if initial_state is not None:
                        arrays["initial_state"] = initial_state
                    raise_for_flags(arrays, self._start_value_flags(arrays, gate="g").result())

        err = local_error(check)
        cu = shapes.get("cu")
        digest = None if cu is None else (
            f"N={len(cu) - 1}, end={int(cu[-1])}, blake2b={hashlib.blake2b(cu.tobytes(), digest_size=8).hexdigest()}")
        agree = self._forward_agreement(err, shapes, q, cu_seqlens=digest,
                                        **{"initial_state per document": initial_state is not None})
        agree_fast(self.comm, "ZeCOGLA.forward", err, agree)
        one = [shapes["T"]]
        lengths = timed.allgather(self.comm, shapes["T"], "ZeCOGLA.forward (slice lengths)") if self.size > 1 else one
        if int(cu[-1]) != sum(lengths):  # the same data on every rank: the same error everywhere
            raise CollectiveInputError(f"ZeCOGLA.forward: cu_seqlens ends at {int(cu[-1])}, but the slices of the "
                                       f"{self.size} ranks hold {sum(lengths)} tokens (lengths {lengths})")
        docs = rank_documents(cu, np.concatenate([[0], np.cumsum(lengths)]), self.rank)
        self.documents = docs

        xp = get_array_module(q)
        H, K, V = shapes["H"], shapes["K"], shapes["V"]
        row = (H, K, V)
        sdt = _state_dtype(q)
        scale = check_scale(self.scale, K)
        pieces = len(docs.pieces) > 0
        t0 = self._now()
        tm: dict[str, float] = {"checks": t0 - t_in}

        def used_states(s_in):
            """The initial state of every piece as run: ``S_in`` for a continued first piece, else its own."""
            if not pieces:
                return None
            return local_rows(xp, initial_state, docs, drop_first=docs.continues,
                              first=s_in if docs.continues else None, shape=row, dtype=sdt)

        if pieces:
            fs = split_forward(q, k, v, g, scale=scale, chunk_size=self.chunk_size, check_values=False,
                               cu_seqlens=docs.cu_local,
                               initial_state=local_rows(xp, initial_state, docs, drop_first=docs.continues,
                                                        dtype=sdt))
            a = fs.a if docs.continues else xp.zeros_like(fs.a)  # a piece starting here cuts off S_in
        else:
            fs = split_forward(q, k, v, g, scale=scale, chunk_size=self.chunk_size, check_values=False)
            a = fs.a  # an empty slice: the identity (1, 0)
        tm["states"] = self._now() - t0
        s_in = self._scan_overlapped(fs, a, fs.S_local, None, False, tm)
        t4 = self._now()
        o, finals = fs.finish(s_in if (pieces and docs.continues) else None)
        tm["correction"] = self._now() - t4
        h0_used = used_states(s_in)
        self._final_state = owned_rows(xp, docs.ends, docs, finals, initial_state, row, sdt)
        tm["total"] = self._now() - t0 + tm["checks"]
        self.timings.fwd = tm
        self._saved = dict(q=q, k=k, v=v, g=g, scale=scale, docs=docs, h0_used=h0_used, N=len(cu) - 1)
        return o

    def _backward_packed(self, do, dht):
        """:meth:`backward` after a forward with ``cu_seqlens``."""
        from .base.checks import check_array, check_finite, check_shape

        sv = self._saved
        q, k, v, g, scale, docs, h0_used = (sv[n] for n in ("q", "k", "v", "g", "scale", "docs", "h0_used"))
        self._device = get_array_module(q) is not np
        t_in = self._now()
        B, L, H, K = q.shape
        V = v.shape[-1]
        row = (H, K, V)

        def check() -> None:
            check_array("do", do, ndim=4)
            check_shape("do", do, (B, L, H, V), "(like v)")
            if get_array_module(do) is not get_array_module(q):
                raise TypeError(f"do must live where q does (a {get_array_module(q).__name__} array)")
            if dht is not None:
                check_document_states("dht", dht, sv["N"], H, K, V, q, check_values=False)
            values = {"do": do} if dht is None else {"do": do, "dht": dht}
            if self.check_values and not self._device:
                for name, x in values.items():
                    check_finite(name, x)
            elif self.check_values:
                raise_for_flags(values, self._start_value_flags(values).result())

        err = local_error(check)
        agree_fast(self.comm, "ZeCOGLA.backward", err,
                   {"topology": self.topology, "B,H,K,V": (B, H, K, V), "dht per document": dht is not None})
        xp = get_array_module(q)
        sdt = _state_dtype(q)
        pieces = len(docs.pieces) > 0
        t0 = self._now()
        tm: dict[str, float] = {"checks": t0 - t_in}

        if pieces:
            bs = split_backward(q, k, v, g, do, scale=scale, initial_state=h0_used, chunk_size=self.chunk_size,
                                check_values=False, cu_seqlens=docs.cu_local,
                                dht=local_rows(xp, dht, docs, drop_last=docs.continues_after, dtype=sdt))
            # the gradient at the slice start goes left only into a document continued from there
            a, U = (bs.a, bs.U) if docs.continues else (xp.zeros_like(bs.a), xp.zeros_like(bs.U))
        else:
            bs = split_backward(q, k, v, g, do, scale=scale, chunk_size=self.chunk_size, check_values=False)
            a, U = bs.a, bs.U
        tm["states"] = self._now() - t0
        D = self._scan_overlapped(bs, a, U, None, True, tm)
        t4 = self._now()
        grads = bs.finish(D if (pieces and docs.continues_after) else None)
        tm["correction"] = self._now() - t4
        dh0 = owned_rows(xp, docs.starts, docs, grads[4] if pieces else None, dht, row, sdt)
        tm["total"] = self._now() - t_in
        self.timings.bwd = tm
        return (*grads[:4], dh0)


def zeco_gla(q, k, v, g, comm, *, topology: str = "ring", blocks: int | None = None, chunk_size: int = 64,
             scale: float | None = None, initial_state=None, output_final_state: bool = False, transport: Any = None,
             check_values: bool = True):
    """Functional ZeCO forward: ``(o [B, L_p, H, V], final_state [B, H, K, V] or None)`` of this rank's slice.

    ``q, k, g: [B, L_p, H, K]``, ``v: [B, L_p, H, V]``: rank p's contiguous slice of one sequence. Collective over
    ``comm``. Options as :class:`ZeCOGLA` (the same keyword options as :func:`hpczeco.torch.zeco_gla`);
    ``initial_state [B, H, K, V]`` on rank 0 only; ``final_state`` (with ``output_final_state``) is this slice's
    final state, on the last rank the global final state.
    """
    layer = ZeCOGLA(comm, topology, blocks, chunk_size, scale, transport=transport, check_values=check_values)
    o = layer.forward(q, k, v, g, initial_state=initial_state)
    return o, (layer.final_state if output_final_state else None)
