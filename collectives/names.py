"""The names the collectives accept and their one set of rules: scan topologies, ring blocks, transports.

Every layer that takes one of these parameters (the scans, the relay, the cost model, the drivers,
the ZeCO layer) checks it with the function here, so a parameter has one rule and one message:

* :data:`TOPOLOGIES` / :func:`check_topology`: the scan algorithms (``"auto"`` = the cost model's pick);
* :func:`check_blocks`: the piece count of the ring and of ``ptree``, an int in ``1..K`` (or ``None`` = the cost
  model's);
* :data:`TRANSPORT_NAMES` / :func:`check_transport_name`: transports by name; the device kinds
  (:data:`DEVICE_TRANSPORT_KINDS`, :func:`check_device_kind`) and :data:`TRANSPORT_ENV`, the variable naming
  the default one (read once per communicator, where its context is made: :mod:`.context`).

Plain data and checks (no MPI, no arrays): the transports themselves are chosen and cached in
:mod:`.selection`. Knows nothing about attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "TOPOLOGIES",
    "ALGORITHMS",
    "PROGRESS_MODES",
    "TRANSPORT_NAMES",
    "DEVICE_TRANSPORT_KINDS",
    "TRANSPORT_ENV",
    "check_topology",
    "check_blocks",
    "check_progress",
    "check_transport_name",
    "check_device_kind",
]

#: accepted values of ``topology``: the six algorithms and "auto" (the cost model's pick); "ptree" is the
#: doubly pipelined in-order binary tree (:mod:`.pipetree`)
TOPOLOGIES = ("ring", "tree", "allgather", "serial", "exscan", "ptree", "auto")
#: the algorithms themselves (``TOPOLOGIES`` without "auto")
ALGORITHMS = tuple(t for t in TOPOLOGIES if t != "auto")
#: accepted values of ``progress`` (:func:`hpczeco.collectives.scan.scan_start`)
PROGRESS_MODES = ("poll", "thread")
#: transport names accepted in place of a Transport object ("auto", like None: ``$HPCZECO_TRANSPORT``, else detection)
TRANSPORT_NAMES = ("host", "auto", "cuda-aware", "staged", "nccl")
#: the device transports (CuPy buffers) by name; "auto" picks one (:func:`.device.resolve_kind`)
DEVICE_TRANSPORT_KINDS = ("auto", "cuda-aware", "staged", "nccl")
#: environment variable naming the device transport: "cuda-aware", "staged", "nccl" or "auto"
TRANSPORT_ENV = "HPCZECO_TRANSPORT"


def check_topology(topology: Any) -> None:
    """Raise ``ValueError`` unless ``topology`` is one of :data:`TOPOLOGIES`."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")


def check_blocks(blocks: Any, K: int | None = None) -> None:
    """The piece count of the ring and of ``ptree``: ``None`` (the cost model's choice) or an int in ``1..K``.

    ``TypeError`` for a non-int (bools too); ``ValueError`` outside ``1..K``, or below 1 when ``K``
    is not known yet (a layer that checks its options before it sees the arrays).
    """
    if blocks is None:
        return
    if isinstance(blocks, (bool, np.bool_)) or not isinstance(blocks, (int, np.integer)):
        raise TypeError(f"blocks must be an int or None, got {type(blocks).__name__}")
    if K is None:
        if int(blocks) < 1:
            raise ValueError(f"blocks must be an int >= 1 or None, got {blocks}")
    elif not 1 <= int(blocks) <= K:
        raise ValueError(f"blocks must be in 1..K={K}, got {blocks}")


def check_progress(progress: Any) -> None:
    """Raise ``ValueError`` unless ``progress`` is one of :data:`PROGRESS_MODES`."""
    if progress not in PROGRESS_MODES:
        raise ValueError(f"progress must be one of {PROGRESS_MODES}, got {progress!r}")


def check_transport_name(name: str, device: bool) -> None:
    """A transport given by name: one of :data:`TRANSPORT_NAMES`; a device kind only for ``device`` buffers."""
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"transport must be one of {TRANSPORT_NAMES}, a Transport or None, got {name!r}")
    if name not in ("host", "auto") and not device:
        raise ValueError(f"transport {name!r} needs device (CuPy) arrays; these are host arrays")


def check_device_kind(kind: Any) -> None:
    """Raise ``ValueError`` unless ``kind`` is one of :data:`DEVICE_TRANSPORT_KINDS`."""
    if kind not in DEVICE_TRANSPORT_KINDS:
        raise ValueError(f"transport kind must be one of {DEVICE_TRANSPORT_KINDS}, got {kind!r}")

