"""`hpczeco bench gpu-gla`: the GLA GPU kernels (:mod:`hpczeco.gpu.gla`) against flash-linear-attention on one GPU.

Issues 14's and 29's table in one run, bf16 (raw bits), at five shapes (``--shapes``; default all):
B=1 T=32768 H=16 K=V=128, B=8 T=4096 H=16 K=V=128, B=1 T=32768 H=32 K=V=64, and flash-linear-attention's GLA layer
heads B=1 T=32768 H=4 K=256 V=512 and B=1 T=32768 H=8 K=128 V=256 (the tiled tensor-core kernels). Per shape, in one
process, two input sets alternating, CUDA events, warm-up excluded, median of ``--repeats``:

- ours: forward (``hpczeco.gpu.gla.chunk_gla``, the default chunk-parallel tensor-core kernels), forward+backward
  with the forward's chunk states reused (``chunk_gla_prepare`` / ``chunk_gla_bwd_prepare(fwd=)``) and with them
  recomputed (``chunk_gla`` then ``chunk_gla_bwd``); each kernel alone (walks, segment scans, output kernel, fused
  backward); a check against the simt kernels on the same inputs;
- flash-linear-attention 0.6 ``chunk_gla`` forward and forward+backward (autograd), unless ``--no-fla`` or it does
  not import; its first forward+backward per case autotunes (150-400 s, mostly compiling; with a cold Triton cache
  ``--fla-jobs N`` compiles every case of the run first in parallel processes, :mod:`hpczeco.drivers.fla_precompile`;
  keep Triton's cache between runs); beside it,
  interleaved with it on the same torch tensors, ours through ``hpczeco.torch.chunk_gla`` (autograd), and the peak
  memory of each forward+backward above the inputs (``torch.cuda.max_memory_allocated``: ours allocates from torch's
  caching allocator under ``hpczeco.torch``, so the counter has all of it; CuPy's pool growth is recorded too);
- bytes: the memory floor (inputs read once, outputs written once) and the bytes our kernels move
  (:func:`hpczeco.gpu.gla_tc_states.traffic`: device memory, and through L2 with every repeated read), each over the
  measured copy bandwidth; the tensor-core FLOP of each kernel (:func:`~hpczeco.gpu.gla_tc_states.mma_flops`).

``--variants`` (comma list or ``all``) times builds of the same kernels at the first shape: ``walk1`` (the former 64
x 64 state walk), ``walk1-ctas2`` / ``walk1-ctas4`` (it with ``-DGW_MIN_CTAS=2`` / ``4``), ``nc2`` / ``nc05`` (chunks
per segment x2 / x0.5), ``f32`` (fp32 chunk states), ``out1`` / ``out2`` (the output kernel ``glatc_fwd_wide`` /
``glatc_fwd_out``, whichever is not the default at that KM), ``tiled`` (the large-head kernels ``glatc_fwd_vt``,
``glatc_bwd_kt`` + ``glatc_bwd_vt`` on a head up to 128), ``vpc1`` (one V tile per CTA of the tiled kernels, each
recomputing its chunk's scores), ``kt64`` (the tiled backward with K tiles of 64: two CTAs per SM); each is checked
against the default build. ``--grid`` adds the accuracy table on flash-linear-attention's test grid
(tests/ops/test_gla.py there: q, k, v, h0 ~ U[0, 1), g = logsigmoid(U[0, 1)) / normaliser, do, dht ~ N(0, 1); T = 1,
63, 777, 1000, 1024, 2048; K = 60 (simt path), 64, 128 with V = 64, 128, and K = 256 with V = 512, K = 128 with
V = 256; normaliser 0.1, 1, 10; B = H = 2): ours and fla's RMS error ratios against a float64 recurrence on the GPU,
the targets (o <= 4e-3, final state and gradients <= 5e-3) and ``ours <= 1.5 x fla + 1e-4``.

``--check`` runs the device checks first (:mod:`hpczeco.drivers.gpu_gla_checks`: small shapes in bf16 and fp16, the
two-slice ZeCO composition, the device's float64 recurrence, each against float64 on the host; with ``--variants``,
each variant build on a small shape as well), table ``device_checks``, exit status 1 if one fails. ``--impls`` adds
the timings of other ``impl=`` values of :mod:`hpczeco.gpu.gla` (e.g. ``simt``) beside the default path.

Every step is guarded: a failure is recorded with its reason and the run goes on. The table prints last. Results:
``--out``/gpu_gla.json and one CSV per table (timings, summary, variants, grid, device_checks), rewritten after every
row. Correctness is tested by ``pytest -m gpu tests/test_gpu_gla*.py``; this is the benchmark.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from typing import Any

import numpy as np
from hpczeco.base import bf16

from . import benchkit
from .gpu_gla_checks import NAMES, TARGET, recurrence64, rel
from .options import int_range

STEM = "gpu_gla"
SHAPES = {"0": (1, 32768, 16, 128, 128), "1": (8, 4096, 16, 128, 128), "2": (1, 32768, 32, 64, 64),
          "3": (1, 32768, 4, 256, 512), "4": (1, 32768, 8, 128, 256)}
GRID_T = (1, 63, 777, 1000, 1024, 2048)
GRID_KV = ((60, 64), (60, 128), (64, 64), (64, 128), (128, 64), (128, 128), (256, 512), (128, 256))
GRID_GN = (0.1, 1.0, 10.0)
VS_FLA, VS_FLA_SLACK = 1.5, 1e-4  # ours <= 1.5 x fla + 1e-4 (RMS error ratios)
VARIANTS = ("walk1", "walk1-ctas2", "walk1-ctas4", "nc2", "nc05", "f32", "out1", "out2", "tiled", "vpc1", "kt64")
COPY_BYTES = 1 << 30  # the device copy that measures the bandwidth the floors are divided by


def build_parser(prog: str) -> argparse.ArgumentParser:
    from .helpfmt import HelpFormatter

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--out", default="runs/gpu_gla", help="folder for the JSON/CSV results")
    p.add_argument("--seed", type=int_range(0), default=None, help="random seed (default: from the clock, printed)")
    p.add_argument("--repeats", type=int_range(1), default=20, help="timed repetitions (median)")
    p.add_argument("--shapes", default="0,1,2,3,4",
                   help="comma list of shapes: 0 = B1 T32768 H16 K=V=128, 1 = B8 T4096 H16 K=V=128, "
                        "2 = B1 T32768 H32 K=V=64, 3 = B1 T32768 H4 K256 V512, 4 = B1 T32768 H8 K128 V256, "
                        "or BxTxHxKxV")  # fmt: skip
    p.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention")
    p.add_argument("--grid", action="store_true", help="accuracy on fla's test grid (ours and fla vs float64)")
    p.add_argument("--grid-kv", default="", help="restrict the grid's (K, V) pairs, e.g. '64x64,128x128'")
    p.add_argument("--grid-t", default="", help="restrict the grid's lengths T, e.g. '777,2048' (fla autotunes anew "
                                                "for each short T and each (K, V): ~1-3 min each)")
    p.add_argument("--variants", default="", help=f"'all' or a comma list of: {', '.join(VARIANTS)}")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-kernel timings")
    p.add_argument("--check", action="store_true",
                   help="also run the device checks (hpczeco.drivers.gpu_gla_checks: small shapes in bf16 and fp16, "
                        "the two-slice ZeCO composition and the device's float64 recurrence against float64 on the "
                        "host; each variant of --variants on a small shape too); exit status 1 if one fails")
    p.add_argument("--no-fp16", action="store_true", help="with --check: leave out the fp16 cases (and their build)")
    p.add_argument("--impls", default="",
                   help="also time hpczeco.gpu.gla's forward and forward+backward with these impl= values at each "
                        "shape, e.g. 'tc,simt' (the backward takes the same impl where it has it, else auto)")
    p.add_argument("--quick", action="store_true", help="the first shape only (jobs/device_session.sh)")
    p.add_argument("--fla-jobs", type=int_range(0), default=0,
                   help="with a cold Triton cache: compile fla's Triton kernels for every shape (and grid (K, V)) of "
                        "the run first, in at most this many parallel processes (hpczeco.drivers.fla_precompile; "
                        "the timing process then autotunes from Triton's cache, alone on the GPU); 0: off. Each "
                        "process is a case's whole first call: worth it for several cases on a cold cache")  # fmt: skip
    p.add_argument("--fla-jobs-timeout", type=int_range(1), default=420,
                   help="seconds one precompile process may take before it is killed (the run then compiles the "
                        "rest itself)")  # fmt: skip
    return p


def main(argv: list[str] | None = None, prog: str = "hpczeco bench gpu-gla") -> int:
    args = build_parser(prog).parse_args(argv)
    reason = benchkit.gpu_missing()
    if reason:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    from .files import check_output_dir

    check_output_dir(args.out, "--out")  # before the work
    return run(args)


def parse_shapes(text: str) -> list[tuple[int, int, int, int, int]]:
    """``0,1,2`` (indices into :data:`SHAPES`) or ``BxTxHxKxV`` items."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item in SHAPES:
            out.append(SHAPES[item])
            continue
        dims = tuple(int(x) for x in item.lower().split("x"))
        if len(dims) != 5 or min(dims) < 1:
            raise ValueError(f"--shapes: {item!r} is neither one of {sorted(SHAPES)} nor BxTxHxKxV")
        out.append(dims)  # type: ignore[arg-type]
    return out


def check_impls(text: str) -> list[str]:
    """The ``--impls`` list, each one of :data:`hpczeco.gpu.gla.FORWARD_IMPLS` (``ValueError`` otherwise)."""
    from hpczeco.gpu.gla import FORWARD_IMPLS  # noqa: PLC0415

    impls = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in impls if x not in FORWARD_IMPLS]
    if bad:
        raise ValueError(f"--impls: unknown {bad}; choose from {list(FORWARD_IMPLS)}")
    return impls


def tag_of(shape) -> str:
    B, T, H, K, V = shape
    return f"B={B} T={T} H={H} K={K} V={V}"


# ------------------------------------------------------------------------------------------------ device helpers


def bench_inputs(cp, shape, seed: int) -> dict[str, Any]:
    """q, k, v, do ~ N(0, 1), g = logsigmoid(N(0, 1) + 2) as bf16 bits on the device (generated there)."""
    B, T, H, K, V = shape
    rs = cp.random.RandomState(seed)
    f = lambda *s: normal32(rs, s)  # noqa: E731
    x = {"q": f(B, T, H, K), "k": f(B, T, H, K), "v": f(B, T, H, V), "do": f(B, T, H, V)}
    x["g"] = (-cp.log1p(cp.exp(-(f(B, T, H, K) + 2.0)))).astype(cp.float32)
    return {n: cp.ascontiguousarray(bf16.to_bits(a, xp=cp)) for n, a in x.items()}


def normal32(rs, shape):
    """float32 N(0, 1) from a CuPy RandomState (generated in float32)."""
    return rs.standard_normal(shape, dtype="float32")


class Only:
    """A kernel runtime that launches only the kernels ``keep(name)`` accepts (to time one kernel of a pass)."""

    def __init__(self, rt: Any, keep):
        self._rt, self._keep, self.xp = rt, keep, rt.xp

    def launch(self, name, grid, block, args, shared_mem=0):
        if self._keep(name):
            self._rt.launch(name, grid, block, args, shared_mem)

    def ptr(self, x):
        return self._rt.ptr(x)


def variant_runtime(defines: tuple[str, ...]) -> Any:
    """A CuPy kernel runtime of the GLA kernels compiled with extra ``-D`` defines."""
    from hpczeco.gpu.gla_common import KERNELS  # noqa: PLC0415
    from hpczeco.gpu.runtime import CupyRuntime  # noqa: PLC0415

    return CupyRuntime(dataclasses.replace(KERNELS, options=KERNELS.options + tuple(f"-D{d}" for d in defines)))


# ------------------------------------------------------------------------------------------------ the run


class Bench:
    def __init__(self, args, rec: benchkit.Recorder, cp, seed: int):
        self.args, self.rec, self.cp, self.seed = args, rec, cp, seed
        self.reps = args.repeats
        self.fla = self.torch = None
        self.summary: dict[str, dict[str, Any]] = {}
        self.copy_Bps: float | None = None

    # -------------------------------------------------------------------- helpers
    def ev(self, fn, reps: int | None = None, warmup: int = 3, sets: int = 2) -> float:
        return benchkit.cuda_event_time(fn, reps or self.reps, warmup=warmup, sets=sets)["median_ms"]

    def guarded(self, name: str, fn, table: str = "timings", **extra: Any) -> Any:
        """``fn()`` -> ms (recorded as a timing row); a failure is recorded with its reason and None returned."""
        try:
            ms = fn()
        except Exception as exc:  # noqa: BLE001 - record and go on
            self.rec.failed(name, exc, table=table, **extra)
            return None
        self.rec.timing(name, ms, table=table, **extra)
        return ms

    def step(self, what: str, fn) -> Any:
        """Run one step; a failure is recorded (``failures`` table) and None returned."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            self.rec.record({"step": what, "error": f"{type(exc).__name__}: {exc}"[:300]}, table="failures")
            return None

    def to_torch(self, x):
        return self.torch.from_dlpack(x.view(self.cp.int16)).view(self.torch.bfloat16)

    def free(self) -> None:
        """Give cached device memory back between shapes (CuPy's pool, and torch's when fla ran)."""
        self.cp.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    # -------------------------------------------------------------------- setup
    def setup(self) -> None:
        cp, rec = self.cp, self.rec

        def copy():
            a = cp.full(COPY_BYTES, 7, dtype=cp.uint8)
            b = cp.empty_like(a)
            ms = self.ev(lambda i: cp.copyto(b, a), 10, sets=1)
            self.copy_Bps = 2 * a.nbytes / (ms * 1e-3)
            rec.info["copy_GBps"] = round(self.copy_Bps / 1e9, 1)
            return ms

        self.guarded("device copy 1 GiB (read + write)", copy)
        cp.get_default_memory_pool().free_all_blocks()
        if self.args.no_fla:
            rec.info["fla"] = "skipped (--no-fla)"
            return
        try:
            import fla as fla_mod  # noqa: PLC0415
            import torch  # noqa: PLC0415
            from fla.ops.gla import chunk_gla as fla_chunk_gla  # noqa: PLC0415

            self.fla, self.torch = fla_chunk_gla, torch
            rec.info["fla"] = getattr(fla_mod, "__version__", "?")
            rec.info["torch"] = torch.__version__
        except Exception as exc:  # noqa: BLE001
            rec.info["fla"] = f"import failed: {type(exc).__name__}: {exc}"
            rec.say(f"flash-linear-attention not available ({exc}); continuing without it")

    def compile_kernels(self) -> None:
        """The NVRTC build of the modules a bf16 run uses (timed: the first call of each pays it)."""
        from hpczeco.gpu.gla_common import RUNTIME, kernel_group, kernel_names  # noqa: PLC0415

        rt = RUNTIME.get()
        for file in ("gla_tc_states.cu", "gla_fwd_tc.cu", "gla_bwd_tc.cu", "gla_tc_large.cu", "gla_kernels.cu"):
            for group in ("common", "bf16"):
                names = [n for n in kernel_names(file) if kernel_group(n) == group]
                if not names:
                    continue

                def build(names=names):
                    t = time.perf_counter()
                    for n in names:
                        rt.function(n)
                    return (time.perf_counter() - t) * 1e3

                self.guarded(f"compile {file} [{group}] (NVRTC, host ms)", build, kernels=len(names))

    def fla_precompile(self, shapes) -> None:
        """``--fla-jobs``: fla's kernels for this run's cases compiled in parallel processes (``fla_precompile``)."""
        from . import fla_precompile as fp  # noqa: PLC0415

        grid_kv, grid_t = (self.grid_pairs(), self.grid_lengths()) if self.args.grid else ((), ())
        todo = fp.cases(shapes, grid_kv, grid_t)
        jobs = min(self.args.fla_jobs, len(todo), max(1, len(os.sched_getaffinity(0)) // 2))
        if jobs < 2:  # one process at a time is the timing process's own first calls, and more
            self.rec.say(f"fla precompile skipped: it needs 2 or more cases and processes ({len(todo)} case(s), "
                         f"{jobs} process(es) allowed)")
            return
        self.rec.say(f"fla precompile: {len(todo)} case(s) in {jobs} parallel process(es)")
        t0 = time.perf_counter()
        for r in fp.precompile(todo, jobs, self.args.fla_jobs_timeout, say=self.rec.say):
            self.rec.record({"case": r.case, "s": r.seconds, "status": r.status,
                             **({} if r.ok else {"tail": r.tail[-300:]})}, table="fla_precompile")  # fmt: skip
        self.rec.info["fla_precompile_s"] = round(time.perf_counter() - t0, 1)

    # -------------------------------------------------------------------- device checks
    def device_checks(self) -> None:
        """``--check``: :func:`.gpu_gla_checks.run` on the library's runtime (``device_checks`` table)."""
        from hpczeco.gpu.gla_common import RUNTIME  # noqa: PLC0415

        from . import gpu_gla_checks  # noqa: PLC0415

        gpu_gla_checks.run(self.rec, self.cp, RUNTIME.get(), self.seed + 3, fp16=not self.args.no_fp16)
        self.cp.get_default_memory_pool().free_all_blocks()

    # -------------------------------------------------------------------- one shape
    def run_shape(self, shape) -> None:
        cp, rec = self.cp, self.rec
        from hpczeco.gpu import gla as G  # noqa: PLC0415
        from hpczeco.gpu import gla_tc_states as tcs  # noqa: PLC0415
        from hpczeco.gpu.gla_common import RUNTIME  # noqa: PLC0415

        B, T, H, K, V = shape
        tag = tag_of(shape)
        row = self.summary.setdefault(tag, {"shape": tag})
        sets = self.step(f"inputs {tag}", lambda: [bench_inputs(cp, shape, self.seed + 10 * j) for j in range(2)])
        if sets is None:
            return
        scale = K**-0.5
        qkvg = ("q", "k", "v", "g")
        rt = RUNTIME.get()
        geo = tcs.geometry(rt, B, T, H, K, V, "bf16", None, None)
        moved = tcs.traffic(geo)
        fl_f = G.memory_floor(B, T, H, K, V)["bytes"]
        fl_b = G.memory_floor(B, T, H, K, V, backward=True)["bytes"]
        bw = self.copy_Bps or 4.1e12
        fb_moved = moved["forward"] + moved["backward_reusing"]
        row.update(NC=geo.NC, floor_fwd_GB=fl_f / 1e9, floor_fwd_ms=fl_f / bw * 1e3,
                   moved_fwd_GB=moved["forward"] / 1e9, moved_fwd_ms=moved["forward"] / bw * 1e3,
                   floor_fwdbwd_GB=(fl_f + fl_b) / 1e9, floor_fwdbwd_ms=(fl_f + fl_b) / bw * 1e3,
                   moved_fwdbwd_GB=fb_moved / 1e9, moved_fwdbwd_ms=fb_moved / bw * 1e3)  # fmt: skip
        rec.info[f"bytes {tag}"] = {k: v for k, v in moved.items()}

        def fwd(i):
            s = sets[i]
            return G.chunk_gla(*(s[n] for n in qkvg), scale=scale)

        def fwd_bwd_reuse(i):
            s = sets[i]
            plan = G.chunk_gla_prepare(*(s[n] for n in qkvg), scale=scale)
            plan.finish()
            G.chunk_gla_bwd_prepare(*(s[n] for n in qkvg), s["do"], scale=scale, fwd=plan).finish()

        def fwd_bwd(i):
            s = sets[i]
            G.chunk_gla(*(s[n] for n in qkvg), scale=scale)
            G.chunk_gla_bwd(*(s[n] for n in qkvg), s["do"], scale=scale)

        def check():  # ours against the simt kernels on the same inputs
            s = sets[0]
            plan = G.chunk_gla_prepare(*(s[n] for n in qkvg), scale=scale)
            o, ht = plan.finish(output_final_state=True)
            grads = G.chunk_gla_bwd_prepare(*(s[n] for n in qkvg), s["do"], scale=scale, fwd=plan).finish()
            o_s, ht_s = G.chunk_gla(*(s[n] for n in qkvg), scale=scale, output_final_state=True, impl="simt")
            g_s = G.chunk_gla_bwd(*(s[n] for n in qkvg), s["do"], scale=scale, impl="simt")
            errs = {"o": rel(cp, o, o_s), "ht": rel(cp, ht, ht_s)}
            errs.update({n: rel(cp, a, b) for n, a, b in zip(NAMES[2:], grads, g_s)})
            row["impl"] = plan.impl
            row["vs_simt_max"] = max(errs.values())
            rec.record({"shape": tag, "impl": plan.impl, **errs, "ok": bool(max(errs.values()) <= 1e-2)},
                       table="checks")  # fmt: skip

        self.step(f"check vs simt {tag}", check)
        cp.get_default_memory_pool().free_all_blocks()
        row["ours fwd"] = self.guarded(f"ours fwd [{tag}]", lambda: self.ev(fwd))
        row["ours fwd+bwd"] = self.guarded(f"ours fwd+bwd, states reused [{tag}]", lambda: self.ev(fwd_bwd_reuse))
        row["ours fwd+bwd (recomputed)"] = self.guarded(f"ours fwd+bwd, states recomputed [{tag}]",
                                                        lambda: self.ev(fwd_bwd))  # fmt: skip

        def bwd(i):
            s = sets[i]
            G.chunk_gla_bwd(*(s[n] for n in qkvg), s["do"], scale=scale)

        row["ours bwd"] = self.guarded(f"ours bwd, states recomputed [{tag}]", lambda: self.ev(bwd))
        for impl in check_impls(self.args.impls):
            self.time_impl(impl, sets, scale, tag, row)
        if not self.args.no_breakdown:
            self.step(f"breakdown {tag}", lambda: self.breakdown(shape, sets[0], geo, row))

        def validate(i):  # the public checks on raw bits: fused bit-pattern reductions, one synchronisation
            from hpczeco.gla import validate_gla_inputs  # noqa: PLC0415

            validate_gla_inputs(*(sets[i][n] for n in qkvg), do=sets[i]["do"])

        self.guarded(f"validate_gla_inputs q, k, v, g, do (uint16 raw bits) [{tag}]",
                     lambda: self.ev(validate, max(5, self.reps // 2)))  # fmt: skip
        if self.fla is not None:
            self.step(f"fla {tag}", lambda: self.fla_shape(shape, sets, row))
        for key in ("fwd", "fwd+bwd"):
            ours, theirs = row.get(f"ours {key}"), row.get(f"fla {key}")
            if ours and theirs:
                row[f"ours/fla {key}"] = ours / theirs
        rec.record({k: v for k, v in row.items()}, table="summary")

    def time_impl(self, impl: str, sets, scale: float, tag: str, row: dict[str, Any]) -> None:
        """``--impls``: the forward with ``impl=impl`` and the forward+backward (the backward's impl the same where
        it has it, else ``"auto"``), each recorded and put in the summary row."""
        from hpczeco.gpu import gla as G  # noqa: PLC0415

        qkvg = ("q", "k", "v", "g")
        bimpl = impl if impl in G.BACKWARD_IMPLS else "auto"

        def fwd(i):
            G.chunk_gla(*(sets[i][n] for n in qkvg), scale=scale, impl=impl)

        def fwd_bwd(i):
            s = sets[i]
            G.chunk_gla(*(s[n] for n in qkvg), scale=scale, impl=impl)
            G.chunk_gla_bwd(*(s[n] for n in qkvg), s["do"], scale=scale, impl=bimpl)

        row[f"impl={impl} fwd"] = self.guarded(f"impl={impl} fwd [{tag}]", lambda: self.ev(fwd))
        row[f"impl={impl} fwd+bwd"] = self.guarded(f"impl={impl} fwd + impl={bimpl} bwd [{tag}]",
                                                   lambda: self.ev(fwd_bwd))  # fmt: skip

    def breakdown(self, shape, s, geo, row) -> None:
        """Each kernel of the forward and of the backward alone (the default build, 16-bit chunk states)."""
        from hpczeco.gpu import gla_bwd_tc, gla_fwd_tc  # noqa: PLC0415
        from hpczeco.gpu import gla_tc_states as tcs  # noqa: PLC0415
        from hpczeco.gpu.gla_common import RUNTIME  # noqa: PLC0415

        cp = self.cp
        tag = tag_of(shape)
        rt = RUNTIME.get()
        B, T, H, K, V = shape
        scale = K**-0.5
        q, k, v, g, do = (s[n] for n in ("q", "k", "v", "g", "do"))
        fplan = gla_fwd_tc.fwd_tc_prepare(rt, q, k, v, g, scale)
        bplan = gla_bwd_tc.bwd_tc_prepare(rt, q, k, v, g, do, scale, fwd=fplan)
        S0 = cp.asarray(np.random.default_rng(self.seed).standard_normal((B, H, K, V)).astype(np.float32))
        walks = Only(rt, lambda n: n.startswith("glatc_walk"))
        scans = Only(rt, lambda n: n == "glatc_scan")
        vm = tcs.walk_vm(V)
        moved, l2, flops = tcs.traffic(geo), tcs.traffic(geo, through_l2=True), tcs.mma_flops(geo)

        def part(prefix):  # the backward plan launching only the kernels named prefix...
            plan = copy.copy(bplan)
            plan._rt = Only(rt, lambda n: n.startswith(prefix))
            return plan
        pieces = {
            "walk": (f"walk ({tcs.walk_name('bf16', False, False, geo.walk, vm)})",
                     lambda: tcs.state_pass(walks, geo, k, v, g, False)),
            "scan": ("segment scan (glatc_scan)", lambda: tcs.state_pass(scans, geo, k, v, g, False)),
            "fwd_out": (f"forward output ({tcs.fwd_name('bf16', geo.km, False, geo.out)})", lambda: fplan.finish()),
            "walk_rev": (f"reverse walk ({tcs.walk_name('bf16', True, False, geo.walk, vm)})",
                         lambda: tcs.state_pass(walks, geo, q, do, g, True, scale, fplan.states.gseg)),
            "scan_rev": ("reverse segment scan", lambda: tcs.state_pass(scans, geo, q, do, g, True, scale,
                                                                       fplan.states.gseg)),
            "bwd": ("fused backward (glatc_bwd)" if geo.bwd == 1 else "tiled backward (glatc_bwd_kt + glatc_bwd_vt)",
                    lambda: bplan.finish()),
            "bwd_h0_dht": ("backward with h0 and dht (+2 glatc_combine)", lambda: bplan.finish(S0, S0)),
            "fwd_prepare": ("forward prepare (walk + scan)", lambda: gla_fwd_tc.fwd_tc_prepare(rt, q, k, v, g, scale)),
        }  # fmt: skip
        if geo.bwd == 2:
            kt, vt = (part(p) for p in ("glatc_bwd_kt", "glatc_bwd_vt"))
            pieces["bwd_kt"] = ("  dq, dk, dg (glatc_bwd_kt)", lambda: kt.finish())
            pieces["bwd_vt"] = ("  dv (glatc_bwd_vt)", lambda: vt.finish())
        bw = self.copy_Bps or 4.1e12
        for key, (name, fn) in pieces.items():
            extra = {}
            if key in moved:
                extra = {"GB": round(moved[key] / 1e9, 3), "floor_ms": round(moved[key] / bw * 1e3, 3),
                         "L2_GB": round(l2[key] / 1e9, 3), "GFLOP": round(flops[key] / 1e9, 2)}
            row[f"kernel {key}"] = self.guarded(f"  {name} [{tag}]", lambda fn=fn: self.ev(lambda i: fn(), sets=1),
                                                table="kernels", **extra)  # fmt: skip

    def fla_shape(self, shape, sets, row) -> None:
        torch, fla, cp = self.torch, self.fla, self.cp
        tag = tag_of(shape)
        scale = shape[3] ** -0.5
        tsets = [{n: self.to_torch(x[n]) for n in ("q", "k", "v", "g", "do")} for x in sets]

        def fla_fwd(i):
            t = tsets[i]
            return fla(t["q"], t["k"], t["v"], t["g"], scale=scale, output_final_state=False)

        row["fla fwd"] = self.guarded(f"fla chunk_gla fwd [{tag}]", lambda: self.ev(fla_fwd))
        gsets = []
        for ts in tsets:
            d = {n: ts[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g")}
            d["do"] = ts["do"]
            gsets.append(d)

        def fla_fb(i):
            d = gsets[i]
            o, _ = fla(d["q"], d["k"], d["v"], d["g"], scale=scale, output_final_state=False)
            torch.autograd.backward(o, d["do"])

        t1 = time.time()
        fla_fb(0)
        cp.cuda.Device().synchronize()
        row["fla first fwd+bwd s"] = round(time.time() - t1, 1)
        row["fla fwd+bwd"] = self.guarded(f"fla chunk_gla fwd+bwd [{tag}]", lambda: self.ev(fla_fb),
                                          first_call_s=row["fla first fwd+bwd s"])  # fmt: skip
        self.step(f"ours through hpczeco.torch vs fla {tag}", lambda: self.torch_vs_fla(shape, tsets, gsets, row))

        def vs_fla():
            from hpczeco.gpu import gla as G  # noqa: PLC0415

            o = G.chunk_gla(*(sets[0][n] for n in ("q", "k", "v", "g")), scale=scale)[0]
            of, _ = fla_fwd(0)
            torch.cuda.synchronize()
            row["o vs fla"] = rel(cp, o, cp.from_dlpack(of.detach().float().contiguous()))

        self.step(f"ours vs fla o {tag}", vs_fla)

    def torch_vs_fla(self, shape, tsets, gsets, row) -> None:
        """Ours through ``hpczeco.torch.chunk_gla`` and fla's ``chunk_gla``, both autograd on the same torch tensors,
        timed interleaved (CUDA events on torch's stream, median), and the peak memory of each forward+backward above
        what is allocated before it (torch's counter; CuPy's pool growth beside it)."""
        import hpczeco.torch as ht  # noqa: PLC0415

        from .bench_torch import time_cuda  # noqa: PLC0415

        torch, fla, cp = self.torch, self.fla, self.cp
        tag = tag_of(shape)
        scale = shape[3] ** -0.5

        def fwd(fn, i):
            t = tsets[i % 2]
            return fn(t["q"], t["k"], t["v"], t["g"], scale=scale, output_final_state=False)

        def fwd_bwd(fn, i):
            d = gsets[i % 2]
            o, _ = fn(d["q"], d["k"], d["v"], d["g"], scale=scale, output_final_state=False)
            torch.autograd.backward(o, d["do"])
            for n in ("q", "k", "v", "g"):
                d[n].grad = None

        calls = {"ours torch fwd": lambda: fwd(ht.chunk_gla, 0), "fla fwd (interleaved)": lambda: fwd(fla, 0),
                 "ours torch fwd+bwd": lambda: fwd_bwd(ht.chunk_gla, 0),
                 "fla fwd+bwd (interleaved)": lambda: fwd_bwd(fla, 0)}  # fmt: skip
        times = time_cuda(calls, repeats=self.reps, warmup=3)
        for name, sec in times.items():
            row[name] = sec * 1e3
            self.rec.timing(f"{name} [{tag}]", sec * 1e3)
        pool = cp.get_default_memory_pool()
        for name, fn in (("ours", ht.chunk_gla), ("fla", fla)):
            torch.cuda.synchronize()
            pool.free_all_blocks()
            cupy_before = pool.total_bytes()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd(fn, 0)
            torch.cuda.synchronize()
            row[f"{name} peak MB fwd+bwd"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row[f"{name} CuPy pool MB"] = (pool.total_bytes() - cupy_before) / 2**20
        for key in ("fwd", "fwd+bwd"):
            ours, theirs = row.get(f"ours torch {key}"), row.get(f"fla {key} (interleaved)")
            if ours and theirs:
                row[f"ours torch/fla {key}"] = ours / theirs
        self.rec.record({"shape": tag, **{k: v for k, v in row.items() if "torch" in k or "peak" in k
                                          or "interleaved" in k or "pool" in k}}, table="torch")  # fmt: skip

    # -------------------------------------------------------------------- variants
    def run_variants(self, shape) -> None:
        from hpczeco.gpu import gla_bwd_tc, gla_fwd_tc  # noqa: PLC0415
        from hpczeco.gpu import gla_tc_states as tcs  # noqa: PLC0415
        from hpczeco.gpu.gla_common import RUNTIME  # noqa: PLC0415

        cp, rec = self.cp, self.rec
        names = VARIANTS if self.args.variants == "all" else [v for v in self.args.variants.split(",") if v]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            rec.record({"step": "variants", "error": f"unknown variants {unknown}; known: {VARIANTS}"}, "failures")
        B, T, H, K, V = shape
        sets = [bench_inputs(cp, shape, self.seed + 100 + j) for j in range(2)]
        rt = RUNTIME.get()
        NC = tcs.chunks_per_segment(rt, B * H, -(-T // 64), K, V)
        table = {"default": ((), {}), "walk1": ((), {"walk": 1}), "walk1-ctas2": (("GW_MIN_CTAS=2",), {"walk": 1}),
                 "walk1-ctas4": (("GW_MIN_CTAS=4",), {"walk": 1}),
                 "nc2": ((), {"nc": 2 * NC}), "nc05": ((), {"nc": max(1, NC // 2)}), "f32": ((), {"f32_states": True}),
                 "out1": ((), {"out": 1}), "out2": ((), {"out": 2}), "tiled": ((), {"out": 3, "bwd": 2}),
                 "vpc1": ((), {"vpc": 1}), "kt64": ((), {"bwd": 2, "ktile": 64})}
        qkvg = [sets[0][n] for n in ("q", "k", "v", "g")]
        base = None
        for vname in ["default"] + [v for v in names if v in table]:
            defines, kw = table[vname]
            out: dict[str, Any] = {"variant": vname, "shape": tag_of(shape), "defines": " ".join(defines),
                                   "options": " ".join(f"{a}={b}" for a, b in kw.items())}
            try:
                r = variant_runtime(defines) if defines else rt
                plan = gla_fwd_tc.fwd_tc_prepare(r, *qkvg, **kw)
                o, ht = plan.finish(output_final_state=True)
                grads = gla_bwd_tc.bwd_tc(r, *qkvg, sets[0]["do"], fwd=plan)
                got = (o, ht) + tuple(grads)
                if base is None:
                    base = got
                else:
                    out["vs_default_max"] = max(rel(cp, a, b) for a, b in zip(got, base))
                    out["ok"] = bool(out["vs_default_max"] <= 1e-2)
                if self.args.check:  # the build on a small shape against float64 too
                    from . import gpu_gla_checks as chk  # noqa: PLC0415

                    out["small_ok"] = chk.record(rec, f"variant {vname}: small shape vs float64",
                                                 lambda r=r, kw=kw: chk.small_case(cp, r, *chk.VARIANT_SMALL,
                                                                                   self.seed + 300, **kw),
                                                 variant=vname)  # fmt: skip

                def fwd(i, r=r, kw=kw):
                    gla_fwd_tc.fwd_tc(r, *(sets[i][n] for n in ("q", "k", "v", "g")), **kw)

                def fb(i, r=r, kw=kw):
                    s = sets[i]
                    p = gla_fwd_tc.fwd_tc_prepare(r, *(s[n] for n in ("q", "k", "v", "g")), **kw)
                    p.finish()
                    gla_bwd_tc.bwd_tc(r, *(s[n] for n in ("q", "k", "v", "g")), s["do"], fwd=p)

                out["fwd_ms"] = self.ev(fwd)
                out["fwd_bwd_ms"] = self.ev(fb)
            except Exception as exc:  # noqa: BLE001
                out["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rec.record(out, table="variants")

    # -------------------------------------------------------------------- accuracy grid
    def grid_pairs(self) -> tuple[tuple[int, int], ...]:
        if not self.args.grid_kv:
            return GRID_KV
        want = {tuple(int(x) for x in item.split("x")) for item in self.args.grid_kv.split(",") if item}
        return tuple(p for p in GRID_KV if p in want)

    def grid_lengths(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.args.grid_t.split(",") if x) if self.args.grid_t else GRID_T

    def run_grid(self) -> None:
        kv, ts = self.grid_pairs(), self.grid_lengths()
        rng = np.random.default_rng(self.seed + 7)
        for K, V in kv:
            for T in ts:
                for gn in GRID_GN:
                    self.grid_case(T, K, V, gn, int(rng.integers(1 << 30)))

    def grid_case(self, T: int, K: int, V: int, gn: float, seed: int) -> None:
        cp, rec = self.cp, self.rec
        from hpczeco.gpu import gla as G  # noqa: PLC0415

        row: dict[str, Any] = {"T": T, "K": K, "V": V, "gn": gn}
        try:
            B, H = 2, 2
            rs = cp.random.RandomState(seed)
            u = lambda *s: rs.uniform(0.0, 1.0, s).astype(cp.float32)  # noqa: E731
            x = {"q": u(B, T, H, K), "k": u(B, T, H, K), "v": u(B, T, H, V)}
            x["g"] = (-cp.log1p(cp.exp(-u(B, T, H, K))) / cp.float32(gn)).astype(cp.float32)  # logsigmoid / gn
            x["do"] = normal32(rs, (B, T, H, V))
            d = {n: cp.ascontiguousarray(bf16.to_bits(a, xp=cp)) for n, a in x.items()}
            h0, dht = u(B, H, K, V), normal32(rs, (B, H, K, V))
            scale = K**-0.5
            args = [d[n] for n in ("q", "k", "v", "g", "do")]
            ref = recurrence64(cp, *args, scale, h0, dht)
            plan = G.chunk_gla_prepare(*args[:4], scale=scale)
            o, ht = plan.finish(h0, output_final_state=True)
            grads = G.chunk_gla_bwd_prepare(*args, scale=scale, fwd=plan).finish(h0, dht)
            row["impl"] = plan.impl
            ours = {n: rel(cp, m, r_) for n, m, r_ in zip(NAMES, (o, ht) + tuple(grads), ref)}
            row.update({f"ours {n}": e for n, e in ours.items()})
            row["targets ok"] = all(ours[n] <= TARGET[n] for n in NAMES)
            if self.fla is not None:
                torch = self.torch
                t = {n: self.to_torch(d[n]) for n in ("q", "k", "v", "g", "do")}
                xs = {n: t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g")}
                h0t = torch.from_dlpack(h0).clone().requires_grad_(True)
                of, hf = self.fla(xs["q"], xs["k"], xs["v"], xs["g"], scale=scale, initial_state=h0t,
                                  output_final_state=True)  # fmt: skip
                torch.autograd.backward((of, hf), (t["do"], torch.from_dlpack(dht)))
                got = [of, hf, xs["q"].grad, xs["k"].grad, xs["v"].grad, xs["g"].grad, h0t.grad]
                theirs = {n: rel(cp, cp.from_dlpack(m.detach().float().contiguous()), r_)
                          for n, m, r_ in zip(NAMES, got, ref)}
                row.update({f"fla {n}": e for n, e in theirs.items()})
                row["vs fla ok"] = all(ours[n] <= VS_FLA * theirs[n] + VS_FLA_SLACK for n in NAMES)
                row["worst ours/fla"] = max(ours[n] / max(theirs[n], 1e-12) for n in NAMES)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rec.record(row, table="grid")
        cp.get_default_memory_pool().free_all_blocks()

    # -------------------------------------------------------------------- the table
    def table(self) -> str:
        lines = ["", "==== hpczeco bench gpu-gla (bf16, ms: CUDA events, median; one process) ===="]
        head = (f"{'shape':32s} {'ours fwd':>9s} {'fla fwd':>9s} {'ratio':>6s} {'ours f+b':>9s} {'fla f+b':>9s} "
                f"{'ratio':>6s} {'f+b recomp':>10s}")  # fmt: skip
        lines.append(head)
        fmt = lambda x, w=9, p=3: (f"{x:{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}s}")  # noqa: E731
        for tag, r in self.summary.items():
            lines.append(f"{tag:32s} {fmt(r.get('ours fwd'))} {fmt(r.get('fla fwd'))} "
                         f"{fmt(r.get('ours/fla fwd'), 6, 2)} {fmt(r.get('ours fwd+bwd'))} {fmt(r.get('fla fwd+bwd'))} "
                         f"{fmt(r.get('ours/fla fwd+bwd'), 6, 2)} {fmt(r.get('ours fwd+bwd (recomputed)'), 10)}")
        lines.append("targets (issue 14): fwd ratio <= 0.8, fwd+bwd ratio <= 1.0")
        if any("ours torch fwd" in r for r in self.summary.values()):
            lines += ["", "through autograd on the same torch tensors, interleaved (hpczeco.torch.chunk_gla vs fla "
                      "chunk_gla; peak: torch.cuda.max_memory_allocated above the inputs, MB):",
                      f"{'shape':32s} {'ours fwd':>9s} {'fla fwd':>9s} {'ratio':>6s} {'ours f+b':>9s} {'fla f+b':>9s} "
                      f"{'ratio':>6s} {'ours peak':>10s} {'fla peak':>10s} {'CuPy pool':>10s}"]
            for tag, r in self.summary.items():
                if "ours torch fwd" not in r:
                    continue
                lines.append(f"{tag:32s} {fmt(r.get('ours torch fwd'))} {fmt(r.get('fla fwd (interleaved)'))} "
                             f"{fmt(r.get('ours torch/fla fwd'), 6, 2)} {fmt(r.get('ours torch fwd+bwd'))} "
                             f"{fmt(r.get('fla fwd+bwd (interleaved)'))} {fmt(r.get('ours torch/fla fwd+bwd'), 6, 2)} "
                             f"{fmt(r.get('ours peak MB fwd+bwd'), 10, 0)} {fmt(r.get('fla peak MB fwd+bwd'), 10, 0)} "
                             f"{fmt(r.get('ours CuPy pool MB'), 10, 0)}")
            lines.append("targets (issue 29): fwd <= 0.5 (K=V=128), 0.45 (K=V=64), 0.8 (K=256 V=512, K=128 V=256); "
                         "fwd+bwd <= 0.6, 0.45, 0.8; peak <= fla's")
        lines.append("")
        lines.append(f"{'shape':32s} {'floor fwd':>10s} {'moved fwd':>10s} {'floor f+b':>10s} {'moved f+b':>10s}"
                     "   (GB; ms at the measured copy bandwidth)")
        for tag, r in self.summary.items():
            if "floor_fwd_GB" not in r:
                continue
            lines.append(f"{tag:32s} {r['floor_fwd_GB']:5.2f}/{r['floor_fwd_ms']:4.2f} "
                         f"{r['moved_fwd_GB']:5.2f}/{r['moved_fwd_ms']:4.2f} "
                         f"{r['floor_fwdbwd_GB']:5.2f}/{r['floor_fwdbwd_ms']:4.2f} "
                         f"{r['moved_fwdbwd_GB']:5.2f}/{r['moved_fwdbwd_ms']:4.2f}")
        impl_rows = [(tag, k, v) for tag, r in self.summary.items() for k, v in r.items() if k.startswith("impl=")]
        if impl_rows:
            lines += ["", "other impls (--impls; ms):"]
            lines += [f"  {tag:32s} {k:22s} {fmt(v)}" for tag, k, v in impl_rows]
        kernels = self.rec.tables.get("kernels", [])
        if kernels:
            lines += ["", "per kernel (ms; GB moved; ms at copy bandwidth):"]
            for k in kernels:
                ms = "n/a" if k.get("median_ms") is None else f"{k['median_ms']:8.3f}"
                extra = f"  {k['GB']:6.3f} GB  floor {k['floor_ms']:6.3f}" if "GB" in k else ""
                extra += f"  L2 {k['L2_GB']:6.3f} GB  {k['GFLOP']:6.1f} GFLOP" if "L2_GB" in k else ""
                lines.append(f"  {k['name']:75s} {ms}{extra}")
        var = self.rec.tables.get("variants", [])
        if var:
            lines += ["", "variants (first shape): " + ", ".join(
                f"{v['variant']} fwd {fmt(v.get('fwd_ms'), 0)} f+b {fmt(v.get('fwd_bwd_ms'), 0)}"
                + ("" if v.get("ok", True) else " (DIFFERS)") + (" (error)" if "error" in v else "") for v in var)]
        grid = self.rec.tables.get("grid", [])
        if grid:
            ok_t = sum(bool(r.get("targets ok")) for r in grid)
            lines += ["", f"accuracy grid: {ok_t}/{len(grid)} cases within the targets"]
            if any("vs fla ok" in r for r in grid):
                ok_f = sum(bool(r.get("vs fla ok")) for r in grid)
                lines.append(f"               {ok_f}/{len(grid)} cases with ours <= {VS_FLA} x fla + {VS_FLA_SLACK}")
            worst = max(grid, key=lambda r: max((r.get(f"ours {n}", 0.0) for n in NAMES), default=0.0))
            lines.append("  worst case: " + " ".join(f"{k}={_short(v)}" for k, v in worst.items()))
            bad = [r for r in grid if not r.get("targets ok") or r.get("vs fla ok") is False or "error" in r]
            for r in bad[:20]:
                lines.append("  FAIL " + " ".join(f"{k}={_short(v)}" for k, v in r.items()))
        fails = self.rec.tables.get("failures", [])
        checks = self.rec.tables.get("checks", [])
        device = self.rec.tables.get("device_checks", [])
        if device:
            n_ok = sum(bool(c.get("ok")) for c in device)
            lines += ["", f"device checks (--check, vs float64): {n_ok}/{len(device)} passed"]
            for c in device:
                if not c.get("ok"):
                    lines.append(f"  FAIL {c['check']}: {c.get('why') or c.get('error', '')}")
        lines.append("")
        lines.append(f"checks vs simt: {sum(bool(c.get('ok')) for c in checks)}/{len(checks)} ok; "
                     f"failed steps: {len(fails)}" + ("" if not fails else " (" + "; ".join(
                         f["step"] for f in fails[:8]) + ")"))  # fmt: skip
        return "\n".join(lines)


def _short(v: Any) -> str:
    return f"{v:.2e}" if isinstance(v, float) else str(v)


def run(args) -> int:
    import cupy as cp  # noqa: PLC0415

    seed = int(args.seed if args.seed is not None else time.time_ns() % 2**31)
    rec = benchkit.Recorder(args.out, STEM, info=benchkit.environment(("numpy", "cupy"), gpu=True))
    rec.info.update(seed=seed, args=vars(args))
    rec.say(f"bench gpu-gla: seed {seed}")
    try:
        shapes = parse_shapes(args.shapes)[: 1 if args.quick else None]
        check_impls(args.impls)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    b = Bench(args, rec, cp, seed)
    b.step("setup", b.setup)
    if b.fla is not None and args.fla_jobs:
        b.step("fla precompile", lambda: b.fla_precompile(shapes))
    b.step("compile", b.compile_kernels)
    if args.check:
        b.step("device checks", b.device_checks)
    for shape in shapes:
        b.step(f"shape {tag_of(shape)}", lambda shape=shape: b.run_shape(shape))
        b.step("free memory", b.free)
    if args.variants and shapes:
        b.step("variants", lambda: b.run_variants(shapes[0]))
        b.step("free memory", b.free)
    if args.grid:
        b.step("grid", b.run_grid)
    rec.info["summary"] = b.summary
    rec.finish(text=rec.text() + "\n" + b.table())
    if args.check:
        checks = rec.tables.get("device_checks", [])
        return 0 if checks and all(c.get("ok") for c in checks) else 1
    return 0
