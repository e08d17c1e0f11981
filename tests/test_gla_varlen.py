"""Packed sequences (``cu_seqlens``) in hpczeco.gla: chunk_gla / chunk_gla_bwd equal each document run alone by the
float64 recurrence (flash-linear-attention's varlen cases: documents of length 0, 1, 15, 63, 64, 65, 200 ...; initial
states and dht; float64, float32, float16), both host runners, the bucket plan, the packed split protocol, the GPU
side (hpczeco.gpu.gla_varlen, the packed splits on device pieces) in the CPU emulation of the kernels, and the
argument checks. Serial tests; fresh random inputs (``rng``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import emulated_gla_runtime, log_gates, rel
from hpczeco.base import bf16
from hpczeco.base.packing import COPY_COST, MERGE_TOKENS, plan_buckets

from hpczeco.gla import chunk_gla, chunk_gla_bwd, recurrent_gla, recurrent_gla_bwd
from hpczeco.gla import split as split_mod
from hpczeco.gla.split import split_backward, split_forward

pytestmark = pytest.mark.filterwarnings("error")  # no overflow/invalid RuntimeWarnings, even for strong decays

TOL = {np.float64: 1e-10, np.float32: 1e-4, np.float16: 1e-2}

# fla's tests/ops/test_gla.py varlen offsets, and lengths around the chunk size
CU_CASES = [
    [0, 15],
    [0, 0, 16],
    [0, 256, 500, 1000],
    [0, 15, 100, 300, 1200, 2000],
    [0, 1, 100, 300, 1200, 2048],
    "edges",  # 0, 1, 15, 63, 64, 65, 200 and 0 again, shuffled
    "short",  # 150 documents of 0 .. 6 tokens
    "equal",  # 6 documents of 37 tokens (one reshape, no copy)
]


def offsets(rng, case) -> np.ndarray:
    if case == "edges":
        lengths = [0, 1, 15, 63, 64, 65, 200, 0]
        rng.shuffle(lengths)
    elif case == "short":
        lengths = rng.integers(0, 7, size=150).tolist()
    elif case == "equal":
        lengths = [37] * 6
    else:
        return np.asarray(case, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def packed_inputs(rng, cu, H, K, V, kind="logsigmoid", states=True):
    T, N = int(cu[-1]), len(cu) - 1
    f = lambda *s: rng.standard_normal(s)  # noqa: E731
    q, k, v, do = f(1, T, H, K), f(1, T, H, K), f(1, T, H, V), f(1, T, H, V)
    g = log_gates(rng, (1, T, H, K), kind)
    h0, dht = (f(N, H, K, V), f(N, H, K, V)) if states else (None, None)
    return q, k, v, g, do, h0, dht


def cast(x, dt):
    return None if x is None else x.astype(dt)


def check_against_reference(got_fwd, got_bwd, q, k, v, g, do, h0, dht, cu, tol, scale=None):
    o_ref, fin_ref = recurrent_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ref = recurrent_gla_bwd(q, k, v, g, do, scale=scale, initial_state=h0, dht=dht, cu_seqlens=cu)
    (o, fin), grads = got_fwd, got_bwd
    assert o.shape == o_ref.shape and fin.shape == fin_ref.shape == (len(cu) - 1,) + h0_shape(q, v)
    assert rel(o, o_ref) < tol, ("o", rel(o, o_ref))
    assert rel(fin, fin_ref) < tol, ("final", rel(fin, fin_ref))
    for name, x, r in zip(("dq", "dk", "dv", "dg", "dh0"), grads, ref):
        assert x.shape == r.shape, name
        assert rel(x, r) < 10 * tol, (name, rel(x, r))


def h0_shape(q, v):
    return (q.shape[2], q.shape[3], v.shape[3])


# ------------------------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("with_states", [False, True])
@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("case", CU_CASES, ids=str)
def test_chunk_gla_cu_seqlens_equals_each_document_alone(rng, case, dt, with_states):
    cu = offsets(rng, case)
    kind = ["logsigmoid", "strong", "mixed", "weak"][int(rng.integers(4))]
    H, K, V = 2, 8, 6
    q, k, v, g, do, h0, dht = packed_inputs(rng, cu, H, K, V, kind, with_states)
    chunk = int(rng.choice([16, 64]))
    ins = [cast(x, dt) for x in (q, k, v, g, do, h0, dht)]
    fwd = chunk_gla(*ins[:4], initial_state=ins[5], output_final_state=True, chunk_size=chunk, cu_seqlens=cu)
    bwd = chunk_gla_bwd(*ins[:5], initial_state=ins[5], dht=ins[6], chunk_size=chunk, cu_seqlens=cu)
    assert fwd[0].dtype == dt and fwd[1].dtype == dt and all(x.dtype == dt for x in bwd)
    check_against_reference(fwd, bwd, *(cast(x, np.float64) for x in ins), cu, TOL[dt])
    # ... and each document through the plain chunked path alone (the same arithmetic, to rounding)
    for i in rng.choice(len(cu) - 1, size=min(3, len(cu) - 1), replace=False):
        a, b = int(cu[i]), int(cu[i + 1])
        h = None if ins[5] is None else ins[5][i : i + 1]
        o1, f1 = chunk_gla(*(x[:, a:b] for x in ins[:4]), initial_state=h, output_final_state=True, chunk_size=chunk)
        assert rel(fwd[0][:, a:b], o1) < TOL[dt] and rel(fwd[1][i : i + 1], f1) < TOL[dt]


@pytest.mark.parametrize("dt", [np.float64, np.float32])
def test_unchecked_runner_and_scale(rng, dt):
    """check_values=False (the packed splits the ZeCO layer uses: their middle documents run by buckets through the
    split runners without value scans) and a custom scale."""
    cu = offsets(rng, "edges")
    q, k, v, g, do, h0, dht = packed_inputs(rng, cu, 2, 5, 7, "mixed")
    ins = [cast(x, dt) for x in (q, k, v, g, do, h0, dht)]
    scale = float(rng.uniform(0.2, 2.0))
    fwd = split_forward(*ins[:4], scale=scale, chunk_size=16, check_values=False, cu_seqlens=cu,
                        initial_state=ins[5]).finish()
    bwd = split_backward(*ins[:5], scale=scale, initial_state=ins[5], chunk_size=16, check_values=False,
                         cu_seqlens=cu, dht=ins[6]).finish()
    check_against_reference(fwd, bwd, *(cast(x, np.float64) for x in ins), cu, TOL[dt], scale=scale)
    # a NaN is not scanned for: it propagates into its own document only
    qn = ins[0].copy()
    i = int(np.argmax(np.diff(cu)))
    qn[0, cu[i]] = np.nan
    with np.errstate(invalid="ignore"):
        o, _ = split_forward(qn, *ins[1:4], chunk_size=16, check_values=False, cu_seqlens=cu).finish()
    assert np.isnan(o[0, cu[i] : cu[i + 1]]).any() and np.isfinite(np.delete(o[0], np.s_[cu[i] : cu[i + 1]], 0)).all()


def test_half_inputs_and_no_final_state(rng):
    """float16 inputs: o in float16, states in float32 (the plain path's rules); output_final_state=False."""
    cu = np.array([0, 5, 5, 70, 71])
    q, k, v, g, do, h0, dht = packed_inputs(rng, cu, 1, 4, 4)
    ins = [x.astype(np.float16) for x in (q, k, v, g, do)]
    o, fin = chunk_gla(*ins[:4], initial_state=h0.astype(np.float32), output_final_state=True, cu_seqlens=cu)
    assert o.dtype == np.float16 and fin.dtype == np.float32
    o_ref, fin_ref = recurrent_gla(*(x.astype(np.float64) for x in ins[:4]), initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu)  # fmt: skip
    assert rel(o, o_ref) < TOL[np.float16] and rel(fin, fin_ref) < 1e-3
    assert chunk_gla(*ins[:4], cu_seqlens=cu)[1] is None
    dh0 = chunk_gla_bwd(*ins, cu_seqlens=cu)[4]
    assert dh0.shape == (4, 1, 4, 4) and dh0.dtype == np.float32


def test_reference_is_each_document_alone(rng):
    """The float64 reference with cu_seqlens is literally the plain recurrence per document."""
    cu = np.array([0, 0, 3, 9, 9, 10])
    q, k, v, g, do, h0, dht = packed_inputs(rng, cu, 2, 3, 2)
    o, fin = recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    grads = recurrent_gla_bwd(q, k, v, g, do, initial_state=h0, dht=dht, cu_seqlens=cu)
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        o1, f1 = recurrent_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], initial_state=h0[i : i + 1],
                               output_final_state=True)  # fmt: skip
        g1 = recurrent_gla_bwd(q[:, sl], k[:, sl], v[:, sl], g[:, sl], do[:, sl], initial_state=h0[i : i + 1],
                               dht=dht[i : i + 1])  # fmt: skip
        assert np.array_equal(o[:, sl], o1) and np.array_equal(fin[i : i + 1], f1)
        for x, y in zip(grads[:4], g1[:4]):
            assert np.array_equal(x[:, sl], y)
        assert np.array_equal(grads[4][i : i + 1], g1[4])
    assert np.array_equal(fin[0], h0[0]) and np.array_equal(grads[4][3], dht[3])  # empty documents


# ------------------------------------------------------------------------------------------- buckets


def test_bucket_plan(rng):
    """Every document in exactly one bucket; a bucket's documents are within its length, each joined one adding at
    most MERGE_TOKENS of padding and copies; long documents of distinct chunk counts run alone, short ones share."""
    for _ in range(50):
        lengths = np.concatenate([rng.integers(0, 3000, size=int(rng.integers(1, 60))), [0] * int(rng.integers(3))])
        rng.shuffle(lengths)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        C = int(rng.choice([16, 64]))
        buckets = plan_buckets(cu, C)
        seen = np.concatenate([b.docs for b in buckets])
        assert np.array_equal(np.sort(seen), np.arange(len(lengths)))  # every document once
        work = lambda L, C=C: L if L <= C else -(-L // C) * C  # noqa: E731
        for b in buckets:
            assert (np.diff(b.docs) > 0).all() and b.length == lengths[b.docs].max()
            if b.length == 0:
                assert (lengths[b.docs] == 0).all()
                continue
            others = sorted((int(L) for L in lengths[b.docs]), reverse=True)[1:]
            for n, L in enumerate(others):
                extra = work(b.length) - work(L) + COPY_COST * (L + (b.length if n == 0 else 0))
                assert 0 < L and extra <= MERGE_TOKENS
    short = np.concatenate([[0], np.cumsum(rng.integers(1, 33, size=500))])
    assert len(plan_buckets(short, 64)) <= 2  # 500 documents of 1 .. 32 tokens: one or two calls
    long = np.concatenate([[0], np.cumsum([5000, 3000, 1000, 200])])
    assert [len(b.docs) for b in plan_buckets(long, 64)] == [1, 1, 1, 1]  # each alone, on a view


# ------------------------------------------------------------------------------------------- packed split protocol


@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("lengths", [[9], [0], [3, 0], [0, 4], [20, 1, 0, 33, 7], [17, 40]], ids=str)
def test_packed_split_protocol(rng, dt, lengths):
    """split_forward/split_backward with cu_seqlens: a (0 unless one document), S_local (the last document's state
    from S_in = 0), U (the first document's dh0 from D = 0), and finish(S_in)/finish(D) adding to the first
    document's initial state / the last document's dht."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    q, k, v, g, do, h0, dht = (cast(x, dt) for x in packed_inputs(rng, cu, 2, 4, 3, "mixed"))
    S_in, D = (rng.standard_normal((1, 2, 4, 3)).astype(dt) for _ in range(2))
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    x64 = [f64(x) for x in (q, k, v, g, do)]
    h0p, dhtp = f64(h0), f64(dht)
    h0p[0] += S_in[0]
    dhtp[-1] += D[0]
    _, fin0 = recurrent_gla(*x64[:4], initial_state=f64(h0), output_final_state=True, cu_seqlens=cu)
    o_ref, fin_ref = recurrent_gla(*x64[:4], initial_state=h0p, output_final_state=True, cu_seqlens=cu)
    dh0_0 = recurrent_gla_bwd(*x64, initial_state=f64(h0), dht=f64(dht), cu_seqlens=cu)[4]
    grads_ref = recurrent_gla_bwd(*x64, initial_state=f64(h0), dht=dhtp, cu_seqlens=cu)
    a_ref = np.exp(x64[3].sum(axis=1)) if len(lengths) == 1 else np.zeros((1, 2, 4))
    tol = TOL[dt]

    fs = split_forward(q, k, v, g, chunk_size=8, cu_seqlens=cu, initial_state=h0)
    assert rel(fs.a, a_ref) < tol and rel(fs.S_local, fin0[-1:]) < tol
    fs.overlap(poll=lambda: None)
    o, fin = fs.finish(S_in)
    assert rel(o, o_ref) < tol and rel(fin, fin_ref) < tol
    bs = split_backward(q, k, v, g, do, initial_state=h0, dht=dht, chunk_size=8, cu_seqlens=cu)
    assert rel(bs.a, a_ref) < tol and rel(bs.U, dh0_0[:1]) < tol
    for x, r in zip(bs.finish(D), grads_ref):
        assert rel(x, r) < 10 * tol


def test_split_protocol_states_need_cu_seqlens(rng):
    q, k, v, g, do, h0, dht = packed_inputs(rng, np.array([0, 4]), 1, 2, 2)
    with pytest.raises(ValueError, match="initial_state only with cu_seqlens"):
        split_forward(q, k, v, g, initial_state=h0)
    with pytest.raises(ValueError, match="dht only with cu_seqlens"):
        split_backward(q, k, v, g, do, dht=dht)


# ------------------------------------------------------------------------------------------- GPU side, emulated


@pytest.fixture
def emu():
    cm = emulated_gla_runtime()
    try:
        rt = cm.__enter__()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    rt.launched.clear()
    yield rt
    cm.__exit__(None, None, None)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_gpu_varlen_in_the_emulation(emu, rng, dt):
    """hpczeco.gpu.gla_varlen on the emulated kernels (numpy arrays; bf16 as raw uint16 bits): buckets of several
    documents (gather/scatter), a lone long one (a view), empty documents."""
    from hpczeco.gpu import gla_varlen  # noqa: PLC0415

    cu = np.array([0, 3, 3, 5, 6, 40, 40])
    H, K, V = 1, 16, 16
    q, k, v, g, do, h0, dht = packed_inputs(rng, cu, H, K, V)
    up = (lambda x: bf16.to_bits(x.astype(np.float32))) if dt == "bf16" else (lambda x: x.astype(np.float32))
    down = (lambda x: bf16.from_bits(x)) if dt == "bf16" else (lambda x: x)
    ins = [up(x) for x in (q, k, v, g, do)]
    h32, d32 = h0.astype(np.float32), dht.astype(np.float32)
    o, fin = gla_varlen.chunk_gla(*ins[:4], initial_state=h32, output_final_state=True, chunk_size=16,
                                  cu_seqlens=list(cu))  # fmt: skip
    grads = gla_varlen.chunk_gla_bwd(*ins, initial_state=h32, dht=d32, chunk_size=16, cu_seqlens=cu)
    assert o.dtype == ins[0].dtype and fin.dtype == np.float32 and grads[4].dtype == np.float32
    tol = 1e-4 if dt == "fp32" else 2e-2
    xs = [down(x).astype(np.float64) for x in ins]
    check_against_reference((down(o), fin), [down(x) for x in grads[:4]] + [grads[4]], *xs, h0, dht, cu, tol)
    assert any("bwd" in n for n in emu.launched)  # the emulated device kernels ran
    with pytest.raises(ValueError, match="one state per document"):
        gla_varlen.chunk_gla(*ins[:4], initial_state=h32[:2], cu_seqlens=cu)


@pytest.mark.timeout(900)
def test_packed_split_on_device_pieces_in_the_emulation(emu, rng, monkeypatch):
    """The packed splits with every piece on the device adapters (hpczeco.gla.split's DeviceForwardSplit /
    DeviceBackwardSplit over the emulated kernels): the ZeCO layer's path on CuPy arrays."""
    monkeypatch.setattr(split_mod, "is_device_array", lambda x: True)
    cu = np.array([0, 4, 6, 6, 7, 30])
    q, k, v, g, do, h0, dht = (cast(x, np.float32) for x in packed_inputs(rng, cu, 1, 8, 8))
    S_in, D = (rng.standard_normal((1, 1, 8, 8)).astype(np.float32) for _ in range(2))
    fs = split_forward(q, k, v, g, chunk_size=8, cu_seqlens=cu, initial_state=h0)
    o, fin = fs.finish(S_in)
    bs = split_backward(q, k, v, g, do, initial_state=h0, dht=dht, chunk_size=8, cu_seqlens=cu)
    grads = bs.finish(D)
    x64 = [x.astype(np.float64) for x in (q, k, v, g, do, h0, dht)]
    h0p, dhtp = x64[5].copy(), x64[6].copy()
    h0p[0] += S_in[0]
    dhtp[-1] += D[0]
    o_ref, fin_ref = recurrent_gla(*x64[:4], initial_state=h0p, output_final_state=True, cu_seqlens=cu)
    grads_ref = recurrent_gla_bwd(*x64[:5], initial_state=x64[5], dht=dhtp, cu_seqlens=cu)
    assert rel(o, o_ref) < 1e-4 and rel(fin, fin_ref) < 1e-4
    for x, r in zip(grads, grads_ref):
        assert rel(x, r) < 1e-3
    assert any("bwd" in n for n in emu.launched)  # the pieces ran on the emulated device kernels


# ------------------------------------------------------------------------------------------- argument checks


def test_bad_cu_seqlens_and_states(rng):
    cu = np.array([0, 3, 10])
    q, k, v, g, do, h0, dht = packed_inputs(rng, cu, 2, 4, 3)
    bad = [
        (np.array([0, 5, 3, 10]), ValueError, "non-decreasing"),
        (np.array([1, 10]), ValueError, "start at 0"),
        (np.array([0, 9]), ValueError, "end at the sequence length T=10"),
        (np.array([0.0, 10.0]), TypeError, "integer dtype"),
        (np.array([True, False]), TypeError, "integer dtype"),
        ([0, 2.5, 10], TypeError, "hold integers"),
        ("0,10", TypeError, "integer array"),
        (np.array([[0, 10]]), ValueError, "1-D"),
        (np.array([0]), ValueError, "N \\+ 1 >= 2"),
    ]
    for c, err, match in bad:
        for fn in (lambda c=c: chunk_gla(q, k, v, g, cu_seqlens=c),
                   lambda c=c: chunk_gla_bwd(q, k, v, g, do, cu_seqlens=c),
                   lambda c=c: recurrent_gla(q, k, v, g, cu_seqlens=c)):  # fmt: skip
            with pytest.raises(err, match=match):
                fn()
    q2 = np.concatenate([q, q])
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_gla(q2, q2, np.concatenate([v, v]), np.concatenate([g, g]), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"initial_state has shape \[3, 2, 4, 3\], expected \[2, 2, 4, 3\]"):
        chunk_gla(q, k, v, g, initial_state=np.concatenate([h0, h0[:1]]), cu_seqlens=cu)
    with pytest.raises(ValueError, match="dht has shape"):
        chunk_gla_bwd(q, k, v, g, do, dht=dht[:1], cu_seqlens=cu)
    with pytest.raises(TypeError, match="initial_state has dtype float32"):
        chunk_gla(q, k, v, g, initial_state=h0.astype(np.float32), cu_seqlens=cu)
    hn = h0.copy()
    hn[1, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="initial_state contains NaN"):
        chunk_gla(q, k, v, g, initial_state=hn, cu_seqlens=cu)
    with pytest.raises(ValueError, match="log forget gate"):
        chunk_gla(q, k, v, np.abs(g), cu_seqlens=cu)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gla(q, k, v, g, chunk_size=0, cu_seqlens=cu)
