"""``--help`` formatting shared by the drivers: the module docstring split into description and epilog
(so no paragraph prints twice), and the default of every option shown once.

:class:`HelpFormatter` keeps the docstring's own line breaks (``RawDescriptionHelpFormatter``) and appends
``(default: X)`` to an option's help unless the help already names its default, the default is ``None``
``False`` or ``""`` (an unset option, a flag that is off), or the option has no help text (:func:`check_parser`
says so: every option should say what it is).
"""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "check_parser", "split_doc", "topology_list"]


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


def topology_list(text: str) -> list[str]:
    """The ``--topologies`` of a bench (argparse ``type``): a comma list of scan topologies, each checked by the
    collectives' one rule (:func:`hpczeco.collectives.names.check_topology`); a bad name is a usage error."""
    from hpczeco.collectives.names import check_topology  # noqa: PLC0415

    names = [t.strip() for t in text.split(",") if t.strip()]
    try:
        for t in names:
            check_topology(t)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return names


def check_parser(ap: argparse.ArgumentParser) -> list[str]:
    """The option strings of ``ap``'s options that have no help text (for the tests)."""
    return [a.option_strings[0] for a in ap._actions
            if a.option_strings and not a.help and a.help is not argparse.SUPPRESS]
