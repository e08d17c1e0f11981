"""The scans' cost model under its public name: :mod:`hpczeco.collectives.costmodel` (formulas, presets,
the ``"auto"`` pick) and :mod:`hpczeco.collectives.calibrate` (measuring the running machine).

Kept so ``hpczeco.costmodel`` (named in the package docstring) still imports; the code lives with the
collectives it models.
"""

from __future__ import annotations

from .collectives.calibrate import calibrate, measure_combine
from .collectives.costmodel import (
    LINK_ENV,
    PRESETS,
    LinkParams,
    allgather_time,
    best_blocks,
    choose,
    default_params,
    exscan_time,
    parse_link,
    predict,
    predict_hier,
    preset,
    ring_time,
    serial_time,
    set_default_params,
    tree_time,
    with_name,
)

__all__ = [
    "LinkParams",
    "PRESETS",
    "preset",
    "parse_link",
    "default_params",
    "set_default_params",
    "ring_time",
    "best_blocks",
    "serial_time",
    "tree_time",
    "allgather_time",
    "exscan_time",
    "predict",
    "choose",
    "calibrate",
    "predict_hier",
    "measure_combine",
    "with_name",
    "LINK_ENV",
]
