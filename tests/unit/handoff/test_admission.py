"""The producer's admission bounds: in all and per peer, the oldest displaced, late ones expired."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from qualify.handoff.admission import Admissions


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """Connected socket pairs: the producer's side first, the peer's second."""
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for ours, theirs in made:
        ours.close()
        theirs.close()


def connection(pairs: list[tuple[socket.socket, socket.socket]]) -> socket.socket:
    ours, theirs = socket.socketpair()
    theirs.settimeout(5.0)
    pairs.append((ours, theirs))
    return ours


def shut_down(pairs: list[tuple[socket.socket, socket.socket]]) -> list[int]:
    """Which pairs' producer side was shut down (their peer reads end of stream)."""
    closed = []
    for index, (_, theirs) in enumerate(pairs):
        theirs.setblocking(False)
        try:
            if theirs.recv(1) == b"":
                closed.append(index)
        except BlockingIOError:
            pass
    return closed


def test_a_peer_over_its_bound_displaces_its_own_oldest_connection(pairs) -> None:
    admissions = Admissions(limit=10, per_peer=2)
    first, _ = admissions.enter(connection(pairs), "10.0.0.1")
    admissions.enter(connection(pairs), "10.0.0.2")
    admissions.enter(connection(pairs), "10.0.0.1")
    entry, displaced = admissions.enter(connection(pairs), "10.0.0.1")
    assert displaced == [first] and first.dropped and not entry.dropped
    assert len(admissions) == 3 and shut_down(pairs) == [0]


def test_over_the_total_bound_the_oldest_of_all_is_displaced(pairs) -> None:
    admissions = Admissions(limit=3, per_peer=3)
    oldest, _ = admissions.enter(connection(pairs), "10.0.0.1")
    for peer in ("10.0.0.2", "10.0.0.3"):
        admissions.enter(connection(pairs), peer)
    _, displaced = admissions.enter(connection(pairs), "10.0.0.4")
    assert displaced == [oldest] and len(admissions) == 3 and shut_down(pairs) == [0]


def test_a_connection_that_left_frees_its_slot(pairs) -> None:
    admissions = Admissions(limit=2, per_peer=1)
    entry, _ = admissions.enter(connection(pairs), "local")
    admissions.leave(entry)
    assert admissions.enter(connection(pairs), "local")[1] == [] and shut_down(pairs) == []


def test_only_connections_past_their_deadline_expire(pairs) -> None:
    admissions = Admissions(seconds=5.0)
    entry, _ = admissions.enter(connection(pairs), "10.0.0.1")
    assert admissions.expire(now=entry.deadline - 0.01) == [] and shut_down(pairs) == []
    assert admissions.expire(now=entry.deadline) == [entry] and len(admissions) == 0
    assert shut_down(pairs) == [0]


@pytest.mark.parametrize("limit, per_peer", [(4, 0), (4, 5)])
def test_bounds_that_admit_nobody_or_exceed_the_total_are_refused(limit: int, per_peer: int) -> None:
    with pytest.raises(ValueError, match="per_peer"):
        Admissions(limit=limit, per_peer=per_peer)
