"""The library's ``HPCZECO_*`` environment variables: one parser each, one message for a bad value.

Every rank reads them when the library first meets a communicator (:mod:`.context`), and they are agreed there:
a value that a parser refuses on any rank, or a value that must be the same everywhere and is not, raises the
same :class:`~.errors.CollectiveInputError` on every rank, before any other message. The single-process readers
(:func:`collective_timeout`, :func:`cuda_aware`, :func:`gla_threads`, ...) use the same parsers, so a value is
never accepted in one place and ignored in another.

============================= ============================================ ===========================
variable                      accepted values                              the same on every rank?
============================= ============================================ ===========================
HPCZECO_COLLECTIVE_TIMEOUT    seconds > 0; ``0``/``off``/``none`` disables  yes (unset: the default,
                              it; unset: :data:`DEFAULT_TIMEOUT_S`         600 s)
HPCZECO_TRANSPORT             ``auto``, ``cuda-aware``, ``staged``,        yes
                              ``nccl``
HPCZECO_CUDA_AWARE            ``1/true/yes/on``, ``0/false/no/off``        yes
HPCZECO_LINK                  a link preset or ``alpha,beta[,...]``        yes
                              (:func:`.costmodel.parse_link`)
HPCZECO_POOL_MB               MiB >= 0                                     no (per rank)
HPCZECO_GLA_THREADS           an int >= 1                                  no (per rank)
HPCZECO_TRACEBACK             ``0``/``1`` (and the other flag words)       no (per rank)
============================= ============================================ ===========================

Unset or empty means "not set" for each. Plain parsing, no MPI. Knows nothing about attention.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from hpczeco.base.checks import env_positive_int

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SETTINGS",
    "AGREED",
    "TIMEOUT_ENV",
    "parse_timeout",
    "collective_timeout",
    "parse_flag",
    "cuda_aware",
    "gla_threads",
    "pool_bytes",
    "read_all",
]

#: seconds a collective wait may take by default: long enough for a first call that compiles kernels (10-30 s on
#: a loaded node), for a large checkpoint written by rank 0 while the others wait, and for a slow file system; short
#: enough that a hung allocation ends within minutes (PyTorch's process groups default to 10 minutes too)
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "HPCZECO_COLLECTIVE_TIMEOUT"
_OFF = ("0", "off", "none", "no", "false", "never")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env(name: str, environ: Mapping[str, str] | None = None) -> str:
    return (os.environ if environ is None else environ).get(name, "").strip()


def parse_timeout(text: str) -> float | None:
    """``$HPCZECO_COLLECTIVE_TIMEOUT``: the default (:data:`DEFAULT_TIMEOUT_S`) when empty, None (no timeout) for
    ``0``/``off``/``none``, else a positive finite number of seconds; ``ValueError`` otherwise."""
    t = text.strip().lower()
    if not t:
        return DEFAULT_TIMEOUT_S
    if t in _OFF:
        return None
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV} must be a number of seconds (0 or off: no timeout), got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"${TIMEOUT_ENV} must be a positive finite number of seconds (0 or off: no timeout), "
                         f"got {text!r}")
    return value


def collective_timeout(environ: Mapping[str, str] | None = None) -> float | None:
    """This process's collective timeout (seconds, None: none) from ``$HPCZECO_COLLECTIVE_TIMEOUT``."""
    return parse_timeout(_env(TIMEOUT_ENV, environ))


def parse_flag(name: str) -> Callable[[str], bool | None]:
    """A parser of a yes/no variable: True for 1/true/yes/on, False for 0/false/no/off, None when empty."""

    def parse(text: str) -> bool | None:
        t = text.strip().lower()
        if not t:
            return None
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        raise ValueError(f"${name} must be one of 1/true/yes/on or 0/false/no/off, got {text!r}")

    return parse


def _parse_transport(text: str) -> str:
    from .names import DEVICE_TRANSPORT_KINDS, TRANSPORT_ENV  # noqa: PLC0415

    t = text.strip() or "auto"
    if t not in DEVICE_TRANSPORT_KINDS:
        raise ValueError(f"${TRANSPORT_ENV} must be one of {', '.join(DEVICE_TRANSPORT_KINDS)} (or unset), "
                         f"got {text!r}")
    return t


def _parse_link(text: str) -> str | None:
    from .costmodel import LINK_ENV, parse_link  # noqa: PLC0415

    if not text.strip():
        return None
    try:
        parse_link(text)
    except ValueError as exc:
        raise ValueError(f"${LINK_ENV}: {exc}") from None
    return text.strip()


def _parse_pool(text: str) -> float | None:
    if not text.strip():
        return None
    try:
        mb = float(text)
    except ValueError:
        mb = float("nan")
    if not (math.isfinite(mb) and mb >= 0):
        raise ValueError(f"$HPCZECO_POOL_MB must be a number of MiB >= 0, got {text!r}")
    return mb


def _parse_threads(text: str) -> int | None:
    return env_positive_int("HPCZECO_GLA_THREADS", text)


#: variable -> parser (the value's meaning, or ``ValueError`` with the message)
SETTINGS: dict[str, Callable[[str], Any]] = {
    TIMEOUT_ENV: parse_timeout,
    "HPCZECO_TRANSPORT": _parse_transport,
    "HPCZECO_CUDA_AWARE": parse_flag("HPCZECO_CUDA_AWARE"),
    "HPCZECO_LINK": _parse_link,
    "HPCZECO_POOL_MB": _parse_pool,
    "HPCZECO_GLA_THREADS": _parse_threads,
    "HPCZECO_TRACEBACK": parse_flag("HPCZECO_TRACEBACK"),
}
#: the variables that must mean the same on every rank of a communicator
AGREED = (TIMEOUT_ENV, "HPCZECO_TRANSPORT", "HPCZECO_CUDA_AWARE", "HPCZECO_LINK")


def read_all(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, Any, str | None]]:
    """Every variable of :data:`SETTINGS`: ``name -> (raw text, parsed value or None, error message or None)``."""
    out = {}
    for name, parse in SETTINGS.items():
        raw = _env(name, environ)
        try:
            out[name] = (raw, parse(raw), None)
        except ValueError as exc:
            out[name] = (raw, None, str(exc))
    return out


def cuda_aware(environ: Mapping[str, str] | None = None) -> bool | None:
    """``$HPCZECO_CUDA_AWARE``: True (declared CUDA-aware), False (forbidden), None (unset: detect)."""
    return SETTINGS["HPCZECO_CUDA_AWARE"](_env("HPCZECO_CUDA_AWARE", environ))


def gla_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """``$HPCZECO_GLA_THREADS`` (None when unset)."""
    return _parse_threads(_env("HPCZECO_GLA_THREADS", environ))


def pool_bytes(environ: Mapping[str, str] | None = None, default_mb: float = 512.0) -> int:
    """``$HPCZECO_POOL_MB`` in bytes (``default_mb`` when unset)."""
    mb = _parse_pool(_env("HPCZECO_POOL_MB", environ))
    return int((default_mb if mb is None else mb) * (1 << 20))
