"""A producer on another host: TCP under mutual TLS 1.3, the run key's MAC handshake inside.

Producers here serve the stub engine of :mod:`tests.unit.handoff.test_handoff_service` (or, for the one run
end to end, the shipped lane on a short prompt) on loopback, each started as an operator starts
one (``qualify producer serve --port 0 --tls-...``); the consumer connects by address. Hostile
peers (one replaying a captured handoff, one stalling, one cutting the stream, a proxy replaying
a TLS record) are small TLS servers in this process holding the producer's certificate.
"""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from qualify.contract.lanes import ProducerMode, lane_spec
from qualify.core.assets import REPO_ROOT
from qualify.core.errors import HandoffRefused, Refused
from qualify.handoff.admission import ADMISSION_S
from qualify.handoff.client import ProducerFailure, RemoteProducer, parse_producer_address
from qualify.handoff.protocol import (
    FRAME_LENGTH,
    PRODUCER_MODULE,
    PROTOCOL,
    PhaseDeadlines,
    StartRefused,
    client_auth_mac,
    decode_frame_header,
    encode_frame_header,
)
from qualify.handoff.tls import (
    CA_CERT,
    CONSUMER_CERT,
    CONSUMER_KEY,
    PRODUCER_CERT,
    PRODUCER_KEY,
    RUN_KEY,
    SET_FILES,
    client_context,
    issue_tls_set,
    server_context,
)
from qualify.handoff.wire import Handoff, open_handoff
from qualify.interfaces.producer_command import parse_config
from tests.unit.handoff.test_handoff_service import (
    EXPECTATION,
    FACTORY,
    HANG_GUARD_DEADLINES,
    HANG_GUARD_S,
    TOKENS,
    stub_expectation,
)

RUN_A = "run-a"
RUN_B = "run-b"
# A stalled peer is given up on after about a second (no test waits longer for one).
SHORT_DEADLINES = PhaseDeadlines(ready_s=2.0, verify_s=1.5, handoff_s=1.5, silence_s=1.0)
# A hostile peer's connection and TLS handshake, each (they are all on loopback).
CONNECT_S = 2.0


# ------------------------------------------------------------------------------------------
# certificate sets and producers


@pytest.fixture(scope="module")
def tls_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tls") / "set"
    issue_tls_set(directory, ["127.0.0.1", "localhost"])
    return directory


@pytest.fixture(scope="module")
def other_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second set: its CA signed neither of the first set's certificates."""
    directory = tmp_path_factory.mktemp("tls-other") / "set"
    issue_tls_set(directory, ["127.0.0.1"])
    return directory


def consumer_tls(directory: Path, *, ca_from: Path | None = None) -> ssl.SSLContext:
    return client_context(ca=(ca_from or directory) / CA_CERT, cert=directory / CONSUMER_CERT,
                          key=directory / CONSUMER_KEY)


def producer_tls(directory: Path) -> ssl.SSLContext:
    return server_context(cert=directory / PRODUCER_CERT, key=directory / PRODUCER_KEY,
                          client_ca=directory / CA_CERT)


def run_key(directory: Path) -> bytes:
    return bytes.fromhex((directory / RUN_KEY).read_text().strip())


@dataclass
class ServedProducer:
    process: subprocess.Popen[str]
    host: str
    port: int


def serve_producer(tls_set: Path, tmp_path: Path, *extra: str, lane: str = "stub-ok", mode: str = "exact",
                   expectation: dict | None = None, factory: str | None = FACTORY) -> ServedProducer:
    """``qualify producer serve`` on a loopback port under the set's TLS, waited for until ready."""
    expect = tmp_path / "expect.json"
    expect.write_text(json.dumps(expectation or EXPECTATION.to_document()))
    argv = [sys.executable, "-m", PRODUCER_MODULE, "--lane", lane, "--mode", mode,
            "--expect", str(expect), "--key-file", str(tls_set / RUN_KEY), "--port", "0",
            "--tls-cert", str(tls_set / PRODUCER_CERT), "--tls-key", str(tls_set / PRODUCER_KEY),
            "--tls-client-ca", str(tls_set / CA_CERT), *extra]
    if factory is not None:
        argv += ["--engine-factory", factory]
    env = {k: v for k, v in os.environ.items() if k != "QUALIFY_HANDOFF_KEY"}
    process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], HANG_GUARD_S)
    line = process.stdout.readline() if ready else ""
    if not line:
        process.kill()
        raise AssertionError(f"producer not ready: {process.communicate()[1][-2000:]}")
    address = json.loads(line)["address"]
    assert address.startswith("tls:127.0.0.1:")
    return ServedProducer(process, "127.0.0.1", int(address.rsplit(":", 1)[1]))


@pytest.fixture
def served(tls_set: Path, tmp_path: Path) -> Iterator[ServedProducer]:
    producer = serve_producer(tls_set, tmp_path)
    yield producer
    producer.process.kill()
    producer.process.communicate()


def remote(port: int, tls: ssl.SSLContext | None, *, key: bytes, run_id: str = RUN_A, host: str = "127.0.0.1",
           deadlines: PhaseDeadlines = HANG_GUARD_DEADLINES) -> RemoteProducer:
    return RemoteProducer(host=host, port=port, key=key, run_id=run_id, lane="stub-ok", mode=ProducerMode.EXACT,
                          deadlines=deadlines, tls=tls)


def open_in(handoff: Handoff, *, key: bytes, run_id: str, request_id: str):
    expectation = stub_expectation(request_id=request_id)
    from dataclasses import replace

    return open_handoff(handoff, key=key, expectation=replace(expectation, run_id=run_id))


# ------------------------------------------------------------------------------------------
# the set


def test_a_set_is_written_whole_with_private_keys_0600_and_never_the_cas_key(tls_set: Path) -> None:
    assert sorted(path.name for path in tls_set.iterdir()) == sorted(SET_FILES)
    for name in (PRODUCER_KEY, CONSUMER_KEY, RUN_KEY):
        assert (tls_set / name).stat().st_mode & 0o777 == 0o600
    assert (tls_set.stat().st_mode & 0o777) == 0o700
    with pytest.raises(Refused, match="already there"):
        issue_tls_set(tls_set, ["127.0.0.1"])
    assert len(run_key(tls_set)) == 32


def test_a_set_needs_a_producer_host_it_can_name(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="at least one --producer-host"):
        issue_tls_set(tmp_path / "a", [])
    with pytest.raises(Refused, match="--producer-host: found 'not a host'"):
        issue_tls_set(tmp_path / "b", ["not a host"])
    assert not (tmp_path / "b" / CA_CERT).exists()


def test_keys_tls_command_issues_a_set_and_refuses_a_used_directory(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "qualify.interfaces.cli", "keys", "tls", "--dir", str(tmp_path / "set"),
               "--producer-host", "producer.example"]
    made = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert made.returncode == 0, made.stderr
    assert "the CA's private key was not kept" in made.stdout
    again = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
    assert "already there" in again.stderr


# ------------------------------------------------------------------------------------------
# a handoff over TLS


def test_a_handoff_over_tls_opens_and_records_its_link(tls_set: Path, served: ServedProducer) -> None:
    key = run_key(tls_set)
    with remote(served.port, consumer_tls(tls_set), key=key) as producer:
        assert producer.host_facts is not None
        assert producer.tls_session is not None and producer.tls_session["version"] == "TLSv1.3"
        handoff = producer.request_prefill(TOKENS, "sample-1")
    kv, manifest, _ = open_in(handoff, key=key, run_id=RUN_A, request_id="sample-1")
    assert manifest.run_id == RUN_A and kv.geometry.positions == len(TOKENS)
    stats = handoff.transport
    assert stats is not None and stats.kind == "tls"
    assert stats.payload_bytes == manifest.payload_size and stats.gbit_per_s > 0
    assert stats.phase_overlap_s is not None and stats.phase_overlap_s >= 0
    # The producer serves the next run too, under that run's id.
    with remote(served.port, consumer_tls(tls_set), key=key, run_id=RUN_B) as producer:
        second = producer.request_prefill(TOKENS, "sample-1")
    assert open_in(second, key=key, run_id=RUN_B, request_id="sample-1")[1].run_id == RUN_B


def test_a_producer_pinned_to_a_run_turns_away_another(tls_set: Path, tmp_path: Path) -> None:
    served = serve_producer(tls_set, tmp_path, "--run-id", RUN_A)
    try:
        with pytest.raises(ProducerFailure, match="auth refused.*serves run 'run-a'"):
            remote(served.port, consumer_tls(tls_set), key=run_key(tls_set), run_id=RUN_B).start()
    finally:
        served.process.kill()
        served.process.communicate()


# ------------------------------------------------------------------------------------------
# refusals: certificates, key, plain TCP


def test_a_producer_certificate_from_another_ca_is_refused(tls_set: Path, other_set: Path,
                                                           served: ServedProducer) -> None:
    producer = remote(served.port, consumer_tls(tls_set, ca_from=other_set), key=run_key(tls_set))
    with pytest.raises(ProducerFailure, match="the producer's certificate is refused .*checked against --tls-ca") \
            as failed:
        producer.start()
    assert "\n" not in str(failed.value)
    # The producer keeps serving the consumers of its own set.
    with remote(served.port, consumer_tls(tls_set), key=run_key(tls_set)) as good:
        assert good.request_prefill(TOKENS, "sample-1").transport is not None


def test_a_producer_certificate_for_another_host_is_refused(tls_set: Path, served: ServedProducer) -> None:
    """The set names 127.0.0.1 and localhost; the same producer dialled as ::ffff:127.0.0.1 is not it."""
    producer = RemoteProducer(host="::ffff:127.0.0.1", port=served.port, key=run_key(tls_set), run_id=RUN_A,
                              lane="stub-ok", mode=ProducerMode.EXACT, deadlines=HANG_GUARD_DEADLINES,
                              tls=consumer_tls(tls_set))
    with pytest.raises(ProducerFailure, match="certificate is refused \\(IP address mismatch"):
        producer.start()


def test_a_consumer_certificate_from_another_ca_is_turned_away(tls_set: Path, other_set: Path,
                                                               served: ServedProducer) -> None:
    stranger = client_context(ca=tls_set / CA_CERT, cert=other_set / CONSUMER_CERT, key=other_set / CONSUMER_KEY)
    with pytest.raises(ProducerFailure, match="connection failed \\(SSLError: TLSV1_ALERT_UNKNOWN_CA\\)") as failed:
        remote(served.port, stranger, key=run_key(tls_set)).start()
    assert "\n" not in str(failed.value)
    with remote(served.port, consumer_tls(tls_set), key=run_key(tls_set)) as good:
        assert good.request_prefill(TOKENS, "sample-1").transport is not None


def test_a_wrong_run_key_is_turned_away(tls_set: Path, other_set: Path, served: ServedProducer) -> None:
    with pytest.raises(ProducerFailure, match="auth refused; producer said: client authentication failed"):
        remote(served.port, consumer_tls(tls_set), key=run_key(other_set)).start()


def test_plain_tcp_off_loopback_is_refused_on_both_sides(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="not loopback; plain TCP would carry the KV in the clear"):
        remote(7443, None, key=os.urandom(32), host="192.0.2.7")
    base = ["--lane", "stub-ok", "--mode", "exact", "--expect", str(tmp_path / "e.json"), "--key-env", "X",
            "--host", "192.0.2.7", "--port", "7443"]
    with pytest.raises(StartRefused, match="not loopback; pass --allow-non-loopback"):
        parse_config(base)
    with pytest.raises(StartRefused, match="in the clear; serve it with --tls-cert"):
        parse_config([*base, "--allow-non-loopback"])
    with pytest.raises(StartRefused, match="give all of --tls-cert, --tls-key and --tls-client-ca"):
        parse_config([*base, "--allow-non-loopback", "--tls-cert", "c.pem"])


def test_a_private_key_others_can_read_is_refused(tls_set: Path, tmp_path: Path) -> None:
    loose = tmp_path / "consumer.key"
    loose.write_bytes((tls_set / CONSUMER_KEY).read_bytes())
    loose.chmod(0o644)
    with pytest.raises(Refused, match="--tls-key .*mode 0644 lets others read it"):
        client_context(ca=tls_set / CA_CERT, cert=tls_set / CONSUMER_CERT, key=loose)
    with pytest.raises(Refused, match="--tls-ca .*not a PEM certificate"):
        client_context(ca=loose, cert=tls_set / CONSUMER_CERT, key=tls_set / CONSUMER_KEY)


@pytest.mark.parametrize(("text", "expected"), [("127.0.0.1:7443", ("127.0.0.1", 7443)),
                                                ("[::1]:7443", ("::1", 7443)),
                                                ("producer.example:1", ("producer.example", 1))])
def test_producer_address_parses(text: str, expected: tuple[str, int]) -> None:
    assert parse_producer_address(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", ":7443", "a b:1", "h:x"])
def test_producer_address_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(Refused, match="--producer-at"):
        parse_producer_address(text)


# ------------------------------------------------------------------------------------------
# hostile peers: a TLS server holding the producer's certificate (and, to replay, the run key)


class HostilePeer:
    """Accepts one TLS client and runs ``behave(conn)`` on it in a thread (``tls=False``: the
    TCP connection, for a peer that never starts TLS)."""

    def __init__(self, tls_set: Path, behave: Callable[[socket.socket], None], *, tls: bool = True) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._context = producer_tls(tls_set) if tls else None
        self._behave = behave
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        try:
            if self._context is not None:
                conn = self._context.wrap_socket(conn, server_side=True)
            self._behave(conn)
        except (OSError, ssl.SSLError):
            pass
        finally:
            self._release.wait(HANG_GUARD_S)
            conn.close()

    def close(self) -> None:
        self._release.set()
        self._thread.join(HANG_GUARD_S)
        self.listener.close()


def read_frame(conn: socket.socket) -> dict:
    def exact(count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = conn.recv(count - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    (length,) = FRAME_LENGTH.unpack(exact(FRAME_LENGTH.size))
    return decode_frame_header(exact(length))


def greet(conn: socket.socket, key: bytes, *, lane: str = "stub-ok", mode: str = "exact") -> None:
    """The producer's side of the handshake, checking the client's proof like a producer does."""
    nonce = os.urandom(32)
    conn.sendall(encode_frame_header({"op": "hello", "protocol": PROTOCOL, "nonce": nonce.hex(), "key_id": "x"}))
    auth = read_frame(conn)
    assert auth["mac"] == client_auth_mac(key, nonce, auth["run_id"]).hex()
    conn.sendall(encode_frame_header({"op": "auth", "status": "ok"}))
    assert read_frame(conn)["op"] == "ready?"
    conn.sendall(encode_frame_header({"op": "ready", "status": "ok", "lane": lane, "producer_mode": mode,
                                      "run_id": auth["run_id"]}))


def handoff_frame(handoff: Handoff, request_id: str) -> bytes:
    """A producer's answer carrying ``handoff`` (as captured off a connection), for ``request_id``."""
    payload = bytes(handoff.payload_bytes)
    return encode_frame_header({"op": "handoff", "status": "ok", "request_id": request_id,
                                "blobs": [len(handoff.manifest_bytes), len(handoff.mac), len(payload)],
                                "compute_s": 0.0, "seal_s": 0.0}) + handoff.manifest_bytes + handoff.mac + payload


@pytest.fixture
def captured(tls_set: Path, served: ServedProducer) -> Handoff:
    """An honest handoff of run A's sample-1, as it crossed the wire."""
    with remote(served.port, consumer_tls(tls_set), key=run_key(tls_set)) as producer:
        return producer.request_prefill(TOKENS, "sample-1")


@pytest.mark.parametrize(("run_id", "request_id", "check"), [(RUN_B, "sample-1", "manifest.run_id"),
                                                             (RUN_A, "sample-2", "request_id")])
def test_a_replayed_handoff_is_refused_before_install(tls_set: Path, captured: Handoff, run_id: str,
                                                      request_id: str, check: str) -> None:
    """Run A's sample-1, replayed by a peer holding the producer's certificate and the run key (its
    frame header rewritten to the request asked): in another run, or for another request, refused
    by the manifest's binding, which the MAC covers."""
    key = run_key(tls_set)

    def replay(conn: socket.socket) -> None:
        greet(conn, key)
        request = read_frame(conn)
        conn.sendall(handoff_frame(captured, request["request_id"]))

    peer = HostilePeer(tls_set, replay)
    try:
        with remote(peer.port, consumer_tls(tls_set), key=key, run_id=run_id) as producer:
            handoff = producer.request_prefill(TOKENS, request_id)
        with pytest.raises(HandoffRefused) as refused:
            open_in(handoff, key=key, run_id=run_id, request_id=request_id)
        assert refused.value.check == check
    finally:
        peer.close()


@pytest.mark.slow
def test_a_replayed_tls_record_breaks_the_connection(tls_set: Path, served: ServedProducer) -> None:
    """A proxy on the path that sends one of the producer's TLS records twice: the record fails
    TLS's own integrity check (its sequence number is spent), so the request fails and nothing is
    returned to install."""
    proxy = RecordReplayProxy(served.port)
    try:
        producer = remote(proxy.port, consumer_tls(tls_set), key=run_key(tls_set))
        with pytest.raises(ProducerFailure, match="connection failed \\(SSLError: DECRYPTION_FAILED_OR_BAD_RECORD_MAC") \
                as failed:
            with producer:
                producer.request_prefill(TOKENS, "sample-1")
        assert "\n" not in str(failed.value)
        assert proxy.replayed
    finally:
        proxy.close()


class RecordReplayProxy:
    """Forwards one connection to ``port``; once the client has sent four encrypted records
    (handshake Finished, auth, ready?, prefill), the producer's next encrypted record is sent twice."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._target = port
        self._client_records = 0
        self.replayed = False
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self._target), timeout=HANG_GUARD_S)
        self._sockets += [client, upstream]
        for source, sink, count in ((client, upstream, True), (upstream, client, False)):
            thread = threading.Thread(target=self._pump, args=(source, sink, count), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        buffered = b""
        try:
            while True:
                chunk = source.recv(1 << 16)
                if not chunk:
                    break
                buffered += chunk
                while len(buffered) >= 5 and len(buffered) >= 5 + int.from_bytes(buffered[3:5], "big"):
                    size = 5 + int.from_bytes(buffered[3:5], "big")
                    record, buffered = buffered[:size], buffered[size:]
                    encrypted = record[0] == 23
                    if from_client and encrypted:
                        self._client_records += 1
                    sink.sendall(record)
                    if not from_client and encrypted and self._client_records >= 4 and not self.replayed:
                        self.replayed = True
                        sink.sendall(record)
        except OSError:
            pass
        finally:
            for each in (source, sink):
                try:
                    each.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for each in self._sockets:
            try:  # a shutdown wakes a pump blocked in recv (a close alone does not, on Linux)
                each.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            each.close()
        self.listener.close()
        for thread in self._threads:
            thread.join(HANG_GUARD_S)


# ------------------------------------------------------------------------------------------
# stalled and truncated peers


def test_a_peer_that_never_starts_tls_is_given_up_at_the_verify_deadline(tls_set: Path) -> None:
    peer = HostilePeer(tls_set, lambda conn: None, tls=False)
    try:
        with pytest.raises(ProducerFailure, match="TLS handshake not done within the verify deadline of 1.5 s"):
            remote(peer.port, consumer_tls(tls_set), key=run_key(tls_set), deadlines=SHORT_DEADLINES).start()
    finally:
        peer.close()


def test_a_peer_silent_after_tls_is_given_up_at_a_deadline(tls_set: Path) -> None:
    peer = HostilePeer(tls_set, lambda conn: None)
    try:
        with pytest.raises(ProducerFailure, match="silent for .* during verify|no answer within the verify deadline"):
            remote(peer.port, consumer_tls(tls_set), key=run_key(tls_set), deadlines=SHORT_DEADLINES).start()
    finally:
        peer.close()


def test_a_peer_stalling_mid_payload_is_given_up_and_nothing_is_returned(tls_set: Path, captured: Handoff) -> None:
    key = run_key(tls_set)

    def stall(conn: socket.socket) -> None:
        greet(conn, key)
        request = read_frame(conn)
        frame = handoff_frame(captured, request["request_id"])
        conn.sendall(frame[:len(frame) // 2])  # then nothing, connection open

    peer = HostilePeer(tls_set, stall)
    try:
        with remote(peer.port, consumer_tls(tls_set), key=key, deadlines=SHORT_DEADLINES) as producer:
            with pytest.raises(ProducerFailure, match="silent for .* during handoff|no answer within the handoff"):
                producer.request_prefill(TOKENS, "sample-1")
            with pytest.raises(ProducerFailure):  # a failed producer serves nothing further
                producer.request_prefill(TOKENS, "sample-2")
    finally:
        peer.close()


def test_a_peer_trickling_its_answer_past_the_deadline_is_given_up(tls_set: Path, captured: Handoff) -> None:
    """An answer that keeps arriving, a few bytes at a time (a link, or a producer, far slower
    than the deadline; never silent long enough for the silence deadline): the handoff deadline
    still ends it, and nothing is returned. The whole answer would take about 200 x 50 ms."""
    key = run_key(tls_set)

    def trickle(conn: socket.socket) -> None:
        greet(conn, key)
        request = read_frame(conn)
        frame = handoff_frame(captured, request["request_id"])
        step = max(1, len(frame) // 200)
        for start in range(0, len(frame), step):
            conn.sendall(frame[start:start + step])
            threading.Event().wait(0.05)

    peer = HostilePeer(tls_set, trickle)
    try:
        with remote(peer.port, consumer_tls(tls_set), key=key, deadlines=SHORT_DEADLINES) as producer:
            with pytest.raises(ProducerFailure, match="no answer within the handoff deadline of 1.5 s") as failed:
                producer.request_prefill(TOKENS, "sample-1")
        assert "\n" not in str(failed.value)
    finally:
        peer.close()


@pytest.mark.parametrize("notify", [True, False], ids=["close-notify", "cut"])
def test_a_truncated_stream_fails_the_request_and_nothing_is_returned(tls_set: Path, captured: Handoff,
                                                                      notify: bool) -> None:
    """The answer cut inside its payload, with a TLS close_notify or by a bare TCP close."""
    key = run_key(tls_set)

    def truncate(conn: socket.socket) -> None:
        greet(conn, key)
        request = read_frame(conn)
        frame = handoff_frame(captured, request["request_id"])
        conn.sendall(frame[:len(frame) - 100])
        if notify:
            assert isinstance(conn, ssl.SSLSocket)
            conn.unwrap()
        else:
            conn.shutdown(socket.SHUT_RDWR)

    peer = HostilePeer(tls_set, truncate)
    try:
        with remote(peer.port, consumer_tls(tls_set), key=key) as producer:
            with pytest.raises(ProducerFailure, match="closed the connection$" if notify else
                               "connection failed \\(SSLEOFError") as failed:
                producer.request_prefill(TOKENS, "sample-1")
        assert "\n" not in str(failed.value)
    finally:
        peer.close()



# ------------------------------------------------------------------------------------------
# hostile clients holding the producer's port


def hold_the_port(tls_set: Path, port: int, *, silent: int, trickling: int, idle_after_tls: int) -> list[socket.socket]:
    """Connections a hostile network holds open: ``silent`` TCP peers that never send a byte,
    ``trickling`` ones that start a TLS ClientHello and stop, and ``idle_after_tls`` certificate
    holders that finish TLS but never authenticate (they lack the run key). Each must connect, and
    finish TLS, within CONNECT_S: a producer that admits one connection at a time fails here."""
    held: list[socket.socket] = []
    try:
        for _ in range(silent):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=CONNECT_S))
        for _ in range(trickling):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=CONNECT_S))
            held[-1].sendall(b"\x16\x03\x01\x02\x00\x01")  # a handshake record's header, one body byte
        context = consumer_tls(tls_set)
        for _ in range(idle_after_tls):
            raw = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_S)
            held.append(raw)
            held[-1] = context.wrap_socket(raw, server_hostname="127.0.0.1")
    except OSError as exc:
        for peer in held:
            peer.close()
        raise AssertionError(f"hostile peer {len(held)} could not connect and finish TLS within {CONNECT_S} s: "
                             f"{type(exc).__name__}") from None
    return held


def dropped(peer: socket.socket) -> bool:
    """Whether the producer has closed ``peer``'s connection (what it sent before, a hello, read past)."""
    peer.settimeout(ADMISSION_S + HANG_GUARD_S)
    try:
        while peer.recv(4096):
            pass
    except (ConnectionError, ssl.SSLError):
        pass
    except TimeoutError:
        return False
    return True


def test_a_hundred_silent_or_stalled_peers_neither_delay_nor_stop_a_correct_client(
        tls_set: Path, served: ServedProducer) -> None:
    """Before admission was concurrent, one silent TCP peer held the producer 25-27 s and two made
    a correct run fail; here 100 hold the port while a client with the set and the run key must be
    ready, and hand off, within deadlines shorter than one admission deadline of theirs."""
    held = hold_the_port(tls_set, served.port, silent=50, trickling=25, idle_after_tls=25)
    try:
        prompt = PhaseDeadlines(ready_s=ADMISSION_S - 1.0, verify_s=ADMISSION_S - 1.0, handoff_s=ADMISSION_S - 1.0,
                                silence_s=ADMISSION_S - 1.0)
        with remote(served.port, consumer_tls(tls_set), key=run_key(tls_set), deadlines=prompt) as producer:
            handoff = producer.request_prefill(TOKENS, "sample-1")
        assert open_in(handoff, key=run_key(tls_set), run_id=RUN_A, request_id="sample-1")[1].run_id == RUN_A
        # Every one of them is dropped (displaced by a newer peer, or at its admission deadline).
        assert [index for index, peer in enumerate(held) if not dropped(peer)] == []
    finally:
        for peer in held:
            peer.close()
    # and no failed handshake or authentication counted toward the producer's exit
    with remote(served.port, consumer_tls(tls_set), key=run_key(tls_set)) as producer:
        assert producer.request_prefill(TOKENS, "sample-2").transport is not None
    assert served.process.poll() is None


def test_certificate_holders_without_the_run_key_never_stop_the_producer(tls_set: Path, other_set: Path,
                                                                         served: ServedProducer) -> None:
    """Failed authentications are dropped at the door: five in a row (the exit after three
    consecutive errors is for an authenticated client's frames) leave the producer serving."""
    for _ in range(5):
        with pytest.raises(ProducerFailure, match="auth refused; producer said: client authentication failed"):
            remote(served.port, consumer_tls(tls_set), key=run_key(other_set)).start()
    with remote(served.port, consumer_tls(tls_set), key=run_key(tls_set)) as producer:
        assert producer.request_prefill(TOKENS, "sample-1").transport is not None
    assert served.process.poll() is None


# ------------------------------------------------------------------------------------------
# a qualification run against a producer at an address

LANE = "nvfp4-native-splitk"
SHORT_PROMPT_TOKENS = 48
SHORT_OUTPUT_TOKENS = 4


def short_contract():
    """The shipped lane on the fixture's first tokens, a few output tokens, under a rule wide
    enough for the lane, so every handoff step runs in seconds."""
    from dataclasses import replace

    from qualify.contract.controls import load_calibration_set
    from qualify.core import assets
    from qualify.evidence.records import BoundedDriftRule
    from qualify.judge.calibration import ANCHOR_PART
    from qualify.run.run_contract import ORDERED_HANDOFFS, CalibrationHandoff, calibration_contract

    calibration_set, set_digest = load_calibration_set()
    prompt = assets.load_prompt(assets.MAIN_PROMPT)[:SHORT_PROMPT_TOKENS]
    fixture = CalibrationHandoff(ANCHOR_PART, assets.MAIN_PROMPT, prompt)
    contract = calibration_contract(lane_spec(LANE), "native-text", [fixture] * ORDERED_HANDOFFS,
                                    calibration_set={"name": calibration_set.name, "sha256": set_digest},
                                    controls=None, output_tokens=SHORT_OUTPUT_TOKENS)
    rule = BoundedDriftRule(maximum_absolute=1.0, maximum_mean_absolute=0.1, output_tokens=SHORT_OUTPUT_TOKENS)
    return replace(contract, rule=rule, basis_records=None)


def run_against(port: int, tls_set: Path, receipts: Path, contract=None, *, verdict: bool = False, **interfaces):
    """The handoff steps against the producer at ``port``; with ``verdict``, the verdict step too,
    its anchor the run's own samples (the short contract has no basis receipt)."""
    from dataclasses import replace

    from qualify.handoff.setup import RemoteProducerChoice
    from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions

    choice = RemoteProducerChoice(host="127.0.0.1", port=port, key=run_key(tls_set), tls=consumer_tls(tls_set))
    run = QualificationRun(RunOptions(recipe="native-text", receipts=receipts, reference_once=True,
                                      producer_at=choice, deadline_s=30.0), contract or short_contract(), **interfaces)
    outcomes = [run.step(label) for label in STEP_LABELS[:6]]
    run.settle_all()
    if verdict:
        run.contract = replace(run.contract, anchor_records=[dict(record) for record in run.records])
        outcomes.append(run.step(STEP_LABELS[6]))
    run.close()
    return run, outcomes


def test_a_run_qualifies_handoffs_from_a_producer_over_tls(tls_set: Path, tmp_path: Path) -> None:
    contract = short_contract()
    served = serve_producer(tls_set, tmp_path, lane=LANE, mode=contract.producer_mode.value,
                            expectation=contract.expectation.to_document(), factory=None)
    INSTALLS.clear()
    try:
        run, outcomes = run_against(served.port, tls_set, tmp_path / "receipts", comparer=counting_comparer)
    finally:
        served.process.kill()
        served.process.communicate()
    assert [outcome.passed for outcome in outcomes] == [True] * 6, [outcome.message for outcome in outcomes]
    assert [record["repetition"] for record in run.records] == [1, 2, 3]
    assert INSTALLS == [SHORT_PROMPT_TOKENS - 1] * 3  # the handed-off prefix, installed once per handoff
    assert all(record["payload_gbit_per_s"] > 0 for record in run.records)
    assert run.receipt_path is not None
    log = (run.receipt_path / "command.log").read_text(encoding="utf-8")
    assert "producer at tls:127.0.0.1:" in log and "TLSv1.3" in log
    for repetition in (1, 2, 3):
        assert f"sample-{repetition}: transport tls: " in log
    assert log.count("phase overlap ") == 3


@pytest.mark.parametrize("floor_gbit_per_s", [1e-6, 1e6])
def test_a_verdict_over_tls_judges_the_identitys_link_floor(tls_set: Path, tmp_path: Path, floor_gbit_per_s: float) -> None:
    from dataclasses import replace

    contract = replace(short_contract(), link_floor_gbit_per_s=floor_gbit_per_s)
    served = serve_producer(tls_set, tmp_path, lane=LANE, mode=contract.producer_mode.value,
                            expectation=contract.expectation.to_document(), factory=None)
    try:
        run, outcomes = run_against(served.port, tls_set, tmp_path / "receipts", contract, verdict=True)
    finally:
        served.process.kill()
        served.process.communicate()
    assert [outcome.passed for outcome in outcomes[:6]] == [True] * 6, [outcome.message for outcome in outcomes]
    rates = ", ".join(f"{record['repetition']} ({record['payload_gbit_per_s']:.9g} Gbit/s)" for record in run.records)
    summary = json.loads((run.receipt_path / "validation-summary.json").read_text(encoding="utf-8"))
    (check,) = [check for check in summary["checks"] if check["name"] == "link floor"]
    if floor_gbit_per_s < 1:
        assert outcomes[6].passed and summary["status"] == "passed", outcomes[6].message
        slowest = min(record["payload_gbit_per_s"] for record in run.records)
        assert check == {"name": "link floor", "passed": True, "detail": "payload rate at or above the link floor "
                         f"1e-06 Gbit/s in every repetition (slowest {slowest:.9g} Gbit/s)"}
    else:
        words = f"payload rate below the link floor 1000000 Gbit/s in repetition {rates}"
        assert not outcomes[6].passed and summary["status"] == "failed"
        assert check == {"name": "link floor", "passed": False, "detail": words}
        assert summary["reasons"] == [words]


def test_a_floor_with_the_producer_on_this_host_is_refused_before_any_handoff(tmp_path: Path) -> None:
    from dataclasses import replace

    from qualify.run.qualification import QualificationRun, RunOptions

    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path / "receipts", reference_once=True),
                           replace(short_contract(), link_floor_gbit_per_s=2.5))
    outcome = run.step("identity sealed")
    run.close()
    assert outcome.refused and not outcome.passed
    assert outcome.message == (f"lane {LANE}: link_floor: 2.5 Gbit/s is judged on handoffs across a network link; "
                               "run with --producer-at HOST:PORT (docs/transport.md)")


def test_an_identity_declaring_a_floor_run_without_a_link_exits_2_with_a_refused_receipt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from qualify.archive.verify import check_receipt
    from qualify.contract import sealed_data
    from qualify.contract.identity import LINK_FLOOR_SCHEMA_ID, identity_sha256, parse_identity_document
    from qualify.interfaces.cli import main

    shipped = json.loads((REPO_ROOT / "contracts" / f"{LANE}-identity-v1.json").read_text(encoding="utf-8"))
    declared = {**shipped, "schema": LINK_FLOOR_SCHEMA_ID, "link_floor": {"gbit_per_s_minimum": 9.5}}
    path = tmp_path / "floored-identity.json"
    path.write_text(json.dumps(declared), encoding="utf-8")
    digest = identity_sha256(parse_identity_document(declared, where="floored"))
    monkeypatch.setattr(sealed_data, "SEALED_IDENTITIES", {**sealed_data.SEALED_IDENTITIES, LANE: digest})
    receipts = tmp_path / "receipts"
    assert main(["--recipe", "native-text", "--identity", str(path), "--receipts", str(receipts)]) == 2
    words = (f"identity {path}: link_floor: 9.5 Gbit/s is judged on handoffs across a network link; "
             "run with --producer-at HOST:PORT (docs/transport.md)")
    assert words in capsys.readouterr().err
    (receipt,) = receipts.iterdir()
    summary = json.loads((receipt / "validation-summary.json").read_text(encoding="utf-8"))
    assert summary["status"] == "refused" and summary["verdict"] == f"refused: identity sealed: {words}"
    assert summary["identity_sha256"] == digest
    problems, _ = check_receipt(receipt)
    assert problems == []


INSTALLS: list[int] = []
"""One entry per handoff a :func:`counting_comparer` was given to install."""


def counting_comparer(setup):
    """The host comparer, noting each handoff it is given to install in :data:`INSTALLS`."""
    from qualify.evidence.comparers import HostComparer

    comparer = HostComparer(setup)
    compare = comparer.compare

    def counted(kv, pending, meanwhile):
        INSTALLS.append(kv.geometry.positions)
        return compare(kv, pending, meanwhile)

    comparer.compare = counted  # type: ignore[method-assign]
    return comparer


def test_a_truncated_handoff_fails_its_sample_and_installs_nothing(tls_set: Path, captured: Handoff,
                                                                  tmp_path: Path) -> None:
    key = run_key(tls_set)
    contract = short_contract()

    def truncate(conn: socket.socket) -> None:
        greet(conn, key, lane=LANE, mode=contract.producer_mode.value)
        request = read_frame(conn)
        frame = handoff_frame(captured, request["request_id"])
        conn.sendall(frame[:len(frame) - 100])
        conn.shutdown(socket.SHUT_RDWR)

    peer = HostilePeer(tls_set, truncate)
    INSTALLS.clear()
    try:
        run, outcomes = run_against(peer.port, tls_set, tmp_path / "receipts", comparer=counting_comparer)
    finally:
        peer.close()
    assert [outcome.passed for outcome in outcomes[:3]] == [True, True, True]
    assert not outcomes[3].passed
    assert INSTALLS == []
    first = run.records[0]
    assert "producer failed" in first["error"] and "SSLEOFError" in first["error"]


# ------------------------------------------------------------------------------------------
# the command line


def qualify_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "QUALIFY_HANDOFF_KEY"}
    return subprocess.run([sys.executable, "-m", "qualify.interfaces.cli", "--recipe", "native-text", *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.mark.parametrize(("args", "cause"), [
    (("--producer-at", "192.0.2.7:7443", "--key-file", "{set}/run.key"), "not loopback; plain TCP"),
    (("--tls-ca", "{set}/ca.crt"), "--tls-ca: only with --producer-at"),
    (("--producer-at", "127.0.0.1:7443"), "exactly one of --key-file or --key-env"),
    (("--producer-at", "127.0.0.1:7443", "--key-file", "{set}/run.key", "--tls-ca", "{set}/ca.crt"),
     "--tls-cert, --tls-key missing"),
    (("--producer-at", "127.0.0.1:7443", "--key-file", "{set}/run.key", "--fault", "v-scale"),
     "--fault: not with --producer-at"),
    (("--producer-at", "127.0.0.1:7443", "--key-file", "{set}/run.key", "--service-conditions", "recovery"),
     "--service-conditions: not with --producer-at"),
    (("--producer-at", "127.0.0.1", "--key-file", "{set}/run.key"), "expected HOST:PORT"),
], ids=["plain-off-loopback", "tls-without-address", "no-key", "half-tls", "fault", "service-conditions",
                        "no-port"])
def test_producer_at_usage_is_refused_with_exit_2_in_one_line(tls_set: Path, tmp_path: Path, args: tuple[str, ...],
                                                             cause: str) -> None:
    result = qualify_cli(*(arg.format(set=tls_set) for arg in args), "--receipts", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and cause in result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before any step: no receipt


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_started_producers_handoff_names_its_transport(kind: str) -> None:
    from tests.unit.handoff.test_handoff_service import free_tcp_port, producer

    options = {"transport": "tcp", "tcp_port": free_tcp_port()} if kind == "tcp" else {}
    with producer(**options) as started:
        handoff = started.request_prefill(TOKENS, "sample-1")
    assert handoff.transport is not None and handoff.transport.kind == kind
