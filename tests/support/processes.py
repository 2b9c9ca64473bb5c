"""Children a test will signal, started with the signal dispositions a foreground shell gives.

A launcher that ignores SIGINT or SIGHUP (``nohup``, a background job of a non-interactive shell,
many CI runners) passes the ignored disposition down to every child, and the harness rightly keeps
an inherited ignored signal ignored. A test that signals a child therefore sets that child's
dispositions itself: :func:`with_default_signals` puts a tiny exec shim in front of the command,
so the child starts from SIG_DFL however the test run itself was launched (``preexec_fn`` would do
the same, but it is unsafe in a process with threads, as an xdist worker is).
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

SIGNALLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_SHIM = (
    "import os, signal, sys\n"
    f"for signum in {tuple(int(s) for s in SIGNALLED)}:\n"
    "    signal.signal(signum, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def with_default_signals(command: list[str]) -> list[str]:
    """``command`` started with SIGINT, SIGTERM and SIGHUP at their default dispositions."""
    return [sys.executable, "-c", _SHIM, *command]


@contextlib.contextmanager
def default_dispositions() -> Iterator[None]:
    """For a test that signals its own process: SIGINT, SIGTERM and SIGHUP at the dispositions a
    foreground run has (Python's KeyboardInterrupt handler for SIGINT, SIG_DFL for the others)
    while it runs, whatever the launcher left; the previous ones afterwards."""
    previous = {signum: signal.getsignal(signum) for signum in SIGNALLED}
    try:
        for signum in SIGNALLED:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
