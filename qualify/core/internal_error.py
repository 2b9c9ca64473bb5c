"""Internal errors: an exception that no refusal, failed step or interrupt explains is a bug in the
harness. It exits with its own code, :data:`EXIT_INTERNAL_ERROR` (70, ``EX_SOFTWARE`` of BSD's
sysexits), so an operator or CI tells a harness bug from a refused contract (2) or a failed
qualification (1). The operator sees one line naming the exception and where its traceback was
saved: in the run's receipt when the run has one (``evidence/internal-error.json``, written by
:mod:`qualify.run.qualification`), else a file under the user state directory
(``$XDG_STATE_HOME/trust-ladder/tracebacks/``, else the temporary directory).

Imports only the standard library and ``platformdirs``.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import tempfile
import traceback
from pathlib import Path

import platformdirs

EXIT_INTERNAL_ERROR = 70
"""The exit code of a harness bug (sysexits ``EX_SOFTWARE``): distinct from 0 qualified, 1 not
qualified, 2 refused, and 128 + N for a run stopped by signal N."""

_MESSAGE_LIMIT = 200


class InternalError(Exception):
    """A harness bug whose traceback is already saved at ``traceback_path``; the message is the
    one line to print (it names that path)."""

    def __init__(self, message: str, traceback_path: Path | None) -> None:
        super().__init__(message)
        self.traceback_path = traceback_path


def described(exc: BaseException) -> str:
    """``Type: message`` on one bounded line (the message of an unexpected exception may be long)."""
    text = " ".join(str(exc).split())[:_MESSAGE_LIMIT]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def traceback_lines(exc: BaseException) -> list[str]:
    """The exception's traceback (its causes included), one string per line."""
    return "".join(traceback.format_exception(exc)).splitlines()


def traceback_directory() -> Path:
    """Where tracebacks with no receipt to go into are saved: the user state directory's ``tracebacks``."""
    return Path(platformdirs.user_state_dir("trust-ladder", appauthor=False)) / "tracebacks"


def save_traceback(exc: BaseException, directory: Path | None = None) -> Path | None:
    """Write ``exc``'s traceback, with the command line and the time, to a new file in
    ``directory`` (default :func:`traceback_directory`; the temporary directory when that cannot be
    written); returns its path, or None when neither can be written."""
    moment = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    text = "\n".join([f"command: {' '.join(sys.argv)}", f"utc: {moment}", *traceback_lines(exc)]) + "\n"
    for place in (directory or traceback_directory(), Path(tempfile.gettempdir())):
        try:
            place.mkdir(parents=True, exist_ok=True, mode=0o700)
            descriptor, name = tempfile.mkstemp(prefix=f"qualify-{moment}-", suffix=".traceback.txt", dir=place)
        except OSError:
            continue
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        return Path(name)
    return None


def internal_error_line(what: str, traceback_path: Path | None) -> str:
    """The one line an operator sees: ``internal error (a bug in the harness): <what>; traceback: <path>``."""
    where = traceback_path if traceback_path is not None else "not saved (no writable directory; QUALIFY_DEBUG=1 prints it)"
    return f"internal error (a bug in the harness): {what}; traceback: {where}"
