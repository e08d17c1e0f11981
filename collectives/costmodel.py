"""Alpha-beta-gamma cost model of the exclusive scans of :mod:`.scan`: formulas, presets, the ``"auto"`` pick.

Parameters (:class:`LinkParams`): ``alpha`` seconds per message (latency plus the software
overhead of one MPI call from Python), ``beta`` seconds per byte on a link, ``gamma`` seconds per
state byte of one combine ``a * X + S`` (reads two states, writes one), ``delta`` the fixed cost
of one combine call, ``overhead`` the fixed cost of one scan call whatever its topology (the
collective validation -- local checks and one ``Allreduce`` --, building the plan, posting and
completing the requests; measured by :func:`.calibrate.calibrate` as what a tiny serial scan costs
beyond its hops), ``piece`` the extra cost of one ring piece per pipeline stage when the piece is larger
than ``eager`` bytes (see below). ``m`` is the state size in bytes (``S.nbytes``); pairs ``(a, S)`` that carry
the decays too are ``m' = m (1 + 1/V)`` bytes. Every formula below adds ``overhead`` (for ``P > 1``).

Formulas (critical path; ``P`` ranks, ``k`` ring pieces, ``L = ceil(log2 P)``):

* ring (pipelined All-Scan): piece 0 takes ``P - 1`` hops and ``P - 2`` combines, the other
  ``k - 1`` pieces trail one stage each::

      T = (P + k - 2)(alpha + pi + m beta / k) + (P + k - 3)(delta + m gamma / k)      [combines only if P > 2]
      pi = piece if m / k > eager else 0

  ``piece`` is what a piece above the MPI library's eager/fragment size costs beyond ``alpha``: the
  rendezvous handshake of every such message (the receiver must enter MPI to answer it, the sender
  to see the answer, while each of them also combines and posts its other pieces from Python) and
  the per-request work of posting and completing it. ``alpha`` (a cyclic shift of tiny messages)
  does not contain it, and ``beta`` (a shift of whole states, where the per-message cost is spread
  over megabytes) hides it; a pipelined ring pays it ``P + k - 2`` times, so it sets how many pieces
  pay. Measured by :func:`.calibrate.measure_piece` (the ring itself at two piece counts, both above
  ``eager``); 0 when not measured (presets, and runs calibrated before it existed), which is the
  model without it. ``eager`` defaults to 32 KiB (Open MPI's shared-memory BTL fragment size
  ``btl_vader_max_send_size``; an assumption, not measured); :func:`.calibrate.calibrate` sets it from the
  library (:func:`.calibrate.eager_bytes`: 4 KiB under Open MPI on one node, its ``btl_vader_eager_limit`` default,
  above which a message waits for the receiver's handshake; read it with ``ompi_info --param btl vader
  --level 9``).

  ``ring_beta`` (when set) replaces ``beta`` and ``gamma`` in the stages of the pipelined ring (``k > 1``):
  ``T = overhead + (P + k - 2)(alpha + pi + m ring_beta / k) + (P + k - 3) delta``. It is the ring's own
  cost per byte of a stage, transfer and combine together, for machines where that is not the sum of what
  the cyclic shift (``beta``) and the combine alone (``gamma``) cost: on shared memory without
  asynchronous progress the bytes of a piece move only while its sender and its receiver are inside MPI,
  and in the ring they are not while they combine and post requests from Python (the shift keeps both
  inside ``Sendrecv``). :func:`.calibrate.measure_ring` fits it with ``piece`` to the ring itself at three
  piece counts (:func:`ring_from_times`); 0 (presets, older runs): ``beta + gamma``. The serial relay
  (one piece, one pair of ranks at a time), tree, allgather and exscan keep ``beta`` and ``gamma``.

  ``ring_beta_big`` (when set) is the same per-byte stage cost measured on a state of ``ring_big`` bytes
  (:func:`.calibrate.measure_ring_big`, :func:`ring_beta_from_times`), ``ring_beta`` being the one of a
  ``ring_bytes`` state: a stage costs more per byte once the ``P`` ranks' states, pieces and results no longer
  fit the caches and every stage runs at the memory's bandwidth shared by all ``P`` ranks at once.
  :func:`ring_beta_at` interpolates the two in ``log(m)`` and holds the nearer value outside
  ``[ring_bytes, ring_big]`` (an assumption: no third regime beyond what was measured). Both are measured at
  the calibration's ``P``; since what leaves the caches is the ``P`` ranks' data together, using them at another
  ``P`` (a saved calibration, ``--link``) is an extrapolation.

  ``ring_k_min`` (when set) is the fewest pieces the fits measured (8). With fewer, larger pieces the model
  does not carry the fitted cost below what a whole message costs: a stage then pays per byte at least
  ``beta`` (plus ``gamma`` where the ring combines, ``P > 2``), the shift's measure of whole messages, which
  holds any large-message protocol of the MPI library (over TCP between two hosts, pieces of 512 KiB and more
  moved at the whole-message rate, 2-3x slower per byte than the fitted pieces of 43-256 KiB). Where the fit is
  the dearer one (shared memory) nothing changes. :func:`ring_stage_beta` is the per-byte cost a stage pays.

  Within each regime (pieces above / at most ``eager``) the time is convex in ``k`` and minimised at
  ``k* = sqrt(m ((P - 2) beta + (P - 3) gamma) / (alpha + pi + delta))`` -- the paper's
  ``sqrt((P - 2) m beta / alpha)`` when combines and pieces are free; :func:`best_blocks` takes the
  better integer next to each regime's ``k*`` and the regimes' boundary (``k = ceil(m / eager)``),
  clamped to 1..K, so a large ``piece`` makes it choose fewer, larger pieces -- or pieces just under
  ``eager``.
* serial relay (LASP-1): ``(P - 1)(alpha + m beta) + (P - 2)(delta + m gamma)`` (the ring with k = 1).
* tree (recursive doubling): ``L`` rounds, each one send and one receive of ``m'`` and up to two
  combines, plus packing the pair once: ``L (alpha + m' beta + 2 (delta + m' gamma)) + m' gamma / 2``.
* allgather (LASP-2): the library allgather of ``P m'`` bytes (recursive doubling for small
  messages, ring for large: ``min(L, P - 1) alpha + (P - 1) m' beta``) plus the last rank's local fold of
  ``P - 2`` combines and a copy.
* exscan: MPICH's ``MPI_Exscan`` is recursive doubling (modelled like the tree);
  Open MPI's (``coll/basic``) is linear, i.e. a serial relay of packed pairs (``algorithm="linear"``).
  Each user-op call also pays ``delta``.

Presets (:data:`PRESETS`; for predictions on machines you are not running on):

* ``nvlink4`` and ``ib-ndr``: fitted (:mod:`hpczeco.drivers.costfit`, ``hpczeco model --fit-paper``) to the ZeCO
  paper's Table 2 (H100 nodes of 8 GPUs, NVLink 4 inside a node and InfiniBand NDR between nodes;
  All-Scan and AllGather at 8..256 GPUs), under these assumptions: the state is one layer's
  ``H=32, K=V=128`` in bf16 (1 MiB per GPU), ranks 0..7 share a node (:func:`predict_hier`), the
  combine runs at HBM speed (``gamma`` from ~3 TB/s over 3 bytes moved per state byte), and the
  paper's All-Scan pipelines with the model's best piece count. ``alpha`` is then the per-hop cost
  as the paper's code sees it (send/recv launch and stream synchronisation, not the wire latency:
  NVLink's ~2 us and NDR's ~1-3 us are a small part of it), which is why the fit gives the two
  links a similar ``alpha``; ``1/beta`` is the achieved bandwidth of one GPU's traffic. The
  residuals are printed by ``hpczeco model`` and listed in docs/benchmarks/network.md.
* ``shm``: one node's shared memory through MPI from Python: ``alpha = 3 us``, ``1/beta = 8 GB/s``,
  host combine ``gamma = 0.05 ns/B``, ``delta = 1 us``, ``overhead = 100 us`` -- the order of what
  the calibration measured on this project's CPU machine when it was quiet (docs/benchmarks/scan.md,
  network.md); calibrate for real numbers.
* ``tcp``: MPI over TCP between hosts through one switch, as the namespace hosts of
  ``tests/netns/netns.sh`` measured it (MPICH ch4:ofi tcp, P = 2, quiet machine): ``alpha = 15 us``,
  ``1/beta = 1.5 GB/s``, ``overhead = 140 us``, host combine as ``shm``.

:func:`.calibrate.calibrate` measures the running machine. Pure arithmetic: no MPI, no arrays.
Knows nothing about attention.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

from . import schedule
from .names import ALGORITHMS, check_blocks

__all__ = [
    "LinkParams",
    "PRESETS",
    "preset",
    "parse_link",
    "default_params",
    "set_default_params",
    "ring_time",
    "best_blocks",
    "ptree_time",
    "best_blocks_ptree",
    "ptree_from_times",
    "ptree_time_hier",
    "PTREE_K_LADDER",
    "beta_at",
    "gamma_at",
    "SHIFT_BYTES",
    "piece_cost",
    "piece_from_times",
    "ring_from_times",
    "ring_beta_from_times",
    "ring_beta_at",
    "ring_stage_beta",
    "RING_BYTES",
    "RING_BIG",
    "serial_time",
    "tree_time",
    "allgather_time",
    "exscan_time",
    "predict",
    "choose",
    "predict_hier",
    "with_name",
    "LINK_ENV",
    "EAGER_DEFAULT",
]

#: state bytes at which ``LinkParams.ring_beta`` and ``ring_beta_big`` are measured unless set (2 and 16 MiB)
RING_BYTES = 2 << 20
RING_BIG = 16 << 20
#: the largest message of the calibration's shift and combine (``beta``, ``gamma`` hold up to it)
SHIFT_BYTES = 4 << 20


def _mib(n: float) -> str:
    return f"{n / (1 << 20):g} MiB"


#: bytes above which a ring piece pays ``LinkParams.piece`` unless set (Open MPI vader's default fragment size)
EAGER_DEFAULT = 32 << 10

#: environment variable with the default link parameters: a preset name or
#: "alpha,beta[,gamma[,delta[,overhead]]][,piece=S][,eager=BYTES][,ring_beta=S_PER_BYTE]..." (``_LINK_FORM``)
LINK_ENV = "HPCZECO_LINK"


@dataclass(frozen=True)
class LinkParams:
    """``alpha`` s/message, ``beta`` s/byte, ``gamma`` s/state byte combined, ``delta`` s/combine call,
    ``overhead`` s per scan call, ``piece`` s per ring piece and stage for pieces above ``eager`` bytes,
    ``ring_beta`` s per byte of one ring stage (the piece's transfer and its combine together; 0: ``beta +
    gamma``, what the shift and the combine alone measure) on a state of ``ring_bytes``, ``ring_beta_big`` the
    same on a state of ``ring_big`` bytes (0: ``ring_beta`` at every size; :func:`ring_beta_at`), ``ring_k_min``
    the fewest pieces those fits measured (0: no floor for fewer; :func:`ring_stage_beta`).

    Results saved before ``piece``/``eager``/``ring_beta``/``ring_beta_big`` existed load with the defaults
    (none of those terms)."""

    alpha: float
    beta: float
    gamma: float = 0.0
    delta: float = 0.0
    overhead: float = 0.0
    piece: float = 0.0
    eager: float = float(EAGER_DEFAULT)
    name: str = "custom"
    ring_beta: float = 0.0
    ring_beta_big: float = 0.0
    ring_bytes: float = float(RING_BYTES)
    ring_big: float = float(RING_BIG)
    ring_k_min: float = 0.0
    beta_big: float = 0.0
    gamma_big: float = 0.0
    shift_bytes: float = float(SHIFT_BYTES)
    big_bytes: float = float(RING_BIG)
    ptree_beta: float = 0.0

    def __post_init__(self) -> None:
        for k in ("alpha", "beta", "gamma", "delta", "overhead", "piece", "eager", "ring_beta", "ring_beta_big",
                  "ring_bytes", "ring_big", "ring_k_min", "beta_big", "gamma_big", "shift_bytes", "big_bytes",
                  "ptree_beta"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"LinkParams.{k} must be a finite number >= 0, got {v!r}")
        if self.ring_beta_big > 0 and not (self.ring_beta > 0 and 0 < self.ring_bytes < self.ring_big):
            raise ValueError(f"LinkParams.ring_beta_big needs ring_beta > 0 and 0 < ring_bytes < ring_big, got "
                             f"ring_beta={self.ring_beta!r}, ring_bytes={self.ring_bytes!r}, "
                             f"ring_big={self.ring_big!r}")
        if (self.beta_big > 0 or self.gamma_big > 0) and not 0 < self.shift_bytes < self.big_bytes:
            raise ValueError(f"LinkParams.beta_big / gamma_big need 0 < shift_bytes < big_bytes, got "
                             f"shift_bytes={self.shift_bytes!r}, big_bytes={self.big_bytes!r}")

    def describe(self) -> str:
        bw = "inf" if self.beta <= 0 else (f"{1e-9 / self.beta:.1f} GB/s" if self.beta <= 1e-9 else
                                           f"{1e-6 / self.beta:.1f} MB/s")
        return (f"{self.name}: alpha={self.alpha * 1e6:.2f} us, 1/beta={bw}, gamma={self.gamma * 1e12:.1f} ps/B, "
                f"delta={self.delta * 1e6:.2f} us, overhead={self.overhead * 1e6:.1f} us"
                + (f", piece={self.piece * 1e6:.1f} us above {self.eager / 1024:g} KiB" if self.piece > 0 else "")
                + (f", ring stage {self.ring_beta * 1e9:.3f} ns/B" if self.ring_beta > 0 else "")
                + (f" ({_mib(self.ring_bytes)}), {self.ring_beta_big * 1e9:.3f} ns/B ({_mib(self.ring_big)})"
                   if self.ring_beta_big > 0 else "")
                + (f", at least beta below k = {self.ring_k_min:g}" if self.ring_beta > 0 and self.ring_k_min > 0
                   else "")
                + (f"; at {_mib(self.big_bytes)}: shift {self.beta_big * 1e9:.3f} ns/B, combine "
                   f"{self.gamma_big * 1e12:.1f} ps/B" if self.beta_big > 0 or self.gamma_big > 0 else "")
                + (f", ptree stage {self.ptree_beta * 1e9:.3f} ns/B" if self.ptree_beta > 0 else ""))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_HBM_GAMMA = 3.0 / 3.0e12  # 3 bytes moved per state byte at ~3 TB/s
#: fixed cost of one layer's communication call in the paper's code (fitted with the two links below)
_PAPER_OVERHEAD = 79e-6
PRESETS: dict[str, LinkParams] = {
    # fitted to the ZeCO paper's Table 2 (drivers/costfit.py fit_paper; RMS log residual 0.090)
    "nvlink4": LinkParams(alpha=4.32e-6, beta=1 / 28.6e9, gamma=_HBM_GAMMA, delta=2e-6, overhead=_PAPER_OVERHEAD,
                          name="nvlink4"),
    "ib-ndr": LinkParams(alpha=3.68e-6, beta=1 / 30.5e9, gamma=_HBM_GAMMA, delta=2e-6, overhead=_PAPER_OVERHEAD,
                         name="ib-ndr"),
    "shm": LinkParams(alpha=3e-6, beta=1 / 8e9, gamma=0.05e-9, delta=1e-6, overhead=100e-6, name="shm"),
    "tcp": LinkParams(alpha=15e-6, beta=1 / 1.5e9, gamma=0.05e-9, delta=1e-6, overhead=140e-6, name="tcp"),
}

_DEFAULT: LinkParams | None = None


def preset(name: str) -> LinkParams:
    """The preset ``name`` (one of :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown link preset {name!r} (choose from {', '.join(PRESETS)})") from None


_LINK_FORM = ("'alpha,beta[,gamma[,delta[,overhead]]][,piece=S][,eager=BYTES][,ring_beta=S_PER_BYTE]"
              "[,ring_beta_big=S_PER_BYTE][,ring_bytes=BYTES][,ring_big=BYTES][,ring_k_min=K]'")
_LINK_NAMED = ("piece", "eager", "ring_beta", "ring_beta_big", "ring_bytes", "ring_big", "ring_k_min", "beta_big",
               "gamma_big", "shift_bytes", "big_bytes", "ptree_beta")


def parse_link(text: str) -> LinkParams:
    """A preset name, or ``"alpha,beta[,gamma[,delta[,overhead]]][,piece=S][,eager=BYTES][,ring_beta=S]..."``
    (:data:`_LINK_FORM`): two to five numbers in seconds and seconds per byte, then optionally the ring's own
    terms by name."""
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    vals: list[float] = []
    named: dict[str, float] = {}
    try:
        for item in text.split(","):
            key, eq, val = item.partition("=")
            if eq:
                if key.strip() not in _LINK_NAMED or key.strip() in named:
                    raise ValueError(item)
                named[key.strip()] = float(val)
            elif named:
                raise ValueError(item)  # positional after named
            else:
                vals.append(float(item))
    except ValueError:
        raise ValueError(f"link must be a preset ({', '.join(PRESETS)}) or {_LINK_FORM}, got {text!r}") from None
    if not 2 <= len(vals) <= 5:
        raise ValueError(f"link {_LINK_FORM} needs 2 to 5 numbers before the named ones, got {text!r}")
    return LinkParams(*vals, **named, name="custom")


def set_default_params(params: LinkParams | None) -> None:
    """Set (or with None, reset) this process's default parameters, used by ``topology="auto"`` and
    ``blocks=None``. Set the same on every rank (a disagreement is reported by the scan)."""
    global _DEFAULT
    if params is not None and not isinstance(params, LinkParams):
        raise TypeError(f"params must be LinkParams or None, got {type(params).__name__}")
    _DEFAULT = params


def default_params(memory: str = "host") -> LinkParams:
    """:func:`set_default_params`'s value, else ``$HPCZECO_LINK``, else "shm" (host) / "nvlink4" (device)."""
    if _DEFAULT is not None:
        return _DEFAULT
    env = os.environ.get(LINK_ENV)
    if env:
        return parse_link(env)
    return PRESETS["nvlink4" if memory == "device" else "shm"]


# --------------------------------------------------------------------------- formulas


def _check(P: int, nbytes: float) -> None:
    if P < 1:
        raise ValueError(f"P must be >= 1, got {P}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


def _rounds(P: int) -> int:
    return (P - 1).bit_length()


def piece_cost(piece_bytes: float, params: LinkParams) -> float:
    """The extra seconds one ring piece of ``piece_bytes`` pays per stage: ``params.piece`` above ``params.eager``."""
    return params.piece if piece_bytes > params.eager else 0.0


def ring_beta_at(nbytes: float, params: LinkParams) -> float:
    """The pipelined ring's cost per byte of a stage on a state of ``nbytes``: ``params.ring_beta`` up to
    ``ring_bytes``, ``ring_beta_big`` from ``ring_big`` on, linear in ``log(nbytes)`` between (just
    ``ring_beta`` without ``ring_beta_big``; 0 without either)."""
    p = params
    if p.ring_beta_big <= 0 or nbytes <= p.ring_bytes:
        return p.ring_beta
    if nbytes >= p.ring_big:
        return p.ring_beta_big
    w = math.log(nbytes / p.ring_bytes) / math.log(p.ring_big / p.ring_bytes)
    return p.ring_beta + w * (p.ring_beta_big - p.ring_beta)


def _log_interp(nbytes: float, small: float, at_small: float, big: float, at_big: float) -> float:
    if nbytes <= small:
        return at_small
    if nbytes >= big:
        return at_big
    w = math.log(nbytes / small) / math.log(big / small)
    return at_small + w * (at_big - at_small)


def beta_at(nbytes: float, params: LinkParams) -> float:
    """Seconds per byte of a message exchange whose ranks each touch ``nbytes`` (all ranks exchanging at once):
    ``params.beta`` up to ``shift_bytes``, ``beta_big`` (the cyclic shift measured at ``big_bytes``, where the
    ranks' buffers no longer fit the caches and every copy runs at the memory bandwidth they share) from
    ``big_bytes`` on, linear in ``log(nbytes)`` between; just ``beta`` without ``beta_big``."""
    p = params
    if p.beta_big <= 0:
        return p.beta
    return _log_interp(nbytes, p.shift_bytes, p.beta, p.big_bytes, p.beta_big)


def gamma_at(nbytes: float, params: LinkParams) -> float:
    """Seconds per state byte of a combine whose ranks each touch ``nbytes`` (all ranks combining at once):
    ``params.gamma`` up to ``shift_bytes``, ``gamma_big`` from ``big_bytes`` on (as :func:`beta_at`)."""
    p = params
    if p.gamma_big <= 0:
        return p.gamma
    return _log_interp(nbytes, p.shift_bytes, p.gamma, p.big_bytes, p.gamma_big)


def ring_stage_beta(P: int, nbytes: float, k: int, params: LinkParams) -> float:
    """Seconds per byte one stage of the pipelined ring (``k > 1``, ``params.ring_beta`` set) pays on a state of
    ``nbytes`` at ``P`` ranks, transfer and combine together: :func:`ring_beta_at`, and for fewer pieces than
    ``params.ring_k_min`` at least ``beta`` (plus ``gamma`` for ``P > 2``)."""
    p = params
    b = ring_beta_at(nbytes, p)
    if 0 < k < p.ring_k_min:
        b = max(b, p.beta + (p.gamma if P > 2 else 0.0))
    return b


def ring_time(P: int, nbytes: float, k: int, params: LinkParams) -> float:
    """Pipelined ring with ``k`` pieces (seconds)."""
    _check(P, nbytes)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if P == 1:
        return 0.0
    p, m = params, float(nbytes)
    if p.ring_beta > 0 and k > 1:  # the pipelined ring's own per-byte stage cost (transfer and combine)
        t = p.overhead + (P + k - 2) * (p.alpha + piece_cost(m / k, p) + m * ring_stage_beta(P, m, k, p) / k)
        return t + ((P + k - 3) * p.delta if P > 2 else 0.0)
    t = p.overhead + (P + k - 2) * (p.alpha + piece_cost(m / k, p) + m * beta_at(m, p) / k)
    if P > 2:
        t += (P + k - 3) * (p.delta + m * gamma_at(m, p) / k)
    return t


def ring_from_times(P: int, nbytes: float, ks: Sequence[int], times: Sequence[float],
                    params: LinkParams) -> tuple[float, float]:
    """``(piece, ring_beta)`` that explain measured ring times ``times`` (seconds) at piece counts ``ks`` (at
    least two, pieces all above ``params.eager`` bytes) on one state of ``nbytes`` at ``P`` ranks: the least
    squares fit of ``t - overhead - (P + k - 3) delta = (P + k - 2)(u + nbytes b / k)`` over the points, then
    ``piece = u - alpha`` and ``ring_beta = b``, both >= 0 (where one would be negative it is 0 and the other
    is fitted alone). Piece counts >= 2 (the pipelined ring's formula). Pure arithmetic."""
    if len(ks) != len(times) or len(ks) < 2 or len(set(ks)) != len(ks):
        raise ValueError(f"need two or more distinct piece counts with one time each, got {ks}, {times}")
    if P < 2 or min(ks) < 2 or nbytes / max(ks) <= params.eager:
        raise ValueError(f"need P >= 2, piece counts >= 2 (one piece keeps beta + gamma) and pieces above eager "
                         f"({params.eager:.0f} bytes), got P = {P}, k = {list(ks)}, {nbytes / max(ks):.0f} bytes "
                         f"at k = {max(ks)}")
    rows, ys = [], []
    for k, t in zip(ks, times):
        stages = P + k - 2
        rows.append((stages, stages * nbytes / k))
        ys.append(t - params.overhead - ((P + k - 3) * params.delta if P > 2 else 0.0))
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    y1 = sum(a * y for (a, _), y in zip(rows, ys))
    y2 = sum(b * y for (_, b), y in zip(rows, ys))
    det = s11 * s22 - s12 * s12
    if det <= 0:
        raise ValueError(f"the piece counts {ks} do not separate the two terms")
    u = (y1 * s22 - y2 * s12) / det
    b = (s11 * y2 - s12 * y1) / det
    a = params.alpha
    if u < a:  # piece >= 0: fit b alone with u = alpha
        u, b = a, (y2 - a * s12) / s22
    if b < 0:  # ring_beta >= 0: fit u alone
        u, b = max(a, y1 / s11), 0.0
    return u - a, b


def ring_beta_from_times(P: int, nbytes: float, ks: Sequence[int], times: Sequence[float],
                         params: LinkParams) -> float:
    """The per-byte stage cost that explains measured ring times ``times`` (seconds) at piece counts ``ks``
    (>= 2 each, at least one) on one state of ``nbytes`` at ``P`` ranks, with ``params``' other terms kept
    (``alpha``, ``piece`` above ``eager``, ``delta``, ``overhead``): the least squares ``b`` of
    ``t - overhead - (P + k - 3) delta - (P + k - 2)(alpha + pi) = (P + k - 2) nbytes b / k``, at least 0.
    Pure arithmetic."""
    if len(ks) != len(times) or not ks or min(ks) < 2 or P < 2 or not nbytes > 0:
        raise ValueError(f"need P >= 2, nbytes > 0 and piece counts >= 2 with one time each, got P = {P}, "
                         f"nbytes = {nbytes}, {ks}, {times}")
    if min(ks) < params.ring_k_min:
        raise ValueError(f"piece counts below params.ring_k_min ({params.ring_k_min:g}) pay the whole-message floor, "
                         f"not the fitted cost; got {list(ks)}")
    if not all(math.isfinite(t) for t in times):
        raise ValueError(f"ring times must be finite, got {times}")
    num = den = 0.0
    for k, t in zip(ks, times):
        stages = P + k - 2
        x = stages * nbytes / k
        y = (t - params.overhead - ((P + k - 3) * params.delta if P > 2 else 0.0)
             - stages * (params.alpha + piece_cost(nbytes / k, params)))
        num += x * y
        den += x * x
    return max(0.0, num / den)


def piece_from_times(P: int, nbytes: float, k1: int, t1: float, k2: int, t2: float, params: LinkParams) -> float:
    """The per-piece cost that explains two measured ring times ``t1``, ``t2`` (seconds, ``k1 < k2`` pieces of
    more than ``params.eager`` bytes, same ``P`` and state): the growth ``t2 - t1`` beyond what
    :func:`ring_time` without the term predicts, over the ``k2 - k1`` extra pipeline stages of
    every piece; clamped at 0. Pure arithmetic."""
    if not 1 <= k1 < k2:
        raise ValueError(f"need 1 <= k1 < k2, got {k1}, {k2}")
    if nbytes / k2 <= params.eager:
        raise ValueError(f"pieces of {nbytes / k2:.0f} bytes at k2 = {k2} are not above eager "
                         f"({params.eager:.0f} bytes)")
    base = replace(params, piece=0.0)
    growth = (t2 - t1) - (ring_time(P, nbytes, k2, base) - ring_time(P, nbytes, k1, base))
    return max(0.0, growth / (k2 - k1))


@lru_cache(maxsize=4096)
def _best_blocks(P: int, nbytes: float, K: int, params: LinkParams) -> int:
    if K <= 1 or (P <= 2 and params.piece == 0 and params.ring_beta == 0):
        return 1  # P = 2: no combines, so every extra piece only adds alpha
    if params.ring_beta > 0 or P <= 2:  # two formulas (one piece and more; costly pieces and eager ones at P = 2)
        return min(range(1, K + 1), key=lambda k: ring_time(P, nbytes, k, params))
    # in each regime (pieces above / at most eager) ring_time = const + k (alpha + pi + delta)
    # + m ((P - 2) beta + (P - 3) gamma) / k: convex in k; the regimes meet at k = ceil(m / eager)
    b = (P - 2) * params.beta + (P - 3) * params.gamma
    k_eager = math.ceil(nbytes / params.eager) if params.eager > 0 else K + 1  # fewest pieces of <= eager bytes
    cands = {1, K, min(K, max(1, k_eager)), min(K, max(1, k_eager - 1))}
    for pi in {0.0, params.piece}:
        a = params.alpha + pi + params.delta
        kstar = math.sqrt(nbytes * b / a) if a > 0 else float(K)
        cands |= {max(1, min(K, math.floor(kstar))), max(1, min(K, math.ceil(kstar)))}
    return min(sorted(cands), key=lambda k: ring_time(P, nbytes, k, params))


def best_blocks(P: int, nbytes: float, K: int, params: LinkParams) -> int:
    """The ring's best piece count in 1..K under :func:`ring_time`: the best of the integers next to
    ``k* = sqrt(m ((P-2) beta + (P-3) gamma) / (alpha + pi + delta))`` for ``pi`` = 0 and ``params.piece``,
    the boundary ``ceil(m / eager)`` of the two regimes (and one less), 1 and K (the paper's
    ``sqrt((P-2) m beta / alpha)`` when combines and pieces are free); ties go to fewer pieces;
    1 for ``P <= 2`` without ``piece`` (where more pieces never pay). With ``ring_beta`` (one piece and more
    follow two formulas), or ``piece`` at ``P <= 2`` (pieces of at most ``eager`` bytes may then pay): the best
    of every k in 1..K."""
    _check(P, nbytes)
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    return _best_blocks(int(P), float(nbytes), int(K), params)


def serial_time(P: int, nbytes: float, params: LinkParams) -> float:
    """Unpipelined relay (LASP-1)."""
    return ring_time(P, nbytes, 1, params)


def tree_time(P: int, nbytes: float, params: LinkParams, V: int = 128) -> float:
    """Recursive-doubling scan of packed pairs."""
    _check(P, nbytes)
    if P == 1:
        return 0.0
    m2 = nbytes * (1 + 1 / V)
    p = params
    b, g = beta_at(m2, p), gamma_at(m2, p)
    return p.overhead + _rounds(P) * (p.alpha + m2 * b + 2 * (p.delta + m2 * g)) + m2 * g / 2


def allgather_time(P: int, nbytes: float, params: LinkParams, V: int = 128) -> float:
    """LASP-2: library allgather of ``P m'`` bytes plus the last rank's local prefix fold."""
    _check(P, nbytes)
    if P == 1:
        return 0.0
    m2 = nbytes * (1 + 1 / V)
    p = params
    b, g = beta_at(P * m2, p), gamma_at(P * m2, p)  # every rank holds all P pairs
    comm = min(_rounds(P), P - 1) * p.alpha + (P - 1) * m2 * b
    fold = max(P - 2, 0) * (p.delta + nbytes * g) + m2 * g / 2 + nbytes * g / 3
    return p.overhead + comm + fold


def exscan_time(
    P: int, nbytes: float, params: LinkParams, V: int = 128, algorithm: str = "recursive_doubling"
) -> float:
    """``MPI_Exscan`` with a user op: "recursive_doubling" (MPICH) or "linear" (Open MPI coll/basic)."""
    _check(P, nbytes)
    if P == 1:
        return 0.0
    m2 = nbytes * (1 + 1 / V)
    p = params
    b, g = beta_at(m2, p), gamma_at(m2, p)
    if algorithm == "linear":
        return p.overhead + (P - 1) * (p.alpha + m2 * b) + (P - 2) * (p.delta + m2 * g) + m2 * g / 2
    if algorithm != "recursive_doubling":
        raise ValueError(f"algorithm must be 'recursive_doubling' or 'linear', got {algorithm!r}")
    return p.overhead + _rounds(P) * (p.alpha + m2 * b + 2 * (p.delta + m2 * g)) + m2 * g / 2


# --------------------------------------------------------------------------- the pipelined tree


#: piece counts the ptree's model tries (and K): its time is not convex in k across the eager boundary and the
#: critical path, and one evaluation walks the tree, so a ladder instead of every k
PTREE_K_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@lru_cache(maxsize=64)
def _ptree_shape(P: int) -> tuple[Any, tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]]:
    """The in-order tree of ``P`` positions and, per position, ``(sources, destinations, combines)`` of one piece
    of ``ptree`` (from :func:`.schedule.ptree_programs`; decay messages left out)."""
    progs = schedule.ptree_programs(P, 1)
    shape = []
    for prog in progs:
        src = tuple(op[3] for op in prog.recvs if op[2] >= 0)
        dst = tuple(op[3] for op in prog.sends() if op[2] >= 0)
        comb = sum(1 for st in prog.streams for op in st if op[0] == "axpy")
        shape.append((src, dst, comb))
    return schedule.inorder_tree(P), tuple(shape)


def _ptree_first_piece(P: int, hop, c: float, launch=None) -> float:
    """Seconds until the last position has its first piece of ``S_in``: the critical path of one piece through the
    up-sweep and the down-sweep, ``hop(u, v)`` seconds per message from ``u`` to ``v`` (``launch(u, v)`` of it
    the sender's own time, default ``hop``), ``c`` per combine (the dependencies and the order of the ops of
    :func:`.schedule.ptree_programs`)."""
    launch = launch or hop
    t, _ = _ptree_shape(P)
    arr = [0.0] * P  # arrival of v's up message at its parent
    ready_u = [0.0] * P  # U = A_L o x_v ready (x_v itself: 0)
    got_l = [0.0] * P  # A_L arrived
    order = sorted(range(P), key=lambda v: -t.depth[v])
    for v in order:
        l, r, par = t.left[v], t.right[v], t.parent[v]
        if l >= 0:
            got_l[v] = arr[l]
            ready_u[v] = arr[l] + c
        if par >= 0 and t.hi[v] < P:
            ready = max(ready_u[v], arr[r]) + c if r >= 0 else ready_u[v]
            arr[v] = ready + hop(v, par)
    x = [0.0] * P
    last = 0.0
    for v in reversed(order):
        l, r, lo = t.left[v], t.right[v], t.lo[v]
        if lo > 0:
            fwd = 0.0
            if l >= 0:
                x[l] = x[v] + hop(v, l)
                fwd = launch(v, l)  # X goes to the left child before X o U is formed for the right one
            if r >= 0:
                x[r] = max(x[v], ready_u[v]) + fwd + c + hop(v, r)
            done = max(x[v] + fwd + (c if r >= 0 else 0.0), got_l[v]) + c if l >= 0 else x[v]
        else:
            done = got_l[v]
            if r >= 0:
                x[r] = ready_u[v] + hop(v, r)
        last = max(last, done)
    return last


@lru_cache(maxsize=4096)
def ptree_time(P: int, nbytes: float, k: int, params: LinkParams) -> float:
    """The pipelined in-order binary tree (``ptree``) in ``k`` pieces on one kind of link (seconds), as the host
    executor runs it: one thread per rank posts, completes and combines every piece, so a position's costs add.

    ``T = overhead + T1 + (k - 1) stage``: ``T1`` the first piece's critical path through both sweeps
    (:func:`_ptree_first_piece`; a message ``t = alpha + pi + (m/k) b`` with ``b`` the transfer part of a ring stage,
    ``ring_stage_beta - gamma`` where the ring's stage cost is measured, else :func:`beta_at`; a combine
    ``c = delta + (m/k) gamma``), ``stage`` the busiest position's work per piece, ``max(in, out) t + combines c``
    (three pieces in, three out and four combines inside the tree; the ring's stage is one, one and one), or, where
    the calibration measured it (``ptree_beta``), ``max(in, out)(alpha + pi) + combines delta + (m/k) ptree_beta``.
    The decays' one message per edge travels ahead of the pieces and is not counted."""
    _check(P, nbytes)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if P == 1:
        return 0.0
    p, m = params, float(nbytes)
    piece = m / k
    g = gamma_at(m, p)
    if p.ring_beta > 0 and k > 1:
        rb = ring_stage_beta(P, m, k, p)
        bt = max(rb - g, 0.0) if P > 2 else rb
    else:
        bt = beta_at(m, p)
    pi = piece_cost(piece, p)
    t = p.alpha + pi + piece * bt
    c = p.delta + piece * g
    first = _ptree_first_piece(P, lambda u, v: t, c, lambda u, v: p.alpha + pi)
    _, shape = _ptree_shape(P)
    if p.ptree_beta > 0 and k > 1:
        stage = max(max(len(s), len(d)) * (p.alpha + pi) + n * p.delta for s, d, n in shape) + piece * p.ptree_beta
    else:
        stage = max(max(len(s), len(d)) * t + n * c for s, d, n in shape)
    return p.overhead + first + (k - 1) * stage


def _ladder(K: int) -> list[int]:
    return sorted({k for k in PTREE_K_LADDER if k <= K} | {K})


@lru_cache(maxsize=4096)
def best_blocks_ptree(P: int, nbytes: float, K: int, params: LinkParams) -> int:
    """The piece count in 1..K that :func:`ptree_time` prefers among :data:`PTREE_K_LADDER` and ``K`` (ties: fewer)."""
    _check(P, nbytes)
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    return min(_ladder(int(K)), key=lambda k: ptree_time(int(P), float(nbytes), k, params))


def ptree_from_times(P: int, nbytes: float, ks: Sequence[int], times: Sequence[float], params: LinkParams) -> float:
    """``ptree_beta``: the per-byte stage cost that explains measured ``ptree`` times ``times`` at piece counts
    ``ks`` (>= 2 each) on one state of ``nbytes`` at ``P`` ranks, with ``params``' other terms kept: the least
    squares ``b`` of ``t - T(b = 0) = (k - 1) (nbytes / k) b`` (``T`` = :func:`ptree_time`, whose stage is linear in
    ``ptree_beta``), at least 0. Pure arithmetic."""
    if len(ks) != len(times) or not ks or min(ks) < 2 or P < 2 or not nbytes > 0:
        raise ValueError(f"need P >= 2, nbytes > 0 and piece counts >= 2 with one time each, got P = {P}, "
                         f"nbytes = {nbytes}, {ks}, {times}")
    if not all(math.isfinite(t) for t in times):
        raise ValueError(f"ptree times must be finite, got {times}")
    tiny = replace(params, ptree_beta=1e-300)  # the stage of ptree_beta, without its bytes
    num = den = 0.0
    for k, t in zip(ks, times):
        x = (k - 1) * nbytes / k
        y = t - ptree_time(P, nbytes, k, tiny)
        num += x * y
        den += x * x
    return max(0.0, num / den)


def predict(
    topology: str,
    P: int,
    nbytes: float,
    params: LinkParams,
    *,
    blocks: int | None = None,
    K: int = 128,
    V: int = 128,
    exscan_algorithm: str = "recursive_doubling",
) -> float:
    """Predicted seconds of one scan. ``blocks=None`` for the ring means :func:`best_blocks`; else an int in
    ``1..K`` (:func:`.names.check_blocks`)."""
    check_blocks(blocks, K)
    if topology == "ring":
        k = best_blocks(P, nbytes, K, params) if blocks is None else blocks
        return ring_time(P, nbytes, k, params)
    if topology == "serial":
        return serial_time(P, nbytes, params)
    if topology == "tree":
        return tree_time(P, nbytes, params, V)
    if topology == "allgather":
        return allgather_time(P, nbytes, params, V)
    if topology == "exscan":
        return exscan_time(P, nbytes, params, V, exscan_algorithm)
    if topology == "ptree":
        k = best_blocks_ptree(P, nbytes, K, params) if blocks is None else blocks
        return ptree_time(P, nbytes, k, params)
    raise ValueError(f"topology must be one of {ALGORITHMS}, got {topology!r}")


def choose(P: int, nbytes: float, K: int, params: LinkParams, V: int = 128) -> tuple[str, int | None]:
    """The fastest of ring and ptree (each with its best piece count), tree and allgather: ``(topology, blocks)``.

    ``blocks`` is None unless the ring or ptree wins. Serial is never faster than the ring and exscan never
    faster than the tree in this model, so neither is picked. Deterministic (same on every rank).
    """
    k = best_blocks(P, nbytes, K, params)
    kp = best_blocks_ptree(P, nbytes, K, params)
    cands = [
        ("ring", ring_time(P, nbytes, k, params), k),
        ("tree", tree_time(P, nbytes, params, V), None),
        ("allgather", allgather_time(P, nbytes, params, V), None),
        ("ptree", ptree_time(P, nbytes, kp, params), kp),
    ]
    topo, _, blocks = min(cands, key=lambda c: c[1])
    return topo, blocks


def with_name(params: LinkParams, name: str) -> LinkParams:
    """``params`` renamed."""
    return replace(params, name=name)


# --------------------------------------------------------------------------- two-level machines


def _hop(p: LinkParams, P: int, nbytes: float, k: int) -> float:
    """One hop of one of ``k`` pieces of an ``nbytes`` state over ``p`` at ``P`` ranks (with ``ring_beta``, for
    ``k > 1``: transfer and combine bytes)."""
    piece = nbytes / k
    per_byte = ring_stage_beta(P, nbytes, k, p) if p.ring_beta > 0 and k > 1 else p.beta
    return p.alpha + piece_cost(piece, p) + piece * per_byte


def _combine(p: LinkParams, piece: float, k: int) -> float:
    """One combine of a ring piece on ``p``'s device (its bytes are in ``ring_beta``'s hops when that is set)."""
    return p.delta + (0.0 if p.ring_beta > 0 and k > 1 else piece * p.gamma)


def predict_hier(
    topology: str,
    P: int,
    nbytes: float,
    intra: LinkParams,
    inter: LinkParams,
    per_node: int,
    *,
    blocks: int | None = None,
    K: int = 128,
    V: int = 128,
) -> tuple[float, int | None]:
    """``(seconds, blocks)`` on nodes of ``per_node`` ranks: ``intra`` links inside a node, ``inter`` across.

    Ranks are numbered node by node. Ring: piece 0 crosses ``P - 1`` hops (``ceil(P/per_node) - 1``
    of them between nodes) and ``P - 2`` combines; the other pieces trail at the slowest stage.
    Tree and allgather: once ``P > per_node`` every round has a pair across nodes, so rounds cost
    ``inter``. Combines use ``intra``'s ``gamma``/``delta`` (the compute is the same device).
    """
    if per_node < 1:
        raise ValueError(f"per_node must be >= 1, got {per_node}")
    check_blocks(blocks, K)
    if P <= per_node:
        k = (best_blocks(P, nbytes, K, intra) if blocks is None else blocks) if topology == "ring" else None
        if topology == "ptree":
            k = best_blocks_ptree(P, nbytes, K, intra) if blocks is None else blocks
        return predict(topology, P, nbytes, intra, blocks=k, K=K, V=V), k
    n_inter = -(-P // per_node) - 1
    n_intra = P - 1 - n_inter
    cmb = intra

    def ring(k: int) -> float:
        piece = nbytes / k
        first = (n_intra * _hop(intra, P, nbytes, k) + n_inter * _hop(inter, P, nbytes, k)
                 + (P - 2) * _combine(cmb, piece, k))
        stage = _hop(inter, P, nbytes, k) + _combine(cmb, piece, k)
        return intra.overhead + first + (k - 1) * stage

    if topology in ("ring", "serial"):
        if topology == "serial":
            return ring(1), 1
        if blocks is None:
            blocks = min(range(1, K + 1), key=ring)
        return ring(blocks), blocks
    if topology == "ptree":
        if blocks is None:
            blocks = min(_ladder(K), key=lambda k: ptree_time_hier(P, nbytes, k, intra, inter, per_node))
        return ptree_time_hier(P, nbytes, blocks, intra, inter, per_node), blocks
    merged = LinkParams(inter.alpha, inter.beta, cmb.gamma, cmb.delta, intra.overhead,
                        name=f"{inter.name}+{intra.name}")
    return predict(topology, P, nbytes, merged, K=K, V=V), None


@lru_cache(maxsize=4096)
def ptree_time_hier(P: int, nbytes: float, k: int, intra: LinkParams, inter: LinkParams, per_node: int) -> float:
    """``ptree`` in ``k`` pieces on nodes of ``per_node`` ranks (numbered node by node), as devices run it: each
    tree edge is an ``intra`` or an ``inter`` link by where its two positions sit, pieces move while the device
    combines, and a position's sends (receives) over one kind of link share its port. ``T = overhead + T1 +
    (k - 1) stage``: ``T1`` the first piece's critical path (:func:`_ptree_first_piece`, a message ``alpha + pi +
    (m/k) beta`` of its link, a combine ``delta + (m/k) gamma`` of ``intra``), ``stage`` the busiest of, over the
    positions: the launches (``alpha`` per send) and combines, and each port's bytes per piece."""
    _check(P, nbytes)
    if k < 1 or per_node < 1:
        raise ValueError(f"k and per_node must be >= 1, got {k}, {per_node}")
    if P == 1:
        return 0.0
    m = float(nbytes)
    piece = m / k

    def link(u: int, v: int) -> LinkParams:
        return intra if u // per_node == v // per_node else inter

    def hop(u: int, v: int) -> float:
        L = link(u, v)
        return L.alpha + piece_cost(piece, L) + piece * beta_at(m, L)

    c = intra.delta + piece * gamma_at(m, intra)
    first = _ptree_first_piece(P, hop, c, lambda u, v: link(u, v).alpha)
    _, shape = _ptree_shape(P)
    stage = 0.0
    for v, (src, dst, n) in enumerate(shape):
        busy = [sum(link(v, d).alpha for d in dst) + n * c]
        for L in (intra, inter):
            busy.append(piece * beta_at(m, L) * sum(1 for d in dst if link(v, d) is L))
            busy.append(piece * beta_at(m, L) * sum(1 for q in src if link(q, v) is L))
        stage = max(stage, max(busy))
    return intra.overhead + first + (k - 1) * stage
