"""Cold branches computed ahead in a forked child: delivered in order and equal to an in-line
recompute bit for bit, or left to the caller (the child failed, died or ran out); the child holds
none of the run's descriptors, stops on an interrupt of its own and is always reaped."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import select
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from qualify.contract.lanes import DEFAULT_NATIVE_TEXT_LANE, lane_spec
from qualify.core import assets
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult
from qualify.engines.factory import build_consumer
from qualify.evidence.cold_ahead import BranchesAhead, PlannedColdBranches, cold_branch, forks_cleanly
from qualify.evidence.compare import parse_logit_transform
from qualify.evidence.comparers import ComparerSetup, HostComparer

# Every fork this process makes (one registration for the whole session: it cannot be undone).
FORKS: list[int] = []
os.register_at_fork(after_in_parent=lambda: FORKS.append(1))


def _slow() -> None:
    time.sleep(60)


@pytest.fixture
def ahead_of():
    """Make BranchesAhead; every one made is closed after the test."""
    made: list[BranchesAhead] = []

    def make(compute, count: int) -> BranchesAhead:
        made.append(BranchesAhead(compute, count))
        return made[-1]

    yield make
    for ahead in made:
        ahead.close()


def test_branches_arrive_in_order_then_the_caller_computes(ahead_of) -> None:
    counter = itertools.count()
    ahead = ahead_of(lambda: np.full(3, next(counter), dtype=np.int64), 2)
    assert [ahead.next().tolist(), ahead.next().tolist()] == [[0, 0, 0], [1, 1, 1]]
    assert ahead.next() is None and "ended without it" in ahead.undelivered
    assert ahead.child.exitcode == 0


def test_a_failing_compute_is_left_to_the_caller(ahead_of) -> None:
    def fail() -> None:
        raise ValueError("activations contain non-finite values")

    ahead = ahead_of(fail, 3)
    assert ahead.next() is None
    assert ahead.undelivered == "the child failed: ValueError: activations contain non-finite values"
    assert ahead.next() is None and not ahead.child.is_alive()


def test_a_killed_child_is_reaped_and_its_branch_left_to_the_caller(ahead_of) -> None:
    ahead = ahead_of(_slow, 1)
    os.kill(ahead.child.pid, signal.SIGKILL)
    assert ahead.next() is None
    assert ahead.child.exitcode == -signal.SIGKILL and "exit code -9" in ahead.undelivered


def test_the_child_holds_none_of_the_parents_descriptors(ahead_of) -> None:
    # A producer's socket or pipe held open in the child would hide the run's end from the producer.
    read_end, write_end = os.pipe()
    try:
        ahead = ahead_of(_slow, 1)
        os.close(write_end)
        readable, _, _ = select.select([read_end], [], [], 10.0)
        assert readable and os.read(read_end, 1) == b""  # end of file while the child still runs
        assert ahead.child.is_alive()
    finally:
        os.close(read_end)


def test_an_interrupt_stops_the_child_and_not_the_run(ahead_of) -> None:
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        ahead = ahead_of(_slow, 1)
        time.sleep(0.2)  # the child has set its own dispositions
        os.kill(ahead.child.pid, signal.SIGINT)
        assert ahead.next() is None
        assert ahead.child.exitcode == -signal.SIGINT and caught == []
    finally:
        signal.signal(signal.SIGINT, previous)


# A SIGINT sent to this process from inside the fork's after-in-parent callbacks (where a handler
# raising would have its exception printed as "Exception ignored" and dropped), while armed.
SIGINT_IN_FORK = threading.Event()
os.register_at_fork(after_in_parent=lambda: SIGINT_IN_FORK.is_set() and os.kill(os.getpid(), signal.SIGINT))


class Stopped(Exception):
    pass


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def test_an_interrupt_as_the_child_forks_reaches_the_caller_and_leaves_no_child(capfd: pytest.CaptureFixture[str]) -> None:
    previous = signal.signal(signal.SIGINT, _raise_stopped)
    SIGINT_IN_FORK.set()
    try:
        with pytest.raises(Stopped):
            BranchesAhead(_slow, 1)
    finally:
        SIGINT_IN_FORK.clear()
        signal.signal(signal.SIGINT, previous)
    assert not multiprocessing.active_children()  # stopped and reaped before the interrupt went on
    assert "Exception ignored" not in capfd.readouterr().err


def test_close_stops_a_running_child_and_reaps_it(ahead_of) -> None:
    ahead = ahead_of(_slow, 1)
    ahead.close()
    assert not ahead.child.is_alive() and ahead.child.exitcode == -signal.SIGKILL
    assert ahead.next() is None and ahead.undelivered == "closed"


def test_only_an_engine_that_declares_it_is_forked() -> None:
    class Declared:
        fork_safe = True

    class Wrapped:  # as a LaneEngine wraps its engine
        engine = Declared()

    assert forks_cleanly(Declared()) and forks_cleanly(Wrapped())
    assert not forks_cleanly(object()) and not forks_cleanly(type("Truthy", (), {"fork_safe": 1})())

    class Refusing:  # its own word stands over the engine it wraps
        fork_safe = False
        engine = Declared()

    assert not forks_cleanly(Refusing())


class PrefillPids:
    """The shipped consumer, noting which process ran each prefill."""

    fork_safe = True

    def __init__(self, engine, notes: Path) -> None:
        self.engine, self.notes = engine, notes
        self.logit_units = engine.logit_units

    def prefill(self, tokens: np.ndarray) -> KVCache:
        with self.notes.open("a") as notes:
            notes.write(f"{os.getpid()}\n")
        return self.engine.prefill(tokens)

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:
        return self.engine.decode(kv, pending, n)

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:
        return self.engine.teacher_forced(kv, pending, forced)


def _three_handoffs(setup: ComparerSetup) -> list:
    comparer = HostComparer(setup)
    try:
        comparer.reference()
        kv = setup.consumer.prefill(setup.prompt[:setup.handoff_positions])
        pending = setup.prompt[setup.handoff_positions:]
        return [comparer.compare(kv, pending, meanwhile=lambda: None) for _ in range(3)]
    finally:
        comparer.close()


def _setup(notes: Path, **chosen) -> ComparerSetup:
    prompt = assets.load_prompt(assets.MAIN_PROMPT)[:48]
    consumer = PrefillPids(build_consumer(lane_spec(DEFAULT_NATIVE_TEXT_LANE)), notes)
    return ComparerSetup(consumer=consumer, prompt=prompt, handoff_positions=40, output_tokens=6,  # type: ignore[arg-type]
                         transform=parse_logit_transform("raw"), maximum_absolute=1.0, maximum_mean_absolute=0.1,
                         **chosen)


@pytest.mark.parametrize("handoffs", [1, 2, 3])
def test_every_cold_branch_comes_from_the_child_and_equals_in_line_ones(tmp_path: Path, handoffs: int) -> None:
    setup = _setup(tmp_path / "pids", handoffs=handoffs)
    forks = len(FORKS)
    ahead = _three_handoffs(setup)
    assert len(FORKS) == forks + 1 and not multiprocessing.active_children()  # one child, reaped at close
    pids = (tmp_path / "pids").read_text().split()
    # Here: the handoff KV, and a third handoff past the comparer's count; in the child: the cold
    # branch of every handoff it counts, the first one's included.
    assert len(pids) == 4 and len(set(pids)) == 2
    assert pids.count(str(os.getpid())) == 1 + (3 - handoffs)
    (tmp_path / "pids").unlink()
    setup.consumer.fork_safe = False  # type: ignore[attr-defined]  # the same consumer, computed in line
    in_line = _three_handoffs(setup)
    assert len(FORKS) == forks + 1
    assert (tmp_path / "pids").read_text().split() == [str(os.getpid())] * 4
    for child, own in zip(ahead, in_line, strict=True):
        assert child.result().cold_digests == own.result().cold_digests
        assert child.result().handoff_digests == own.result().handoff_digests
    # Each handoff from the child reports its own branch's seconds; in line, the first handoff
    # meets the reference step's branch, whose seconds that step reported.
    assert all("recompute" in compared.seconds for compared in ahead)
    assert "recompute" not in in_line[0].seconds and all("recompute" in compared.seconds for compared in in_line[1:])


def test_reference_once_takes_one_branch_from_the_child_for_every_handoff(tmp_path: Path) -> None:
    forks = len(FORKS)
    compared = _three_handoffs(_setup(tmp_path / "pids", handoffs=3, reference_once=True))
    assert len(FORKS) == forks + 1
    pids = (tmp_path / "pids").read_text().split()
    assert len(pids) == 2 and pids.count(str(os.getpid())) == 1  # the handoff KV here, one branch there
    assert ["recompute" in handoff.seconds for handoff in compared] == [True, False, False]
    assert len({handoff.result().cold_digests for handoff in compared}) == 1


def _cells(tmp_path: Path) -> tuple[PrefillPids, list[tuple[np.ndarray, int]]]:
    fixture = assets.load_prompt(assets.MAIN_PROMPT)
    consumer = PrefillPids(build_consumer(lane_spec(DEFAULT_NATIVE_TEXT_LANE)), tmp_path / "pids")
    # Two cells of their own prompts, then the same anchor twice (as a calibration plans them).
    return consumer, [(fixture[:40], 39), (fixture[8:52], 43), (fixture[:48], 47), (fixture[:48], 47)]


def test_a_planned_branch_per_handoff_comes_from_the_child_in_order(tmp_path: Path) -> None:
    consumer, cells = _cells(tmp_path)
    plan = PlannedColdBranches(consumer, cells, output_tokens=5)  # type: ignore[arg-type]
    try:
        taken = [plan.take(prompt, positions, 5) for prompt, positions in cells]
        assert plan.take(*cells[0], 5) is None  # the plan is spent
    finally:
        plan.close()
    pids = (tmp_path / "pids").read_text().split()
    assert len(pids) == 4 and str(os.getpid()) not in pids and not plan.ahead.child.is_alive()
    for branch, (prompt, positions) in zip(taken, cells, strict=True):
        assert branch is not None
        kv, result, seconds = branch
        own_kv, own, _ = cold_branch(consumer.engine, prompt, positions, 5)
        assert np.array_equal(result.tokens, own.tokens) and np.array_equal(result.logits, own.logits)
        assert all(np.array_equal(a, b) for a, b in zip(kv.keys + kv.values, own_kv.keys + own_kv.values, strict=True))
        assert seconds > 0


@pytest.mark.parametrize("asked", ["another prompt", "another split", "another length"])
def test_a_branch_out_of_the_plans_order_ends_the_plan(tmp_path: Path, asked: str) -> None:
    consumer, cells = _cells(tmp_path)
    plan = PlannedColdBranches(consumer, cells, output_tokens=5)  # type: ignore[arg-type]
    prompt, positions = cells[0]
    try:
        wrong = {"another prompt": (cells[1][0], positions, 5), "another split": (prompt, positions - 1, 5),
                 "another length": (prompt, positions, 6)}[asked]
        assert plan.take(*wrong) is None
        assert plan.take(prompt, positions, 5) is None and plan.take(*cells[1], 5) is None
        assert plan.ahead.undelivered == "a branch out of the plan's order was asked for"
        assert not plan.ahead.child.is_alive()
    finally:
        plan.close()


def test_a_comparer_takes_its_branches_from_the_plan(tmp_path: Path) -> None:
    consumer, cells = _cells(tmp_path)
    plan = PlannedColdBranches(consumer, cells, output_tokens=5)  # type: ignore[arg-type]
    results = []
    try:
        for prompt, positions in cells[:2]:
            setup = ComparerSetup(consumer=consumer, prompt=prompt, handoff_positions=positions,  # type: ignore[arg-type]
                                  output_tokens=5, transform=parse_logit_transform("raw"), maximum_absolute=1.0,
                                  maximum_mean_absolute=0.1, planned=plan)
            comparer = HostComparer(setup)
            comparer.reference()
            kv = consumer.engine.prefill(prompt[:positions])
            results.append(comparer.compare(kv, prompt[positions:], meanwhile=lambda: None).result())
            comparer.close()
    finally:
        plan.close()
    assert str(os.getpid()) not in (tmp_path / "pids").read_text().split()  # every cold branch from the child
    assert all(result.cold_digests == result.handoff_digests for result in results)


def _busy(seconds: float) -> str:
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        pass
    return "worked"


def test_a_child_that_stops_working_is_given_up_and_its_branch_left_to_the_caller() -> None:
    # Blocked on a lock it will never get (as a fork can inherit one another thread held): no CPU.
    ahead = BranchesAhead(threading.Event().wait, 1, stalled_after_s=1.0)
    try:
        began = time.monotonic()
        assert ahead.next() is None
        assert time.monotonic() - began < 10 and not ahead.child.is_alive()
        assert ahead.undelivered == "the child used no CPU time for 1 s (stuck)"
    finally:
        ahead.close()


def test_a_child_working_longer_than_the_stall_bound_is_waited_for() -> None:
    ahead = BranchesAhead(lambda: _busy(3.0), 1, stalled_after_s=1.0)
    try:
        assert ahead.next() == "worked"
    finally:
        ahead.close()
