"""Streams and events for overlapping GPU work (CuPy), e.g. ZeCO's intra-chunk kernels with the scan.

The GLA kernels in :mod:`hpczeco.gpu.gla` run on CuPy's *current* stream. Pattern used by the ZeCO
layer::

    from hpczeco.gpu import streams
    cs = streams.compute_stream()
    with cs:                                    # intra-chunk work and local states on the compute stream
        o_local, S_local = gla.chunk_gla(q, k, v, g, output_final_state=True)
        G = gla.decay_cumsum(g)
    local_done = streams.record(cs)             # event: local results ready
    streams.wait(local_done)                    # the scan (current stream) needs S_local ...
    S_in = collectives.scan(a, S_local, comm, transport=t)   # ... transport syncs the stream it runs on
    scan_done = streams.record()                # event on the current stream
    with cs:
        streams.wait(scan_done)                 # the correction waits for S_in only
        gla.state_correction(o_local, q, G, S_in)

``compute_stream()`` is one non-blocking stream per device (cached); ``record``/``wait`` wrap
``cupy.cuda.Event``. Nothing here talks MPI.
"""

from __future__ import annotations

from typing import Any

_STREAMS: dict[tuple[str, int], Any] = {}


def _cp():
    import cupy  # noqa: PLC0415

    return cupy


def _named(name: str):
    cp = _cp()
    key = (name, cp.cuda.runtime.getDevice())
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = cp.cuda.Stream(non_blocking=True)
    return s


def compute_stream():
    """The (cached, per-device) non-blocking stream for local compute that overlaps communication."""
    return _named("compute")


def comm_stream():
    """A second cached non-blocking stream, for communication-side device work (combines, copies)."""
    return _named("comm")


def current():
    """CuPy's current stream."""
    return _cp().cuda.get_current_stream()


def record(stream: Any = None):
    """An event recorded now on ``stream`` (default: the current stream)."""
    cp = _cp()
    ev = cp.cuda.Event(block=False, disable_timing=True)
    ev.record(stream if stream is not None else cp.cuda.get_current_stream())
    return ev


def wait(event: Any, stream: Any = None) -> None:
    """Make ``stream`` (default: the current one) wait for ``event`` without blocking the host."""
    (stream if stream is not None else current()).wait_event(event)


def synchronize(stream: Any = None) -> None:
    """Block the host until ``stream`` (default: current) has finished its queued work."""
    (stream if stream is not None else current()).synchronize()
