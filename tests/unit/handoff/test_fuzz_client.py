"""Hostile producers through the real client: keyed wire mutants, frame-header, length and byte
mutations, handshake mutations and heartbeat abuse, each sent by a fake producer over a real
socket to :class:`~qualify.handoff.client.ProducerConnection` and then opened with
:func:`~qualify.handoff.wire.open_handoff`, as a run does.

Every example ends one of three ways, and only these: the client breaks the connection
(``ConnectionBroken``, a ``ProducerFailed``), the wire refuses the handoff (``HandoffRefused``),
or the handoff is accepted and carries exactly what the pristine one carried
(``tests.support.wire_mutants.equivalent``). Never another exception, never past the deadline.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.contract.lanes import ProducerMode
from qualify.core.errors import HandoffRefused
from qualify.handoff.client import ConnectionBroken, ProducerConnection, parse_ready_line
from qualify.handoff.protocol import FRAME_LENGTH, MAX_HEADER_BYTES, PROTOCOL, PhaseDeadlines, decode_frame_header
from qualify.handoff.wire import Handoff, handoff_key_id, manifest_canonical_bytes, manifest_mac, open_handoff
from tests.conftest import FuzzTally
from tests.support.wire_mutants import (
    REQUEST_ID,
    RUN_KEY,
    Mutant,
    all_mutants,
    equivalent,
    pristine_expectation,
    pristine_handoff,
)

DEADLINES = PhaseDeadlines(ready_s=5.0, verify_s=5.0, handoff_s=5.0, silence_s=2.0)
# A hang is an example that outlives its deadline (with room for a loaded CI machine).
HANG_S = DEADLINES.handoff_s + DEADLINES.verify_s + 5.0
NONCE = "ab" * 32
DEFAULT_EXAMPLES = 300
SLOW_EXAMPLES = 10_000


def as_json(document: object) -> bytes:
    """JSON as a hostile producer may write it: Infinity and NaN included (no encoder refusal)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def frame(header: dict[str, object]) -> bytes:
    body = as_json(header)
    return FRAME_LENGTH.pack(len(body)) + body


def answer_header(handoff: Handoff) -> dict[str, object]:
    return {"op": "handoff", "status": "ok", "request_id": REQUEST_ID, "compute_s": 0.01, "seal_s": 0.001,
            "blobs": [len(handoff.manifest_bytes), len(handoff.mac), memoryview(handoff.payload_bytes).nbytes]}


@dataclass
class Script:
    """What the fake producer sends, step by step: the three handshake answers, then the bytes
    answering the prefill request (heartbeats, the frame header, manifest, MAC and payload)."""

    what: str
    hello: bytes = frame({"op": "hello", "protocol": PROTOCOL, "nonce": NONCE, "key_id": handoff_key_id(RUN_KEY)})
    auth: bytes = frame({"op": "auth", "status": "ok"})
    ready: bytes = frame({"op": "ready", "status": "ok", "ready": True, "lane": "x", "host": {}})
    answer: bytes = b""
    mutant: Mutant | None = None
    original: Handoff = field(default_factory=pristine_handoff)


def wire_answer(handoff: Handoff, header: dict[str, object] | None = None) -> bytes:
    return (frame(header if header is not None else answer_header(handoff)) + bytes(handoff.manifest_bytes)
            + bytes(handoff.mac) + bytes(handoff.payload_bytes))


# ------------------------------------------------------------------------------------------
# strategies


@st.composite
def keyed_wire_scripts(draw: st.DrawFn) -> Script:
    """A keyed (or unkeyed) handoff mutant in a well-formed frame."""
    mutant = draw(all_mutants())
    return Script(f"wire {mutant.kind}: {mutant.what}", answer=wire_answer(mutant.handoff), mutant=mutant,
                  original=mutant.original)


_ODD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        st.text(max_size=20), st.lists(st.integers(-5, 2**40), max_size=5),
                        st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))


@st.composite
def header_scripts(draw: st.DrawFn) -> Script:
    """The handoff frame's header changed: a field's value or type, a field added or removed,
    the raw JSON replaced, or the length prefix lying about the header's size."""
    handoff = pristine_handoff()
    header = answer_header(handoff)
    blobs_and_rest = bytes(handoff.manifest_bytes) + bytes(handoff.mac) + bytes(handoff.payload_bytes)
    action = draw(st.sampled_from(["value", "blobs", "drop", "add", "raw", "length", "nesting"]))
    if action == "value":
        name = draw(st.sampled_from(sorted(header)))
        header[name] = draw(_ODD_VALUES)
        return Script(f"header {name}={header[name]!r:.60}", answer=frame(header) + blobs_and_rest)
    if action == "blobs":
        index = draw(st.integers(0, 2))
        blobs = list(header["blobs"])  # type: ignore[call-overload]
        blobs[index] = draw(st.one_of(st.integers(-3, 2**64), st.sampled_from([4.0, True, "8", None, 2.5, float("inf")])))
        header["blobs"] = blobs
        return Script(f"header blobs[{index}]={blobs[index]!r}", answer=frame(header) + blobs_and_rest)
    if action == "drop":
        name = draw(st.sampled_from(sorted(header)))
        del header[name]
        return Script(f"header without {name}", answer=frame(header) + blobs_and_rest)
    if action == "add":
        name = draw(st.text(min_size=1, max_size=8))
        header[name] = draw(_ODD_VALUES)
        return Script(f"header plus {name!r}", answer=frame(header) + blobs_and_rest)
    if action == "raw":
        body = draw(st.one_of(
            st.binary(max_size=64),
            st.sampled_from([b'{"op":"handoff","blobs":[1e400,32,8]}', b'{"op":"handoff","status":"ok","blobs":[NaN,32,8]}',
                             b'{"op":"handoff","op":"progress"}', b'\xff\xfe{}', b'[]', b'"op"', b'{"op":1}']),
        ))
        return Script(f"header raw {body[:40]!r}", answer=FRAME_LENGTH.pack(len(body)) + body + blobs_and_rest)
    if action == "nesting":
        depth = draw(st.integers(9, 100_000))
        body = b'{"op":"handoff","x":' + b"[" * depth + b"]" * depth + b"}"
        return Script(f"header nested {depth} deep", answer=FRAME_LENGTH.pack(len(body)) + body + blobs_and_rest)
    body = as_json(header)
    claimed = draw(st.one_of(st.integers(0, len(body) - 1), st.integers(len(body) + 1, MAX_HEADER_BYTES * 4),
                             st.just(2**32 - 1)))
    return Script(f"header length {claimed} for {len(body)}", answer=FRAME_LENGTH.pack(claimed) + body + blobs_and_rest)


@st.composite
def byte_scripts(draw: st.DrawFn) -> Script:
    """The answer's bytes changed anywhere: flipped, cut short, or grown."""
    answer = bytearray(wire_answer(pristine_handoff()))
    action = draw(st.sampled_from(["flip", "truncate", "insert"]))
    at = draw(st.integers(0, len(answer) - 1))
    if action == "flip":
        answer[at] ^= draw(st.integers(1, 255))
    elif action == "truncate":
        del answer[at:]
    else:
        answer[at:at] = draw(st.binary(min_size=1, max_size=16))
    return Script(f"bytes {action} at {at}", answer=bytes(answer))


@st.composite
def handshake_scripts(draw: st.DrawFn) -> Script:
    """One handshake answer replaced by another value of each field, or by other bytes."""
    script = Script("handshake", answer=wire_answer(pristine_handoff()))
    step = draw(st.sampled_from(["hello", "auth", "ready"]))
    documents = {
        "hello": {"op": "hello", "protocol": PROTOCOL, "nonce": NONCE, "key_id": handoff_key_id(RUN_KEY)},
        "auth": {"op": "auth", "status": "ok"},
        "ready": {"op": "ready", "status": "ok", "ready": True, "lane": "x", "host": {}},
    }
    document = documents[step]
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(document)))
        document[name] = draw(_ODD_VALUES)
        replaced = frame(document)
        script.what = f"handshake {step} {name}={document[name]!r:.60}"
    else:
        body = draw(st.binary(max_size=48))
        replaced = FRAME_LENGTH.pack(len(body)) + body
        script.what = f"handshake {step} raw {body[:30]!r}"
    setattr(script, step, replaced)
    return script


@st.composite
def heartbeat_scripts(draw: st.DrawFn) -> Script:
    """Heartbeats before the answer: honest ones, another request's, ones claiming a status."""
    handoff = pristine_handoff()
    count = draw(st.integers(1, 50))
    beat: dict[str, object] = {"op": "progress", "request_id": REQUEST_ID, "elapsed_s": 0.5}
    kind = draw(st.sampled_from(["honest", "other-request", "with-status", "with-blobs"]))
    if kind == "other-request":
        beat["request_id"] = "req-other"
    elif kind == "with-status":
        beat["status"] = draw(st.sampled_from(["ok", "error"]))
    elif kind == "with-blobs":
        beat["blobs"] = [1, 2, 3]
    return Script(f"{count} {kind} heartbeats", answer=frame(beat) * count + wire_answer(handoff))


ALL_SCRIPTS = st.one_of(keyed_wire_scripts(), keyed_wire_scripts(), keyed_wire_scripts(), header_scripts(),
                        byte_scripts(), handshake_scripts(), heartbeat_scripts())


# ------------------------------------------------------------------------------------------
# the fake producer and one exchange


def _read_frame(sock: socket.socket) -> dict[str, object]:
    (length,) = FRAME_LENGTH.unpack(sock.recv(FRAME_LENGTH.size, socket.MSG_WAITALL))
    return decode_frame_header(sock.recv(length, socket.MSG_WAITALL))


def fake_producer(sock: socket.socket, script: Script) -> None:
    """Answer the client's handshake and one prefill request as the script says, then close."""
    sock.settimeout(HANG_S)
    try:
        sock.sendall(script.hello)
        _read_frame(sock)  # auth
        sock.sendall(script.auth)
        _read_frame(sock)  # ready?
        sock.sendall(script.ready)
        _read_frame(sock)  # prefill
        sock.sendall(script.answer)
    except Exception:
        pass  # the client hung up on a broken handshake: that is its job
    finally:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def exchange(script: Script) -> str:
    """Run one exchange through the real client and the wire; returns how it ended."""
    client_sock, producer_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    expectation = script.mutant.expectation if script.mutant is not None else pristine_expectation()
    producer = threading.Thread(target=fake_producer, args=(producer_sock, script), daemon=True)
    producer.start()
    connection = ProducerConnection(client_sock, key=RUN_KEY, run_id="run-fuzz", deadlines=DEADLINES,
                                    expected_payload_bytes=expectation.expected_payload_bytes)
    try:
        connection.handshake()
        handoff = connection.request_prefill(list(range(8)), REQUEST_ID)
        opened = open_handoff(handoff, RUN_KEY, expectation)
    except ConnectionBroken:
        return "broken by the client"
    except HandoffRefused:
        return "refused by the wire"
    finally:
        connection.close()
        producer.join(HANG_S)
        producer_sock.close()
    return "accepted equivalent" if equivalent(script.original, opened) else "ACCEPTED NON-EQUIVALENT"


def check_exchange(script: Script, tally: FuzzTally) -> None:
    started = time.monotonic()
    try:
        outcome = exchange(script)
    except Exception as exc:  # counted, then failed: the boundary let something through
        tally.add("raw_exceptions")
        raise AssertionError(f"{script.what}: raw {type(exc).__name__}: {exc}") from exc
    elapsed = time.monotonic() - started
    tally.add("examples")
    tally.add(outcome.replace(" ", "_").lower())
    if elapsed > HANG_S:
        tally.add("hangs")
    assert elapsed <= HANG_S, f"{script.what}: took {elapsed:.1f} s, past the deadline"
    assert outcome != "ACCEPTED NON-EQUIVALENT", script.what


# ------------------------------------------------------------------------------------------
# the tests


def test_the_pristine_handoff_is_accepted_through_the_client() -> None:
    assert exchange(Script("pristine", answer=wire_answer(pristine_handoff()))) == "accepted equivalent"


def test_a_foreign_key_id_through_the_client_is_refused_naming_key_id() -> None:
    mutant_manifest = json.loads(pristine_handoff().manifest_bytes)
    mutant_manifest["key_id"] = "0" * 16
    manifest = manifest_canonical_bytes(mutant_manifest)
    original = pristine_handoff()
    forged = Handoff(manifest, manifest_mac(RUN_KEY, manifest), original.payload_bytes)
    client_sock, producer_sock = socket.socketpair()
    thread = threading.Thread(target=fake_producer, args=(producer_sock, Script("key", answer=wire_answer(forged))))
    thread.start()
    connection = ProducerConnection(client_sock, key=RUN_KEY, run_id="run-fuzz", deadlines=DEADLINES)
    connection.handshake()
    handoff = connection.request_prefill([1, 2], REQUEST_ID)
    with pytest.raises(HandoffRefused, match="key_id") as refused:
        open_handoff(handoff, RUN_KEY, pristine_expectation())
    assert refused.value.check == "manifest.key_id"
    connection.close()
    thread.join()


@settings(max_examples=DEFAULT_EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(script=ALL_SCRIPTS)
def test_hostile_producers_through_the_client_are_refused(script: Script, fuzz_tally: FuzzTally) -> None:
    check_exchange(script, fuzz_tally)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(script=ALL_SCRIPTS)
def test_ten_thousand_hostile_producers_through_the_client_are_refused(script: Script, fuzz_tally: FuzzTally) -> None:
    check_exchange(script, fuzz_tally)


@settings(max_examples=12, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cut=st.integers(1, 2000))
def test_a_producer_silent_mid_answer_is_dropped_at_the_silence_deadline(cut: int, fuzz_tally: FuzzTally) -> None:
    answer = wire_answer(pristine_handoff())
    cut = min(cut, len(answer) - 1)
    client_sock, producer_sock = socket.socketpair()
    silence = PhaseDeadlines(ready_s=5.0, verify_s=5.0, handoff_s=30.0, silence_s=0.5)
    stop = threading.Event()

    def stall() -> None:  # answers part of the frame, then keeps the socket open and says nothing
        fake_producer_partial(producer_sock, answer[:cut])
        stop.wait(30)

    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    connection = ProducerConnection(client_sock, key=RUN_KEY, run_id="run-fuzz", deadlines=silence)
    started = time.monotonic()
    connection.handshake()
    with pytest.raises(ConnectionBroken, match=r"silent for \d+\.\d s during handoff"):
        connection.request_prefill([1, 2], REQUEST_ID)
    waited = time.monotonic() - started
    stop.set()
    connection.close()
    producer_sock.close()
    fuzz_tally.add("examples")
    fuzz_tally.add("dropped_at_silence_deadline")
    assert 0.5 <= waited < 0.5 + 5.0


def fake_producer_partial(sock: socket.socket, answer: bytes) -> None:
    sock.settimeout(HANG_S)
    sock.sendall(Script("partial").hello)
    _read_frame(sock)
    sock.sendall(Script("partial").auth)
    _read_frame(sock)
    sock.sendall(Script("partial").ready)
    _read_frame(sock)
    sock.sendall(answer)


_READY_LINE = {"event": "ready", "protocol": PROTOCOL, "pid": 4242, "address": "unix:/x", "lane": "nvfp4-exact",
               "producer_mode": "exact", "key_id": handoff_key_id(RUN_KEY), "warmup_s": 0.5}


@settings(max_examples=2000, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_ready_lines_are_refused_naming_the_field(data: st.DataObject, fuzz_tally: FuzzTally) -> None:
    line: dict[str, object] = dict(_READY_LINE)
    action = data.draw(st.sampled_from(["value", "drop", "add", "raw"]))
    if action == "value":
        name = data.draw(st.sampled_from(sorted(line)))
        line[name] = data.draw(_ODD_VALUES.filter(lambda value: value != _READY_LINE[name] or type(value) is not type(_READY_LINE[name])))
        raw = as_json(line)
    elif action == "drop":
        del line[data.draw(st.sampled_from(sorted(line)))]
        raw = as_json(line)
    elif action == "add":
        line[data.draw(st.text(min_size=1, max_size=6).filter(lambda name: name not in _READY_LINE))] = 1
        raw = as_json(line)
    else:
        raw = data.draw(st.binary(max_size=80))
    fuzz_tally.add("examples")
    try:
        parsed = parse_ready_line(raw, lane="nvfp4-exact", mode=ProducerMode.EXACT, run_key_id=handoff_key_id(RUN_KEY), pid=4242)
    except ConnectionBroken as broken:
        assert str(broken).startswith("ready line")
        fuzz_tally.add("refused")
        return
    # Accepted: only the two fields the client does not act on may differ, each well formed (an
    # announced address is recorded and never connected to; the warm-up time is informational).
    changed = {name for name in _READY_LINE if parsed[name] != _READY_LINE[name]}
    assert changed <= {"address", "warmup_s"}, changed
    assert isinstance(parsed["address"], str)
    assert type(parsed["warmup_s"]) in (int, float) and 0 <= parsed["warmup_s"] < float("inf")
    fuzz_tally.add("accepted_other_" + "_and_".join(sorted(changed)))


# ------------------------------------------------------------------------------------------
# the red team's client findings, one test each


def _broken_by(script: Script, **connection_options: object) -> ConnectionBroken:
    client_sock, producer_sock = socket.socketpair()
    thread = threading.Thread(target=fake_producer, args=(producer_sock, script), daemon=True)
    thread.start()
    connection = ProducerConnection(client_sock, key=RUN_KEY, run_id="run-fuzz", deadlines=DEADLINES, **connection_options)  # type: ignore[arg-type]
    try:
        with pytest.raises(ConnectionBroken) as broken:
            connection.handshake()
            connection.request_prefill([1, 2], REQUEST_ID)
    finally:
        connection.close()
        thread.join(HANG_S)
        producer_sock.close()
    return broken.value


def test_deeply_nested_frame_header_is_refused_not_a_recursion_error() -> None:
    body = b'{"op":"handoff","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    broken = _broken_by(Script("nested", answer=FRAME_LENGTH.pack(len(body)) + body))
    assert "frame header: nesting deeper than 8 levels" in str(broken)


def test_an_announced_16_gib_payload_is_refused_before_any_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.handoff import client

    def no_allocation(size: int) -> memoryview:
        raise AssertionError(f"allocated {size} bytes for a payload the client should have refused")

    monkeypatch.setattr(client, "receive_buffer", no_allocation)
    handoff = pristine_handoff()
    header = answer_header(handoff)
    header["blobs"] = [len(handoff.manifest_bytes), len(handoff.mac), 16 << 30]
    answer = frame(header) + bytes(handoff.manifest_bytes) + bytes(handoff.mac)
    expected = pristine_expectation().expected_payload_bytes
    broken = _broken_by(Script("16 GiB", answer=answer), expected_payload_bytes=expected)
    assert f"handoff frame blobs: payload of {16 << 30} bytes, expected at most {expected} (the run's geometry)" in str(broken)
    # Without the run's geometry, the client's ceiling still refuses it before allocating.
    broken = _broken_by(Script("16 GiB", answer=answer), max_payload_bytes=8 << 30)
    assert "expected at most 8589934592" in str(broken)


def test_a_bad_port_in_the_ready_line_is_recorded_not_parsed() -> None:
    """The client never parses the announced address (it connects only to its own socket:
    tests/unit/handoff/test_producer_deadlines.py::test_client_connects_only_to_the_socket_it_created)."""
    line = dict(_READY_LINE, address="tcp:127.0.0.1:not-a-port")
    parsed = parse_ready_line(as_json(line), lane="nvfp4-exact", mode=ProducerMode.EXACT,
                              run_key_id=handoff_key_id(RUN_KEY), pid=4242)
    assert parsed["address"] == "tcp:127.0.0.1:not-a-port"  # kept for the record only


def test_a_ready_line_for_another_run_key_is_refused_naming_key_id() -> None:
    line = dict(_READY_LINE, key_id="0" * 16)
    with pytest.raises(ConnectionBroken, match="ready line key_id: found '0000000000000000'"):
        parse_ready_line(as_json(line), lane="nvfp4-exact", mode=ProducerMode.EXACT, run_key_id=handoff_key_id(RUN_KEY), pid=4242)
