"""E2 controls measurement: ``ReferenceEngine.score_rows`` and ``qualify.evidence.controls_measure``.

``score_rows`` is checked against the engine's own decode (``teacher_forced`` after installing the
first r positions), bit for bit; the record against counts recomputed here from independently
scored top tokens. Short prefixes of the shipped fixture keep the tests fast; the full-length
check is ``slow``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from qualify.contract.controls import check_controls_record, load_document
from qualify.contract.lanes import ProducerMode, lane_spec
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.core.numerics import FixedPointRows, tree_sum, weighted_sum
from qualify.engines.base import LaneEngine
from qualify.engines.factory import build_consumer, build_producer
from qualify.engines.kquant import build_kquant_engine
from qualify.engines.reference import ReferenceEngine, visible_tree_sum, weighted_sum_own_diagonal
from qualify.evidence.controls_measure import (
    Producer,
    SharedScoring,
    build_control_engines,
    measure_controls,
    reference_consumer,
    score_shared,
)

LANE = "nvfp4-native-w4a4"
CRITERIA_ID = {"name": "e2-controls-v1", "sha256": "c" * 64}
YARDSTICK_ID = {"name": "kquant-q8_0", "sha256": "d" * 64}
# Rows at both ends, at query-block (128) and reduction-chunk (256) edges.
ROWS = (0, 1, 2, 127, 128, 129, 255, 256, 257, 299)


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def first_positions(kv: KVCache, positions: int) -> KVCache:
    """The handoff of ``kv``'s first ``positions`` positions."""
    return KVCache([k[:, :positions].copy() for k in kv.keys], [v[:, :positions].copy() for v in kv.values])


def top_tokens_of(logits: np.ndarray) -> np.ndarray:
    """First index of each row's maximum, found without np.argmax."""
    return np.array([int(np.flatnonzero(row == row.max())[0]) for row in logits], dtype=np.int32)


class OwnPrefill:
    """A producer handing off the consumer's own prefill (honest KV)."""

    def __init__(self, engine: ReferenceEngine, abi: str = "own-prefill") -> None:
        self.engine, self.abi = engine, abi

    def prefill(self, tokens: np.ndarray) -> KVCache:
        return self.engine.prefill(tokens)


class ScaledV(OwnPrefill):
    """The consumer's own prefill with one layer's V multiplied by ``factor``."""

    def __init__(self, engine: ReferenceEngine, layer: int, factor: float) -> None:
        super().__init__(engine, abi=f"scaled-v-{layer}-{factor}")
        self.layer, self.factor = layer, np.float32(factor)

    def prefill(self, tokens: np.ndarray) -> KVCache:
        kv = self.engine.prefill(tokens)
        kv.values[self.layer] = kv.values[self.layer] * self.factor
        return kv


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread() -> Iterator[None]:
    """A shared 2-core machine: BLAS on one thread (the engines' bits do not depend on it; under
    load, spinning BLAS threads make these tests many times slower)."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="module")
def consumer() -> ReferenceEngine:
    """The lane's consumer: the NVFP4 exact engine."""
    return reference_consumer(build_consumer(lane_spec(LANE)), LANE)


@pytest.fixture(scope="module")
def producer() -> LaneEngine:
    return build_producer(LANE, lane_spec(LANE).mode)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return assets.load_prompt()[:300]


def measure(consumer: object, producer: Producer, yardstick: Producer, documents: Mapping[str, np.ndarray],
            lengths: list[int], window: int, *, lane: str = LANE, criteria: Mapping[str, str] = CRITERIA_ID,
            yardstick_id: Mapping[str, str] = YARDSTICK_ID, shared: SharedScoring | None = None) -> dict[str, Any]:
    return measure_controls(consumer, producer, yardstick, documents, lengths, window, lane=lane, criteria=criteria,
                            yardstick_id=yardstick_id, shared=shared)


# --- score_rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["reference-own-kv", "nvfp4-consumer-w4a4-kv", "f16-engine-own-kv"])
def test_score_rows_row_r_is_the_decode_step_after_a_handoff_of_r_positions(case: str, reference: ReferenceEngine,
                                                                              consumer: ReferenceEngine, producer: LaneEngine,
                                                                              tokens: np.ndarray) -> None:
    if case == "reference-own-kv":
        engine, past = reference, reference.prefill(tokens)
    elif case == "nvfp4-consumer-w4a4-kv":
        engine, past = consumer, producer.prefill(tokens)
    else:  # float16 materialization: every intermediate rounded, the attention probabilities too
        engine = reference_consumer(build_producer("nvfp4-native-f16", ProducerMode.NATIVE), "nvfp4-native-f16")
        past = engine.prefill(tokens)
    rows = engine.score_rows(tokens, past)
    assert rows.shape == (tokens.size, engine.geometry.vocab) and rows.dtype == np.float32
    for r in ROWS:
        decoded = engine.teacher_forced(first_positions(past, r), tokens[r:r + 1], tokens[r:r + 1])[0]
        assert np.array_equal(bits(rows[r]), bits(decoded)), f"row {r}"


def test_score_rows_ignores_the_last_past_position_and_nests(consumer: ReferenceEngine, producer: LaneEngine,
                                                             tokens: np.ndarray) -> None:
    """Row r never reads past position r or later, and the first L rows of a pass are the pass
    over the first L tokens (L a whole number of prefill query blocks)."""
    past = producer.prefill(tokens[:256])
    rows = consumer.score_rows(tokens[:256], past)
    moved = first_positions(past, 256)
    for key, value in zip(moved.keys, moved.values, strict=True):
        key[:, -1] += 1.0
        value[:, -1] *= 2.0
    assert np.array_equal(bits(consumer.score_rows(tokens[:256], moved)), bits(rows))
    shorter = consumer.score_rows(tokens[:128], producer.prefill(tokens[:128]))
    assert np.array_equal(bits(shorter), bits(rows[:128]))


def test_visible_tree_sum_is_tree_sum_of_each_rows_visible_prefix() -> None:
    rng = np.random.default_rng(7)
    x = rng.random((2, 3, 9, 40), dtype=np.float32) * np.float32(1e3)
    visible = np.array([1, 2, 3, 7, 16, 17, 31, 39, 40])
    summed = visible_tree_sum(x, visible)
    assert summed.shape == (2, 3, 9, 1)
    for row, length in enumerate(visible):
        assert np.array_equal(bits(summed[..., row, :]), bits(tree_sum(x[..., row, :length]))), f"length {length}"


def test_weighted_sum_own_diagonal_is_each_rows_weighted_sum_over_its_own_slots() -> None:
    """Rows 200..299 straddle the 256-key reduction chunk: each equals weighted_sum over the
    handed-off values before it and its own value, as a decode row's cache holds them."""
    rng = np.random.default_rng(11)
    kv_heads, group, start, rows, head_dim = 2, 3, 200, 100, 8
    keys = start + rows
    probs = rng.random((kv_heads, group, rows, keys), dtype=np.float32)
    probs[..., np.arange(rows)[:, None] < np.arange(keys)[None, :] - start] = 0  # keys after the row
    past = rng.standard_normal((kv_heads, keys, head_dim), dtype=np.float32) * np.float32(3)
    own = rng.standard_normal((kv_heads, rows, head_dim), dtype=np.float32) * np.float32(50)
    block = weighted_sum_own_diagonal(probs, FixedPointRows.of(past), FixedPointRows.of(own), start)
    for row in range(rows):
        position = start + row
        slots = np.concatenate([past[:, :position], own[:, row:row + 1]], axis=1)  # [kv, position + 1, hd]
        expected = weighted_sum(probs[:, :, row, :position + 1], FixedPointRows.of(slots))
        assert np.array_equal(bits(block[:, :, row]), bits(expected)), f"row {row}"


@pytest.mark.parametrize(("cut", "message"), [
    (lambda kv: first_positions(kv, 63), r"^score past: 63 positions, expected 64 \(the KV of exactly the scored tokens\)$"),
    (lambda kv: KVCache([*kv.keys, kv.keys[0]], [*kv.values, kv.values[0]]),
     r"^kv: expected 4 layers of K and V, found \(5, 5\)$"),
    (lambda kv: KVCache(kv.keys, [kv.values[0].astype(np.float16), *kv.values[1:]]),
     r"^kv: layers\.0\.v: expected float32, found float16$"),
    (lambda kv: KVCache([k[:, :, :16].copy() for k in kv.keys], kv.values),
     r"^kv: layers\.0\.k: shape \[4, 64, 16\], expected \[4, 64, 32\]$"),
    (lambda kv: KVCache(kv.keys, [np.where(np.arange(64)[None, :, None] == 5, np.inf, v).astype(np.float32)
                                  for v in kv.values]),
     r"^kv: layers\.0\.v: non-finite values$"),
])
def test_score_rows_refuses_a_past_that_does_not_fit(reference: ReferenceEngine, tokens: np.ndarray,
                                                     cut: Callable[[KVCache], KVCache],
                                                     message: str) -> None:
    past = reference.prefill(tokens[:64])
    with pytest.raises(Refused, match=message):
        reference.score_rows(tokens[:64], cut(past))


def test_score_rows_refuses_a_longer_past(reference: ReferenceEngine, tokens: np.ndarray) -> None:
    with pytest.raises(Refused, match=r"^score past: 65 positions, expected 64 "):
        reference.score_rows(tokens[:64], reference.prefill(tokens[:65]))


# --- measure_controls ------------------------------------------------------------------------


def test_one_layers_v_scaled_by_one_and_a_half_disagrees_where_honest_kv_agrees(consumer: ReferenceEngine,
                                                                                tokens: np.ndarray) -> None:
    documents = {"fixture-prefix": tokens[:256]}
    honest = OwnPrefill(consumer)
    for layer in range(consumer.geometry.layers):
        record = measure(consumer, ScaledV(consumer, layer, 1.5), honest, documents, [64, 128, 256], 64)
        document = record["documents"][0]
        # The honest yardstick is the reference itself: no row may differ, and its top tokens are the reference's.
        assert [cell["yardstick_disagreeing"] for cell in document["cells"]] == [0, 0, 0]
        assert document["top_tokens_sha256"]["yardstick"] == document["top_tokens_sha256"]["reference"]
        assert document["cells"][-1]["lane_disagreeing"] > 0, f"layer {layer}"
        assert document["top_tokens_sha256"]["lane"] != document["top_tokens_sha256"]["reference"]


def test_record_counts_are_the_independently_scored_disagreements(consumer: ReferenceEngine, producer: LaneEngine,
                                                                  tokens: np.ndarray) -> None:
    documents = {"fixture-prefix": tokens[:256], "fixture-shifted": tokens[44:300]}
    yardstick = build_kquant_engine(ProducerMode.EXACT)
    lengths, window = [64, 128, 192, 256], 32
    record = measure(consumer, producer, yardstick, documents, lengths, window)
    json.loads(json.dumps(record, allow_nan=False))  # JSON as it stands
    check_controls_record(record, "test")
    assert list(record) == ["schema", "criteria", "lane", "yardstick", "documents", "seconds"]
    assert record["schema"] == "trust-ladder.controls-record.v1"
    assert (record["criteria"], record["lane"], record["yardstick"]) == (CRITERIA_ID, LANE, YARDSTICK_ID)
    assert set(record["seconds"]) == {"prefill", "scoring"} and min(record["seconds"].values()) > 0
    assert [document["document"] for document in record["documents"]] == list(documents)
    for document, ids in zip(record["documents"], documents.values(), strict=True):
        top = {"reference": top_tokens_of(consumer.score_rows(ids, consumer.prefill(ids))),
               "lane": top_tokens_of(consumer.score_rows(ids, producer.prefill(ids))),
               "yardstick": top_tokens_of(consumer.score_rows(ids, yardstick.prefill(ids)))}
        assert document["token_sha256"] == hashlib.sha256(ids.astype("<u4").tobytes()).hexdigest()
        assert document["rows"] == ids.size
        assert document["top_tokens_sha256"] == {
            source: hashlib.sha256(values.astype("<i4").tobytes()).hexdigest() for source, values in top.items()}
        differs = {source: top[source] != top["reference"] for source in ("lane", "yardstick")}
        assert [cell["length"] for cell in document["cells"]] == lengths
        for cell in document["cells"]:
            assert cell["rows"] == cell["length"]
            assert cell["lane_disagreeing"] == int(differs["lane"][:cell["length"]].sum())
            assert cell["yardstick_disagreeing"] == int(differs["yardstick"][:cell["length"]].sum())
        for source in ("lane", "yardstick"):
            counts = [cell[f"{source}_disagreeing"] for cell in document["cells"]]
            assert counts == sorted(counts), "a longer cell holds the shorter one's rows"
        assert [(window_["start"], window_["stop"]) for window_ in document["profile"]] == \
            [(start, start + window) for start in range(0, ids.size, window)]
        for cell in document["cells"]:
            below = [w for w in document["profile"] if w["stop"] <= cell["length"]]
            assert sum(w["lane_disagreeing"] for w in below) == cell["lane_disagreeing"]
            assert sum(w["yardstick_disagreeing"] for w in below) == cell["yardstick_disagreeing"]
    # The lane's passes are the only ones a second lane redoes: shared passes give the same record.
    shared = score_shared(consumer, yardstick, documents)
    again = measure(consumer, producer, yardstick, documents, lengths, window, shared=shared)
    assert again["documents"] == record["documents"]


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "window", "message"), [
    ([64, 128], 64, None),  # the longest length exactly the document's rows
    ([64, 192], 64, r"^controls document doc: 128 tokens, expected at least the longest length 192$"),
    ([64, 64], 64, r"^controls lengths\[1\]: found 64, expected a whole length above 64$"),
    ([0, 64], 64, r"^controls lengths\[0\]: found 0, expected a whole length above 0$"),
    ([True, 64], 1, r"^controls lengths\[0\]: found true, expected a whole length above 0$"),
    ([64.0, 128], 64, r"^controls lengths\[0\]: found 64\.0, expected a whole length above 0$"),
    ([], 64, r"^controls lengths: found \[\], expected a list of positive lengths$"),
    ([48, 128], 32, r"^controls lengths\[0\]: found 48, expected a multiple of profile_window 32$"),
    ([64], 0, r"^controls profile_window: found 0, expected a positive whole number of rows$"),
    ([60], 60, r"^controls document doc: 128 tokens, expected a multiple of profile_window 60$"),
])
def test_lengths_and_window_are_refused_at_their_bounds(consumer: ReferenceEngine, tokens: np.ndarray,
                                                        lengths: list[int], window: int, message: str | None) -> None:
    honest = OwnPrefill(consumer)
    if message is None:
        record = measure(consumer, honest, honest, {"doc": tokens[:128]}, lengths, window)
        assert [cell["length"] for cell in record["documents"][0]["cells"]] == lengths
        return
    with pytest.raises(Refused, match=message):
        measure(consumer, honest, honest, {"doc": tokens[:128]}, lengths, window)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"criteria": {"name": "e2-controls-v1"}}, r"^controls criteria: found .*, expected exactly name and sha256$"),
    ({"criteria": {**CRITERIA_ID, "file": "x"}}, r"^controls criteria: found .*, expected exactly name and sha256$"),
    ({"yardstick_id": {"name": "kquant-q8_0", "sha256": "D" * 64}}, r"^controls yardstick\.sha256: found "),
    ({"yardstick_id": {"name": "Q8", "sha256": "d" * 64}}, r'^controls yardstick\.name: found "Q8", expected a name'),
    ({"lane": "nvfp4-native-f16"}, r"^lane nvfp4-native-f16: producer is lane nvfp4-native-w4a4's, expected lane nvfp4-native-f16's$"),
])
def test_identification_blocks_are_refused_unless_exact(consumer: ReferenceEngine, producer: LaneEngine,
                                                         tokens: np.ndarray, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(Refused, match=message):
        measure(consumer, producer, OwnPrefill(consumer), {"doc": tokens[:64]}, [64], 64, **overrides)


@pytest.mark.parametrize(("documents", "message"), [
    ({}, r"^controls documents: found \{\}, expected a mapping of names to token ids$"),
    ({"Doc": np.arange(64)}, r'^controls documents: name found "Doc", expected a document name'),
    ({"doc": np.array([1, 2, 4096] * 64)}, r"^controls document doc: token ids must lie in 0\.\.4095, found 1\.\.4096$"),
    ({"doc": np.zeros(64, dtype=np.float32)}, r"^controls document doc: expected integer token ids, found dtype float32$"),
])
def test_documents_are_refused_unless_named_token_ids(consumer: ReferenceEngine, documents: dict[str, np.ndarray],
                                                      message: str) -> None:
    honest = OwnPrefill(consumer)
    with pytest.raises(Refused, match=message):
        measure(consumer, honest, honest, documents, [64], 64)


def test_a_consumer_that_is_not_the_reference_engine_is_refused_naming_the_lane(tokens: np.ndarray) -> None:
    kquant = build_kquant_engine(ProducerMode.EXACT)
    with pytest.raises(Refused, match=rf"^lane {LANE}: consumer kquant-numpy cannot score rows, expected the numpy reference engine$"):
        measure(kquant, kquant, kquant, {"doc": tokens[:64]}, [64], 64)


@pytest.mark.parametrize("lane", ["kquant-exact-dflash", "vllm-to-vllm", "reference-to-vllm", "llama3-8b-shape-pd"])
def test_lanes_whose_consumer_is_not_the_reference_engine_are_refused_before_building(lane: str) -> None:
    with pytest.raises(Refused, match=rf"^lane {lane}: its consumer is not the numpy reference engine"):
        build_control_engines(lane_spec(lane))


def test_the_control_engines_of_a_native_lane(consumer: ReferenceEngine) -> None:
    engines = build_control_engines(lane_spec(LANE))
    assert engines.consumer.abi == consumer.abi
    assert engines.producer.spec.name == LANE and engines.producer.mode is ProducerMode.NATIVE
    assert engines.yardstick.abi == build_kquant_engine(ProducerMode.EXACT).abi
    assert getattr(engines.yardstick, "name", None) == "kquant-numpy"  # plain target, no draft


def test_shared_passes_of_other_documents_or_engines_are_refused(consumer: ReferenceEngine, tokens: np.ndarray) -> None:
    honest = OwnPrefill(consumer)
    shared = score_shared(consumer, honest, {"doc": tokens[:64]})
    with pytest.raises(Refused, match=r"^controls shared passes: documents "):
        measure(consumer, honest, honest, {"doc": tokens[1:65]}, [64], 64, shared=shared)
    with pytest.raises(Refused, match=r"^controls shared passes: yardstick abi own-prefill, expected other$"):
        measure(consumer, honest, OwnPrefill(consumer, abi="other"), {"doc": tokens[:64]}, [64], 64, shared=shared)


# --- full length -------------------------------------------------------------------------------


@pytest.mark.slow
def test_score_rows_is_the_decode_step_at_full_control_length(consumer: ReferenceEngine, producer: LaneEngine) -> None:
    ids = load_document("python-test-shlex")
    past = producer.prefill(ids)
    rows = consumer.score_rows(ids, past)
    for r in (511, 2047, 4095):
        decoded = consumer.teacher_forced(first_positions(past, r), ids[r:r + 1], ids[r:r + 1])[0]
        assert np.array_equal(bits(rows[r]), bits(decoded)), f"row {r}"
