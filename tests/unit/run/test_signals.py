"""An interrupt whose raise Python drops (a signal handled inside a finalizer or an at-fork
callback is printed as "Exception ignored" and lost) is raised again at a run's next step
boundary, never forgotten while the run lasts."""

from __future__ import annotations

import os
import signal

import pytest

from qualify.run.signals import (
    RunInterrupted,
    interrupt_caught,
    interrupts_raise,
    raise_swallowed_interrupt,
)


class SignalledInFinalizer:
    """Sends the process SIGINT from its finalizer and lingers there, so the run's handler runs
    inside ``__del__``, where Python prints its exception as ignored and drops it."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100_000):  # the handler runs at one of these bytecode boundaries
            pass


# Python hands the dropped exception to sys.unraisablehook, which pytest turns into this warning.
DROPPED = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@DROPPED
def test_an_interrupt_dropped_inside_a_finalizer_is_raised_at_the_next_boundary() -> None:
    with interrupts_raise():
        SignalledInFinalizer()  # collected at once: its finalizer runs, the raise is dropped there
        with pytest.raises(RunInterrupted) as raised:
            raise_swallowed_interrupt()
        assert raised.value.signum == signal.SIGINT
        raise_swallowed_interrupt()  # raised once: nothing is left


def test_a_caught_interrupt_is_not_raised_again() -> None:
    with interrupts_raise():
        with pytest.raises(RunInterrupted):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100_000):
                pass
        interrupt_caught()
        raise_swallowed_interrupt()  # nothing to raise


@DROPPED
def test_a_run_that_ends_forgets_a_dropped_interrupt() -> None:
    with interrupts_raise():
        SignalledInFinalizer()
    with interrupts_raise():
        raise_swallowed_interrupt()  # the next run starts clean
