"""Host side shared by the chunk-parallel tensor-core GLA forward and backward (``gla_fwd_tc``, ``gla_bwd_tc``).

Kernels: ``gla_tc_states.cu`` (state walks, segment scan, combine), ``gla_fwd_tc.cu`` (output),
``gla_bwd_tc.cu`` (fused backward), ``gla_tc_large.cu`` (output and backward tiled over V / K for large heads), all
on ``gla_tc_chunk.cuh``. Inputs are 16-bit (bf16 as ``uint16`` bit patterns or a ``bfloat16`` dtype, or float16),
``q, k, g: [B, T, H, K]``, ``v, do: [B, T, H, V]``, C-contiguous and 16-byte aligned, K and V multiples of 16 up to
:data:`K_MAX` and :data:`V_MAX`; T >= 1. Heads with K and V up to 128 run the one-CTA-per-chunk kernels (``out`` 1 or
2, ``bwd`` 1); larger ones the tiled kernels (``out`` 3: ``glatc_fwd_vt``, one CTA per chunk and 128 columns of V;
``bwd`` 2: ``glatc_bwd_kt`` per chunk and 128 columns of K for dq, dk, dg, then ``glatc_bwd_vt`` per chunk and 128
columns of V for dv), which also take small heads (``out=3``, ``bwd=2``).

A state walk runs every segment of ``nc`` chunks of 64 tokens from a zero state and writes each chunk's state
inside its segment (``[B*H, NT, K, V]``, 16-bit or fp32), the segment's local state and log decay, and each
chunk's log decay from the segment boundary; the segment scan turns the local states into the states entering
(reverse: leaving) every segment. A consumer's state of chunk ``c`` is ``Hc[c] + exp(pc[c]) * Sf[c // nc]``, with
``Sf`` the segment states plus the initial state (reverse: dht) carried to them (``combine``). So the work that
needs no initial state / dht (walks, scan) is done before ZeCO's scan over ranks, the rest after it. Two walks
compute the same: ``walk=2`` (the default, ``glatc_walk2``: one CTA per 64 rows of K over all of V, inputs by
cp.async) and ``walk=1`` (``glatc_walk``: one CTA per 64 x 64 tile of the state).

Every function takes the kernel runtime ``rt``: ``rt.xp`` (cupy or numpy), ``rt.launch(name, grid, block, args,
shared_mem)``, ``rt.ptr(x)``; the CPU emulation (:func:`emu_runtime`) and a CuPy ``RawModule`` runtime both fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .runtime import kernel_source

KERNEL_FILES = ("gla_tc_states.cu", "gla_fwd_tc.cu", "gla_bwd_tc.cu", "gla_tc_large.cu")
TYPES = {"uint16": "bf16", "bfloat16": "bf16", "float16": "f16"}
#: largest diagonal sub-chunk decay span (log units) done on tensor cores; beyond it: exact elementwise
SPAN_LIMIT = {"bf16": 40.0, "f16": 8.0}
WALK_THREADS = {1: 128, 2: 256}
CHUNK_THREADS = 256
#: the default state walk (1: ``glatc_walk``, 64 x 64 state tiles; 2: ``glatc_walk2``, 64 rows of K x all of V)
DEFAULT_WALK = 2
#: largest head sizes the tensor-core kernels take (the tiled kernels loop over pieces of 128 columns; these are the
#: sizes they are tested at: flash-linear-attention's GLA layer heads, K = 256 with V = 512)
K_MAX, V_MAX = 256, 512
#: largest K and V of the one-CTA-per-chunk kernels (``glatc_fwd_out`` / ``glatc_fwd_wide``, ``glatc_bwd``)
SMALL_MAX = 128
#: the forward output kernels (1: ``glatc_fwd_wide``, every operand in shared memory; 2: ``glatc_fwd_out``, the
#: lean layout that lets two CTAs share an SM at KM 128; 3: ``glatc_fwd_vt``, one CTA per chunk and tile of 128
#: columns of V, any K and V) and the default per KM: at KM 64 the wide one already fits two CTAs per SM and was
#: faster on an H200 (docs/benchmarks/gla_tc_design.md); above K or V = 128 only 3 applies
FWD_KERNELS = {1: "glatc_fwd_wide", 2: "glatc_fwd_out", 3: "glatc_fwd_vt"}
DEFAULT_OUT = {64: 1, 128: 2}
#: the backward kernels (1: ``glatc_bwd``, one CTA per chunk, K and V up to 128; 2: ``glatc_bwd_kt`` + ``glatc_bwd_vt``,
#: tiled over K for dq, dk, dg and over V for dv, any K and V)
BWD_KERNELS = (1, 2)
#: the tile width of the tiled kernels (``KM`` of their template: 128 columns of V or K per CTA, pieces of 128)
TILE = 128
#: K tile widths of ``glatc_bwd_kt`` (``ktile``: 128, one CTA per SM, the default; 64, two CTAs per SM)
K_TILES = (128, 64)
#: walk CTAs per SM each walk aims at (chunks per segment are chosen so the walk fills the device ~6-8 times)
_WALK_CTAS_PER_SM = {1: 24, 2: 12}
i32, f32 = np.int32, np.float32


def _b(x: bool) -> str:
    return "true" if x else "false"


# ---------------------------------------------------------------------------------------------- kernels


def walk_name(t: str, reverse: bool, f32_states: bool, walk: int = 1, vm: int = 128) -> str:
    """Name expression of a state walk: ``glatc_walk<t, REV, F32S>`` (walk 1) or ``glatc_walk2<t, REV, F32S, vm>``."""
    if walk == 2:
        return f"glatc_walk2<{t}, {_b(reverse)}, {_b(f32_states)}, {vm}>"
    return f"glatc_walk<{t}, {_b(reverse)}, {_b(f32_states)}>"


def fwd_name(t: str, km: int, f32_states: bool, out: int | None = None) -> str:
    """Name expression of a forward output kernel (``out``: a key of :data:`FWD_KERNELS`; None: the default at ``km``,
    which is 1 or 2; the tiled kernel 3 has KM = :data:`TILE` whatever ``km``)."""
    o = out or DEFAULT_OUT[km]
    return f"{FWD_KERNELS[o]}<{t}, {TILE if o == 3 else km}, {_b(f32_states)}>"


def bwd_name(t: str, km: int, f32_states: bool) -> str:
    """Name expression of the fused backward ``glatc_bwd`` (``bwd=1``)."""
    return f"glatc_bwd<{t}, {km}, {_b(f32_states)}>"


def bwd_tiled_names(t: str, f32_states: bool, ktile: int = TILE) -> tuple[str, str]:
    """Name expressions of the tiled backward (``bwd=2``): ``glatc_bwd_kt`` (dq, dk, dg; K tiles of ``ktile``
    columns, :data:`K_TILES`), ``glatc_bwd_vt`` (dv)."""
    return (f"glatc_bwd_kt<{t}, {ktile}, {_b(f32_states)}>", f"glatc_bwd_vt<{t}, {TILE}, {_b(f32_states)}>")


def kernel_names(types: tuple[str, ...] = ("bf16", "f16"), kms: tuple[int, ...] = (64, 128),
                 f32_states: tuple[bool, ...] = (False, True)) -> list[str]:  # fmt: skip
    """Name expressions (template instantiations) of every kernel for the given types / KM / state storage."""
    return [n for f in KERNEL_FILES for n in file_kernel_names(f, types, kms, f32_states)]


def file_kernel_names(file: str, types: tuple[str, ...] = ("bf16", "f16"), kms: tuple[int, ...] = (64, 128),
                      f32_states: tuple[bool, ...] = (False, True)) -> list[str]:  # fmt: skip
    """The name expressions of one of :data:`KERNEL_FILES` (the kernel registry of :mod:`hpczeco.gpu.gla_common`)."""
    names = ["glatc_scan", "glatc_combine"] if file == "gla_tc_states.cu" else []
    for t in types:
        for f in f32_states:
            for km in kms:
                if file == "gla_tc_states.cu":
                    names += [walk_name(t, r, f, 2, km) for r in (False, True)]
                elif file == "gla_fwd_tc.cu":  # the tiled kernel 3 lives in gla_tc_large.cu
                    names += [fwd_name(t, km, f, out) for out in FWD_KERNELS if out != 3]
                elif file == "gla_bwd_tc.cu":
                    names.append(bwd_name(t, km, f))
            if file == "gla_tc_large.cu":
                names += [fwd_name(t, TILE, f, 3), *bwd_tiled_names(t, f)]
                names += [bwd_tiled_names(t, f, kt)[0] for kt in K_TILES if kt != TILE]
            if file == "gla_tc_states.cu":
                names += [walk_name(t, False, f), walk_name(t, True, f)]
    return names


# ---------------------------------------------------------------------------------------------- layouts


def _layout(km: int) -> dict[str, int]:
    """Mirror of ``GtLayout<KM>`` in gla_tc_chunk.cuh (bytes)."""
    P, BP, AP = km + 8, km + 4, 72
    T64, TK, F64, A64 = 64 * P * 2, km * P * 2, 64 * BP * 4, 64 * AP * 2
    zone = max(2 * TK + T64, 224 * P * 2, F64)  # h, dS, Kd | Qh, Kh, Ko | dG
    bwd = F64 + 4 * T64 + zone + 2 * A64 + (10 * km + 4) * 4
    wide = F64 + T64 + TK + 2 * A64 + 352 * P * 2 + (8 * km + 4) * 4
    PH = km // (2 if km == 128 else 1) + 8  # the lean kernel's piece of K
    lean = T64 + 2 * A64 + max(352 * PH * 2, T64 + TK, F64) + (8 * km + 4) * 4
    ktiled = F64 + 2 * T64 + max(2 * T64 + 2 * TK, 224 * P * 2, F64) + 2 * A64 + (10 * km + 4) * 4
    return {"bwd": bwd, "fwd1": wide, "fwd2": lean, "fwd3": lean, "bwd_vt": lean, "bwd_kt": ktiled}


def smem_bwd(km: int) -> int:
    """Dynamic shared memory of ``glatc_bwd<T, km, *>`` (bytes)."""
    return _layout(km)["bwd"]


def smem_fwd(km: int, out: int | None = None) -> int:
    """Dynamic shared memory of the forward output kernel ``out`` (:data:`FWD_KERNELS`; None: the default) at
    ``km`` (bytes; the tiled kernel 3 at its own KM, :data:`TILE`)."""
    o = out or DEFAULT_OUT[km]
    return _layout(TILE if o == 3 else km)[f"fwd{o}"]


def smem_bwd_tiled(ktile: int = TILE) -> tuple[int, int]:
    """Dynamic shared memory of ``glatc_bwd_kt`` (K tiles of ``ktile``) and ``glatc_bwd_vt`` (bytes; mirror of
    ``GtLayout<ktile>::K_TOTAL`` and ``GtLayout<TILE>::O_TOTAL``)."""
    return _layout(ktile)["bwd_kt"], _layout(TILE)["bwd_vt"]


def smem_walk2(vm: int) -> int:
    """Dynamic shared memory of ``glatc_walk2<T, *, *, vm>`` (mirror of ``Gw2Layout<VM>``, bytes)."""
    LT, RT = 64 * 72 * 2, 64 * (vm + 8) * 2
    return 2 * (2 * LT + RT) + LT + RT + 8 * 64 * 4 + 64 * 4


# ---------------------------------------------------------------------------------------------- checks


def type_of(x: Any) -> str:
    """Kernel type of an input array: "bf16" (uint16 bits or bfloat16) or "f16"; TypeError otherwise."""
    dt = str(x.dtype)
    if dt not in TYPES:
        raise TypeError(f"the tensor-core GLA kernels take bf16 (uint16 bits or bfloat16) or float16, got {dt}")
    return TYPES[dt]


def applies(t: str, K: int, V: int) -> bool:
    """The tensor-core kernels handle this type and head size."""
    return t in ("bf16", "f16") and 16 <= K <= K_MAX and 16 <= V <= V_MAX and K % 16 == 0 and V % 16 == 0


def large(K: int, V: int) -> bool:
    """Whether a head size needs the tiled kernels (K or V above :data:`SMALL_MAX`)."""
    return max(K, V) > SMALL_MAX


def km_of(K: int, V: int) -> int:
    """The shared-memory layout (KM) of the one-CTA-per-chunk kernels at this head size (64 or 128; 128 for large
    heads, whose tiled kernels have KM = :data:`TILE`)."""
    return 64 if max(K, V) <= 64 else 128


def walk_vm(V: int) -> int:
    """Columns of V per CTA of ``glatc_walk2`` (``VM``: 64 for V <= 64, else 128 and V tiled by 128)."""
    return 64 if V <= 64 else 128


def check_inputs(rt: Any, q: Any, k: Any, v: Any, g: Any, do: Any = None) -> tuple[int, int, int, int, int, str]:
    """``(B, T, H, K, V, t)`` after checking shapes, dtypes, contiguity, alignment and head sizes."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("do", do)):
        if x is None:
            continue
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        if rt.ptr(x) % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
    B, T, H, K = (int(s) for s in q.shape)
    V = int(v.shape[3])
    for name, x, shp in (("k", k, (B, T, H, K)), ("g", g, (B, T, H, K)), ("v", v, (B, T, H, V)),
                         ("do", do, (B, T, H, V))):  # fmt: skip
        if x is not None and tuple(x.shape) != shp:
            raise ValueError(f"{name} has shape {list(x.shape)}, expected {list(shp)}")
        if x is not None and x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, expected {q.dtype} (the dtype of q)")
    t = type_of(q)
    if not applies(t, K, V):
        raise ValueError(f"the tensor-core GLA kernels need K and V multiples of 16, K up to {K_MAX} and V up to "
                         f"{V_MAX}, got K={K}, V={V}")
    if T < 1 or B * H < 1:
        raise ValueError(f"need T >= 1 and B*H >= 1, got q of shape {list(q.shape)}")
    return B, T, H, K, V, t


def state32(rt: Any, x: Any, B: int, H: int, K: int, V: int, name: str) -> Any:
    if x is None:
        return None
    if tuple(x.shape) != (B, H, K, V):
        raise ValueError(f"{name} has shape {list(x.shape)}, expected {[B, H, K, V]}")
    return rt.xp.ascontiguousarray(x, dtype=rt.xp.float32)


# ---------------------------------------------------------------------------------------------- plan


def num_sms(rt: Any) -> int:
    try:
        return int(rt.xp.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:  # noqa: BLE001 - numpy (emulation) or an old CuPy
        return 132


def walk_tiles(K: int, V: int, walk: int) -> int:
    """CTAs of a walk per (segment, bh): 64 x 64 state tiles (walk 1) or 64 rows of K x :func:`walk_vm` columns of V
    (walk 2)."""
    return -(-K // 64) * -(-V // (64 if walk == 1 else walk_vm(V)))


def chunks_per_segment(rt: Any, BH: int, NT: int, K: int, V: int, walk: int = DEFAULT_WALK) -> int:
    """Chunks per segment: enough segments that the walk fills the device (24 CTAs of walk 1 per SM, 12 of walk 2:
    the same segments for both)."""
    ns = max(1, -(-_WALK_CTAS_PER_SM[walk] * num_sms(rt) // (walk_tiles(K, V, walk) * BH)))
    return max(1, -(-NT // ns))


@dataclass
class Geometry:
    """Sizes of one call: ``[B, T, H, K]`` / ``V``, chunks ``NT``, chunks per segment ``NC``, segments ``NS``."""

    B: int
    T: int
    H: int
    K: int
    V: int
    t: str
    NC: int
    f32_states: bool
    walk: int = DEFAULT_WALK
    out: int = 0  # the forward output kernel (a key of FWD_KERNELS); 0: the default at this KM
    bwd: int = 1  # the backward kernels (BWD_KERNELS: 1 fused, 2 tiled)
    vpc: int = 1  # V tiles per CTA of glatc_fwd_vt / glatc_bwd_vt (their scores computed once for them)
    ktile: int = TILE  # K tile of glatc_bwd_kt (K_TILES)

    @property
    def v_tiles(self) -> int:
        """V tiles of :data:`TILE` columns of the tiled kernels."""
        return -(-self.V // TILE)

    @property
    def v_groups(self) -> int:
        """CTAs per chunk of ``glatc_fwd_vt`` / ``glatc_bwd_vt`` (groups of ``vpc`` V tiles)."""
        return -(-self.v_tiles // self.vpc)

    @property
    def BH(self) -> int:
        return self.B * self.H

    @property
    def NT(self) -> int:
        return -(-self.T // 64)

    @property
    def NS(self) -> int:
        return -(-self.NT // self.NC)

    @property
    def km(self) -> int:
        return km_of(self.K, self.V)

    def dims(self) -> tuple:
        return (i32(self.B), i32(self.T), i32(self.H), i32(self.K), i32(self.V))


def v_tiles_per_cta(rt: Any, V: int, chunks: int) -> int:
    """V tiles per CTA of ``glatc_fwd_vt`` / ``glatc_bwd_vt``: all of them (the scores of a chunk computed once) where
    the chunks then still give 8 CTAs per SM (4 rounds of 2 resident), else halved until they do."""
    nvt, vpc, target = -(-V // TILE), -(-V // TILE), 8 * num_sms(rt)
    while vpc > 1 and -(-nvt // vpc) * chunks < target:
        vpc = -(-vpc // 2)
    return vpc


def geometry(rt: Any, B: int, T: int, H: int, K: int, V: int, t: str, nc: int | None, f32_states: bool | None,
             walk: int | None = None, out: int | None = None, bwd: int | None = None,
             vpc: int | None = None, ktile: int | None = None) -> Geometry:  # fmt: skip
    """The :class:`Geometry` of a call: ``nc`` chunks per segment (None: :func:`chunks_per_segment`), 16-bit or fp32
    chunk states (None: 16 bits for bf16, fp32 for fp16), the state walk (None: :data:`DEFAULT_WALK`), the forward
    output kernel (None: :data:`DEFAULT_OUT` at this KM; 3 for large heads), the backward kernels (None: 1, fused,
    for K and V up to 128; 2, tiled, above), the V tiles per CTA of the tiled kernels (None:
    :func:`v_tiles_per_cta`), the K tile of ``glatc_bwd_kt`` (None: :data:`TILE`)."""
    wk = DEFAULT_WALK if walk is None else int(walk)
    if wk not in WALK_THREADS:
        raise ValueError(f"walk must be one of {sorted(WALK_THREADS)}, got {walk}")
    big = large(K, V)
    ok = (3 if big else DEFAULT_OUT[km_of(K, V)]) if out is None else int(out)
    if ok not in FWD_KERNELS:
        raise ValueError(f"out must be one of {sorted(FWD_KERNELS)}, got {out}")
    if big and ok != 3:
        raise ValueError(f"out={ok} takes K and V up to {SMALL_MAX}; K={K}, V={V} needs out=3 (glatc_fwd_vt)")
    bk = (2 if big else 1) if bwd is None else int(bwd)
    if bk not in BWD_KERNELS:
        raise ValueError(f"bwd must be one of {list(BWD_KERNELS)}, got {bwd}")
    if big and bk != 2:
        raise ValueError(f"bwd=1 takes K and V up to {SMALL_MAX}; K={K}, V={V} needs bwd=2 (the tiled backward)")
    NT = -(-T // 64)
    NC = int(nc) if nc else chunks_per_segment(rt, B * H, NT, K, V, wk)
    if NC < 1:
        raise ValueError(f"nc (chunks per segment) must be >= 1, got {nc}")
    f32s = (t == "f16") if f32_states is None else bool(f32_states)  # fp16 states could overflow 16 bits
    vp = v_tiles_per_cta(rt, V, B * H * NT) if vpc is None else int(vpc)
    if vp < 1:
        raise ValueError(f"vpc (V tiles per CTA) must be >= 1, got {vpc}")
    kt = TILE if ktile is None else int(ktile)
    if kt not in K_TILES:
        raise ValueError(f"ktile must be one of {list(K_TILES)}, got {ktile}")
    return Geometry(B, T, H, K, V, t, NC, f32s, wk, ok, bk, vp, kt)


@dataclass
class StatePass:
    """One walk + scan: per-chunk states inside segments ``Hc [BH, NT, K, V]``, the states entering (reverse: the
    gradients leaving) the segments from a zero start ``Sin [BH, NS, K, V]`` fp32, segment log decays ``gseg``,
    chunk log decays from the segment boundary ``pc [BH, NT, K]``, ``fin [BH, K, V]`` (forward: the final
    state; reverse: the gradient into the initial state) from a zero start, and (forward pass) ``dec [BH, K]``,
    ``exp`` of the gate summed over T."""

    Hc: Any
    Sin: Any
    gseg: Any
    pc: Any
    fin: Any
    dec: Any = None


def state_pass(rt: Any, geo: Geometry, left: Any, right: Any, g: Any, reverse: bool, scale: float = 1.0,
               gseg: Any = None) -> StatePass:  # fmt: skip
    """Forward (``left, right = k, v``) or reverse (``q, do`` with ``scale``) walk and segment scan. The reverse
    pass takes the forward pass's ``gseg`` for its scan (same decays, one rounding)."""
    xp = rt.xp
    BH, NT, NS, K, V = geo.BH, geo.NT, geo.NS, geo.K, geo.V
    Hc = xp.empty((BH, NT, K, V), dtype=xp.float32 if geo.f32_states else xp.uint16)
    Sin = xp.empty((BH, NS, K, V), dtype=xp.float32)
    own = xp.empty((BH, NS, K), dtype=xp.float32) if gseg is None else None
    pc = xp.empty((BH, NT, K), dtype=xp.float32)
    vm = walk_vm(V)  # glatc_walk2: 64 columns of V, or tiles of 128
    rt.launch(
        walk_name(geo.t, reverse, geo.f32_states, geo.walk, vm), (walk_tiles(K, V, geo.walk), NS, BH),
        (WALK_THREADS[geo.walk],),
        (left, right, g, Hc, Sin, own, pc, f32(scale)) + geo.dims() + (i32(geo.NC), i32(NS), i32(NT)),
        shared_mem=smem_walk2(vm) if geo.walk == 2 else 0,
    )  # fmt: skip
    gs = own if gseg is None else gseg
    fin = xp.empty((BH, K, V), dtype=xp.float32)
    dec = xp.empty((BH, K), dtype=xp.float32) if gseg is None else None
    rt.launch("glatc_scan", (-(-K * V // 256), BH), (256,),
              (Sin, gs, fin, dec, i32(NS), i32(K), i32(V), i32(reverse)))  # fmt: skip
    return StatePass(Hc, Sin, gs, pc, fin, dec)


def carried(rt: Any, geo: Geometry, sp: StatePass, S0: Any, reverse: bool) -> Any:
    """Segment states with ``S0`` (initial state; reverse: dht ``[B, H, K, V]`` fp32 or None) carried in:
    ``Sin[s] + exp(log decay between the sequence boundary and s) * S0``; None if that is all zero."""
    if S0 is None:
        return sp.Sin if geo.NS > 1 else None
    out = rt.xp.empty_like(sp.Sin)
    rt.launch(
        "glatc_combine", (-(-geo.K * geo.V // 256), geo.BH), (256,),
        (out, sp.Sin, S0, sp.gseg, i32(geo.NS), i32(geo.K), i32(geo.V), i32(reverse)),
    )  # fmt: skip
    return out


def decay_total(geo: Geometry, sp: StatePass) -> Any:
    """``exp`` of the gate summed over T: ``[B, H, K]`` fp32 (computed by the forward pass's segment scan)."""
    return sp.dec.reshape(geo.B, geo.H, geo.K)


# ---------------------------------------------------------------------------------------------- bytes


def traffic(geo: Geometry, itemsize: int = 2, through_l2: bool = False) -> dict[str, int]:
    """Bytes each kernel of a forward and of a backward reads and writes (a model). Device memory (default): every
    input tile once, the tiles that sibling CTAs of a walk, the V / K tiles of one chunk, or a segment's chunk CTAs
    share counted once, as if L2 served the repeats; two kernels reading the same array each count it (they run
    apart). ``through_l2``: what the CTAs read, every repeat counted (the L2 -> SM traffic; writes as in device
    memory). Keys: the kernels (``walk``, ``scan``, ``fwd_out``, ``walk_rev``, ``scan_rev``, ``bwd``; with the tiled
    backward also its parts ``bwd_kt``, ``bwd_vt``) and ``forward`` = walk + scan + fwd_out, ``backward`` (states
    recomputed) = walk + scan + walk_rev + scan_rev + bwd, ``backward_reusing`` (the forward's states reused) =
    walk_rev + scan_rev + bwd."""
    E, BH, NT, NS, K, V, s = geo.B * geo.T * geo.H, geo.BH, geo.NT, geo.NS, geo.K, geo.V, itemsize
    hc = BH * NT * K * V * (4 if geo.f32_states else 2)  # per-chunk states
    seg = BH * NS * K * V * 4  # segment states (fp32)
    seg_read = BH * NT * K * V * 4 if through_l2 else seg  # every chunk CTA reads its segment's state
    pcs = BH * NT * K * 4  # chunk log decays
    small = pcs + BH * NS * K * 4  # and segment log decays
    vm = walk_vm(V)
    nkt, nvt = -(-K // 64), -(-V // (64 if geo.walk == 1 else vm))  # walk CTAs per (segment, bh): K x V tiles
    wk, wv = (nvt, nkt) if through_l2 else (1, 1)  # how often a walk reads each left / right tile
    # V tiles, their CTA groups (one pass over the scores each) and K tiles of the tiled chunk kernels
    vt, vg, kt = (geo.v_tiles, geo.v_groups, -(-K // geo.ktile)) if through_l2 else (1, 1, 1)
    t: dict[str, int] = {}
    t["walk"] = (2 * E * K * wk + E * V * wv) * s + hc + seg + small
    t["scan"] = 2 * seg + BH * NS * K * 4 + BH * K * V * 4 + BH * K * 4
    if geo.out == 3:  # glatc_fwd_vt per (V tile group, chunk): q, k, g in pass 1, q, g in pass 2 per tile; v, o once
        t["fwd_out"] = (3 * E * K * vg + 2 * E * K * vt + 2 * E * V) * s + hc + seg_read + pcs * vt
    else:
        t["fwd_out"] = (3 * E * K + 2 * E * V) * s + hc + seg_read + pcs
    t["walk_rev"] = (2 * E * K * wk + E * V * wv) * s + hc + seg + pcs
    t["scan_rev"] = 2 * seg + BH * NS * K * 4 + BH * K * V * 4
    if geo.bwd == 2:  # glatc_bwd_kt per (K tile, chunk): dq, dk, dg; glatc_bwd_vt per (V tile, chunk): dv
        t["bwd_kt"] = (3 * E * K + 2 * E * V * kt + 3 * E * K) * s + 2 * hc + 2 * seg_read + 2 * pcs
        t["bwd_vt"] = (3 * E * K * vg + 2 * E * K * vt + 2 * E * V) * s + hc + seg_read + pcs * vt
        t["bwd"] = t["bwd_kt"] + t["bwd_vt"]
    else:
        t["bwd"] = (6 * E * K + 3 * E * V) * s + 2 * hc + 2 * seg_read + 2 * pcs
    t["forward"] = t["walk"] + t["scan"] + t["fwd_out"]
    t["backward_reusing"] = t["walk_rev"] + t["scan_rev"] + t["bwd"]
    t["backward"] = t["walk"] + t["scan"] + t["backward_reusing"]
    return t


def mma_flops(geo: Geometry) -> dict[str, int]:
    """Tensor-core FLOP (2 per multiply-add, as issued: split products, recomputed scores of the tiled kernels, the
    triangular blocks only) of each kernel of a forward and a backward; keys as :func:`traffic`."""
    BH, NT, K, V = geo.BH, geo.NT, geo.K, geo.V
    n = BH * NT  # chunks
    blk = 2 * 16 * 16  # one 16 x 16 block, per multiply-add column
    scores_split = (6 + 4 * 3) * blk * K  # 6 off-diagonal blocks, 4 diagonal ones as hi + lo (3 products)
    scores_single = 10 * blk * K
    av_split = 10 * blk * V * 2  # A (hi + lo) times V over the 10 blocks
    av_single = 10 * blk * V
    state = 2 * 64 * K * V  # one 64-row product with the K x V state (Qe h, Kd dS, K^T V, do h^T, v dS^T ...)
    vg, kt = geo.v_groups, -(-K // geo.ktile)
    f: dict[str, int] = {}
    f["walk"] = f["walk_rev"] = n * state
    f["scan"] = f["scan_rev"] = 0
    f["fwd_out"] = n * ((scores_split * (vg if geo.out == 3 else 1)) + av_split + state)
    da = 10 * blk * V  # dA' (single product; the backward keeps hi + lo of its result)
    intra = 2 * (10 * blk * K * 2)  # dq and dk from dA' (hi + lo) and the pair operands
    if geo.bwd == 2:
        f["bwd_kt"] = n * (da * kt + 2 * state + intra)
        f["bwd_vt"] = n * (scores_single * vg + state + av_single)
        f["bwd"] = f["bwd_kt"] + f["bwd_vt"]
    else:
        f["bwd"] = n * (scores_single + da + 3 * state + av_single + intra)
    f["forward"] = f["walk"] + f["fwd_out"]
    f["backward_reusing"] = f["walk_rev"] + f["bwd"]
    f["backward"] = f["walk"] + f["backward_reusing"]
    return f


# ---------------------------------------------------------------------------------------------- emulation


def emu_runtime(types: tuple[str, ...] = ("bf16",), kms: tuple[int, ...] = (64, 128),
                f32_states: tuple[bool, ...] = (False, True)):  # fmt: skip
    """A CPU-emulation runtime (``hpczeco.gpu.emu.EmuRuntime``) of these kernels (tests; tiny shapes only)."""
    from .emu import EmuRuntime  # noqa: PLC0415

    return EmuRuntime(kernel_source(KERNEL_FILES), kernel_names(types, kms, f32_states))
