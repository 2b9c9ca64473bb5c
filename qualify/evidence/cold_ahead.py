"""Cold branches computed ahead, in a forked child, while the handoffs run.

Every handoff is compared with a cold local recompute of its own (``HostComparer``), and that
recompute does not depend on the handoff. Computed in line it doubles the consumer's work on the
run's critical path while the producer's process and a second core wait; computed ahead in a
child it runs beside the producer's prefill and the consumer's decode.

The child is a fork of the consumer's process: the same engine object, its weights shared
copy-on-write, the same arithmetic. The numpy engines' bits do not depend on the process, its
thread count or how BLAS splits the work (:mod:`qualify.core.numerics`), so a branch from the child
is the branch an in-line recompute gives; the tests compare them bit for bit. Only an engine that
declares ``fork_safe`` (pure numpy: no thread pool, device or open session a fork would break) is
forked; any other recomputes in line, as before.

The child closes every descriptor it inherited but its pipe and standard streams (a producer's
socket or pipe held open there would hide the parent's end from the producer), takes the default
disposition of the stop signals (the run's handlers stay the parent's; an operator's Ctrl-C stops
it), sends each branch as it is done and stops when its parent is gone. The parent gives up on
a child whose CPU time stands still for 30 s (a fork can inherit a lock another thread held). A branch the child does not
deliver (killed, or the engine raised there) is recomputed in line, where the same code raises the
same error, so a child never changes what a run concludes, only when it is known.

Two schedules use it: a qualification's comparer forks at its reference step for the cold
branch of every handoff (one prompt; the first runs beside the first handoff's prefill and decode
rather than before them); a calibration plans the branch of every handoff, each cell with its own
prompt (:class:`PlannedColdBranches`).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import resource
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult, Engine

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A child whose CPU time stands still this long is stuck (a cold branch is CPU work throughout).
STALLED_AFTER_S = 30.0
POLL_S = 0.5


def cpu_ticks(pid: int | None) -> int | None:
    """User plus system clock ticks ``pid`` has run (Linux ``/proc``), or None once it is gone
    or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime


def forks_cleanly(engine: object) -> bool:
    """Whether ``engine`` declares that a forked child may run it (else the engine it wraps, as a
    :class:`~qualify.engines.base.LaneEngine` does), and this platform forks."""
    declared = getattr(engine, "fork_safe", None)
    if declared is None:
        declared = getattr(getattr(engine, "engine", None), "fork_safe", None)
    return declared is True and "fork" in multiprocessing.get_all_start_methods()


def _close_inherited(keep: int) -> None:
    """Close every descriptor above the standard streams but ``keep``."""
    highest = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    os.closerange(3, keep)
    os.closerange(keep + 1, highest if highest != resource.RLIM_INFINITY else 1 << 16)


def _serve(compute: Callable[[], Any], count: int, sender: Connection, parent: int) -> None:
    """The child: ``count`` branches, each sent as ``("branch", value)``, or one
    ``("error", line)`` and stop."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _close_inherited(sender.fileno())
    for _ in range(count):
        if os.getppid() != parent:
            return  # the run is gone: nobody will read
        try:
            message: tuple[str, Any] = ("branch", compute())
        except BaseException as exc:  # recomputed in line by the parent, which raises it there
            message = ("error", f"{type(exc).__name__}: {exc}")
        try:
            sender.send(message)
        except Exception:  # the parent closed its end or is gone (or the branch would not pickle, and
            return  # the parent recomputes it): stop without a word on the operator's terminal
        if message[0] == "error":
            return


def _note_stop_signals(noted: list[int]) -> dict[int, Any]:
    """Replace each stop signal's Python handler with one that appends the signal to ``noted``;
    returns the replaced handlers (none outside the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    replaced: dict[int, Any] = {}
    for signum in STOP_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):  # a default or ignored disposition runs no Python code
            replaced[signum] = signal.signal(signum, lambda received, frame: noted.append(received))
    return replaced


class BranchesAhead:
    """``count`` results of ``compute()``, computed in order by a forked child from the moment
    this is made. :meth:`next` returns the next one, or None where the child did not deliver it."""

    def __init__(self, compute: Callable[[], Any], count: int, *, stalled_after_s: float = STALLED_AFTER_S) -> None:
        self.stalled_after_s = stalled_after_s
        context = multiprocessing.get_context("fork")
        receiver, sender = context.Pipe(duplex=False)
        self.child = context.Process(target=_serve, args=(compute, count, sender, os.getpid()),
                                     name="qualify-cold-ahead", daemon=True)
        self._receiver: Connection | None = receiver
        self.undelivered: str | None = None  # why the child stopped delivering, once it has
        # A stop signal whose handler raises inside the fork's at-fork callbacks (logging's lock
        # release) has its exception printed as "Exception ignored" and dropped: while the child
        # starts, the handlers only note a signal, which is raised again once it has started, in
        # line here, with the child this object's to stop.
        noted: list[int] = []
        handlers = _note_stop_signals(noted)
        try:
            self.child.start()  # multiprocessing flushes stdout and stderr first: nothing printed twice
        finally:
            sender.close()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        if noted:
            try:
                signal.raise_signal(noted[0])  # its handler runs here, in this thread
            except BaseException:
                self.close("the run was stopped as the child started")
                raise

    def next(self) -> Any | None:
        """The child's next branch (waiting for it), or None: the child ended or failed (its
        reason in :attr:`undelivered`) and the caller computes the branch itself."""
        receiver = self._receiver
        if receiver is None:
            return None
        try:
            if not self._wait_while_it_works(receiver):
                self.close(f"the child used no CPU time for {self.stalled_after_s:g} s (stuck)")
                return None
            kind, value = receiver.recv()
        except (EOFError, OSError) as exc:
            self.close(f"the child ended without it ({type(exc).__name__}; exit code {self._reap()})")
            return None
        if kind != "branch":
            self.close(f"the child failed: {value}")
            return None
        return value

    def _wait_while_it_works(self, receiver: Connection) -> bool:
        """Wait until the child has sent something (or ended); False if meanwhile its CPU time
        stood still for ``stalled_after_s``. A fork of a process with threads can inherit a lock
        another thread held, and a child stuck on it must not hang the run: its branch is then
        computed in line."""
        last_ticks, still_since = cpu_ticks(self.child.pid), time.monotonic()
        while not receiver.poll(POLL_S):
            ticks = cpu_ticks(self.child.pid)
            if ticks is None or ticks != last_ticks:  # ended (recv sees EOF) or working
                last_ticks, still_since = ticks, time.monotonic()
                if ticks is None:
                    return True
            elif time.monotonic() - still_since >= self.stalled_after_s:
                return False
        return True

    def _reap(self) -> int | None:
        self.child.join(timeout=5.0)
        return self.child.exitcode

    def close(self, reason: str = "closed") -> None:
        """Stop the child (if it still runs) and reap it; later :meth:`next` calls return None."""
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
            self.undelivered = reason
        if self.child.is_alive():
            self.child.kill()
        self.child.join(timeout=5.0)


ColdBranch = tuple[KVCache, DecodeResult, float]
"""A cold local recompute: the consumer's own KV, its greedy decode, and the seconds both took."""


def cold_branch(consumer: Engine, prompt: np.ndarray, handoff_positions: int, output_tokens: int) -> ColdBranch:
    """The consumer's own prefill of ``prompt[:handoff_positions]``, then the pending tokens and
    ``output_tokens`` greedy tokens decoded from it, as every handoff of that split is."""
    started = time.perf_counter()
    kv = consumer.prefill(prompt[:handoff_positions])
    result = consumer.decode(kv, prompt[handoff_positions:], output_tokens)
    return kv, result, time.perf_counter() - started


def branch_key(prompt: np.ndarray, handoff_positions: int, output_tokens: int) -> tuple[str, int, int]:
    """What a cold branch is the branch of: the prompt's tokens (SHA-256 of int64), its split and
    the decoded length."""
    tokens = np.ascontiguousarray(prompt, dtype=np.int64)
    return hashlib.sha256(tokens.tobytes()).hexdigest(), int(handoff_positions), int(output_tokens)


class PlannedColdBranches:
    """The cold branches of a run whose handoffs are known before it starts and bring prompts of
    their own (a calibration's cells, then its anchors: one branch per handoff, in order),
    computed by a forked child of the consumer from the moment this is made. A comparer takes the
    next one only when it is the branch of the comparer's own prompt, split and length; any other
    request ends the plan, and that branch and every later one are recomputed in line."""

    def __init__(self, consumer: Engine, handoffs: Sequence[tuple[np.ndarray, int]], output_tokens: int) -> None:
        planned = [(np.array(prompt, copy=True), positions) for prompt, positions in handoffs]
        self._expected = deque(branch_key(prompt, positions, output_tokens) for prompt, positions in planned)
        pending = iter(planned)

        def compute() -> ColdBranch:
            prompt, positions = next(pending)
            return cold_branch(consumer, prompt, positions, output_tokens)

        self.ahead = BranchesAhead(compute, len(planned))

    def take(self, prompt: np.ndarray, handoff_positions: int, output_tokens: int) -> ColdBranch | None:
        """The next planned branch if it is this one's, else None (and the plan ends)."""
        if not self._expected:
            return None
        if self._expected.popleft() != branch_key(prompt, handoff_positions, output_tokens):
            self.close("a branch out of the plan's order was asked for")
            return None
        branch: ColdBranch | None = self.ahead.next()
        return branch

    def close(self, reason: str = "closed") -> None:
        """Stop the child; every later branch is recomputed in line."""
        self._expected.clear()
        self.ahead.close(reason)
