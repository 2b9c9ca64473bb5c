"""The in-process transport: its handoffs open like the producer process's, and fail like them.

The engine is the producer service tests' stub (:mod:`tests.unit.handoff.test_handoff_service`); the socket
handoff it is compared with comes from a real producer process serving the same stub.
"""

from __future__ import annotations

import numpy as np
import pytest

from qualify.contract.lanes import VLLM_TO_REFERENCE_LANE, ProducerMode, lane_spec
from qualify.core.errors import HandoffRefused, ProducerFailed, Refused
from qualify.core.kv import KVCache
from qualify.handoff.transport import InProcessProducer, InProcessTransport, PrefillProducer, ProducedKV
from qualify.handoff.wire import Handoff, open_handoff, payload_layout
from tests.unit.handoff.test_handoff_service import (
    IDENTITY_SHA256,
    KEY,
    RUN_ID,
    STUB_CACHE_IDENTITY,
    STUB_GEOMETRY,
    TOKENS,
    StubEngine,
    open_stub_handoff,
    producer,
    stub_expectation,
    stub_kv,
)


def in_process(made_by: InProcessProducer, *, lane: str = "stub-ok",
               mode: ProducerMode = ProducerMode.EXACT) -> InProcessTransport:
    return InProcessTransport(made_by, key=KEY, identity_sha256=IDENTITY_SHA256,
                              cache_identity=STUB_CACHE_IDENTITY[mode], mode=mode, lane=lane, run_id=RUN_ID)


def stub(behaviour: str = "ok", mode: ProducerMode = ProducerMode.EXACT, lane: str = "stub-ok") -> PrefillProducer:
    return PrefillProducer(StubEngine(behaviour, mode, lane))


class PayloadWriter:
    """A producer that writes its KV straight into one preallocated payload buffer laid out by
    ``payload_layout`` (as a GPU producer copies into a pinned host buffer); ``views=False``
    hands off copies instead, which the transport must refuse."""

    def __init__(self, positions: int, *, views: bool = True) -> None:
        geometry = STUB_GEOMETRY.kv_geometry(positions)
        layout = payload_layout(geometry)
        self.payload = np.zeros(layout.size, dtype=np.uint8)
        self.payload[:len(layout.prefix)] = np.frombuffer(layout.prefix, dtype=np.uint8)
        shape = (geometry.kv_heads, positions, geometry.head_dim)
        self.tensors = {name: self.payload[begin:end].view(np.float32).reshape(shape)
                        for name, (begin, end) in layout.offsets.items()}
        self.views = views

    def produce(self, prompt: np.ndarray, request_id: str) -> ProducedKV:
        made = stub_kv(prompt)
        layers = len(made.keys)
        for index in range(layers):
            self.tensors[f"layers.{index}.k"][...] = made.keys[index]
            self.tensors[f"layers.{index}.v"][...] = made.values[index]
        kv = KVCache([self.tensors[f"layers.{i}.k"] for i in range(layers)],
                     [self.tensors[f"layers.{i}.v"] for i in range(layers)])
        if not self.views:
            kv = KVCache([k.copy() for k in kv.keys], [v.copy() for v in kv.values])
        return ProducedKV(kv, self.payload, compute_s=0.0, transfer_s=0.0)


def test_an_in_process_handoff_opens_and_equals_the_socket_handoff() -> None:
    with producer() as process:
        over_socket = process.request_prefill(TOKENS, "req-1")
        socket_kv, socket_manifest, _ = open_stub_handoff(over_socket, request_id="req-1")
        with in_process(stub()) as transport:
            assert transport.host_facts is not None and transport.host_facts_problem is None
            handoff = transport.request_prefill(TOKENS, "req-1")
        kv, manifest, _ = open_stub_handoff(handoff, request_id="req-1")
    for found, wanted in zip(kv.keys + kv.values, socket_kv.keys + socket_kv.values, strict=True):
        assert np.array_equal(found, wanted)
    assert bytes(handoff.payload_bytes) == bytes(over_socket.payload_bytes)
    assert manifest.payload_tree_sha256 == socket_manifest.payload_tree_sha256
    assert manifest.seams == socket_manifest.seams and manifest.lane == socket_manifest.lane
    assert handoff.transport is not None and handoff.transport.payload_bytes == manifest.payload_size
    assert kv.keys[0].flags.writeable  # like a received payload, the consumer may install in place


def test_a_corrupted_in_process_payload_is_refused() -> None:
    with in_process(stub()) as transport:
        handoff = transport.request_prefill(TOKENS, "req-1")
    corrupted = bytearray(handoff.payload_bytes)
    corrupted[-1] ^= 0x01  # the last tensor in layout order
    with pytest.raises(HandoffRefused, match="tree digest mismatch"):
        open_stub_handoff(Handoff(handoff.manifest_bytes, handoff.mac, corrupted), request_id="req-1")


def test_a_payload_written_in_place_is_sealed_and_opened_without_a_copy() -> None:
    writer = PayloadWriter(len(TOKENS))
    with in_process(writer) as transport:
        handoff = transport.request_prefill(TOKENS, "req-in-place")
    assert handoff.transport is not None and handoff.transport.transfer_s == 0.0
    assert np.shares_memory(np.frombuffer(handoff.payload_bytes, dtype=np.uint8), writer.payload)
    kv, manifest, _ = open_stub_handoff(handoff, request_id="req-in-place")
    assert all(np.shares_memory(array, writer.payload) for array in kv.keys + kv.values)
    assert np.array_equal(kv.values[1], stub_kv(TOKENS).values[1])
    begin = writer.tensors["layers.1.v"].ctypes.data - writer.payload.ctypes.data
    writer.payload[begin + 3] ^= 0x10  # the buffer changes after sealing
    with pytest.raises(HandoffRefused, match="tree digest mismatch.*seam digest differs at layer 1 V"):
        open_handoff(handoff, key=KEY, expectation=stub_expectation(request_id="req-in-place"))


def test_a_payload_that_does_not_hold_the_sealed_kv_fails_the_producer() -> None:
    with in_process(PayloadWriter(len(TOKENS), views=False)) as transport:
        with pytest.raises(ProducerFailed, match="tensor 0 in layout order is not a view of the payload"):
            transport.request_prefill(TOKENS, "req-copies")
        with pytest.raises(ProducerFailed, match="req-copies"):  # a failed producer stays failed
            transport.request_prefill(TOKENS, "req-again")


def test_the_lane_fixes_how_many_positions_the_producer_hands_off() -> None:
    tokens = np.arange(200, dtype=np.int64) * 5 % STUB_GEOMETRY.vocab
    handed_off = lane_spec(VLLM_TO_REFERENCE_LANE).handed_off_positions(len(tokens))
    native = ProducerMode.NATIVE
    with in_process(stub("ok", native), lane=VLLM_TO_REFERENCE_LANE, mode=native) as transport:
        with pytest.raises(ProducerFailed, match=f"produced 200 positions of a 200-token prompt, the lane hands "
                                                 f"off {handed_off}"):
            transport.request_prefill(tokens, "req-all")
    blocks = stub("blocks", native, VLLM_TO_REFERENCE_LANE)
    with in_process(blocks, lane=VLLM_TO_REFERENCE_LANE, mode=native) as transport:
        handoff = transport.request_prefill(tokens, "req-blocks")
    _, manifest, _ = open_stub_handoff(handoff, mode=native, request_id="req-blocks", tokens=tokens[:handed_off],
                                       lane=VLLM_TO_REFERENCE_LANE)
    assert manifest.handed_off_positions == handed_off


def test_the_in_process_transport_refuses_bad_setup_and_unstarted_use() -> None:
    setup = dict(key=KEY, identity_sha256=IDENTITY_SHA256, cache_identity=STUB_CACHE_IDENTITY[ProducerMode.EXACT],
                 mode=ProducerMode.EXACT, lane="stub-ok", run_id=RUN_ID)
    for change, message in (({"key": b"k" * 16}, "handoff key: 16 bytes"),
                            ({"mode": "fast"}, "in-process transport mode: found 'fast'"),
                            ({"cache_identity": "b" * 63}, "in-process transport cache_identity: found 'bbb"),
                            ({"run_id": "run id"}, "in-process transport run_id: found 'run id'")):
        with pytest.raises(Refused, match=message):
            InProcessTransport(stub(), **{**setup, **change})
    transport = in_process(stub())
    assert transport.host_facts is None and transport.host_facts_problem == "the in-process producer has not started"
    with pytest.raises(ProducerFailed, match="not started"):
        transport.request_prefill(TOKENS, "req-early")
