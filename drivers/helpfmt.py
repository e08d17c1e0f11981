"""``--help`` formatting shared by the drivers: the module docstring split into description and epilog
(so no paragraph prints twice), and the default of every option shown once.

:class:`HelpFormatter` keeps the docstring's own line breaks (``RawDescriptionHelpFormatter``) and appends
``(default: X)`` to an option's help unless the help already names its default, the default is ``None``
``False`` or ``""`` (an unset option, a flag that is off), or the option has no help text (:func:`check_parser`
says so: every option should say what it is).
"""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "check_parser", "split_doc"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is False or default == ""
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def split_doc(doc: str | None) -> tuple[str, str | None]:
    """``(first paragraph, the rest or None)`` of a module docstring: ``description`` and ``epilog``."""
    parts = (doc or "").strip().split("\n\n", 1)
    return parts[0], (parts[1] if len(parts) > 1 and parts[1].strip() else None)


def check_parser(ap: argparse.ArgumentParser) -> list[str]:
    """The option strings of ``ap``'s options that have no help text (for the tests)."""
    return [a.option_strings[0] for a in ap._actions
            if a.option_strings and not a.help and a.help is not argparse.SUPPRESS]
