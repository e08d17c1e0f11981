"""Fault injection into the checkpoint writer, for the reliability tests (``tests/test_reliability.py``).

``$HPCZECO_FAULT_CKPT`` = ``MODE[:STEP]`` with MODE ``mid-write`` (the process exits abruptly after writing
about half of the datasets into the temporary file) or ``before-rename`` (exits after the temporary file is
complete and fsync'ed, before it is renamed); STEP limits it to that checkpoint step. The process ends with
``os._exit(FAULT_EXIT_CODE)`` (no cleanup, like a crash). Unset (the normal case): no effect.
"""

from __future__ import annotations

import os
import sys

FAULT_ENV = "HPCZECO_FAULT_CKPT"
FAULT_EXIT_CODE = 77
FAULT_MODES = ("mid-write", "before-rename")


def fault_here(mode: str, step: int) -> bool:
    """True when ``$HPCZECO_FAULT_CKPT`` asks for ``mode`` at checkpoint ``step``."""
    env = os.environ.get(FAULT_ENV, "").strip()
    if not env:
        return False
    want, _, at = env.partition(":")
    if want not in FAULT_MODES:
        raise ValueError(f"${FAULT_ENV} must be MODE[:STEP] with MODE in {FAULT_MODES}, got {env!r}")
    return want == mode and (not at or int(at) == step)


def crash(mode: str, step: int) -> None:
    """End the process at once with :data:`FAULT_EXIT_CODE` (no cleanup, no ``finally``), like a crash."""
    sys.stderr.write(f"hpczeco checkpoint: fault injection: exiting abruptly ({mode}) while writing step {step}\n")
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)
