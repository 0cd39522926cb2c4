"""What every ``specdial`` command shares: its logging setup and how it reports an error.

- :func:`setup_logging`: log records at ``level`` and above to stderr, one line each
  (``time LEVEL logger: message``), with the ``specdial`` loggers at that level too.
- :func:`cli_error`: ``specdial: error: <message>`` on stderr and exit status 2 (argparse's
  status for a usage error), for bad input a command rejects with a clear message.
- :class:`StrictParser`: the parser class of every subcommand, which names an unknown option.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

#: Exit status of a command that rejected its input (argparse uses 2 for usage errors).
EXIT_BAD_INPUT = 2


def setup_logging(level: str) -> None:
    """Configure the root logger for a command run: ``level`` is a logging level name
    (``"debug"``, ``"info"``, ``"warning"``, ``"error"``, any case); raises ``ValueError`` for
    another name."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdial").setLevel(level.upper())


def cli_error(message: Any) -> int:
    """Print ``specdial: error: <message>`` to stderr; returns :data:`EXIT_BAD_INPUT`."""
    print(f"specdial: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


class StrictParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that refuses an unknown ``--option`` by name before parsing.

    Plain argparse sets an unknown option aside and takes the value after it as the next
    positional, here a subcommand, so the error named the value (``invalid choice: '4'``) and
    not the option. Only the tokens before this parser's subcommand are checked (the
    subcommand's own parser checks the rest); a token with a space is a positional, as for
    argparse, and ``--`` ends the options. Abbreviations argparse accepts are accepted.
    :attr:`hints` maps a flag this parser does not take (another tool's) to what to use
    instead, added to the error."""

    #: unknown flag -> what to use instead (set per parser; empty by default)
    hints: dict[str, str] = {}

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> Any:
        """Refuse (``error``, exit status 2) the first unknown ``--option`` of ``args``, then
        parse as argparse does."""
        if args is not None:
            unknown = self._first_unknown(list(args))
            if unknown is not None:
                hint = self.hints.get(unknown)
                self.error(f"{unknown}: {hint}" if hint else f"unrecognized option {unknown} "
                           "(see --help for this command's options)")
        return super().parse_known_args(args, namespace)

    def _first_unknown(self, args: list[str]) -> str | None:
        known = [s for a in self._actions for s in a.option_strings]
        commands = {name for a in self._actions if a.nargs == argparse.PARSER
                    for name in a.choices}
        for token in args:
            if token == "--" or token in commands:
                return None
            if not token.startswith("--") or " " in token:
                continue
            name = token.split("=", 1)[0]
            if not any(s == name or (self.allow_abbrev and s.startswith(name)) for s in known):
                return name
        return None
