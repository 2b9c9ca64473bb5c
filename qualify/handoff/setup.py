"""How a run reaches its producer: what it hands a transport factory when the producer starts
(:class:`TransportSetup`), the default factory (the lane's producer process over a Unix socket),
the factory of ``--producer-at`` (a producer the operator runs), and killing a producer at once
when a run is interrupted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qualify.contract.lanes import ProducerMode
from qualify.core.errors import Refused
from qualify.handoff.protocol import PhaseDeadlines, ProducerExpectation

if TYPE_CHECKING:
    import ssl

    from qualify.handoff.transport import Transport


@dataclass(frozen=True)
class RemoteProducerChoice:
    """``--producer-at HOST:PORT``: a producer the operator already runs, perhaps on another host,
    instead of one this run starts. The run key is the operator's (the one the producer was
    started with), not minted; ``tls`` is the consumer's context (pinned CA, client certificate),
    None for plain loopback TCP."""

    host: str
    port: int
    key: bytes = field(repr=False)
    tls: ssl.SSLContext | None = field(default=None, repr=False)


@dataclass(frozen=True)
class TransportSetup:
    """What the run hands a transport factory when the producer starts: the lane and mode, the
    run key and ids the handoffs are sealed under, what the producer must be, its watchdog, and
    (for the producer process) extra arguments, an engine factory and environment overrides."""

    lane: str
    mode: ProducerMode
    key: bytes
    run_id: str
    expectation: ProducerExpectation
    watchdog_s: float
    extra_args: list[str]
    engine_factory: str | None
    env: dict[str, str]
    # How many positions each handoff carries (an in-process producer sizes its buffers by it).
    handed_off_positions: int
    # How long the consumer waits for the producer, per phase (the identity's, or --deadline-s).
    deadlines: PhaseDeadlines
    # The exact payload size the run's geometry implies: a producer announcing another is refused
    # before anything is allocated for it.
    expected_payload_bytes: int


TransportFactory = Callable[[TransportSetup], "Transport"]


def producer_process(setup: TransportSetup) -> Transport:
    """The default transport: the lane's producer in its own process, over a Unix socket."""
    from qualify.handoff.client import ProducerProcess

    return ProducerProcess(
        lane=setup.lane, mode=setup.mode, key=setup.key, run_id=setup.run_id,
        expectation=setup.expectation, watchdog_s=setup.watchdog_s, extra_args=setup.extra_args,
        engine_factory=setup.engine_factory, env=setup.env, deadlines=setup.deadlines,
        expected_payload_bytes=setup.expected_payload_bytes)


def remote_producer(choice: RemoteProducerChoice) -> TransportFactory:
    """The transport factory of ``--producer-at``: a connection to the operator's producer. What
    only a started producer can take (a fault lane, an engine factory, environment overrides) is
    refused: that producer runs as its operator started it."""

    def connect(setup: TransportSetup) -> Transport:
        from qualify.handoff.client import RemoteProducer

        if setup.extra_args or setup.engine_factory is not None or setup.env:
            raise Refused("--producer-at: the producer runs as its operator started it; a fault lane, an engine "
                          "factory or producer environment overrides cannot be applied to it")
        return RemoteProducer(host=choice.host, port=choice.port, key=setup.key, run_id=setup.run_id,
                              lane=setup.lane, mode=setup.mode, deadlines=setup.deadlines, tls=choice.tls,
                              expected_payload_bytes=setup.expected_payload_bytes)

    return connect


def kill_producer(producer: Transport) -> None:
    """Kill a producer process's group at once (an in-process producer has none; a remote one's
    connection is dropped)."""
    from qualify.handoff.client import ProducerProcess, RemoteProducer

    if isinstance(producer, (ProducerProcess, RemoteProducer)):
        producer.kill()


KILL_REAP_S = 10.0
"""How long a producer killed on purpose may take to be gone (SIGKILL is not deferred)."""


def kill_and_reap(producer: Transport, timeout_s: float = KILL_REAP_S) -> int | None:
    """SIGKILL a producer process's group and wait for the process to exit: its exit status (-9
    when the kill took), or None where there is no local process to kill (in-process, remote) or it
    did not exit within ``timeout_s``."""
    import time

    from qualify.handoff.client import ProducerProcess

    if not isinstance(producer, ProducerProcess):
        return None
    producer.kill()
    deadline = time.monotonic() + timeout_s
    while (status := producer.exit_status) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return status
