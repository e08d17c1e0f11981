"""hpczeco: ZeCO sequence parallelism (All-Scan) for gated linear attention, and DAAF attention, over MPI.

Public API (imported lazily so ``import hpczeco`` stays cheap and never imports CuPy):

- ``hpczeco.gla``: ``recurrent_gla`` (float64 reference), ``chunk_gla``, ``chunk_gla_bwd``
- ``hpczeco.collectives``: ``scan``/``scan_start`` (ring All-Scan, tree, allgather, serial, exscan)
- ``hpczeco.ZeCOGLA`` / ``hpczeco.zeco_gla``: the sequence-parallel GLA layer
- ``hpczeco.collectives.costmodel``: alpha-beta model of the scans (``hpczeco.collectives.calibrate``: measured)
- ``hpczeco.daaf``: entropy-planned global/local attention
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# In a source checkout used without installing (PYTHONPATH=<repo>), collectives/, gpu/ and drivers/
# sit beside this package rather than inside it: let them import as hpczeco.collectives etc.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_root, "collectives", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

#: what users call, by the module that defines it (imported on first use)
_LAZY = {
    "ZeCOGLA": "hpczeco.zeco",
    "zeco_gla": "hpczeco.zeco",
    "recurrent_gla": "hpczeco.gla",
    "chunk_gla": "hpczeco.gla",
    "chunk_gla_bwd": "hpczeco.gla",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpczeco' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
