"""The process's interrupt signals during a run: SIGINT, SIGTERM and SIGHUP raise
:class:`RunInterrupted` in the main thread while a run lasts (:func:`interrupts_raise`), are held
while a receipt is sealed (:func:`signals_held`), and, for the ``qualify`` executable, are noted
rather than fatal once a run has ended (:func:`hold_interrupts_after_runs`). Signals are
process-wide, and so is this module's state."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

INTERRUPT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a run cleanly: Ctrl-C, a CI cancel or ``kill``, a closed terminal. Each ends the
producer, removes its temporary directory and seals the receipt as incomplete; the process exits
128 + the signal's number (130, 143, 129)."""


class RunInterrupted(KeyboardInterrupt):
    """One of :data:`INTERRUPT_SIGNALS` arrived during a run. A KeyboardInterrupt, so whatever
    stops on Ctrl-C (pytest, the CLI) stops on each; the process exits 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def interrupt_signal(exc: BaseException) -> int:
    """The signal an interrupt came from: its own for :class:`RunInterrupted`, else SIGINT (Python's
    default handler raises a plain KeyboardInterrupt)."""
    return exc.signum if isinstance(exc, RunInterrupted) else int(signal.SIGINT)


@dataclass
class _HeldSignals:
    depth: int = 0
    pending: int | None = None
    raised: int | None = None  # the last interrupt raised, until a run's step caught it


_HELD = _HeldSignals()
"""Signals are process-wide, and so is their holding."""


def _raise_interrupt(signum: int, frame: object) -> None:
    """The run's handler of :data:`INTERRUPT_SIGNALS` (runs in the main thread): raise, or, while a
    receipt is being sealed, note the signal for :func:`signals_held` to raise once it is sealed."""
    if _HELD.depth > 0:
        _HELD.pending = _HELD.pending or signum
        return
    _HELD.raised = signum
    raise RunInterrupted(signum)


def interrupt_caught() -> None:
    """A run's step caught the interrupt its handler raised: nothing is left to raise again."""
    _HELD.raised = None


def raise_swallowed_interrupt() -> None:
    """Raise again an interrupt whose raise never reached the run: a handler that runs inside an
    at-fork callback, a finalizer or a weakref callback has its exception printed as "Exception
    ignored" and dropped (measured: SIGINT landing in logging's at-fork lock release, as the
    consumer forked its cold-ahead child, let the run finish and exit 0). Called between a run's
    steps and at each step's end, so such a signal stops the run at the next boundary."""
    signum, _HELD.raised = _HELD.raised, None
    if signum is not None:
        raise RunInterrupted(signum)


_late_signals: list[int] = []
"""Interrupt signals that arrived after a run ended, noted by :func:`_note_late_signal`."""
_hold_after_runs = False


def hold_interrupts_after_runs() -> None:
    """For the ``qualify`` executable: once a run's :func:`interrupts_raise` ends, an interrupt
    signal is noted instead of restored to its previous disposition. SIGTERM's and SIGHUP's is to
    end the process on the spot, so a signal landing after a run's receipt was sealed and its
    verdict printed would kill the process during its last output or teardown, turning a decided
    exit code into a death by signal. A noted signal stops the next run of the same command, if
    any, as it starts."""
    global _hold_after_runs
    _hold_after_runs = True


def _note_late_signal(signum: int, frame: object) -> None:
    _late_signals.append(signum)


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """For a run's duration: SIGINT, SIGTERM and SIGHUP raise :class:`RunInterrupted` in the main
    thread (so the run's cleanup runs: without a handler SIGTERM and SIGHUP end the process where
    it stands, leaving its producer, its temporary directory and a ``.partial-`` receipt); a signal
    the process ignores (nohup, a background job) stays ignored. The previous handlers come back on
    exit. Outside the main thread, where no handler can be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[signal.Signals, Any] = {}
    for signum in INTERRUPT_SIGNALS:
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN:
            continue
        signal.signal(signum, _raise_interrupt)
        # None: a handler set outside Python; the default is what it meant here.
        previous[signum] = signal.SIG_DFL if current is None else current
    _HELD.raised = None
    try:
        if _late_signals:
            raise RunInterrupted(_late_signals.pop(0))
        yield
    finally:
        _HELD.raised = None  # a run's end forgets: its receipt is sealed, its verdict decided
        for restored, handler in previous.items():
            signal.signal(restored, _note_late_signal if _hold_after_runs else handler)


@contextmanager
def signals_held(*, discard: bool = False) -> Iterator[None]:
    """While a receipt is sealed (or an interrupted run is being stopped), an interrupt signal
    is held, not raised mid-write: raised once the block ends, or ``discard``-ed (a second
    signal while stopping for the first changes nothing). Held only under :func:`interrupts_raise`."""
    _HELD.depth += 1
    try:
        yield
    finally:
        _HELD.depth -= 1
        if _HELD.depth == 0 and _HELD.pending is not None:
            signum, _HELD.pending = _HELD.pending, None
            if not discard:
                raise RunInterrupted(signum)
