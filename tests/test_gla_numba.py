"""The float64 GPU path (:mod:`hpczeco.gpu.gla_numba`, Numba CUDA kernels) without a GPU: under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, chosen before numba is imported: every check runs in its own process) on the numpy
stand-in for CuPy (``tests/fake_cupy`` through :func:`helpers.install_numpy_cupy`), so the arrays take the
library's device branches: :func:`hpczeco.gla.chunk_gla` / ``chunk_gla_bwd``, the prepare/finish objects and the ZeCO
pieces of :mod:`hpczeco.gpu.gla`, and the ZeCO layer (``hpczeco.ZeCOGLA``) under ``mpiexec`` on 2 and 3 ranks.

Every result is checked against the float64 recurrence to 1e-12 (float32 arithmetic would be ~1e-7 off), and the
Numba kernels' launches are counted (:data:`hpczeco.gpu.gla_numba.LAUNCHES`): a run that bypassed them fails. Tiny
shapes (the simulator runs every CUDA thread as a Python thread). On a GPU, tests/test_gpu_gla.py and
tests/test_gpu_gla_checks.py run the same path on CuPy arrays.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hpczeco.drivers.mpienv import launch_env

HERE = Path(__file__).resolve().parent
TOL = 1e-12

_PRELUDE = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
from helpers import install_numpy_cupy, rel  # rel: relative norm error (absolute where the reference is zero)
cp = install_numpy_cupy()
from hpczeco.gpu import gla_numba
assert gla_numba.SIMULATOR, "the CUDA simulator is not on"
"""

_LOCAL = """
from hpczeco.gla import chunk_gla, chunk_gla_bwd, recurrent_gla, recurrent_gla_bwd
from hpczeco.gpu import gla as G

rng = np.random.default_rng(int(sys.argv[1]))
out = {"errors": {}, "launches": {}, "checks": {}}
# B, T, H, K, V, chunk, strong gates, initial state and dht: partial chunks, T < chunk, T = 1, K != V
CASES = [(1, 11, 2, 3, 2, 4, True, True), (2, 9, 1, 4, 5, 16, False, True), (1, 1, 1, 2, 3, 4, False, False),
         (1, 8, 1, 2, 2, 4, True, False)]
for i, (B, T, H, K, V, C, strong, states) in enumerate(CASES):
    q, k, v, do = (rng.standard_normal(s) for s in ((B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, V)))
    g = -rng.uniform(0, 1, (B, T, H, K))
    if strong:
        g = np.where(rng.random(g.shape) < 0.5, -rng.uniform(4, 8, g.shape), g)
    h0, dht = (rng.standard_normal((B, H, K, V)) if states else None for _ in range(2))
    up = lambda x: None if x is None else cp.asarray(x)
    before = gla_numba.LAUNCHES.copy()
    o, ht = chunk_gla(up(q), up(k), up(v), up(g), initial_state=up(h0), output_final_state=True, chunk_size=C)
    grads = chunk_gla_bwd(up(q), up(k), up(v), up(g), up(do), initial_state=up(h0), dht=up(dht), chunk_size=C)
    out["launches"][f"case {i}"] = dict(gla_numba.LAUNCHES - before)
    ro, rht = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    ref = recurrent_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht)
    out["checks"][f"case {i} dtypes"] = [str(x.dtype) for x in (o, ht, *grads)]
    out["checks"][f"case {i} on the device"] = all(type(x).__module__ == "cupy" for x in (o, ht, *grads))
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dh0"), (o, ht, *grads), (ro, rht, *ref)):
        out["errors"][f"case {i} {name}"] = rel(a, b)

# prepare / finish over two slices, as two ZeCO ranks would (the scan pair passed by hand)
B, T, H, K, V, C, cut = 1, 13, 1, 3, 2, 4, 6
q, k, v, do = (rng.standard_normal(s) for s in ((B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, V)))
g = -rng.uniform(0, 2, (B, T, H, K))
h0, dht = rng.standard_normal((B, H, K, V)), rng.standard_normal((B, H, K, V))
parts = [[cp.asarray(np.ascontiguousarray(x[:, s])) for x in (q, k, v, g, do)] for s in (slice(0, cut), slice(cut, T))]
fw = [G.chunk_gla_prepare(*p[:4], chunk_size=C) for p in parts]
out["checks"]["prepare impl"] = [f.impl for f in fw]
S1 = fw[0].decay[..., None] * cp.asarray(h0) + fw[0].local_final_state
o0, _ = fw[0].finish(cp.asarray(h0))
o1, fin = fw[1].finish(S1, output_final_state=True)
bw = [G.chunk_gla_bwd_prepare(*p, chunk_size=C) for p in parts]
D0 = bw[1].decay[..., None] * cp.asarray(dht) + bw[1].dh0_local
g0, g1 = bw[0].finish(cp.asarray(h0), D0), bw[1].finish(S1, cp.asarray(dht))
ro, rht = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
ref = recurrent_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht)
out["errors"]["two slices o"] = rel(np.concatenate([o0, o1], axis=1), ro)
out["errors"]["two slices ht"] = rel(fin, rht)
for j, name in enumerate(("dq", "dk", "dv", "dg")):
    out["errors"][f"two slices {name}"] = rel(np.concatenate([g0[j], g1[j]], axis=1), ref[j])
out["errors"]["two slices dh0"] = rel(g0[4], ref[4])

# the ZeCO pieces
B, T, H, K, V = 1, 10, 2, 3, 4
q, do = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V))
g = -rng.uniform(0, 1, (B, T, H, K))
S, L = rng.standard_normal((B, H, K, V)), rng.standard_normal((B, H, K, V))
o0 = rng.standard_normal((B, T, H, V))
G64 = np.cumsum(g, axis=1)
before = gla_numba.LAUNCHES.copy()
Gc = G.decay_cumsum(cp.asarray(g), chunk_size=4)
out["errors"]["decay_cumsum"] = rel(Gc, G64)
o = cp.asarray(o0.copy())
G.state_correction(o, cp.asarray(q), Gc, cp.asarray(S), scale=0.3)
out["errors"]["state_correction"] = rel(o, o0 + 0.3 * np.einsum("bthk,bhkv->bthv", q * np.exp(G64), S))
U = G.initial_state_grad(cp.asarray(q), cp.asarray(g), cp.asarray(do), scale=0.3, chunk_size=4)
out["errors"]["initial_state_grad"] = rel(U, 0.3 * np.einsum("bthk,bthv->bhkv", q * np.exp(G64), do))
a = np.exp(G64[:, -1])
out["errors"]["final_state"] = rel(G.final_state(cp.asarray(a), cp.asarray(S), cp.asarray(L)), a[..., None] * S + L)
res = cp.asarray(np.zeros_like(S))
G.scan_combine(cp.asarray(a), cp.asarray(S), cp.asarray(L), out=res)
out["errors"]["scan_combine"] = rel(res, a[..., None] * S + L)
out["launches"]["pieces"] = dict(gla_numba.LAUNCHES - before)

# float64 runs on "numba" only; one rule for scale
x = [cp.asarray(np.zeros((1, 4, 1, 2))) for _ in range(4)]
for what, call in (("impl=simt", lambda: G.chunk_gla(*x, impl="simt")),
                   ("impl=tc-chunk", lambda: G.chunk_gla_bwd(*x, x[2], impl="tc-chunk")),
                   ("scale=-1", lambda: G.chunk_gla(*x, scale=-1.0)),
                   ("scale=0 correction", lambda: G.state_correction(x[2], x[0], x[3], cp.zeros((1, 1, 2, 2)), 0.0))):
    try:
        call()
        out["checks"][what] = "no error"
    except ValueError as exc:
        out["checks"][what] = str(exc)
print(json.dumps(out))
"""

_ZECO = """
from mpi4py import MPI
from hpczeco import ZeCOGLA
from hpczeco.collectives.transport import HostTransport
from hpczeco.gla import recurrent_gla, recurrent_gla_bwd


class NumpyAsDevice(HostTransport):
    \"\"\"The host transport moving the stand-in's "device" arrays (numpy memory underneath).\"\"\"

    name = "numpy-as-cupy"

    @property
    def xp(self):
        return cp


comm = MPI.COMM_WORLD
rank, P = comm.Get_rank(), comm.Get_size()
rng = np.random.default_rng(int(sys.argv[1]))  # the same global inputs on every rank
lengths = [5, 0, 7, 3][:P] if P > 2 else [6, 9][:P]  # an empty slice on 3+ ranks; partial chunks everywhere
B, H, K, V, C = 1, 2, 3, 2, 4
T = sum(lengths)
q, k, v, do = (rng.standard_normal(s) for s in ((B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, V)))
g = np.where(rng.random((B, T, H, K)) < 0.3, -rng.uniform(4, 8, (B, T, H, K)), -rng.uniform(0, 1, (B, T, H, K)))
h0, dht = rng.standard_normal((B, H, K, V)), rng.standard_normal((B, H, K, V))
lo = sum(lengths[:rank])
sl = slice(lo, lo + lengths[rank])
mine = [cp.asarray(np.ascontiguousarray(x[:, sl])) for x in (q, k, v, g, do)]
ro, rht = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
ref = recurrent_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht)
errors, launches = {}, {}
for scan in sys.argv[2].split(","):
    layer = ZeCOGLA(comm, topology=scan, chunk_size=C, transport=NumpyAsDevice(comm))
    before = gla_numba.LAUNCHES.copy()
    o = layer.forward(*mine[:4], initial_state=cp.asarray(h0) if rank == 0 else None)
    grads = layer.backward(mine[4], dht=cp.asarray(dht) if rank == P - 1 else None)
    launches[scan] = dict(gla_numba.LAUNCHES - before)
    parts = comm.gather((np.asarray(o), [np.asarray(x) for x in grads[:4]]), root=0)
    fin = comm.bcast(np.asarray(layer.final_state) if rank == P - 1 else None, root=P - 1)
    if rank == 0:
        errors[f"{scan} o"] = rel(np.concatenate([p[0] for p in parts], axis=1), ro)
        errors[f"{scan} final_state"] = rel(fin, rht)
        for j, name in enumerate(("dq", "dk", "dv", "dg")):
            errors[f"{scan} {name}"] = rel(np.concatenate([p[1][j] for p in parts], axis=1), ref[j])
        errors[f"{scan} dh0"] = rel(np.asarray(grads[4]), ref[4])
        errors[f"{scan} dtypes"] = [str(x.dtype) for x in (o, layer.final_state, *grads)]
everyone = comm.gather({"lengths": lengths, "rank": rank, "launches": launches}, root=0)
if rank == 0:
    print(json.dumps({"errors": errors, "ranks": everyone}))
"""


def _run(cmd: list[str], timeout: float) -> dict:
    env = dict(launch_env(), NUMBA_ENABLE_CUDASIM="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MPIEXEC_TIMEOUT=str(int(timeout)))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 30)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "sim.py"
    path.write_text(textwrap.dedent(_PRELUDE.format(tests=str(HERE))) + textwrap.dedent(body))
    return str(path)


@pytest.mark.timeout(600)
def test_float64_gla_and_zeco_pieces_on_the_numba_kernels(tmp_path, rng):
    seed = int(rng.integers(1 << 30))
    out = _run([sys.executable, _script(tmp_path, _LOCAL), str(seed)], 500)
    bad = {n: e for n, e in out["errors"].items() if not e < TOL}
    assert not bad, f"seed {seed}: {bad}"
    assert len(out["errors"]) == 4 * 7 + 7 + 5
    for case, ran in out["launches"].items():  # every case and piece ran on the Numba kernels
        if case.startswith("case"):
            assert ran.get("fwd_output") == 1 and ran.get("bwd_dqdk") == 1 and ran.get("bwd_dv") == 1, (case, ran)
            assert ran.get("seg_finish") == 1 and ran.get("state_scan", 0) >= 3, (case, ran)  # dg; fwd + bwd scans
    pieces = out["launches"]["pieces"]
    assert pieces.get("correction") == 1 and pieces.get("combine") == 2 and pieces.get("chunk_outer") == 1, pieces
    for key, val in out["checks"].items():
        if key.endswith("dtypes"):
            assert val == ["float64"] * 7, (key, val)
        elif key.endswith("on the device"):
            assert val is True, key
    assert out["checks"]["prepare impl"] == ["numba", "numba"]
    assert "does not take float64" in out["checks"]["impl=simt"]
    assert "does not take float64" in out["checks"]["impl=tc-chunk"]
    assert "scale must be a positive" in out["checks"]["scale=-1"]
    assert "scale must be a positive" in out["checks"]["scale=0 correction"]


def _mpiexec() -> str:
    sys.path.insert(0, str(HERE))
    from run_suite import find_mpiexec  # noqa: PLC0415

    return find_mpiexec()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", [2, 3])
def test_zeco_layer_in_float64_on_the_numba_kernels(tmp_path, rng, ranks):
    """hpczeco.ZeCOGLA on float64 "CuPy" arrays over ``ranks`` MPI processes (an empty slice on 3): ring, tree and
    serial scans, forward and backward, equal the float64 recurrence of the whole sequence; every rank with tokens
    ran the Numba kernels."""
    seed = int(rng.integers(1 << 30))
    scans = "ring,tree,serial"
    out = _run([_mpiexec(), "-n", str(ranks), sys.executable, _script(tmp_path, _ZECO), str(seed), scans], 800)
    errors = out["errors"]
    for scan in scans.split(","):
        assert errors.pop(f"{scan} dtypes") == ["float64"] * 7, scan
    bad = {n: e for n, e in errors.items() if not e < TOL}
    assert not bad, f"seed {seed}, {ranks} ranks: {bad}"
    assert len(errors) == 3 * 7
    assert len(out["ranks"]) == ranks
    for r in out["ranks"]:
        for scan, ran in r["launches"].items():
            if r["lengths"][r["rank"]] > 0:
                assert ran.get("fwd_output") == 1 and ran.get("bwd_dqdk") == 1, (r["rank"], scan, ran)
            else:  # an empty slice needs no kernels
                assert not ran.get("fwd_output"), (r["rank"], scan, ran)

