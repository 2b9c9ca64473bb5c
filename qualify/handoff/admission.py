"""The producer's admission of connections: from ``accept`` to an authenticated client.

A peer that connects and then sends nothing, or trickles a TLS handshake, must not delay anyone
else (issue #38: behind one idle TCP connection a correct run waited 25-27 s for "producer
ready"; behind two it failed). So every accepted connection is admitted on its own thread under
one deadline (TLS handshake, ``hello``, ``auth``), and :class:`Admissions` bounds how many are in
admission at once, in all and per peer address. A new connection over either bound displaces the
oldest one in admission (of its peer, or of all), never itself: the correct client's handshake
takes milliseconds, so a flood must displace it within that time to stop it, while refusing the
newest would let a few silent peers hold every slot until their deadlines. A connection past its
deadline is shut down by :meth:`Admissions.expire`, however slowly it trickles bytes.

May import: the standard library only (the handoff layer's service owns the sockets' use).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

# From accept to authenticated (TLS handshake, hello, auth): the correct client needs milliseconds
# on a LAN; a peer still in admission after this is dropped.
ADMISSION_S = 5.0
# Connections in admission at once, in all and from one peer address.
MAX_ADMITTING = 128
MAX_ADMITTING_PER_PEER = 32
# Connections the kernel completes and queues before the service accepts them.
LISTEN_BACKLOG = 128


@dataclass(eq=False)
class Admitting:
    """One connection in admission: its socket (the TLS side once wrapped), its peer address and
    its deadline (monotonic seconds)."""

    sock: socket.socket
    peer: str
    deadline: float
    dropped: bool = field(default=False)

    def drop(self) -> None:
        """Shut the connection down so a thread blocked on it returns at once; its owner closes it.
        (The base class's shutdown: on a TLS socket it acts on the descriptor, not the TLS state
        another thread is using.)"""
        self.dropped = True
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass


class Admissions:
    """The connections in admission, oldest first, bounded in all and per peer address."""

    def __init__(self, *, limit: int = MAX_ADMITTING, per_peer: int = MAX_ADMITTING_PER_PEER,
                 seconds: float = ADMISSION_S) -> None:
        if not 0 < per_peer <= limit:
            raise ValueError(f"admission bounds: per_peer {per_peer} must be in 1..limit {limit}")
        self.limit = limit
        self.per_peer = per_peer
        self.seconds = seconds
        self._lock = threading.Lock()
        self._admitting: OrderedDict[Admitting, None] = OrderedDict()

    def enter(self, sock: socket.socket, peer: str) -> tuple[Admitting, list[Admitting]]:
        """Register ``sock`` from ``peer``: its entry, and the entries it displaced (already shut
        down; each owner's thread sees its socket fail and closes it)."""
        entry = Admitting(sock, peer, time.monotonic() + self.seconds)
        displaced: list[Admitting] = []
        with self._lock:
            same_peer = [other for other in self._admitting if other.peer == peer]
            if len(same_peer) >= self.per_peer:
                displaced.append(same_peer[0])
            elif len(self._admitting) >= self.limit:
                displaced.append(next(iter(self._admitting)))
            for other in displaced:
                del self._admitting[other]
            self._admitting[entry] = None
        for other in displaced:
            other.drop()
        return entry, displaced

    def leave(self, entry: Admitting) -> None:
        """``entry`` is out of admission (authenticated, refused or dropped)."""
        with self._lock:
            self._admitting.pop(entry, None)

    def expire(self, now: float | None = None) -> list[Admitting]:
        """Shut down every connection past its deadline; returns them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [entry for entry in self._admitting if entry.deadline <= now]
            for entry in late:
                del self._admitting[entry]
        for entry in late:
            entry.drop()
        return late

    def __len__(self) -> int:
        with self._lock:
            return len(self._admitting)
