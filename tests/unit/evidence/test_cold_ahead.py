"""Cold branches computed ahead in a forked child: delivered in order and equal to an in-line
recompute bit for bit, or left to the caller (the child failed, died or ran out); the child holds
none of the run's descriptors, stops on an interrupt of its own and is always reaped."""

from __future__ import annotations

import itertools
import os
import select
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from qualify.contract.lanes import DEFAULT_NATIVE_TEXT_LANE, lane_spec
from qualify.core import assets
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult
from qualify.engines.factory import build_consumer
from qualify.evidence.cold_ahead import BranchesAhead, forks_cleanly
from qualify.evidence.compare import parse_logit_transform
from qualify.evidence.comparers import ComparerSetup, HostComparer


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


def test_later_cold_branches_come_from_the_child_and_equal_in_line_ones(tmp_path: Path) -> None:
    prompt = assets.load_prompt(assets.MAIN_PROMPT)[:48]
    consumer = PrefillPids(build_consumer(lane_spec(DEFAULT_NATIVE_TEXT_LANE)), tmp_path / "pids")
    setup = ComparerSetup(consumer=consumer, prompt=prompt, handoff_positions=40, output_tokens=6,  # type: ignore[arg-type]
                          transform=parse_logit_transform("raw"), maximum_absolute=1.0, maximum_mean_absolute=0.1,
                          handoffs=3)
    ahead = _three_handoffs(setup)
    pids = (tmp_path / "pids").read_text().split()
    # In this process: the reference's cold branch and the handoff KV; in one child: two branches.
    assert pids.count(str(os.getpid())) == 2 and len(pids) == 4 and len(set(pids)) == 2
    (tmp_path / "pids").unlink()
    in_line = _three_handoffs(ComparerSetup(**{**setup.__dict__, "handoffs": 1}))
    assert (tmp_path / "pids").read_text().split() == [str(os.getpid())] * 4
    for child, own in zip(ahead, in_line, strict=True):
        assert child.result().cold_digests == own.result().cold_digests
        assert child.result().handoff_digests == own.result().handoff_digests
    assert all("recompute" in compared.seconds for compared in ahead[1:] + in_line[1:])
