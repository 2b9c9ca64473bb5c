"""The producer service across a real process boundary, with a stub engine.

The stub engine factory lives in this module (``--engine-factory
tests.unit.handoff.test_handoff_service:build_stub_engine``); its lane name picks a behaviour: ``stub-ok``,
``stub-raise`` (raises on the first real request), ``stub-hang`` and ``stub-slow`` (block on the
first real request after touching a marker file, so a test knows the request is inside the
engine). On a lane of the table it hands off every position, or with ``STUB_ENGINE_BLOCKS`` set
the lane's own count. Watchdogs are short here; client timeouts are generous and only guard
against hangs.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qualify.contract.lanes import LANES, VLLM_TO_REFERENCE_LANE, ProducerMode, lane_spec
from qualify.core.assets import REPO_ROOT, prompt_sha256
from qualify.core.digests import document_sha256
from qualify.core.errors import HandoffRefused, ProducerFailed, Refused
from qualify.core.kv import KVCache
from qualify.engines.base import ModelGeometry
from qualify.handoff import client
from qualify.handoff.client import ProducerFailure, ProducerProcess, ProducerStartRefused
from qualify.handoff.protocol import (
    FRAME_LENGTH,
    PRODUCER_MODULE,
    PhaseDeadlines,
    ProducerExpectation,
    StartRefused,
    client_auth_mac,
    decode_frame_header,
    encode_frame_header,
    expectation_from_identity,
)
from qualify.handoff.service import bind_unix
from qualify.handoff.wire import HandoffExpectation, mint_run_key, open_handoff
from qualify.interfaces.producer_command import parse_config

FACTORY = "tests.unit.handoff.test_handoff_service:build_stub_engine"
MARKER_ENV = "STUB_ENGINE_MARKER"
BLOCKS_ENV = "STUB_ENGINE_BLOCKS"
STUB_GEOMETRY = ModelGeometry(layers=3, hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=64,
                              max_positions=256, rope_theta=10000.0)
STUB_DIGESTS = {"model.safetensors": hashlib.sha256(b"stub checkpoint").hexdigest()}
STUB_CACHE_IDENTITY = {
    mode: hashlib.sha256(f"stub cache identity {mode.value}".encode()).hexdigest() for mode in ProducerMode
}
IDENTITY_SHA256 = hashlib.sha256(b"stub identity").hexdigest()
EXPECTATION = ProducerExpectation(
    engine_version="stub-1", geometry=STUB_GEOMETRY, identity_sha256=IDENTITY_SHA256,
    engine_name="stub", engine_abi="stub-abi-1", digests=STUB_DIGESTS,
)
RUN_ID = "run-test"
TOKENS = np.arange(40, dtype=np.int64) * 7 % STUB_GEOMETRY.vocab
HANG_GUARD_S = 60.0
# Every phase of a test producer bounded by the hang guard (a test never waits longer for one).
HANG_GUARD_DEADLINES = PhaseDeadlines(ready_s=HANG_GUARD_S, verify_s=HANG_GUARD_S, handoff_s=HANG_GUARD_S,
                                      silence_s=HANG_GUARD_S)


# ------------------------------------------------------------------------------------------
# the stub engine (imported by the producer subprocess)


def stub_kv(tokens: np.ndarray) -> KVCache:
    """Deterministic KV of ``tokens`` in the canonical layout."""
    g = STUB_GEOMETRY
    positions = len(tokens)
    grid = (np.arange(g.kv_heads)[:, None, None] * 0.5
            + np.asarray(tokens, dtype=np.float64)[None, :, None] * 0.01
            + np.arange(g.head_dim)[None, None, :] * 0.001)
    keys = [np.ascontiguousarray((grid + layer).astype(np.float32)) for layer in range(g.layers)]
    values = [np.ascontiguousarray((-grid - layer).astype(np.float32)) for layer in range(g.layers)]
    assert keys[0].shape == (g.kv_heads, positions, g.head_dim)
    return KVCache(keys, values)


class StubEngine:
    """Implements the Engine attributes the producer checks, with one scripted behaviour."""

    name = "stub"
    version = "stub-1"
    abi = "stub-abi-1"
    logit_units = "raw"
    geometry = STUB_GEOMETRY
    digests = STUB_DIGESTS

    def __init__(self, behaviour: str, mode: ProducerMode, lane: str = "stub-ok") -> None:
        self.behaviour = behaviour
        self.lane = lane
        self.producer_mode = mode
        self.target_cache_identity_sha256 = STUB_CACHE_IDENTITY[mode]
        self.calls = 0

    def prefill(self, tokens: np.ndarray) -> KVCache:
        self.calls += 1
        if self.calls > 1:  # the first call is the producer's warm-up
            if self.behaviour == "raise":
                raise RuntimeError("stub engine exploded")
            if self.behaviour in ("hang", "slow"):
                Path(os.environ[MARKER_ENV]).write_text("inside prefill")
                while True:
                    time.sleep(0.05)
        if self.behaviour == "blocks":  # the lane's whole blocks, as a vLLM-side producer hands off
            return stub_kv(tokens[:lane_spec(self.lane).handed_off_positions(len(tokens))])
        return stub_kv(tokens)

    def decode(self, kv: KVCache, pending: np.ndarray, n: int):  # pragma: no cover
        raise NotImplementedError

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray):  # pragma: no cover
        raise NotImplementedError


def build_stub_engine(lane: str, mode: ProducerMode) -> StubEngine:
    if lane in LANES:
        return StubEngine("blocks" if os.environ.get(BLOCKS_ENV) else "ok", mode, lane)
    behaviour = lane.removeprefix("stub-")
    if behaviour not in ("ok", "raise", "hang", "slow"):
        raise ValueError(f"unknown stub lane {lane}")
    return StubEngine(behaviour, mode, lane)


# ------------------------------------------------------------------------------------------
# helpers


def producer(lane: str = "stub-ok", mode: ProducerMode = ProducerMode.EXACT, *, key: bytes | None = None,
             expectation: ProducerExpectation = EXPECTATION, watchdog_s: float = 30.0,
             marker: Path | None = None, whole_blocks: bool = False, **options) -> ProducerProcess:
    env = {MARKER_ENV: str(marker)} if marker is not None else {}
    if whole_blocks:
        env[BLOCKS_ENV] = "1"
    return ProducerProcess(
        lane=lane, mode=mode, key=key if key is not None else KEY, run_id=RUN_ID,
        expectation=expectation, watchdog_s=watchdog_s,
        deadlines=options.pop("deadlines", HANG_GUARD_DEADLINES),
        engine_factory=FACTORY, env=env, **options,
    )


KEY = mint_run_key()


def stub_expectation(*, mode: ProducerMode = ProducerMode.EXACT, request_id: str,
                     tokens: np.ndarray = TOKENS, lane: str = "stub-ok") -> HandoffExpectation:
    """What the consumer expects of a stub handoff of (all of) ``tokens`` from ``lane``'s producer."""
    return HandoffExpectation(
        identity_sha256=IDENTITY_SHA256, cache_identity=STUB_CACHE_IDENTITY[mode],
        geometry=STUB_GEOMETRY.kv_geometry(len(tokens)), prompt_sha256=prompt_sha256(tokens), run_id=RUN_ID,
        request_id=request_id, lane=lane, producer_mode=mode,
    )


def open_stub_handoff(handoff, *, mode: ProducerMode = ProducerMode.EXACT, request_id: str, tokens=TOKENS,
                      lane: str = "stub-ok"):
    return open_handoff(handoff, key=KEY, expectation=stub_expectation(mode=mode, request_id=request_id,
                                                                       tokens=tokens, lane=lane))


def sorted_by_layout(tensors: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Tensors in safetensors layout order (larger dtype first, then name), as the payload holds them."""
    return [tensors[name] for name in sorted(
        tensors, key=lambda name: (-tensors[name].dtype.itemsize, name.encode()))]


def run_service(*args: str, key_hex: str | None = None, expect: Path | None = None,
                tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run the service directly (for start refusals); the key travels in the environment."""
    expect_path = expect or tmp_path / "expect.json"
    if expect is None:
        import json

        expect_path.write_text(json.dumps(EXPECTATION.to_document()))
    env = dict(os.environ, QUALIFY_HANDOFF_KEY=key_hex or KEY.hex())
    return subprocess.run(
        [sys.executable, "-m", PRODUCER_MODULE, "--run-id", RUN_ID,
         "--expect", str(expect_path), "--engine-factory", FACTORY, *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )


def kill_when_inside_engine(marker: Path, pid: int) -> threading.Thread:
    """SIGKILL ``pid`` once the stub engine has entered prefill (marker file appears)."""
    def watch() -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------------------------------
# round trips


def test_prefill_round_trip_across_process_boundary() -> None:
    with producer() as p:
        assert p.ready_info["event"] == "ready"
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{p.pid}/environ").read_bytes()
        assert KEY.hex().encode() not in cmdline and KEY.hex().encode() not in environ
        for index in range(2):
            request_id = f"req-{index}"
            handoff = p.request_prefill(TOKENS, request_id)
            kv, manifest, timings = open_stub_handoff(handoff, request_id=request_id)
            expected = stub_kv(TOKENS)
            for found, wanted in zip(kv.keys + kv.values, expected.keys + expected.values,
                                     strict=True):
                assert np.array_equal(found, wanted)
            assert manifest.producer_mode == "exact"
            assert manifest.lane == "stub-ok"
            assert manifest.schema == "trust-ladder.handoff-manifest.v4"
            payload = bytes(handoff.payload_bytes)
            header_end = 8 + int.from_bytes(payload[:8], "little")
            leaves = b"".join(hashlib.sha256(a.tobytes()).digest()
                              for a in sorted_by_layout(expected.tensors()))
            assert manifest.payload_tree_sha256 == hashlib.sha256(
                payload[:header_end] + leaves).hexdigest()
            assert manifest.seams[1].k_sha256 == hashlib.sha256(expected.keys[1].tobytes()).hexdigest()
            assert manifest.handed_off_positions == len(TOKENS)
            assert handoff.transport is not None
            assert handoff.transport.payload_bytes == manifest.payload_size
            assert handoff.transport.gbit_per_s > 0
            assert timings.total_s >= 0
    assert p.exit_status == 0


def free_tcp_port() -> int:
    """A loopback port nothing listens on now (the operator's choice in a real TCP run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_client_refuses_tcp_without_an_operator_port() -> None:
    with pytest.raises(Refused, match="producer tcp port: found 0, expected the port to connect to"):
        producer(transport="tcp")


def test_loopback_tcp_round_trip_into_huge_page_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "HUGE_PAGE_MIN_BYTES", 1)  # take the large-payload path
    port = free_tcp_port()
    with producer(transport="tcp", tcp_port=port) as p:
        assert p.ready_info["address"] == f"tcp:127.0.0.1:{port}"
        handoff = p.request_prefill(TOKENS, "req-tcp")
        assert isinstance(handoff.payload_bytes, memoryview)
        assert isinstance(handoff.payload_bytes.obj, mmap.mmap)
        kv, _, _ = open_stub_handoff(handoff, request_id="req-tcp")
        assert np.array_equal(kv.values[2], stub_kv(TOKENS).values[2])
        assert kv.values[2].flags.writeable
    assert p.exit_status == 0


def test_client_refuses_non_integer_tokens() -> None:
    with producer() as p:
        with pytest.raises(Refused, match="prefill tokens"):
            p.request_prefill(TOKENS.astype(np.float32), "req-float")
        handoff = p.request_prefill(TOKENS, "req-after")  # the producer is unaffected
        open_stub_handoff(handoff, request_id="req-after")


def test_native_producer_handoff_refused_where_exact_expected() -> None:
    with producer(mode=ProducerMode.NATIVE) as p:
        handoff = p.request_prefill(TOKENS, "req-native")
        _, manifest, _ = open_stub_handoff(handoff, mode=ProducerMode.NATIVE, request_id="req-native")
        assert manifest.producer_mode is ProducerMode.NATIVE
        with pytest.raises(HandoffRefused, match="target_cache_identity_sha256.*producer mode native"):
            open_stub_handoff(handoff, mode=ProducerMode.EXACT, request_id="req-native")


def test_a_whole_block_lane_hands_off_its_whole_blocks_and_names_their_tokens() -> None:
    """On a lane with vLLM on a side the producer hands off the lane's count (whole blocks) of a
    prompt, and its manifest names exactly those tokens; the consumer recomputes the rest."""
    tokens = np.arange(200, dtype=np.int64) * 5 % STUB_GEOMETRY.vocab
    handed_off = lane_spec(VLLM_TO_REFERENCE_LANE).handed_off_positions(len(tokens))
    assert handed_off == 128
    with producer(VLLM_TO_REFERENCE_LANE, ProducerMode.NATIVE, whole_blocks=True) as p:
        handoff = p.request_prefill(tokens, "req-blocks")
        kv, manifest, _ = open_stub_handoff(handoff, mode=ProducerMode.NATIVE, request_id="req-blocks",
                                            tokens=tokens[:handed_off], lane=VLLM_TO_REFERENCE_LANE)
    assert manifest.handed_off_positions == handed_off and manifest.lane == VLLM_TO_REFERENCE_LANE
    assert np.array_equal(kv.keys[0], stub_kv(tokens[:handed_off]).keys[0])


def test_an_engine_handing_off_other_than_its_lanes_count_is_refused_at_start() -> None:
    """A whole-block lane's producer whose engine hands off every position fails its warm-up."""
    with pytest.raises(ProducerStartRefused, match="engine prefill geometry.*'positions': 128") as refused:
        with producer(VLLM_TO_REFERENCE_LANE, ProducerMode.NATIVE):
            pass
    assert refused.value.exit_status == 2


def test_client_with_wrong_key_is_turned_away() -> None:
    with producer() as p:
        assert p.socket_path is not None
        intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        intruder.settimeout(HANG_GUARD_S)
        intruder.connect(str(p.socket_path))
        # the producer serves one client at a time: close the harness connection first
        assert p._connection is not None
        p._connection.close()
        p._connection = None

        def read_header(sock: socket.socket) -> dict:
            (length,) = FRAME_LENGTH.unpack(sock.recv(FRAME_LENGTH.size, socket.MSG_WAITALL))
            return decode_frame_header(sock.recv(length, socket.MSG_WAITALL))

        hello = read_header(intruder)
        wrong = client_auth_mac(mint_run_key(), bytes.fromhex(hello["nonce"]), RUN_ID)
        intruder.sendall(encode_frame_header({"op": "auth", "run_id": RUN_ID, "mac": wrong.hex()}))
        answer = read_header(intruder)
        assert answer["status"] == "error" and "authentication failed" in answer["error"]
        assert intruder.recv(1) == b""  # connection closed
        intruder.close()


# ------------------------------------------------------------------------------------------
# start refusals (exit 2)


def test_bad_mode_refuses_to_start(tmp_path: Path) -> None:
    result = run_service("--lane", "stub-ok", "--mode", "fast", "--socket",
                         str(tmp_path / "p.sock"), tmp_path=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mode" in lines[0] and "'fast'" in lines[0]
    with pytest.raises(Refused, match="producer mode: found 'turbo', expected exact or native"):
        producer(mode="turbo")  # the harness refuses it before any process starts


def test_non_loopback_address_needs_explicit_flag(tmp_path: Path) -> None:
    result = run_service("--lane", "stub-ok", "--mode", "exact", "--host", "0.0.0.0",
                         "--port", "0", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "not loopback" in result.stderr and "--allow-non-loopback" in result.stderr


@pytest.mark.parametrize(
    ("expectation", "field"),
    [
        (replace(EXPECTATION, geometry=replace(STUB_GEOMETRY, heads=8)), "heads"),
        (replace(EXPECTATION, geometry=replace(STUB_GEOMETRY, rope_theta=500000.0)), "rope_theta"),
        (replace(EXPECTATION, geometry=replace(STUB_GEOMETRY, max_positions=4096)),
         "max_positions"),
        (replace(EXPECTATION, engine_version="stub-2"), "engine version"),
        (replace(EXPECTATION, digests={"model.safetensors": "0" * 64}), "digests"),
        (replace(EXPECTATION, engine_kat_sha256="1" * 64), "known-answer digest"),
    ],
    ids=["heads", "rope_theta", "context_length", "engine_version", "digests", "known_answer"],
)
def test_engine_mismatch_fails_at_start(expectation: ProducerExpectation, field: str) -> None:
    with pytest.raises(ProducerStartRefused, match=field) as refused:
        with producer(expectation=expectation):
            pass
    assert refused.value.exit_status == 2


def test_start_arguments_refused_in_one_line(tmp_path: Path) -> None:
    base = ["--lane", "stub-ok", "--run-id", RUN_ID, "--expect", str(tmp_path / "e.json"),
            "--socket", str(tmp_path / "p.sock"), "--key-env", "X"]
    with pytest.raises(StartRefused, match="--mode"):
        parse_config([*base, "--mode", "EXACT"])
    with pytest.raises(StartRefused, match="exactly one of --socket"):
        parse_config([*base, "--mode", "exact", "--port", "0"])
    with pytest.raises(StartRefused, match="--watchdog-s"):
        parse_config([*base, "--mode", "exact", "--watchdog-s", "0"])
    with pytest.raises(StartRefused, match="run key"):
        parse_config([*base, "--mode", "exact", "--key-fd", "9"])
    with pytest.raises(StartRefused, match="producer arguments"):
        parse_config([*base, "--mode", "exact", "--bogus"])
    with pytest.raises(StartRefused, match="geometry"):
        document = EXPECTATION.to_document()
        del document["geometry"]["rope_theta"]
        ProducerExpectation.from_document(document)
    assert ProducerExpectation.from_document(EXPECTATION.to_document()) == EXPECTATION
    # Every KV dtype the wire carries (bfloat16 for the torch-llama lanes), and nothing else.
    bf16 = ProducerExpectation.from_document({**EXPECTATION.to_document(), "kv_dtype": "bfloat16"})
    assert bf16.kv_dtype == "bfloat16"
    with pytest.raises(StartRefused, match="kv_dtype 'int8' is not a KV dtype"):
        ProducerExpectation.from_document({**EXPECTATION.to_document(), "kv_dtype": "int8"})


def test_expectation_from_identity_pins_engine_digests_and_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import qualify.contract.identity

    # a stand-in identity (a real one needs sealed constants and a basis receipt)
    monkeypatch.setattr(qualify.contract.identity, "identity_sha256",
                        lambda identity: document_sha256(identity.document()))
    document = {"schema": "trust-ladder.onboarding-identity.v2", "lane": "stub-ok", "n": 1}
    identity = SimpleNamespace(
        lane="nvfp4-exact",  # a float32 lane: the expectation's KV dtype is the lane's
        spec=lane_spec("nvfp4-exact"),
        producer_engine=SimpleNamespace(name="stub", version="stub-1", abi="stub-abi-1", kat_sha256=None),
        checkpoint=SimpleNamespace(files=STUB_DIGESTS),
        context_policy=SimpleNamespace(max_positions=STUB_GEOMETRY.max_positions),
        rope=SimpleNamespace(theta=STUB_GEOMETRY.rope_theta),
        document=lambda: document,
    )
    expectation = expectation_from_identity(identity, STUB_GEOMETRY)
    assert expectation == replace(EXPECTATION, identity_sha256=document_sha256(document))
    with pytest.raises(Refused, match="rope.theta"):
        expectation_from_identity(identity, replace(STUB_GEOMETRY, rope_theta=1.0))
    with pytest.raises(Refused, match="max_positions"):
        expectation_from_identity(identity, replace(STUB_GEOMETRY, max_positions=8))


def test_stale_socket_is_replaced_and_live_socket_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # leaves the file behind, nobody listening
    listener = bind_unix(path)
    try:
        assert (path.stat().st_mode & 0o777) == 0o600
        with pytest.raises(StartRefused, match="live producer"):
            bind_unix(path)
    finally:
        listener.close()


# ------------------------------------------------------------------------------------------
# failures become ProducerFailed within seconds (exit 75, SIGKILL, watchdog)


def test_engine_error_returns_error_frame_then_exit_75() -> None:
    with producer("stub-raise") as p:
        with pytest.raises(ProducerFailure) as failed:
            p.request_prefill(TOKENS, "req-boom")
        with pytest.raises(ProducerFailed):  # the producer stays failed
            p.request_prefill(TOKENS, "req-again")
    assert failed.value.exit_status == 75
    assert "stub engine exploded" in failed.value.producer_message
    assert "exit status 75" in str(failed.value)


def test_sigkill_mid_request_becomes_producer_failed(tmp_path: Path) -> None:
    marker = tmp_path / "inside"
    with producer("stub-slow", marker=marker) as p:
        killer = kill_when_inside_engine(marker, p.pid)
        with pytest.raises(ProducerFailure) as failed:
            p.request_prefill(TOKENS, "req-killed")
        killer.join(HANG_GUARD_S)
    assert failed.value.exit_status == -signal.SIGKILL
    assert "killed by signal 9" in str(failed.value)


def test_hanging_engine_is_stopped_by_watchdog(tmp_path: Path) -> None:
    with producer("stub-hang", watchdog_s=1.0, marker=tmp_path / "inside") as p:
        with pytest.raises(ProducerFailure) as failed:
            p.request_prefill(TOKENS, "req-hang")
    assert failed.value.exit_status == 75
    assert "watchdog" in failed.value.producer_message


def test_client_deadline_stops_a_stuck_producer(tmp_path: Path) -> None:
    one_second = PhaseDeadlines(ready_s=HANG_GUARD_S, verify_s=HANG_GUARD_S, handoff_s=1.0, silence_s=HANG_GUARD_S)
    with producer("stub-hang", watchdog_s=600.0, marker=tmp_path / "inside", deadlines=one_second) as p:
        with pytest.raises(ProducerFailure, match="no answer within the handoff deadline of 1 s") as failed:
            p.request_prefill(TOKENS, "req-stuck")
    assert failed.value.exit_status == -signal.SIGKILL


def test_request_validation_errors_do_not_touch_engine_but_three_exit_75() -> None:
    with producer() as p:
        connection = p._connection
        assert connection is not None
        for index in range(2):
            connection._send({"op": "prefill", "request_id": f"bad-{index}", "tokens": [10_000]})
            answer = connection._read_header(time.monotonic() + HANG_GUARD_S)
            assert answer["status"] == "error" and "tokens" in answer["error"]
        handoff = p.request_prefill(TOKENS, "req-good")  # a success resets the count
        open_stub_handoff(handoff, request_id="req-good")
        for _ in range(2):
            connection._send({"op": "nonsense"})
            connection._read_header(time.monotonic() + HANG_GUARD_S)
        connection._send({"op": "nonsense"})
        answer = connection._read_header(time.monotonic() + HANG_GUARD_S)
        assert answer.get("exit_status") == 75
    assert p.exit_status == 75
