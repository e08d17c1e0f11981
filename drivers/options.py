"""Checked option types for the drivers' parsers: every number is checked where it enters.

Each function returns an ``argparse`` ``type=``: a value outside its range, not finite, or not a number is a usage
error that names the option (``argument --tokens: must be an integer >= 1, got '0'``), exit status 2, before any
work. ``tests/test_reliability_inputs.py`` checks that no parser of the commands takes a bare ``int`` or ``float``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["int_range", "float_range", "int_list", "size_bytes", "size_list", "link_text", "as_text", "BARE_TYPES"]

#: what a parser must not use as an option type (unchecked: ``nan``, ``-1``, ``0`` pass)
BARE_TYPES = (int, float)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {_num(lo)}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {_num(hi)}")
    return " and ".join(parts)


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An int in ``[lo, hi]`` (either bound may be None)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = _bounds(lo, hi)
            raise argparse.ArgumentTypeError(f"must be an integer{' ' + rng if rng else ''}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def float_range(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                hi_open: bool = False) -> Callable[[str], float]:
    """A finite float in the range (``lo_open``/``hi_open``: the bound itself excluded)."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        ok = math.isfinite(value)
        if ok and lo is not None:
            ok = value > lo if lo_open else value >= lo
        if ok and hi is not None:
            ok = value < hi if hi_open else value <= hi
        if not ok:
            rng = _bounds(lo, hi, lo_open, hi_open)
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + rng if rng else ''}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def int_list(lo: int | None = None, hi: int | None = None) -> Callable[[str], list[int]]:
    """A non-empty comma list of ints in ``[lo, hi]``."""
    one = int_range(lo, hi)

    def parse(text: str) -> list[int]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"needs a comma list of integers, got {text!r}")
        try:
            return [one(t) for t in items]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"every item {exc}") from None

    parse.__name__ = "int list"
    return parse


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size_bytes(allow_zero: bool = False) -> Callable[[str], int]:
    """A size in bytes: ``4096``, ``4K``, ``1M``, ``64MiB``, ``1.5G`` -- finite, positive (or 0 with
    ``allow_zero``), a whole number of bytes."""

    def parse(text: str) -> int:
        t = text.strip().upper().removesuffix("IB").removesuffix("B")
        mult = _UNITS.get(t[-1:], 1)
        num = t[:-1] if t[-1:] in _UNITS else t
        try:
            value = float(num) * mult
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) or (0 < value < 1):
            need = "0 or a positive size" if allow_zero else "a positive size"
            raise argparse.ArgumentTypeError(f"must be {need} in bytes (e.g. 4096, 4K, 1M, 64M), got {text!r}")
        return int(value)

    parse.__name__ = "size"
    return parse


def size_list() -> Callable[[str], list[int]]:
    """A non-empty comma list of positive sizes (:func:`size_bytes`)."""
    one = size_bytes()

    def parse(text: str) -> list[int]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"needs a comma list of sizes (e.g. 4K,1M), got {text!r}")
        try:
            return [one(t) for t in items]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"every item {exc}") from None

    parse.__name__ = "size list"
    return parse


def link_text(text: str) -> str:
    """A link: a preset name or the link's numbers, checked (:func:`hpczeco.collectives.costmodel.parse_link`); the
    text itself is kept."""
    from hpczeco.collectives.costmodel import parse_link  # noqa: PLC0415

    try:
        parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def as_text(parse: Callable[[str], object]) -> Callable[[str], str]:
    """``parse``'s check, keeping the text itself (for options passed on to another command as they are)."""

    def check(text: str) -> str:
        parse(text)
        return text

    check.__name__ = getattr(parse, "__name__", "value")
    return check
