"""Argument checks the wrappers in ``gpu/`` share: :func:`hpczeco.base.checks.check_int`."""

from __future__ import annotations

from ..base.checks import check_int

__all__ = ["check_int"]
