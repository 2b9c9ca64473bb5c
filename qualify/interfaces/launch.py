"""The ``qualify`` executable's entry point (``pyproject.toml``'s ``[project.scripts]``): only the
standard library runs before it can answer an interrupt. The command line interface takes a
tenth of a second to import; an interrupt meanwhile ends the process with one line and exit 130
(128 + SIGINT), as an interrupt during a command does, never a traceback.
"""

from __future__ import annotations

import signal
import sys


def console() -> None:
    """Import :mod:`qualify.interfaces.cli` and run its ``console``; an interrupt while it loads
    exits 130 with one line."""
    try:
        from qualify.interfaces import cli
    except KeyboardInterrupt:
        print("qualify: interrupted", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    cli.console()
