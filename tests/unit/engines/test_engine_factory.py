"""What the engine factory hands out: LaneEngines that carry their lane's facts, and fault producers.

A LaneEngine keeps the engine's name, version, ABI and arithmetic, adds its mode, checkpoint
digests and mode-separated cache identity, and on a lane with vLLM on either side hands off whole
blocks only. A fault producer looks like the honest one at start (same facts) and differs only in
what it hands off. None of this starts vLLM: the reference side of ``reference-to-vllm`` is used.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # a shared 2-core machine: keep BLAS to one thread

import numpy as np
import pytest

from qualify.contract.lanes import (
    LANES,
    REFERENCE_TO_VLLM_LANE,
    VLLM_BLOCK_SIZE,
    VLLM_TO_REFERENCE_LANE,
    LaneKind,
    ProducerMode,
    lane_spec,
)
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.kv import KVGeometry
from qualify.engines import faults
from qualify.engines.base import LaneEngine
from qualify.engines.factory import (
    build_cache_identity,
    build_consumer,
    build_producer,
    checkpoint_digests,
    lane_producer_abi,
    producer_facts,
)
from qualify.engines.reference import ReferenceEngine

NVFP4_LANE = "nvfp4-native-w4a4"


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    return assets.load_prompt()


@pytest.fixture(scope="module")
def whole_block_producer() -> LaneEngine:
    """The reference producer of ``reference-to-vllm`` (its consumer is vLLM: whole blocks only)."""
    return build_producer(REFERENCE_TO_VLLM_LANE, ProducerMode.NATIVE)


def test_a_lane_engine_carries_its_lane_facts() -> None:
    producer = build_producer(NVFP4_LANE, ProducerMode.NATIVE)
    spec = lane_spec(NVFP4_LANE)
    assert producer.spec is spec and producer.mode is ProducerMode.NATIVE
    assert dict(producer.digests) == checkpoint_digests(spec.kind)
    assert producer.target_cache_identity_sha256 == build_cache_identity(spec)
    assert producer.handoff_block_size is None
    assert (producer.name, producer.version, producer.abi) == (
        producer.engine.name, producer.engine.version, producer.engine.abi)


@pytest.mark.parametrize("lane", sorted(name for name, spec in LANES.items() if spec.kind is LaneKind.NVFP4
                                         or (spec.kind is LaneKind.KQUANT and not spec.speculative_draft)))
def test_a_lanes_producer_abi_is_the_built_producers_without_building_it(lane: str) -> None:
    """The identity step names the producer's abi before the producer starts; on an NVFP4 lane
    and a draftless k-quant lane it is composed from the arithmetic (no weight image made) and
    must be the one the producer process reports, or every handoff's cache identity would be
    refused."""
    spec = lane_spec(lane)
    assert lane_producer_abi(spec) == build_producer(lane, spec.mode).abi


def test_a_producer_built_in_the_other_mode_carries_that_modes_cache_identity() -> None:
    """The exact anchor's arithmetic and identity, so the native lane's consumer refuses its KV."""
    native = build_producer(NVFP4_LANE, ProducerMode.NATIVE)
    exact = build_producer(NVFP4_LANE, ProducerMode.EXACT)
    assert exact.mode is ProducerMode.EXACT and exact.abi != native.abi
    assert exact.target_cache_identity_sha256 == build_producer("nvfp4-exact", ProducerMode.EXACT)\
        .target_cache_identity_sha256
    assert exact.target_cache_identity_sha256 != native.target_cache_identity_sha256


def test_producer_mode_text_is_converted_and_anything_else_refused() -> None:
    """The handoff service passes its ``--mode`` text; the factory converts it."""
    assert build_producer(NVFP4_LANE, "native").mode is ProducerMode.NATIVE  # type: ignore[arg-type]  # as sent
    with pytest.raises(Refused, match="producer mode: found 'fast', expected exact or native"):
        build_producer(NVFP4_LANE, "fast")  # type: ignore[arg-type]  # the refusal under test


def test_a_whole_block_producer_hands_off_whole_blocks_of_its_prefill(
        whole_block_producer: LaneEngine, prompt: np.ndarray) -> None:
    assert whole_block_producer.handoff_block_size == VLLM_BLOCK_SIZE
    kv = whole_block_producer.prefill(prompt[:2047])
    full = ReferenceEngine.from_model_dir().prefill(prompt[:2047])
    assert kv.geometry.positions == 1920 == lane_spec(REFERENCE_TO_VLLM_LANE).handed_off_positions(2047)
    for ours, theirs in zip(kv.keys + kv.values, full.keys + full.values, strict=True):
        assert ours.flags.c_contiguous and ours.tobytes() == np.ascontiguousarray(theirs[:, :1920]).tobytes()
    with pytest.raises(Refused, match=f"prefill: 100 positions fill no whole block of {VLLM_BLOCK_SIZE}"):
        whole_block_producer.prefill(prompt[:100])


def test_consumers_hand_off_nothing_and_only_a_drafting_one_expects_a_draft() -> None:
    consumer = build_consumer(lane_spec(VLLM_TO_REFERENCE_LANE))  # the reference side: vLLM is not started
    assert consumer.handoff_block_size is None and consumer.draft_kv_geometry(2047) is None
    speculative = build_consumer(lane_spec("kquant-exact-dflash"))
    geometry = speculative.engine.geometry
    assert speculative.draft_kv_geometry(2047) == KVGeometry(1, geometry.kv_heads, geometry.head_dim, 2046, "float32")


def test_a_block_size_on_a_lane_that_hands_off_every_position_is_refused() -> None:
    honest = build_producer(NVFP4_LANE, ProducerMode.NATIVE)
    with pytest.raises(Refused, match=f"lane {NVFP4_LANE}: handoff_block_size: found 128"):
        LaneEngine(honest.engine, honest.spec, honest.mode, honest.digests, honest.target_cache_identity_sha256,
                   handoff_block_size=128)


def test_producer_facts_are_the_producers_own() -> None:
    facts = producer_facts(lane_spec(NVFP4_LANE))
    producer = build_producer(NVFP4_LANE, ProducerMode.NATIVE)
    assert (facts.name, facts.version, facts.abi, facts.geometry, dict(facts.digests)) == (
        producer.name, producer.version, producer.abi, producer.geometry, dict(producer.digests))


# ---- fault producers -------------------------------------------------------------------------------------


def test_a_fault_producer_starts_as_the_honest_one_and_corrupts_only_its_handoff(prompt: np.ndarray) -> None:
    honest = build_producer(NVFP4_LANE, ProducerMode.NATIVE)
    faulty = faults.faulty_producer(honest, "kv-ulp")
    facts = ("name", "version", "abi", "logit_units", "geometry", "digests", "mode", "target_cache_identity_sha256")
    assert all(getattr(faulty, fact) == getattr(honest, fact) for fact in facts)
    tokens = prompt[:1100]
    ours, theirs = faulty.prefill(tokens), honest.prefill(tokens)
    differing = [(name, int(np.count_nonzero(a != b))) for (name, a), b in
                 zip(ours.tensors().items(), theirs.tensors().values(), strict=True) if not np.array_equal(a, b)]
    assert differing == [(f"layers.{faults.FAULT_LAYER}.k", 1)]


def test_an_other_mode_fault_carries_the_other_modes_entry(prompt: np.ndarray) -> None:
    honest = build_producer(NVFP4_LANE, ProducerMode.NATIVE)
    other = build_producer(NVFP4_LANE, ProducerMode.EXACT)
    faulty = faults.faulty_producer(honest, "other-mode", other)
    assert faulty.mode is ProducerMode.NATIVE and faulty.abi == honest.abi  # passes its start checks
    assert faulty.target_cache_identity_sha256 == other.target_cache_identity_sha256
    tokens = prompt[:40]
    assert faulty.prefill(tokens).keys[0].tobytes() == other.prefill(tokens).keys[0].tobytes()
    with pytest.raises(Refused, match="other-mode: needs the lane's engine built in the other producer mode"):
        faults.faulty_producer(honest, "other-mode")
    with pytest.raises(Refused, match="other-mode: needs"):
        faults.faulty_producer(honest, "kv-ulp", other)
    with pytest.raises(Refused, match="fault: unknown name 'bit-rot'"):
        faults.faulty_producer(honest, "bit-rot")


