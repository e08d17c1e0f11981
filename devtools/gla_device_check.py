"""Device check of the chunk-parallel tensor-core GLA kernels (gpu/gla_tc_states.cu, gla_fwd_tc.cu, gla_bwd_tc.cu)
on one GPU: NVRTC build (CuPy RawModule, the same sources), correctness, timings, a short table last.

    python3 devtools/gla_device_check.py --out $OUT                  # ~2-3 min: checks + timings, no fla
    python3 devtools/gla_device_check.py --out $OUT --fla            # + fla 0.6 fwd, fwd+bwd (first call ~150 s)
    python3 devtools/gla_device_check.py --out $OUT --variants all   # + build options, the fastest correct one wins
    python3 devtools/gla_device_check.py --out $OUT --grid [--fla]   # + accuracy on fla's test grid

fla autotunes its backward once per (K, V) (~150-200 s the first time): with a tight budget run
``--fla --shapes 0,1`` and ``--fla --shapes 2`` as separate calls. ``--no-existing`` skips the old hpczeco path
(its NVRTC build and timings), ``--no-fp16`` the fp16 build and checks.

Steps (each in try/except: a failure is recorded and the run goes on):
1. build the bf16 (and fp16) kernels; a CuPy float64 recurrence is checked against hpczeco.gla's CPU one;
2. small shapes against the float64 CPU recurrences (hpczeco.gla.recurrent_gla / recurrent_gla_bwd): RMS error
   ratio ||ours - ref|| / ||ref||, targets o <= 4e-3, final state and gradients <= 5e-3 (issue 14); T off the
   chunk, T = 1, K != V, strong gates, h0, dht, several segments, 16-bit / fp32 chunk states, fp16; the
   prepare/finish split over two slices as two ZeCO ranks;
3. the bench shapes (B=1 T=32768 H=16 K=V=128; B=8 T=4096 H=16 K=V=128; B=1 T=32768 H=32 K=V=64, bf16): ours
   against the existing path (hpczeco.gpu.gla: tensor-core forward, simt backward), <= 1e-2;
4. timings (CUDA events, 3 warm-up calls, median of 20, two input sets alternating): ours forward, backward,
   forward+backward (the backward reusing the forward's chunk states, and not), per-kernel breakdown; the
   existing forward and forward+backward; fla (with --fla); a 1 GiB device copy (bandwidth ceiling);
5. --variants: the former state walk (walk=1), chunks per segment x2 / x0.5, walk 1's register cap
   (-DGW_MIN_CTAS=2 / 4), fp32 chunk states: each
   checked (small shape vs float64, bench shape vs the base build) and timed (fwd+bwd), the fastest correct kept;
6. --grid: T = 1, 63, 777, 1000, 1024, 2048; (K, V) in (64|128)^2; gate normaliser 0.1, 1, 10; h0 and dht;
   B = H = 2: ours (and fla with --fla) against a CuPy float64 recurrence.
JSON (every record, rewritten after each) in OUT/gla_device_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # hpczeco/__init__.py maps base/, gpu/ ... of a source checkout

import numpy as np  # noqa: E402

# the bench's CuPy helpers: bf16 bits -> float32, and the float64 recurrences on the device
from hpczeco.drivers.bench_gpu_gla import f32_of  # noqa: E402
from hpczeco.drivers.bench_gpu_gla import recurrence64 as ref64_gpu  # noqa: E402

TARGET = {"o": 4e-3, "ht": 5e-3, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3, "dg": 5e-3, "dh0": 5e-3}
BENCH = [(1, 32768, 16, 128, 128), (8, 4096, 16, 128, 128), (1, 32768, 32, 64, 64)]
SMALL = [  # B, T, H, K, V, strong gates, chunks per segment (None: automatic), fp32 chunk states
    (1, 1, 1, 16, 32, False, None, False), (2, 63, 2, 64, 64, False, None, False),
    (1, 130, 2, 32, 48, True, 1, False), (1, 300, 2, 128, 128, False, 2, False),
    (1, 300, 1, 128, 64, True, 1, True), (2, 777, 1, 64, 128, False, 3, False),
    (1, 1000, 2, 128, 128, False, None, False),
]  # fmt: skip
SMALL_FP16 = [(1, 130, 2, 64, 64, False, 1, None), (1, 300, 1, 128, 128, True, None, None)]
TWO_SLICES = (1, 300, 2, 64, 64, 137)  # B, T, H, K, V, cut
VARIANT_SMALL = (1, 300, 2, 64, 64)
GRID_T = (1, 63, 777, 1000, 1024, 2048)  # fla's tests/ops/test_gla.py grid (K = 60 is not a tensor-core size)
GRID_KV = ((64, 64), (64, 128), (128, 64), (128, 128))
GRID_GN = (0.1, 1.0, 10.0)  # gate normaliser: g = logsigmoid(x) / gn


# ------------------------------------------------------------------------------------------------ records


class Report:
    def __init__(self, out: Path):
        self.out, self.t0 = out, time.time()
        self.data: dict[str, Any] = {"info": {}, "checks": [], "timings": [], "grid": [], "variants": []}

    def say(self, *a: Any) -> None:
        print(f"[{time.time() - self.t0:6.1f}s]", *a, flush=True)

    def save(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gla_device_check.json").write_text(json.dumps(self.data, indent=1, default=str))
        except Exception as exc:  # noqa: BLE001
            print("could not write JSON:", exc, flush=True)

    def check(self, name: str, fn, tol: dict | float | None = None) -> dict:
        """fn() -> {metric: error}; pass if every metric <= its tolerance (TARGET entries by default)."""
        t = time.time()
        rec: dict[str, Any] = {"name": name}
        try:
            errs = fn()
            rec["errors"] = {k: float(v) for k, v in errs.items()}
            bad = []
            for k, v in errs.items():
                lim = tol if isinstance(tol, float) else (tol or TARGET).get(k, 5e-3)
                if not (v <= lim):  # NaN fails
                    bad.append(f"{k}={v:.2e}>{lim:.0e}")
            rec["ok"] = not bad
            rec["why"] = ", ".join(bad)
        except Exception as exc:  # noqa: BLE001
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
        rec["s"] = round(time.time() - t, 2)
        self.data["checks"].append(rec)
        errs = " ".join(f"{k}={v:.2e}" for k, v in rec.get("errors", {}).items())
        self.say(("PASS" if rec["ok"] else "FAIL"), name, errs, rec.get("why", ""), rec.get("error", "")[:300])
        self.save()
        return rec

    def timing(self, name: str, fn, **extra: Any) -> float | None:
        rec: dict[str, Any] = {"name": name, **extra}
        try:
            rec["ms"] = float(fn())
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rec["trace"] = traceback.format_exc()[-2000:]
        self.data["timings"].append(rec)
        self.say("TIME", name, f"{rec['ms']:.3f} ms" if "ms" in rec else rec["error"][:300])
        self.save()
        return rec.get("ms")


# ------------------------------------------------------------------------------------------------ runtime


class NvrtcRuntime:
    """The kernel runtime of hpczeco.gpu.gla_tc_states on CuPy: one RawModule per (type, state storage) group and
    define set, compiled on first use; ``launch`` raises the dynamic shared-memory limit where needed. With ``base``
    and ``own``, kernels ``own(name)`` rejects run on ``base`` (a variant rebuilds only what its defines change)."""

    def __init__(self, cp: Any, defines: tuple[str, ...] = (), base: Any = None, own: Any = None):
        from hpczeco.gpu import gla_tc_states as st  # noqa: PLC0415
        from hpczeco.gpu.runtime import kernel_source  # noqa: PLC0415

        self.xp, self.st, self.defines, self.base, self.own = cp, st, tuple(defines), base, own
        self.mods: dict[str, Any] = {}
        self.fns: dict[str, Any] = {}
        self.smem: dict[str, int] = {}
        self.compile_s: dict[str, float] = {}
        self.source = kernel_source(st.KERNEL_FILES)

    @staticmethod
    def group(name: str) -> str:
        if "<" not in name:
            return "common"
        args = [a.strip() for a in name[name.index("<") + 1 : name.rindex(">")].split(",")]
        return f"{args[0]}-{args[2]}"  # type and fp32-state flag (the third template argument of every glatc_*)

    def _names(self, group: str) -> list[str]:
        if group == "common":
            return ["glatc_scan", "glatc_combine"]
        t, f = group.split("-")
        names = self.st.kernel_names((t,), (64, 128), (f == "true",))[2:]
        return [n for n in names if self.own is None or self.own(n)]

    def fn(self, name: str):
        f = self.fns.get(name)
        if f is None:
            g = self.group(name)
            t = time.time()
            if g not in self.mods:
                self.mods[g] = self.xp.RawModule(
                    code=self.source,
                    options=("-std=c++17", "--use_fast_math") + tuple(f"-D{d}" for d in self.defines),
                    name_expressions=self._names(g),
                )
            f = self.fns[name] = self.mods[g].get_function(name)  # the first call compiles the module
            self.compile_s[g] = self.compile_s.get(g, 0.0) + round(time.time() - t, 1)
        return f

    def launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
        if self.base is not None and self.own is not None and not self.own(name):
            self.base.launch(name, grid, block, args, shared_mem)
            return
        f = self.fn(name)
        if shared_mem > 48 * 1024 and self.smem.get(name, 0) < shared_mem:
            f.max_dynamic_shared_size_bytes = shared_mem
            self.smem[name] = shared_mem
        conv = tuple(np.uint64(0) if a is None else a for a in args)
        f(tuple(int(x) for x in grid), tuple(int(x) for x in block), conv, shared_mem=shared_mem)

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data.ptr)

    @staticmethod
    def is_native(x: Any) -> bool:
        return type(x).__module__.startswith("cupy")


class Filtered:
    """A view of a runtime that launches only the kernels ``keep(name)`` accepts (timing one kernel of a pass)."""

    def __init__(self, rt: NvrtcRuntime, keep):
        self._rt, self._keep, self.xp = rt, keep, rt.xp

    def launch(self, name, grid, block, args, shared_mem=0):
        if self._keep(name):
            self._rt.launch(name, grid, block, args, shared_mem)

    def ptr(self, x):
        return self._rt.ptr(x)


# ------------------------------------------------------------------------------------------------ helpers


def bits_of(cp, x32):
    """bf16 bit patterns (uint16) of a finite float32 CuPy array (round to nearest even)."""
    u = x32.view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)


def gpu_inputs(cp, B, T, H, K, V, seed, dtype="bf16", normalizer=1.0, strong=False):
    """q, k, v, g, do in the kernel dtype (uint16 bf16 bits or float16) and fp32 h0, dht, on the device."""
    rs = cp.random.RandomState(seed)
    f = lambda *s: rs.standard_normal(s, dtype=cp.float32)  # noqa: E731
    q, k, v, do = f(B, T, H, K), f(B, T, H, K), f(B, T, H, V), f(B, T, H, V)
    x = f(B, T, H, K)
    g = (-cp.log1p(cp.exp(-x)) / cp.float32(normalizer)).astype(cp.float32)  # logsigmoid / normaliser
    if strong:
        g = cp.where(rs.uniform(size=g.shape) < 0.5, -rs.uniform(4.0, 8.0, g.shape), g).astype(cp.float32)
    conv = (lambda a: bits_of(cp, a)) if dtype == "bf16" else (lambda a: a.astype(cp.float16))
    d = {n: cp.ascontiguousarray(conv(a)) for n, a in (("q", q), ("k", k), ("v", v), ("g", g), ("do", do))}
    d["h0"], d["dht"] = f(B, H, K, V), f(B, H, K, V)
    return d


def rel_gpu(cp, a, b) -> float:
    a, b = f32_of(cp, a).astype(cp.float64), b.astype(cp.float64)
    if not bool(cp.isfinite(a).all()):
        return float("nan")
    return float(cp.linalg.norm(a - b) / max(float(cp.linalg.norm(b)), 1e-300))


def cuda_time(cp, fn, reps=20, warmup=3, sets=2) -> float:
    for i in range(warmup):
        fn(i % sets)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(reps):
        start.record()
        fn(i % sets)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "gla_device_check_out"))
    p.add_argument("--fla", action="store_true", help="time flash-linear-attention (first fwd+bwd autotunes)")
    p.add_argument("--variants", default="", help="'all' or a comma list of: walk1,nc2,nc05,ctas2,ctas4,f32")
    p.add_argument("--grid", action="store_true", help="accuracy on fla's test grid (CuPy float64 reference)")
    p.add_argument("--shapes", default="0,1,2", help="indices into the bench shapes to run")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-fp16", action="store_true")
    p.add_argument("--no-existing", action="store_true", help="skip hpczeco.gpu.gla (the old tc/simt path)")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args(argv)
    R = Report(Path(a.out))
    import cupy as cp  # noqa: PLC0415
    from hpczeco.base import bf16  # noqa: PLC0415
    from hpczeco.gpu import gla_bwd_tc, gla_fwd_tc  # noqa: PLC0415
    from hpczeco.gpu import gla_tc_states as st  # noqa: PLC0415

    from hpczeco.gla import recurrent_gla, recurrent_gla_bwd  # noqa: PLC0415

    seed = int(a.seed if a.seed is not None else time.time_ns() % 2**31)
    rng = np.random.default_rng(seed)
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    R.data["info"].update(
        seed=seed, cupy=cp.__version__, device=name.decode() if isinstance(name, bytes) else str(name),
        sms=dev.attributes["MultiProcessorCount"], smem_optin=props.get("sharedMemPerBlockOptin"), args=vars(a),
    )  # fmt: skip
    R.say("device", R.data["info"]["device"], "seed", seed)
    rt = NvrtcRuntime(cp)

    # ---- 1. builds, copy bandwidth, the GPU float64 reference -------------------------------------------------
    for nm in ("glatc_scan", st.bwd_name("bf16", 128, False), st.bwd_name("f16", 128, True)):
        if rt.group(nm).startswith("f16") and a.no_fp16:
            continue
        R.check(f"NVRTC build of the {rt.group(nm)} kernels", lambda nm=nm: (rt.fn(nm), {})[1])
    R.data["info"]["compile_s"] = dict(rt.compile_s)

    def copy_bw():
        x = cp.empty(1 << 28, dtype=cp.float32)  # 1 GiB
        y = cp.empty_like(x)
        ms = cuda_time(cp, lambda i: y.__setitem__(Ellipsis, x), reps=10, sets=1)
        R.data["info"]["copy_TBps"] = 2 * x.nbytes / (ms * 1e-3) / 1e12
        return ms

    R.timing("device copy 1 GiB (read + write)", copy_bw)

    def ref_check():
        B, T, H, K, V = 1, 50, 2, 32, 16
        d = gpu_inputs(cp, B, T, H, K, V, seed + 1)
        x64 = [bf16.from_bits(cp.asnumpy(d[n])).astype(np.float64) for n in ("q", "k", "v", "g", "do")]
        h0, dht = cp.asnumpy(d["h0"]).astype(np.float64), cp.asnumpy(d["dht"]).astype(np.float64)
        ro, rht = recurrent_gla(*x64[:4], scale=0.3, initial_state=h0, output_final_state=True)
        rg = recurrent_gla_bwd(*x64, scale=0.3, initial_state=h0, dht=dht)
        mine = ref64_gpu(cp, *(d[n] for n in ("q", "k", "v", "g", "do")), 0.3, d["h0"], d["dht"])
        names = ("o", "ht", "dq", "dk", "dv", "dg", "dh0")
        return {n: float(np.linalg.norm(cp.asnumpy(m) - r) / np.linalg.norm(r))
                for n, m, r in zip(names, mine, (ro, rht) + tuple(rg))}  # fmt: skip

    R.check("CuPy float64 recurrence == hpczeco.gla's CPU recurrence", ref_check, 1e-10)

    # ---- 2. small shapes against the float64 CPU recurrences ---------------------------------------------------
    def host(d, n):
        x = cp.asnumpy(d[n])
        return (bf16.from_bits(x) if x.dtype == np.uint16 else x.astype(np.float32)).astype(np.float64)

    def small_case(B, T, H, K, V, strong, nc, f32s, dtype="bf16", runtime=None):
        r = runtime or rt
        d = gpu_inputs(cp, B, T, H, K, V, int(rng.integers(1 << 30)), dtype, strong=strong)
        x64 = [host(d, n) for n in ("q", "k", "v", "g", "do")]
        h0, dht = cp.asnumpy(d["h0"]).astype(np.float64), cp.asnumpy(d["dht"]).astype(np.float64)
        o, ht = gla_fwd_tc.fwd_tc(r, d["q"], d["k"], d["v"], d["g"], initial_state=d["h0"], output_final_state=True,
                                  nc=nc, f32_states=f32s)  # fmt: skip
        grads = gla_bwd_tc.bwd_tc(r, d["q"], d["k"], d["v"], d["g"], d["do"], initial_state=d["h0"], dht=d["dht"],
                                  nc=nc, f32_states=f32s)  # fmt: skip
        ro, rht = recurrent_gla(*x64[:4], initial_state=h0, output_final_state=True)
        rg = recurrent_gla_bwd(*x64, initial_state=h0, dht=dht)
        errs = {}
        for n, m, ref in zip(("o", "ht", "dq", "dk", "dv", "dg", "dh0"), (o, ht) + tuple(grads), (ro, rht) + tuple(rg)):
            mm = cp.asnumpy(f32_of(cp, m)).astype(np.float64)
            errs[n] = float(np.linalg.norm(mm - ref) / np.linalg.norm(ref)) if np.isfinite(mm).all() else float("nan")
        return errs

    for c in SMALL:
        R.check(f"bf16 vs float64: B={c[0]} T={c[1]} H={c[2]} K={c[3]} V={c[4]} strong={c[5]} nc={c[6]} f32s={c[7]}",
                lambda c=c: small_case(*c))  # fmt: skip
    if not a.no_fp16:
        for c in SMALL_FP16:
            R.check(f"fp16 vs float64: T={c[1]} K={c[3]} V={c[4]} strong={c[5]}",
                    lambda c=c: small_case(*c, dtype="f16"))  # fmt: skip

    def two_slices():
        B, T, H, K, V, cut = TWO_SLICES
        d = gpu_inputs(cp, B, T, H, K, V, int(rng.integers(1 << 30)), strong=True)
        x64 = [host(d, n) for n in ("q", "k", "v", "g", "do")]
        h0, dht = d["h0"], d["dht"]
        h064, dht64 = cp.asnumpy(h0).astype(np.float64), cp.asnumpy(dht).astype(np.float64)
        ro, rht = recurrent_gla(*x64[:4], initial_state=h064, output_final_state=True)
        rg = recurrent_gla_bwd(*x64, initial_state=h064, dht=dht64)
        part = [[cp.ascontiguousarray(d[n][:, s_]) for n in ("q", "k", "v", "g", "do")]
                for s_ in (slice(0, cut), slice(cut, T))]  # fmt: skip
        fw = [gla_fwd_tc.fwd_tc_prepare(rt, *pp[:4], nc=1) for pp in part]
        s_in1 = fw[0].decay[..., None] * h0 + fw[0].local_final_state
        o0, _ = fw[0].finish(h0)
        o1, fin = fw[1].finish(s_in1, output_final_state=True)
        bw = [gla_bwd_tc.bwd_tc_prepare(rt, *pp, nc=1) for pp in part]
        d0 = bw[1].decay[..., None] * dht + bw[1].dh0_local
        g0, g1 = bw[0].finish(h0, d0), bw[1].finish(s_in1, dht)
        got = [cp.concatenate([o0, o1], axis=1), fin] + [cp.concatenate([g0[i], g1[i]], axis=1) for i in range(4)]
        got.append(g0[4])
        errs = {}
        for n, m, ref in zip(("o", "ht", "dq", "dk", "dv", "dg", "dh0"), got, (ro, rht) + tuple(rg)):
            mm = cp.asnumpy(f32_of(cp, m)).astype(np.float64)
            errs[n] = float(np.linalg.norm(mm - ref) / np.linalg.norm(ref))
        return errs

    R.check("prepare/finish over two slices (ZeCO composition), bf16, strong gates", two_slices)

    # ---- 3./4. bench shapes: checks against the existing path, timings -----------------------------------------
    G = None
    if not a.no_existing:
        try:
            from hpczeco.gpu import gla as G  # noqa: PLC0415
        except Exception as exc:  # noqa: BLE001
            R.say("existing hpczeco.gpu.gla not importable:", exc)
    fla = torch = None
    if a.fla:
        try:
            import torch  # noqa: PLC0415
            from fla.ops.gla import chunk_gla as fla  # noqa: PLC0415

            R.data["info"]["torch"] = torch.__version__
        except Exception as exc:  # noqa: BLE001
            R.say("fla not importable:", exc)
            fla = None

    def to_torch(x):
        return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)

    def ours_fwd(r, d, **kw):
        return gla_fwd_tc.fwd_tc(r, d["q"], d["k"], d["v"], d["g"], **kw)

    def ours_fb(r, d, reuse=True, **kw):
        plan = gla_fwd_tc.fwd_tc_prepare(r, d["q"], d["k"], d["v"], d["g"], **kw)
        o, _ = plan.finish()
        grads = gla_bwd_tc.bwd_tc(r, d["q"], d["k"], d["v"], d["g"], d["do"], fwd=plan if reuse else None, **kw)
        return o, grads

    summary: dict[str, dict] = {}
    shapes = [BENCH[int(i)] for i in a.shapes.split(",") if i.strip()]

    def run_shape(si: int, B: int, T: int, H: int, K: int, V: int) -> None:
        tag = f"B={B} T={T} H={H} K={K} V={V}"
        row = summary.setdefault(tag, {})
        try:
            sets = [gpu_inputs(cp, B, T, H, K, V, seed + 100 + j) for j in range(2)]
        except Exception as exc:  # noqa: BLE001
            R.say("inputs failed", tag, exc)
            return
        scale = K**-0.5
        n_in = (3 * B * T * H * K + 2 * B * T * H * V) * 2
        R.data["info"][f"bytes {tag}"] = {"fwd_min": n_in, "bwd_min": n_in + (3 * B * T * H * K + B * T * H * V) * 2}
        qkvgd = ("q", "k", "v", "g", "do")

        def vs_existing():
            d, errs = sets[0], {}
            o, _ = ours_fwd(rt, d)
            o_ex, _ = G.chunk_gla(d["q"], d["k"], d["v"], d["g"], impl="simt")
            errs["o"] = rel_gpu(cp, o, f32_of(cp, o_ex))
            grads = gla_bwd_tc.bwd_tc(rt, *(d[n] for n in qkvgd))
            ref = G.chunk_gla_bwd(*(d[n] for n in qkvgd))
            for n, m, r_ in zip(("dq", "dk", "dv", "dg", "dh0"), grads, ref):
                errs[n] = rel_gpu(cp, m, f32_of(cp, r_))
            return errs

        if G is not None:
            R.check(f"ours vs existing path (simt), bench {tag}", vs_existing, 1e-2)
        row["ours fwd"] = R.timing(f"ours fwd [{tag}]", lambda: cuda_time(cp, lambda i: ours_fwd(rt, sets[i]), a.reps))
        row["ours bwd"] = R.timing(
            f"ours bwd [{tag}]",
            lambda: cuda_time(cp, lambda i: gla_bwd_tc.bwd_tc(rt, *(sets[i][n] for n in qkvgd)), a.reps),
        )
        row["ours fwd+bwd"] = R.timing(
            f"ours fwd+bwd, states reused [{tag}]", lambda: cuda_time(cp, lambda i: ours_fb(rt, sets[i]), a.reps)
        )
        row["ours fwd+bwd (no reuse)"] = R.timing(
            f"ours fwd+bwd, states recomputed [{tag}]",
            lambda: cuda_time(cp, lambda i: ours_fb(rt, sets[i], reuse=False), a.reps),
        )
        if si == 0:  # per-kernel breakdown at the first shape
            d0 = sets[0]
            geo = st.geometry(rt, B, T, H, K, V, "bf16", None, None)
            R.data["info"]["NC"] = geo.NC
            fplan = gla_fwd_tc.fwd_tc_prepare(rt, d0["q"], d0["k"], d0["v"], d0["g"])
            bplan = gla_bwd_tc.bwd_tc_prepare(rt, *(d0[n] for n in qkvgd))
            walks = Filtered(rt, lambda n: n.startswith("glatc_walk"))
            scans = Filtered(rt, lambda n: n == "glatc_scan")
            pieces = {
                f"walk fwd ({st.walk_name('bf16', False, False, geo.walk, st.km_of(16, V))})": lambda: st.state_pass(
                    walks, geo, d0["k"], d0["v"], d0["g"], False),
                "segment scan (glatc_scan)": lambda: st.state_pass(scans, geo, d0["k"], d0["v"], d0["g"], False),
                f"walk rev ({st.walk_name('bf16', True, False, geo.walk, st.km_of(16, V))})": lambda: st.state_pass(
                    walks, geo, d0["q"], d0["do"], d0["g"], True, scale, fplan.states.gseg),
                "fwd output (glatc_fwd_out)": lambda: fplan.finish(),
                "bwd fused (glatc_bwd)": lambda: bplan.finish(),
                "bwd fused with h0 and dht (+2 glatc_combine)": lambda: bplan.finish(d0["h0"], d0["dht"]),
                "fwd prepare (walk + scan + decay)": lambda: gla_fwd_tc.fwd_tc_prepare(
                    rt, d0["q"], d0["k"], d0["v"], d0["g"]),
            }  # fmt: skip
            for pname, pf in pieces.items():
                row[pname] = R.timing(f"  {pname} [{tag}]", lambda pf=pf: cuda_time(cp, lambda i: pf(), a.reps, sets=1))
        if G is not None:
            row["existing fwd"] = R.timing(
                f"existing fwd (hpczeco.gpu.gla simt) [{tag}]",
                lambda: cuda_time(cp, lambda i: G.chunk_gla(*(sets[i][n] for n in qkvgd[:4]), impl="simt"), a.reps),
            )

            def ex_fb(i):
                G.chunk_gla(*(sets[i][n] for n in qkvgd[:4]))
                G.chunk_gla_bwd(*(sets[i][n] for n in qkvgd))

            row["existing fwd+bwd"] = R.timing(
                f"existing fwd+bwd [{tag}]", lambda: cuda_time(cp, ex_fb, max(5, a.reps // 2))
            )
        if fla is not None:
            try:
                tsets = [{n: to_torch(x[n]) for n in qkvgd} for x in sets]

                def fla_fwd(i):
                    t = tsets[i]
                    return fla(t["q"], t["k"], t["v"], t["g"], scale=scale, output_final_state=False)

                row["fla fwd"] = R.timing(f"fla 0.6 chunk_gla fwd [{tag}]", lambda: cuda_time(cp, fla_fwd, a.reps))

                def vs_fla():
                    o, _ = ours_fwd(rt, sets[0])
                    of, _ = fla_fwd(0)
                    torch.cuda.synchronize()
                    return {"o": rel_gpu(cp, o, cp.from_dlpack(of.float().contiguous()))}

                R.check(f"ours vs fla forward [{tag}]", vs_fla, 1e-2)
                gsets = []
                for ts in tsets:
                    dd = {n: ts[n].detach().clone().requires_grad_(True) for n in qkvgd[:4]}
                    dd["do"] = ts["do"]
                    gsets.append(dd)

                def fla_fb(i):
                    dd = gsets[i]
                    o, _ = fla(dd["q"], dd["k"], dd["v"], dd["g"], scale=scale, output_final_state=False)
                    torch.autograd.backward(o, dd["do"])

                t1 = time.time()
                fla_fb(0)
                cp.cuda.Device().synchronize()
                first = round(time.time() - t1, 1)
                row["fla fwd+bwd"] = R.timing(
                    f"fla 0.6 chunk_gla fwd+bwd [{tag}]", lambda: cuda_time(cp, fla_fb, max(5, a.reps // 2)),
                    first_call_s=first,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                R.say("fla failed", tag, exc)

    for si, shape in enumerate(shapes):
        run_shape(si, *shape)
        cp.get_default_memory_pool().free_all_blocks()

    # ---- 5. variants ----------------------------------------------------------------------------------------------
    def run_variants() -> None:
        B, T, H, K, V = shapes[0] if shapes else BENCH[0]
        geo = st.geometry(rt, B, T, H, K, V, "bf16", None, None)
        allv = {
            "base": ((), {}),
            "walk1": ((), {"walk": 1}),  # the former 64 x 64 state walk
            "nc2": ((), {"nc": 2 * geo.NC}),
            "nc05": ((), {"nc": max(1, geo.NC // 2)}),
            "ctas2": (("GW_MIN_CTAS=2",), {"walk": 1}),  # GW_MIN_CTAS: walk 1's register cap
            "ctas4": (("GW_MIN_CTAS=4",), {"walk": 1}),
            "f32": ((), {"f32_states": True}),
        }
        pick = list(allv) if a.variants == "all" else ["base"] + [v for v in a.variants.split(",") if v in allv]
        sets = [gpu_inputs(cp, B, T, H, K, V, seed + 200 + j) for j in range(2)]
        o_base, g_base = ours_fb(rt, sets[0])
        walk_only = lambda n: n.startswith("glatc_walk")  # noqa: E731 - what GW_MIN_CTAS changes
        best = None
        for vname in pick:
            defines, kw = allv[vname]
            rec: dict[str, Any] = {"variant": vname, "defines": defines, "kw": kw}
            try:
                r = NvrtcRuntime(cp, defines, base=rt, own=walk_only) if defines else rt
                f32s = kw.get("f32_states", False)
                ok1 = R.check(
                    f"variant {vname}: small vs float64",
                    lambda r=r, f32s=f32s: small_case(*VARIANT_SMALL, True, 2, f32s, runtime=r),
                )
                o_v, g_v = ours_fb(r, sets[0], **kw)
                errs = {"o": rel_gpu(cp, o_v, f32_of(cp, o_base))}
                for n, m, b_ in zip(("dq", "dk", "dv", "dg", "dh0"), g_v, g_base):
                    errs[n] = rel_gpu(cp, m, f32_of(cp, b_))
                ok2 = R.check(f"variant {vname}: bench vs base build", lambda errs=errs: errs, 1e-2)
                rec["ok"] = bool(ok1["ok"] and ok2["ok"])
                rec["fwd_ms"] = R.timing(
                    f"variant {vname}: fwd",
                    lambda r=r, kw=kw: cuda_time(cp, lambda i: ours_fwd(r, sets[i], **kw), a.reps),
                )
                rec["fwd_bwd_ms"] = R.timing(
                    f"variant {vname}: fwd+bwd",
                    lambda r=r, kw=kw: cuda_time(cp, lambda i: ours_fb(r, sets[i], **kw), a.reps),
                )
                if rec["ok"] and rec["fwd_bwd_ms"] and (best is None or rec["fwd_bwd_ms"] < best["fwd_bwd_ms"]):
                    best = rec
            except Exception as exc:  # noqa: BLE001
                rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
                R.say("variant", vname, "failed:", rec["error"][:300])
            R.data["variants"].append(rec)
            R.save()
        R.data["info"]["best_variant"] = best and best["variant"]

    if a.variants:
        try:
            run_variants()
        except Exception as exc:  # noqa: BLE001
            R.say("variants failed:", exc)

    # ---- 6. fla's test grid -----------------------------------------------------------------------------------------
    def run_grid_case(T: int, K: int, V: int, gn: float) -> None:
        rec: dict[str, Any] = {"T": T, "K": K, "V": V, "normaliser": gn}
        names = ("o", "ht", "dq", "dk", "dv", "dg", "dh0")
        try:
            d = gpu_inputs(cp, 2, T, 2, K, V, int(rng.integers(1 << 30)), normalizer=gn)
            scale = K**-0.5
            args = [d[n] for n in ("q", "k", "v", "g", "do")]
            ref = ref64_gpu(cp, *args, scale, d["h0"], d["dht"])
            o, ht = gla_fwd_tc.fwd_tc(rt, *args[:4], initial_state=d["h0"], output_final_state=True)
            grads = gla_bwd_tc.bwd_tc(rt, *args, initial_state=d["h0"], dht=d["dht"])
            rec["ours"] = {n: rel_gpu(cp, m, r_) for n, m, r_ in zip(names, (o, ht) + tuple(grads), ref)}
            rec["ok"] = all(rec["ours"][n] <= TARGET[n] for n in names)
            if fla is not None:
                t = {n: to_torch(d[n]) for n in ("q", "k", "v", "g", "do")}
                x = {n: t[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g")}
                h0t = torch.from_dlpack(d["h0"]).clone().requires_grad_(True)
                of, hf = fla(x["q"], x["k"], x["v"], x["g"], scale=scale, initial_state=h0t, output_final_state=True)
                torch.autograd.backward((of, hf), (t["do"], torch.from_dlpack(d["dht"])))
                got = [of, hf, x["q"].grad, x["k"].grad, x["v"].grad, x["g"].grad, h0t.grad]
                rec["fla"] = {n: rel_gpu(cp, cp.from_dlpack(m.float().contiguous()), r_)
                              for n, m, r_ in zip(names, got, ref)}  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        R.data["grid"].append(rec)
        worst = max(rec.get("ours", {}).items(), key=lambda kv: kv[1], default=("-", float("nan")))
        fl = max(rec.get("fla", {}).values(), default=None)
        R.say("GRID", f"T={T} K={K} V={V} gn={gn}", "ok" if rec.get("ok") else "FAIL",
              f"worst {worst[0]}={worst[1]:.2e}", "" if fl is None else f"(fla worst {fl:.2e})",
              rec.get("error", ""))  # fmt: skip
        R.save()

    if a.grid:
        for T in GRID_T:
            for K, V in GRID_KV:
                for gn in GRID_GN:
                    run_grid_case(T, K, V, gn)

    # ---- table ----------------------------------------------------------------------------------------------------
    R.data["summary"] = summary
    R.save()
    checks = R.data["checks"]
    nbad = sum(not c["ok"] for c in checks)
    print("\n==== gla_device_check summary (ms, CUDA events, median) ====")
    print(f"checks: {len(checks) - nbad} passed, {nbad} failed" + ("" if not nbad else ": " + "; ".join(
        c["name"][:60] for c in checks if not c["ok"])))  # fmt: skip
    for tag, row in summary.items():
        print(f"-- {tag}")
        for key in ("ours fwd", "existing fwd", "fla fwd", "ours bwd", "ours fwd+bwd", "ours fwd+bwd (no reuse)",
                    "existing fwd+bwd", "fla fwd+bwd"):  # fmt: skip
            if row.get(key) is not None:
                print(f"   {key:28s} {row[key]:9.3f}")
        for key in ("fwd", "fwd+bwd"):
            ours, theirs = row.get(f"ours {key}"), row.get(f"fla {key}")
            if ours and theirs:
                print(f"   ours/fla {key:19s} {ours / theirs:9.3f}")
        for key, val in row.items():
            if key.startswith(("walk", "segment", "fwd output", "bwd fused", "fwd prepare")) and val is not None:
                print(f"   . {key:45s} {val:8.3f}")
    if R.data["variants"]:
        print("variants:", ", ".join(f"{v['variant']}={v.get('fwd_bwd_ms') or float('nan'):.3f}"
                                     f"{'' if v.get('ok') else '(bad)'}" for v in R.data["variants"]),
              "best:", R.data["info"].get("best_variant"))  # fmt: skip
    if R.data["grid"]:
        ok = sum(bool(r.get("ok")) for r in R.data["grid"])
        print(f"grid: {ok}/{len(R.data['grid'])} cases within the targets")
    print(f"JSON: {R.out / 'gla_device_check.json'}")
    return 1 if nbad else 0


if __name__ == "__main__":
    sys.exit(main())
