"""What every ``specdial`` command shares: its logging setup and how it reports an error.

- :func:`setup_logging`: log records at ``level`` and above to stderr, one line each
  (``time LEVEL logger: message``), with the ``specdial`` loggers at that level too.
- :func:`cli_error`: ``specdial: error: <message>`` on stderr and exit status 2 (argparse's
  status for a usage error), for bad input a command rejects with a clear message.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

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
