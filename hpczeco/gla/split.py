"""The phase split of the chunked GLA: the forward and backward of :mod:`hpczeco.gla.chunk`, cut where the incoming
state (forward) or the incoming state gradient (backward) enters, so that a sequence-parallel layer (ZeCO,
:mod:`hpczeco.zeco`) overlaps its scan with the work that does not need it.

The protocol (:class:`SplitForward`, :class:`SplitBackward`), which the layer talks to on numpy and CuPy alike, so
it has one code path. Order of use, forward: construct (the local pass from a zero state), scan ``(a, S_local)``,
``overlap(poll)`` while the scan is in flight, ``finish(S_in)`` with its result. Backward: construct, scan ``(a,
U)`` in reverse, ``overlap(poll)``, ``finish(dht)``. ``finish`` runs once per object. :func:`split_forward` /
:func:`split_backward` pick the implementation:

* numpy arrays: :class:`ForwardSplit` / :class:`BackwardSplit` (below);
* CuPy arrays: :class:`DeviceForwardSplit` / :class:`DeviceBackwardSplit`, adapters over :mod:`hpczeco.gpu.gla`'s
  prepare/finish objects;
* packed documents (``cu_seqlens``): :class:`PackedForwardSplit` / :class:`PackedBackwardSplit`, whose pieces are
  plain splits of either kind.

Layout and semantics as :func:`hpczeco.gla.chunk_gla` / :func:`hpczeco.gla.chunk_gla_bwd` (``q, k, g:
[B, T, H, K]``, ``v, do: [B, T, H, V]``, states ``[B, H, K, V]``). Everything is local: no communication.

numpy. With ``G_n`` the gate summed over the chunks before chunk ``n`` (float64, <= 0) and ``a = exp(sum of g over
the slice)``:

Forward (:class:`ForwardSplit`)::

    constructor   chunk states from a zero state S_n^loc, S_local, a       (before the scan: its input)
    intra()       A V of every chunk (intra-chunk attention), q-side operand scale q exp(b)   (overlaps)
    finish(S_in)  S_n = S_n^loc + diag(exp(G_n)) S_in;  o = A V + scale (q exp(b)) S_n;
                  final = diag(a) S_in + S_local                                            (after)

Backward (:class:`BackwardSplit`), ``dH_n`` the gradient into chunk ``n``'s end state, linear in dht::

    constructor   W_n = scale (q exp(b))^T dO per chunk, dH_n^loc by the reverse recurrence
                  from dht = 0, U = its value at the start (dh0 when dht = 0)             (before the scan)
    local()       chunk states from initial_state, A, dA, dq (complete), the intra parts of dk, dv, dg
                                                                                           (overlaps)
    finish(dht)   dH_n = dH_n^loc + diag(exp(G_T - G_{n+1})) dht; dv += K exp(b_C - b) dH_n,
                  dk += exp(b_C - b) (V dH_n^T), dg += the S dH terms; dh0 = U + diag(a) dht   (after)

Every product of chunk_gla / chunk_gla_bwd is done once (the forward's fused ``[A | Qe] [V; S]`` becomes
``A V`` in ``intra`` and ``Qe S`` in ``finish``); the constructors use light exponent kernels (one ``exp``
per token and key instead of the full sub-chunk exponent buffer). Numerical form as the fused one: every
exponent is <= 0 (strong decays go through the exact pairwise diagonal blocks), and dg uses the
same cancellation-free form. Kept between the phases: the chunk states ``[N + 1, K, V]`` and state
gradients ``[N, K, V]`` per sequence, and ``[T, K]`` per sequence of operands (``scale q exp(b)`` in the
forward, ``exp(b_C - b)`` in the backward), in a :class:`SplitWorkspace` if one is given (reused from call to
call, so that a layer that runs the split every step touches warm pages). ``finish`` adds into the intra results
in place, so it runs once per object. After the forward's finish, :attr:`ForwardSplit.states` holds the true chunk
states; a :class:`BackwardSplit` given them (``states=``) skips their recomputation. ``check_values=False`` skips
the value scans (NaN/Inf, g <= 0) for inputs the caller has validated (the ZeCO layer checks collectively),
and of the state handed to ``finish`` (a scan result: a NaN found there on one rank only would end that
rank alone; it propagates instead). ``intra``/``local`` (the protocol's ``overlap``) call ``poll()`` (if given)
about every millisecond of work, from the calling thread, so ``poll`` may make MPI progress (``handle.test()``)
without MPI_THREAD_MULTIPLE. Threads, kernels and group steps are those of :mod:`hpczeco.gla.chunk` and
:mod:`hpczeco.gla.kernels`.

CuPy. The device kernels fold the incoming state into the chunk states inside ``finish`` (no correction pass), so
everything that needs no incoming state is queued by the constructor and ``overlap`` has no host work (it does not
poll). Slices with no tokens or no heads need no kernels: the adapters answer them directly (``a = 1``, zero local
state; the incoming state passes through). States are float32 (float64 for float64 inputs); inputs and outputs in
any form :mod:`hpczeco.gpu.gla` takes (float64, float32, float16, bfloat16, raw bf16 bits as ``uint16``). The
forward's chunk states (the chunk-parallel tensor-core kernels) are handed to the backward as
:attr:`DeviceForwardSplit.states`, so a layer that keeps them between forward and backward skips one state walk. The
caller validates the inputs (shapes and dtypes are checked again by :mod:`hpczeco.gpu.gla`, values not at all).

Packed documents. A sequence-parallel layer hands a rank's slice with the slice's own offsets ``cu_seqlens [N + 1]``
(``N >= 1`` documents or pieces of documents, ``B == 1``); only the first document can continue a document of the
ranks before, and only the last one can continue into the ranks after. So, with the per-document states
``[N, H, K, V]``: :class:`PackedForwardSplit`'s ``finish(S_in)`` returns what ``chunk_gla(q, k, v, g,
cu_seqlens=..., initial_state=h0', output_final_state=True)`` returns, ``h0'`` being ``initial_state`` (zeros if
None) with ``S_in`` added to row 0; the scan element is ``a = exp(sum of g)`` when ``N == 1``, else 0 (a document
start is a zero decay for everything before it), ``S_local`` the last document's final state with ``S_in = 0``.
:class:`PackedBackwardSplit`'s ``finish(D)`` returns ``chunk_gla_bwd(..., initial_state, dht=dht')`` with ``D`` added
to row ``N - 1`` of ``dht``; ``a`` as above, ``U`` the first document's ``dh0`` with ``D = 0``. The first document is
a plain split (its ``finish`` needs ``S_in``), the last one (``N >= 2``) a plain split whose scan element
``S_local + a h0`` is ready after its local pass, and the documents between them run whole (by buckets, split
runners without value scans) in ``overlap``; in the backward the roles of first and last swap. The constructors
check shapes, dtypes and ``cu_seqlens``, and the values unless ``check_values=False``; the state handed to
``finish`` is not checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..base.backend import get_array_module, is_device_array
from ..base.checks import check_array, check_shape, dtype_name
from ..base.packing import BackwardRunner, ForwardRunner, packed_backward, packed_forward
from . import kernels as _kn
from .chunk import (
    Geom,
    OperandBuffers,
    Poll,
    Tick,
    a_matrix,
    exponents,
    intra_grads,
    matmul_rows,
    num_chunks,
    rows,
    run_units,
    unit_blocks,
)
from .validate import (
    check_cu_seqlens,
    check_device_values,
    check_document_states,
    check_finite_values,
    check_gla_call,
    state_dtype_ok,
    validate_gla_inputs,
)

__all__ = [
    "SplitForward",
    "SplitBackward",
    "split_forward",
    "split_backward",
    "SplitWorkspace",
    "ForwardSplit",
    "BackwardSplit",
    "DeviceForwardSplit",
    "DeviceBackwardSplit",
    "PackedForwardSplit",
    "PackedBackwardSplit",
]


# --------------------------------------------------------------------------------------------------------- workspace

class SplitWorkspace:
    """Named scratch arrays reused across calls: ``take(name, shape, dtype)`` hands back the array held under
    ``name`` when its shape and dtype match (else a new one, which replaces it)."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array ``shape`` of ``dtype`` (C-contiguous, contents undefined) held under ``name``."""
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        x = self._arrays.get(name)
        if x is None or x.shape != shape or x.dtype != dtype:
            self._arrays.pop(name, None)  # drop the old one first: peak memory of one array, not two
            x = self._arrays[name] = np.empty(shape, dtype)
        return x

    def clear(self) -> None:
        """Drop every held array."""
        self._arrays.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(x.nbytes for x in self._arrays.values())

    def names(self) -> list[str]:
        """The names of the held arrays."""
        return sorted(self._arrays)

# ------------------------------------------------------------------------------------------------------ the protocol

class SplitForward(Protocol):
    """A GLA forward of one slice, local pass done. Shapes: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``.

    Attributes:
        a: ``[B, H, K]``, ``exp`` of the gate summed over the slice (the state dtype).
        S_local: ``[B, H, K, V]``, the slice's final state from a zero initial state (the state dtype).
    """

    a: Any
    S_local: Any

    def overlap(self, poll: Poll = None) -> None:
        """The work that needs no incoming state, calling ``poll()`` (if given) about every millisecond of
        host work, from the calling thread. Idempotent; :meth:`finish` runs it if it has not run."""
        ...

    def finish(self, S_in: Any = None) -> tuple[Any, Any]:
        """``(o [B, T, H, V] input dtype, final state [B, H, K, V])`` with the incoming state ``S_in
        [B, H, K, V]`` (None: zeros); ``final = diag(a) S_in + S_local``. Once per object."""
        ...

    @property
    def states(self) -> Any:
        """After :meth:`finish`: what :func:`split_backward` may take as ``states`` (the chunk states
        ``[B, H, N + 1, K, V]`` on numpy, the prepared forward on CuPy), or None where the backend recomputes
        them."""
        ...


class SplitBackward(Protocol):
    """A GLA backward of one slice, its state passes done. Shapes as :class:`SplitForward`, ``do [B, T, H, V]``.

    Attributes:
        a: ``[B, H, K]`` as :attr:`SplitForward.a`.
        U: ``[B, H, K, V]``, the gradient into the slice's initial state when no gradient flows into its
            final state, ``scale sum_t (q_t exp(G_t))^T do_t`` (the state dtype).
    """

    a: Any
    U: Any

    def overlap(self, poll: Poll = None) -> None:
        """The work that needs no incoming state gradient, polling as :meth:`SplitForward.overlap`."""
        ...

    def finish(self, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` with the gradient ``dht [B, H, K, V]`` into the final state (None:
        zeros); ``dh0 = U + diag(a) dht``. Once per object."""
        ...


# ------------------------------------------------------------------------------------------------------------- numpy

def _check_numpy(**arrays: Any) -> None:
    for name, x in arrays.items():
        if x is not None and is_device_array(x):
            raise TypeError(f"{name} is a CuPy array: the phase-split GLA runs on numpy arrays (use hpczeco.gpu.gla)")


def _check_state(name: str, x: Any, B: int, H: int, K: int, V: int, in_dtype: np.dtype,
                 check_values: bool = True) -> None:
    """``x`` is a numpy ``[B, H, K, V]`` state with the input dtype (float32 too for half inputs), finite
    (unless ``check_values`` is False)."""
    check_array(name, x, ndim=4)
    _check_numpy(**{name: x})
    check_shape(name, x, (B, H, K, V), "([B, H, K, V] from q and v)")
    want = dtype_name(np.empty(0, in_dtype))
    if not state_dtype_ok(want, dtype_name(x)):
        raise TypeError(f"{name} has dtype {dtype_name(x)}, expected {want} (the dtype of q)")
    if check_values:
        check_finite_values(name, x)


class _Split:
    """What both split classes share: the checked call's sizes and dtypes, the once-only ``finish``, and
    the arrays kept between phases (from the workspace if one was given)."""

    _workspace: SplitWorkspace | None = None

    def _kept(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised compute-dtype array kept between the phases: the workspace's ``name`` (reused
        across calls) or a fresh one."""
        if self._workspace is None:
            return np.empty(shape, self.dtype)
        return self._workspace.take(name, shape, self.dtype)

    def _setup(self, q: Any, call: tuple, check_values: bool) -> None:
        B, T, H, K, V, s, chunk_size, cdt = call
        self.shape = (B, T, H, K, V)
        self.chunk_size, self.dtype, self.in_dtype = chunk_size, cdt, q.dtype
        self.scale = cdt.type(s)
        self._check_values = bool(check_values)  # also for the state handed to finish()
        self._finished = False

    def _begin_finish(self, name: str, x: Any, overlap: Callable[[], None]) -> np.ndarray | None:
        """Checks of ``finish(x)`` (once per object; ``x`` a ``[B, H, K, V]`` state or None), then the overlap
        phase if it has not run; returns ``x`` contiguous in the compute dtype."""
        if self._finished:
            cls = type(self).__name__
            raise RuntimeError(f"{cls}.finish() was already called (it works in place): make a new {cls}")
        B, T, H, K, V = self.shape
        if x is not None:
            _check_state(name, x, B, H, K, V, self.in_dtype, self._check_values)
        x0 = None if x is None else np.ascontiguousarray(x, dtype=self.dtype)
        overlap()
        self._finished = True
        return x0


def _light_pass(geo: Geom, dt: np.dtype, units, g, x, s, y, tot, reverse: bool,
                step: Callable[[int, int, int, int, np.ndarray, np.ndarray], None]) -> None:
    """The light pass of the split constructors (one ``exp`` per token and key) over the sequences ``units``:
    per chunk ``n`` the product ``M_n = (s x exp(E))^T y_n [K, V]``, with ``E`` the gate summed over the chunk's
    tokens after each token (forward) or up to it (``reverse``: the backward); groups of chunks in time order,
    reversed with ``reverse``. ``step(b, h, n0, gc, M, Xj)`` runs the recurrence on the group's
    ``M [gc, K, V]``; ``Xj [G, Cp + 1, K]`` (exponentiated) holds ``exp(E)`` and, in row ``Cp``, ``exp(b_C)``.
    ``tot [B, H, N, K]`` (float64) receives the chunks' gate totals."""
    K, V, C, T, N, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.Cp
    G = geo.group_light()
    blocks = unit_blocks(units)
    nb_ = max(len(p) for p, _, _ in blocks)
    X = np.empty((nb_, G, Cp + 1, K), dt)
    Xs = np.empty((nb_, G, Cp, K), dt)
    Yb = np.empty((G, Cp, V), dt)
    M = np.empty((G, K, V), dt)
    for n0 in range(((N - 1) // G) * G, -1, -G) if reverse else range(0, N, G):
        gc = min(G, N - n0)
        for part, ub, uh in blocks:
            m = len(part)
            _kn.chunk_exponents(g, ub, uh, n0, gc, T, C, Cp, X, tot, not reverse)
            np.exp(X[:m, :gc], out=X[:m, :gc])
            _kn.scaled_rows(x, ub, uh, n0, gc, T, C, Cp, s, X, None, Xs)
            for j, (b, h) in enumerate(part):
                yr = rows(y, b, h, n0, gc, geo, Yb)
                np.matmul(Xs[j, :gc].transpose(0, 2, 1), yr, out=M[:gc])
                step(b, h, n0, gc, M, X[j])


# --------------------------------------------------------------------------------------------- forward


class ForwardSplit(_Split):
    """Chunked GLA forward in three phases (numpy): :meth:`finish` returns what ``chunk_gla(q, k, v, g,
    scale, initial_state=S_in, output_final_state=True, chunk_size)`` returns.

    The constructor computes the chunk states from a zero state and exposes ``S_local [B, H, K, V]`` (the
    slice's final state from a zero state, compute dtype) and ``a [B, H, K]`` (``exp`` of the gate summed
    over the slice, summed in float64, compute dtype): the slice's scan element. After :meth:`finish`,
    ``states [B, H, N + 1, K, V]`` holds the state entering every chunk and the final state (what
    :class:`BackwardSplit` can take instead of recomputing them). ``q, k, g: [B, T, H, K]``, ``v: [B, T, H,
    V]``; validation and dtypes as :func:`hpczeco.gla.chunk_gla` (``check_values=False`` skips the NaN/Inf
    and ``g <= 0`` scans for inputs validated by the caller). ``workspace``
    (:class:`SplitWorkspace`): where the chunk states and the q-side operands live
    (reused across calls; ``states`` is then the workspace's array, valid until the next split with it).
    Local: no communication. Implements :class:`SplitForward`.
    """

    S_local: np.ndarray
    a: np.ndarray

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        scale: float | None = None,
        chunk_size: int = 64,
        *,
        check_values: bool = True,
        workspace: SplitWorkspace | None = None,
    ):
        _check_numpy(q=q, k=k, v=v, g=g)
        call = check_gla_call(q, k, v, g, scale, None, chunk_size, check_values=check_values)
        self._setup(q, call, check_values)
        self._workspace = workspace
        B, T, H, K, V, _, chunk_size, cdt = call
        self._intra_done = False
        self._states_out: np.ndarray | None = None
        if T == 0 or B * H == 0:
            self._geo = None
            self.S_local = np.zeros((B, H, K, V), cdt)
            self.a = np.ones((B, H, K), cdt)
            return
        geo = self._geo = Geom(B, T, H, K, V, chunk_size)
        self._q, self._k, self._v, self._g = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g))
        N = geo.N
        self._Sst = self._kept("fwd.states", (B, H, N + 1, K, V))  # state entering every chunk (and the end)
        tot = np.empty((B, H, N, K), np.float64)
        run_units(B, H, lambda units, tick: self._states(units, tot))
        cum = np.cumsum(tot, axis=2)  # gate summed up to the end of each chunk, float64
        self.a = np.exp(cum[:, :, -1]).astype(cdt)
        cum -= tot  # ... up to the start of each chunk
        self._e = np.exp(cum).astype(cdt)  # [B, H, N, K] decay from the slice start to chunk n's start
        self.S_local = np.ascontiguousarray(self._Sst[:, :, N])

    def _states(self, units, tot) -> None:
        """Chunk states from a zero state: ``S_{n+1} = exp(b_C) S_n + (k exp(b_C - b))^T V`` (light pass)."""
        for b, h in units:
            self._Sst[b, h, 0] = 0

        def step(b: int, h: int, n0: int, gc: int, M: np.ndarray, Xj: np.ndarray) -> None:
            _kn.state_chain(M, Xj, self._geo.Cp, gc, self._Sst[b, h], n0)

        _light_pass(self._geo, self.dtype, units, self._g, self._k, self.dtype.type(1), self._v, tot, False, step)

    def overlap(self, poll: Poll = None) -> None:
        """The split protocol's state-independent phase: :meth:`intra`."""
        self.intra(poll)

    def intra(self, poll: Poll = None) -> None:
        """The state-independent work: the intra-chunk attention ``A V`` of every chunk (and the q-side
        operand of the inter-chunk product). Calls ``poll()`` about every millisecond. Idempotent."""
        if self._intra_done:
            return
        geo = self._geo
        if geo is not None:
            B, T, H, K, V = self.shape
            self._o = np.empty((B, T, H, V), self.dtype)
            self._Qs = self._kept("fwd.Qs", (B, H, geo.N, geo.Cp, K))
            run_units(B, H, self._intra_units, poll)
        elif poll is not None:
            poll()
        self._intra_done = True

    def _intra_units(self, units, tick: Tick) -> None:
        geo = self._geo
        V, C, T, ns, c, Cp = geo.V, geo.C, geo.T, geo.ns, geo.c, geo.Cp
        G = geo.group()
        dt, s = self.dtype, self.scale
        q, k, g = self._q, self._k, self._g
        ob = OperandBuffers(geo, G, dt)
        L = np.zeros((G, Cp, Cp), dt)  # blocks above the diagonal stay zero
        Vb = np.empty((G, Cp, V), dt)
        Ot = np.empty((G, Cp, V), dt)
        for n0 in range(0, geo.N, G):
            gc = min(G, geo.N - n0)
            for b, h in units:
                exponents(g, b, h, n0, gc, geo, ob.X, ob.bad)
                Qs = self._Qs[b, h, n0 : n0 + gc]  # scale q exp(b), the inter-chunk operand kept for finish()
                _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, ob.X, ob.bad, ob.Qp, ob.KX, Qs, 0, None, None,
                                  None, None, None, None, None)  # fmt: skip
                a_matrix(q, k, g, b, h, n0, gc, geo, s, ob.bad, ob.Qp, ob.KX, L)
                vr = rows(self._v, b, h, n0, gc, geo, Vb)
                matmul_rows(L[:gc], vr, self._o, b, h, n0, gc, geo, Ot)
                tick()

    @property
    def states(self) -> np.ndarray:
        """``[B, H, N + 1, K, V]`` (compute dtype, ``N`` chunks): the state entering every chunk, then the final
        state, with the incoming state given to :meth:`finish`; set by :meth:`finish`."""
        if self._states_out is None:
            raise RuntimeError("ForwardSplit.states is set by finish(); call finish first")
        return self._states_out

    def finish(self, S_in: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(o [B, T, H, V] input dtype, final [B, H, K, V] compute dtype)`` with the incoming state
        ``S_in [B, H, K, V]`` (None: zeros): the chunk states are corrected in place,
        ``S_n = S_n^loc + diag(exp(G_n)) S_in``, their inter-chunk product added to the intra part in place, and
        ``final = diag(a) S_in + S_local``. Runs :meth:`intra` first if it has not run. Once per object."""
        S0 = self._begin_finish("S_in", S_in, self.intra)
        B, T, H, K, V = self.shape
        if self._geo is None:
            o = np.zeros((B, T, H, V), self.in_dtype)
            final = np.zeros((B, H, K, V), self.dtype) if S0 is None else S0.copy()
            self._states_out = final[:, :, None].copy()
            return o, final
        o = self._o
        run_units(B, H, lambda units, tick: self._finish_units(units, S0))
        final = self.S_local.copy() if S0 is None else (self.a[..., None] * S0 + self.S_local).astype(self.dtype)
        self._Sst[:, :, self._geo.N] = final
        self._states_out = self._Sst
        del self._o, self._Qs, self._Sst, self._q, self._k, self._v, self._g, self._e
        return o.astype(self.in_dtype, copy=False), final

    def _finish_units(self, units, S0) -> None:
        geo = self._geo
        V, C, T, Cp = geo.V, geo.C, geo.T, geo.Cp
        G = geo.group()
        blocks = unit_blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        Ot = np.empty((nb_, G, Cp, V), self.dtype)
        for n0 in range(0, geo.N, G):
            gc = min(G, geo.N - n0)
            for part, ub, uh in blocks:
                if S0 is not None:
                    _kn.correct_states(self._Sst, self._e, S0, ub, uh, n0, gc)
                for j, (b, h) in enumerate(part):
                    np.matmul(self._Qs[b, h, n0 : n0 + gc], self._Sst[b, h, n0 : n0 + gc], out=Ot[j, :gc])
                _kn.add_rows(Ot, self._o, ub, uh, n0, gc, T, C)


# --------------------------------------------------------------------------------------------- backward


class BackwardSplit(_Split):
    """Chunked GLA backward in three phases (numpy): :meth:`finish` returns ``(dq, dk, dv, dg, dh0)`` equal
    (to rounding) to ``chunk_gla_bwd(q, k, v, g, do, scale, initial_state, dht, chunk_size)``.

    The constructor computes ``U [B, H, K, V]`` (compute dtype): the gradient into the initial state when
    ``dht = 0``, ``scale sum_t (q_t exp(G_t))^T do_t`` — and ``a [B, H, K]`` as :class:`ForwardSplit`.
    Shapes, validation and dtypes as :func:`hpczeco.gla.chunk_gla_bwd`. ``states`` (optional): the
    forward's chunk states ``[B, H, N + 1, K, V]`` (:attr:`ForwardSplit.states` with the same inputs, chunk
    size and ``S_in = initial_state``); :meth:`local` then uses them instead of recomputing them (its first
    slot must equal ``initial_state``, zeros if None). ``check_values=False`` skips the NaN/Inf and
    ``g <= 0`` scans. ``workspace`` as :class:`ForwardSplit` (the state gradients, ``exp(b_C - b)`` and
    recomputed states live there; given ``states`` are only read). Local: no communication. Implements
    :class:`SplitBackward`.
    """

    U: np.ndarray
    a: np.ndarray

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        do: Any,
        scale: float | None = None,
        initial_state: Any = None,
        chunk_size: int = 64,
        *,
        states: Any = None,
        check_values: bool = True,
        workspace: SplitWorkspace | None = None,
    ):
        _check_numpy(q=q, k=k, v=v, g=g, do=do, initial_state=initial_state, states=states)
        call = check_gla_call(q, k, v, g, scale, initial_state, chunk_size, do=do, check_values=check_values)
        self._setup(q, call, check_values)
        self._workspace = workspace
        B, T, H, K, V, _, chunk_size, cdt = call
        self._dh0_dtype = cdt if initial_state is None else initial_state.dtype
        self._h0 = None if initial_state is None else np.asarray(initial_state, dtype=cdt)
        self._local_done = False
        self._given_states = None
        if states is not None:
            check_array("states", states, ndim=5)
            N = num_chunks(T, chunk_size) if B * H else 0
            check_shape("states", states, (B, H, N + 1, K, V), f"([B, H, N + 1, K, V] with N = {N} chunks)")
            if states.dtype != cdt:
                raise TypeError(f"states has dtype {states.dtype}, expected {cdt} (the compute dtype)")
            first = np.zeros((B, H, K, V), cdt) if self._h0 is None else self._h0
            if not np.array_equal(states[:, :, 0], first):
                raise ValueError(
                    "states[:, :, 0] must equal initial_state (zeros when None): states of another forward?"
                )
            self._given_states = states
        if T == 0 or B * H == 0:
            self._geo = None
            self.U = np.zeros((B, H, K, V), cdt)
            self.a = np.ones((B, H, K), cdt)
            return
        geo = self._geo = Geom(B, T, H, K, V, chunk_size)
        self._q, self._k, self._v, self._g, self._do = (np.ascontiguousarray(x, dtype=cdt) for x in (q, k, v, g, do))
        N = geo.N
        self._dHl = self._kept("bwd.dHl", (B, H, N, K, V))  # gradient into every chunk's end state when dht = 0
        self._ac = np.empty((B, H, N, K), cdt)  # exp(gate summed over chunk n)
        self.U = np.empty((B, H, K, V), cdt)
        tot = np.empty((B, H, N, K), np.float64)
        run_units(B, H, lambda units, tick: self._ctor_units(units, tot))
        cum = np.cumsum(tot[:, :, ::-1], axis=2)[:, :, ::-1]  # gate summed from chunk n's start to the end
        self._a64 = np.exp(cum[:, :, 0])
        self.a = self._a64.astype(cdt)
        cum -= tot  # ... from chunk n's end to the end
        self._e = np.exp(cum).astype(cdt)  # [B, H, N, K] decay from chunk n's end to the slice end

    def _ctor_units(self, units, tot) -> None:
        """Per chunk ``W_n = scale (q exp(b))^T dO``, reverse time order with the recurrence
        ``dH <- exp(b_C) dH + W_n`` from dH = 0: ``_dHl[n]`` = dH entering from the right, ``U`` = the end."""
        K, V, Cp = self._geo.K, self._geo.V, self._geo.Cp
        dH = {u: np.zeros((K, V), self.dtype) for u in units}

        def step(b: int, h: int, n0: int, gc: int, M: np.ndarray, Xj: np.ndarray) -> None:
            self._ac[b, h, n0 : n0 + gc] = Xj[:gc, Cp]
            _kn.state_bwd(M, Xj, Cp, gc, dH[(b, h)], self._dHl[b, h, n0 : n0 + gc])

        _light_pass(self._geo, self.dtype, units, self._g, self._q, self.scale, self._do, tot, True, step)
        for b, h in units:
            self.U[b, h] = dH[(b, h)]

    def overlap(self, poll: Poll = None) -> None:
        """The split protocol's dht-independent phase: :meth:`local`."""
        self.local(poll)

    def local(self, poll: Poll = None) -> None:
        """All dht-independent work: the chunk states from ``initial_state``, ``A``, ``dA``, dq (complete)
        and the intra-chunk parts of dk, dv, dg. Calls ``poll()`` about every millisecond. Idempotent."""
        if self._local_done:
            return
        geo = self._geo
        if geo is not None:
            B, T, H, K, V = self.shape
            cdt = self.dtype
            given = self._given_states is not None
            self._Sst = self._given_states if given else self._kept("bwd.states", (B, H, geo.N + 1, K, V))
            self._E = self._kept("bwd.E", (B, H, geo.N, geo.Cp, K))
            self._dq, self._dk, self._dg = (np.empty((B, T, H, K), cdt) for _ in range(3))
            self._dv = np.empty((B, T, H, V), cdt)
            run_units(B, H, self._local_units, poll)
        elif poll is not None:
            poll()
        self._local_done = True

    def _local_units(self, units, tick: Tick) -> None:
        geo = self._geo
        K, V, C, T, N, ns, c, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.ns, geo.c, geo.Cp
        G = geo.group()
        dt, s = self.dtype, self.scale
        q, k, g = self._q, self._k, self._g
        oA = _kn.layout(ns, c)[3]
        blocks = unit_blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        ob = OperandBuffers(geo, G, dt, qx=True)
        Kd, M1 = np.empty((G, Cp, K), dt), np.empty((G, Cp, K), dt)
        DQ, DK = np.empty((nb_, G, Cp, K), dt), np.empty((nb_, G, Cp, K), dt)
        Vb, dOb = np.empty((G, Cp, V), dt), np.empty((G, Cp, V), dt)
        DV = np.empty((nb_, G, Cp, V), dt)
        LA, dA = np.zeros((G, Cp, Cp), dt), np.empty((G, Cp, Cp), dt)  # LA: blocks above the diagonal stay zero
        dd = np.empty((nb_, G, Cp), dt)
        U = np.empty((G, K, V), dt)
        recompute = self._given_states is None
        if recompute:
            for b, h in units:
                self._Sst[b, h, 0] = 0 if self._h0 is None else self._h0[b, h]
        for n0 in range(0, N, G):
            gc = min(G, N - n0)
            for part, ub, uh in blocks:
                for j, (b, h) in enumerate(part):
                    Sst = self._Sst[b, h]
                    exponents(g, b, h, n0, gc, geo, ob.X, ob.bad)
                    E = self._E[b, h, n0 : n0 + gc]  # exp(b_C - b), kept for finish()
                    _kn.prep_operands(q, k, b, h, n0, gc, T, C, ns, c, s, ob.X, ob.bad, ob.Qp, ob.KX, None, 0, ob.QX,
                                      Kd if recompute else None, E, None, None, None, None)  # fmt: skip
                    vr = rows(self._v, b, h, n0, gc, geo, Vb)
                    dor = rows(self._do, b, h, n0, gc, geo, dOb)
                    if recompute:
                        np.matmul(Kd[:gc].transpose(0, 2, 1), vr, out=U[:gc])
                        _kn.state_chain(U, ob.X, oA, gc, Sst, n0)
                    intra_grads(q, k, g, b, h, n0, gc, geo, s, ob, vr, dor, Sst[n0 : n0 + gc], LA, dA, dd[j], DV[j],
                                M1, DQ[j], DK[j])  # fmt: skip
                    tick()
                _kn.local_write(q, k, ub, uh, n0, gc, T, C, s, DQ, DK, dd, DV, self._dq, self._dk, self._dv, self._dg)

    def finish(self, dht: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(dq, dk, dv, dg, dh0)`` of ``chunk_gla_bwd`` with the gradient ``dht [B, H, K, V]`` into the final
        state (None: zeros): the dH terms with ``dH_n = dH_n^loc + diag(exp(G_T - G_{n+1})) dht`` added in
        place, and ``dh0 = U + diag(a) dht``. Gradients in the input dtype, dh0 in ``initial_state``'s dtype
        (compute dtype without one). Runs :meth:`local` first if it has not run. Once per object."""
        D0 = self._begin_finish("dht", dht, self.local)
        B, T, H, K, V = self.shape
        if self._geo is None:
            dq = np.zeros((B, T, H, K), self.in_dtype)
            dh0 = np.zeros((B, H, K, V), self._dh0_dtype) if D0 is None else D0.astype(self._dh0_dtype)
            return dq, dq.copy(), np.zeros((B, T, H, V), self.in_dtype), dq.copy(), dh0
        run_units(B, H, lambda units, tick: self._finish_units(units, D0))
        if D0 is None:
            dh0 = self.U.astype(self._dh0_dtype)
        else:
            dh0 = (self.U + self._a64[..., None] * D0).astype(self._dh0_dtype)
        it = self.in_dtype
        out = tuple(x.astype(it, copy=False) for x in (self._dq, self._dk, self._dv, self._dg))
        del self._dq, self._dk, self._dv, self._dg, self._E, self._Sst, self._dHl, self._q, self._k, self._v, self._g
        del self._do
        return (*out, dh0)

    def _finish_units(self, units, D0) -> None:
        geo = self._geo
        K, V, C, T, N, Cp = geo.K, geo.V, geo.C, geo.T, geo.N, geo.Cp
        G = geo.group()
        dt = self.dtype
        blocks = unit_blocks(units)
        nb_ = max(len(p) for p, _, _ in blocks)
        dHt = np.empty((nb_, G, K, V), dt)
        Kd, VdH = np.empty((nb_, G, Cp, K), dt), np.empty((nb_, G, Cp, K), dt)
        Vb, DV2 = np.empty((G, Cp, V), dt), np.empty((nb_, G, Cp, V), dt)
        for n0 in range(0, N, G):
            gc = min(G, N - n0)
            for part, ub, uh in blocks:
                _kn.corrected_states(self._dHl, self._e, D0, ub, uh, n0, gc, dHt)
                _kn.scaled_rows(self._k, ub, uh, n0, gc, T, C, Cp, dt.type(1), None, self._E, Kd)
                for j, (b, h) in enumerate(part):
                    dH = dHt[j, :gc]
                    np.matmul(Kd[j, :gc], dH, out=DV2[j, :gc])
                    vr = rows(self._v, b, h, n0, gc, geo, Vb)
                    np.matmul(vr, dH.transpose(0, 2, 1), out=VdH[j, :gc])
                _kn.add_state_grads(
                    self._k, ub, uh, n0, gc, T, C, self._E, VdH, DV2, self._ac, self._Sst, dHt,
                    self._dk, self._dv, self._dg,
                )  # fmt: skip

# ----------------------------------------------------------------------------------------------------- CuPy adapters

def _state_dtype(xp: Any, x: Any) -> Any:
    """The state dtype of inputs like ``x``: float64 for float64, else float32 (as :mod:`hpczeco.gpu.gla`)."""
    return xp.float64 if str(x.dtype) == "float64" else xp.float32


class DeviceForwardSplit:
    """:class:`SplitForward` on CuPy arrays ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``:
    ``a [B, H, K]`` and ``S_local [B, H, K, V]`` float32; ``finish(S_in)`` returns ``(o [B, T, H, V] input
    dtype, final [B, H, K, V] float32)``. ``states``: the prepared forward (``hpczeco.gpu.gla.GLAForward``) whose
    chunk states :class:`DeviceBackwardSplit` reuses, or None where they are recomputed (simt kernels, empty slice).
    Keeps references to the inputs: leave them unmodified until :meth:`finish` (and the backward given ``states``)."""

    states: Any = None

    def __init__(self, q: Any, k: Any, v: Any, g: Any, scale: float | None = None, chunk_size: int = 64):
        B, T, H, K = (int(s) for s in q.shape)
        V = int(v.shape[3])
        self._xp = xp = get_array_module(q)
        self._out = ((B, T, H, V), q.dtype)
        self._sdt = sdt = _state_dtype(xp, q)
        if T == 0 or B * H == 0:
            self._fw = None
            self.a = xp.ones((B, H, K), dtype=sdt)
            self.S_local = xp.zeros((B, H, K, V), dtype=sdt)
            return
        from ..gpu.gla import chunk_gla_prepare  # noqa: PLC0415

        self._fw = chunk_gla_prepare(q, k, v, g, scale=scale, chunk_size=chunk_size)
        self.a, self.S_local = self._fw.decay, self._fw.local_final_state
        self.states = self._fw if self._fw.impl == "tc-chunk" else None

    def overlap(self, poll: Poll = None) -> None:
        """No host work: the local pass is queued on the device, the outputs need ``S_in``."""

    def finish(self, S_in: Any = None) -> tuple[Any, Any]:
        """``(o, final)`` with the incoming state ``S_in [B, H, K, V]`` (None: zeros)."""
        xp = self._xp
        if self._fw is None:
            shape, dtype = self._out
            B, _, H, V = shape
            final = (xp.zeros((B, H, self.a.shape[2], V), dtype=self._sdt) if S_in is None
                     else xp.ascontiguousarray(S_in.astype(self._sdt)))
            return xp.zeros(shape, dtype=dtype), final
        return self._fw.finish(initial_state=S_in, output_final_state=True)


class DeviceBackwardSplit:
    """:class:`SplitBackward` on CuPy arrays (shapes as :class:`DeviceForwardSplit`,
    ``do [B, T, H, V]``, ``initial_state [B, H, K, V]`` or None): ``a [B, H, K]`` and ``U [B, H, K, V]``
    float32; ``finish(dht)`` returns ``(dq, dk, dv, dg)`` in the input dtype and ``dh0 [B, H, K, V]``
    float32. ``states``: :attr:`DeviceForwardSplit.states` of the forward of the same ``q, k, v, g`` (its chunk
    states are reused), or None. Keeps references to the inputs: leave them unmodified until :meth:`finish`."""

    def __init__(self, q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None,
                 initial_state: Any = None, chunk_size: int = 64, states: Any = None):
        B, T, H, K = (int(s) for s in q.shape)
        V = int(v.shape[3])
        self._xp = xp = get_array_module(q)
        self._shapes = ((B, T, H, K), (B, T, H, V), q.dtype)
        self._h0 = initial_state
        self._sdt = sdt = _state_dtype(xp, q)
        if T == 0 or B * H == 0:
            self._bw = None
            self.a = xp.ones((B, H, K), dtype=sdt)
            self.U = xp.zeros((B, H, K, V), dtype=sdt)
            return
        from ..gpu.gla import chunk_gla_bwd_prepare  # noqa: PLC0415

        self._bw = chunk_gla_bwd_prepare(q, k, v, g, do, scale=scale, chunk_size=chunk_size, fwd=states)
        self.a, self.U = self._bw.decay, self._bw.dh0_local

    def overlap(self, poll: Poll = None) -> None:
        """No host work: the state passes are queued on the device, the gradients need ``dht``."""

    def finish(self, dht: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0)`` with the gradient ``dht [B, H, K, V]`` into the final state (None: zeros)."""
        xp = self._xp
        if self._bw is None:
            qk, vshape, dtype = self._shapes
            dh0 = xp.zeros(self.U.shape, dtype=self._sdt) if dht is None else dht.astype(self._sdt)
            return (xp.zeros(qk, dtype=dtype), xp.zeros(qk, dtype=dtype), xp.zeros(vshape, dtype=dtype),
                    xp.zeros(qk, dtype=dtype), dh0)  # fmt: skip
        return self._bw.finish(initial_state=self._h0, dht=dht)

# ---------------------------------------------------------------------------------------- one sequence by array type

def _plain_split_forward(q: Any, k: Any, v: Any, g: Any, scale: float | None = None, chunk_size: int = 64, *,
                        check_values: bool = True, workspace: SplitWorkspace | None = None,
                        ) -> ForwardSplit | DeviceForwardSplit:
    """The forward split of ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]`` by array type (see
    :func:`split_forward`; ``check_values`` and ``workspace`` apply to numpy only)."""
    if is_device_array(q):
        return DeviceForwardSplit(q, k, v, g, scale=scale, chunk_size=chunk_size)
    return ForwardSplit(q, k, v, g, scale=scale, chunk_size=chunk_size, check_values=check_values, workspace=workspace)


def _plain_split_backward(q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None,
                         initial_state: Any = None, chunk_size: int = 64, *, states: Any = None,
                         check_values: bool = True, workspace: SplitWorkspace | None = None,
                         ) -> BackwardSplit | DeviceBackwardSplit:
    """The backward split (``do: [B, T, H, V]``, ``initial_state [B, H, K, V]`` or None) by array type (see
    :func:`split_backward`)."""
    if is_device_array(q):
        return DeviceBackwardSplit(q, k, v, g, do, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                                   states=states)
    return BackwardSplit(q, k, v, g, do, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                         states=states, check_values=check_values, workspace=workspace)


def _split_runners(scale: float | None, chunk_size: int) -> tuple[ForwardRunner, BackwardRunner]:
    """The plain GLA through the split protocol without value scans (numpy: :class:`ForwardSplit` /
    :class:`BackwardSplit`, CuPy: the device adapters), as :mod:`hpczeco.base.packing`'s runners: the packed
    splits' middle documents."""

    def fwd(q, k, v, g, h0, poll):
        fs = _plain_split_forward(q, k, v, g, scale=scale, chunk_size=chunk_size, check_values=False)
        fs.overlap(poll)
        return fs.finish(h0)

    def bwd(q, k, v, g, do, h0, dht, poll):
        bs = _plain_split_backward(q, k, v, g, do, scale=scale, initial_state=h0, chunk_size=chunk_size,
                                  check_values=False)
        bs.overlap(poll)
        return bs.finish(dht)

    return fwd, bwd


# -------------------------------------------------------------------------------------------------- packed documents

def _row(x: Any, i: int) -> Any:
    return None if x is None else x[i : i + 1]


def _add(x: Any, y: Any) -> Any:
    """``x + y`` where None means zeros."""
    if x is None:
        return y
    return x if y is None else x + y


def _tokens(x: Any, a: int, b: int) -> Any:
    return x[:, a:b]


class _Packed:
    def _setup(self, q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, states: dict[str, Any], do: Any,
               check_values: bool) -> None:
        B, T, H, K, V = validate_gla_inputs(q, k, v, g, do=do, check_values=check_values)
        self.cu = cu = check_cu_seqlens(cu_seqlens, B, T)
        self.N = N = len(cu) - 1
        for name, x in states.items():
            if x is not None:
                check_document_states(name, x, N, H, K, V, q, check_values=check_values)
        if check_values and self._device(q):
            present = {n: x for n, x in states.items() if x is not None}
            if present:
                check_device_values(present)
        self.xp = get_array_module(q)
        self.shape = (B, T, H, K, V)
        self._first = (0, int(cu[1]))
        self._last = (int(cu[N - 1]), T)
        self._mid = (int(cu[1]), int(cu[N - 1]))  # documents 1 .. N - 2

    @staticmethod
    def _device(x: Any) -> bool:
        return get_array_module(x) is not np


class PackedForwardSplit(_Packed):
    """:class:`SplitForward` of a slice of packed documents (module docstring): ``q, k, g
    [1, T, H, K]``, ``v [1, T, H, V]``, ``cu_seqlens [N + 1]`` (the slice's offsets), ``initial_state [N, H, K, V]``
    or None. ``a [1, H, K]``, ``S_local [1, H, K, V]``; ``finish(S_in [1, H, K, V] or None)`` returns ``(o [1, T,
    H, V], final [N, H, K, V])``. ``states`` is None (the backward recomputes its chunk states)."""

    states = None

    def __init__(self, q: Any, k: Any, v: Any, g: Any, cu_seqlens: Any, scale: float | None = None,
                 initial_state: Any = None, chunk_size: int = 64, *, check_values: bool = True):
        self._setup(q, k, v, g, cu_seqlens, {"initial_state": initial_state}, None, check_values)
        self._args = (q, k, v, g)
        self._scale, self._chunk, self._h0 = scale, chunk_size, initial_state
        self._fs = _plain_split_forward(*(_tokens(x, *self._first) for x in self._args), scale=scale,
                                       chunk_size=chunk_size, check_values=False)
        self._mid_out = self._last_out = None
        self._done = False
        if self.N == 1:
            self.a = self._fs.a
            self.S_local = _add(self._fs.S_local, _scaled(self._fs.a, _row(initial_state, 0)))
            self._ls = None
        else:
            self._ls = _plain_split_forward(*(_tokens(x, *self._last) for x in self._args), scale=scale,
                                           chunk_size=chunk_size, check_values=False)
            self.a = self.xp.zeros_like(self._fs.a)
            self.S_local = _add(self._ls.S_local, _scaled(self._ls.a, _row(initial_state, self.N - 1)))

    def overlap(self, poll: Poll = None) -> None:
        """The first document's intra-chunk work, the documents after it whole. Idempotent."""
        if self._done:
            return
        self._fs.overlap(poll)
        if self.N >= 2:
            self._ls.overlap(poll)
            self._last_out = self._ls.finish(_row(self._h0, self.N - 1))
        if self.N >= 3:
            a, b = self._mid
            h0 = None if self._h0 is None else self._h0[1 : self.N - 1]
            fwd, _ = _split_runners(self._scale, self._chunk)
            self._mid_out = packed_forward(fwd, *(_tokens(x, a, b) for x in self._args), self.cu[1:-1] - a, h0,
                                           self._chunk, poll)  # fmt: skip
        self._done = True

    def finish(self, S_in: Any = None) -> tuple[Any, Any]:
        """``(o [1, T, H, V], final [N, H, K, V])`` with ``S_in`` added to the first document's initial state."""
        self.overlap()
        o0, f0 = self._fs.finish(_add(_row(self._h0, 0), S_in))
        if self.N == 1:
            return o0, f0
        pieces = [(self._first, o0)]
        finals = [f0]
        if self._mid_out is not None:
            pieces.append((self._mid, self._mid_out[0]))
            finals.append(self._mid_out[1])
        pieces.append((self._last, self._last_out[0]))
        finals.append(self._last_out[1])
        B, T, H, K, V = self.shape
        o = self.xp.empty((B, T, H, V), dtype=o0.dtype)
        for (a, b), x in pieces:
            o[:, a:b] = x
        sdt = np.result_type(*(f.dtype for f in finals))
        return o, self.xp.concatenate([f.astype(sdt, copy=False) for f in finals])


class PackedBackwardSplit(_Packed):
    """:class:`SplitBackward` of a slice of packed documents (module docstring): shapes as
    :class:`PackedForwardSplit`, ``do [1, T, H, V]``, ``initial_state`` and ``dht`` ``[N, H, K, V]`` or None.
    ``a [1, H, K]``, ``U [1, H, K, V]``; ``finish(D [1, H, K, V] or None)`` returns ``(dq, dk, dv, dg [1, T, H, *],
    dh0 [N, H, K, V])``."""

    def __init__(self, q: Any, k: Any, v: Any, g: Any, do: Any, cu_seqlens: Any, scale: float | None = None,
                 initial_state: Any = None, dht: Any = None, chunk_size: int = 64, *, check_values: bool = True):
        self._setup(q, k, v, g, cu_seqlens, {"initial_state": initial_state, "dht": dht}, do, check_values)
        self._args = (q, k, v, g, do)
        self._scale, self._chunk, self._h0, self._dht = scale, chunk_size, initial_state, dht
        N = self.N
        self._ls = _plain_split_backward(*(_tokens(x, *self._last) for x in self._args), scale=scale,
                                        initial_state=_row(initial_state, N - 1), chunk_size=chunk_size,
                                        check_values=False)
        self._mid_out = self._first_out = None
        self._done = False
        if N == 1:
            self.a = self._ls.a
            self.U = _add(self._ls.U, _scaled(self._ls.a, _row(dht, 0)))
            self._fs = None
        else:
            self._fs = _plain_split_backward(*(_tokens(x, *self._first) for x in self._args), scale=scale,
                                            initial_state=_row(initial_state, 0), chunk_size=chunk_size,
                                            check_values=False)
            self.a = self.xp.zeros_like(self._fs.a)
            self.U = _add(self._fs.U, _scaled(self._fs.a, _row(dht, 0)))

    def overlap(self, poll: Poll = None) -> None:
        """The last document's local work, the documents before it whole. Idempotent."""
        if self._done:
            return
        self._ls.overlap(poll)
        if self.N >= 2:
            self._fs.overlap(poll)
            self._first_out = self._fs.finish(_row(self._dht, 0))
        if self.N >= 3:
            a, b = self._mid
            sl = slice(1, self.N - 1)
            h0 = None if self._h0 is None else self._h0[sl]
            dht = None if self._dht is None else self._dht[sl]
            _, bwd = _split_runners(self._scale, self._chunk)
            self._mid_out = packed_backward(bwd, *(_tokens(x, a, b) for x in self._args), self.cu[1:-1] - a, h0, dht,
                                            self._chunk, poll)  # fmt: skip
        self._done = True

    def finish(self, D: Any = None) -> tuple[Any, Any, Any, Any, Any]:
        """``(dq, dk, dv, dg, dh0 [N, H, K, V])`` with ``D`` added to the last document's ``dht``."""
        self.overlap()
        last = self._ls.finish(_add(_row(self._dht, self.N - 1), D))
        if self.N == 1:
            return last
        pieces = [(self._first, self._first_out)]
        if self._mid_out is not None:
            pieces.append((self._mid, self._mid_out))
        pieces.append((self._last, last))
        B, T, H, K, V = self.shape
        xp = self.xp
        grads = [xp.empty((B, T, H, K if i != 2 else V), dtype=last[i].dtype) for i in range(4)]
        for (a, b), res in pieces:
            for out, x in zip(grads, res[:4]):
                out[:, a:b] = x
        sdt = np.result_type(*(r[4].dtype for _, r in pieces))
        return (*grads, xp.concatenate([r[4].astype(sdt, copy=False) for _, r in pieces]))


def _scaled(a: Any, x: Any) -> Any:
    """``diag(a) x`` for a decay ``a [1, H, K]`` and a state row ``x [1, H, K, V]`` (None: None)."""
    return None if x is None else a[..., None] * x


# ----------------------------------------------------------------------------------------------------- the entry

def split_forward(q: Any, k: Any, v: Any, g: Any, scale: float | None = None, chunk_size: int = 64, *,
                  check_values: bool = True, cu_seqlens: Any = None, initial_state: Any = None,
                  workspace: SplitWorkspace | None = None) -> SplitForward:
    """The forward split for these arrays: :class:`ForwardSplit` for numpy (validated as
    :func:`hpczeco.gla.chunk_gla`; ``check_values=False`` skips the value scans), the device adapter for CuPy
    (shapes and dtypes checked by :mod:`hpczeco.gpu.gla`; the value scans are the caller's). With ``cu_seqlens
    [N + 1]``: :class:`PackedForwardSplit` (``initial_state [N, H, K, V]`` or None, the
    documents' own initial states; ``S_in`` adds to row 0). ``initial_state`` needs ``cu_seqlens``. ``workspace``
    (:class:`SplitWorkspace`): where the numpy split keeps its arrays between calls (the
    other forms ignore it). Local."""
    if cu_seqlens is not None:
        return PackedForwardSplit(q, k, v, g, cu_seqlens, scale=scale, initial_state=initial_state,
                                  chunk_size=chunk_size, check_values=check_values)
    if initial_state is not None:
        raise ValueError("split_forward takes initial_state only with cu_seqlens (else it is finish()'s S_in)")
    return _plain_split_forward(q, k, v, g, scale=scale, chunk_size=chunk_size, check_values=check_values,
                               workspace=workspace)


def split_backward(q: Any, k: Any, v: Any, g: Any, do: Any, scale: float | None = None, initial_state: Any = None,
                   chunk_size: int = 64, *, states: Any = None, check_values: bool = True, cu_seqlens: Any = None,
                   dht: Any = None, workspace: SplitWorkspace | None = None) -> SplitBackward:
    """The backward split for these arrays (``initial_state [B, H, K, V]`` or None; ``states`` from
    :attr:`SplitForward.states` or None), chosen and checked as :func:`split_forward`. With ``cu_seqlens``:
    :class:`PackedBackwardSplit` (``initial_state``, ``dht`` ``[N, H, K, V]`` or None;
    the ``dht`` handed to ``finish`` adds to row ``N - 1``; ``states`` is not used). ``workspace`` as
    :func:`split_forward`. Local."""
    if cu_seqlens is not None:
        return PackedBackwardSplit(q, k, v, g, do, cu_seqlens, scale=scale, initial_state=initial_state, dht=dht,
                                   chunk_size=chunk_size, check_values=check_values)
    if dht is not None:
        raise ValueError("split_backward takes dht only with cu_seqlens (else it is finish()'s argument)")
    return _plain_split_backward(q, k, v, g, do, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
                                states=states, check_values=check_values, workspace=workspace)
