"""The per-sample series in a receipt (qualify.evidence.series): built from a comparison, written by
a real run beside each compared sample's record and agreeing with it, and read back only when its
names, dtypes and shapes are exactly the documented ones."""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from qualify.archive.verify import verify_receipt
from qualify.core.errors import ProducerFailed, Refused
from qualify.engines.base import DecodeResult
from qualify.evidence.compare import compare_branches, generated_token_sha256, teacher_forced_drift
from qualify.evidence.records import BoundedDriftRule
from qualify.evidence.series import (
    ENVELOPE_TENSORS,
    MAX_SERIES_BYTES,
    SERIES_DTYPES,
    envelope_series,
    read_envelope_series,
    read_series,
    sample_series,
)
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions
from tests.unit.core.test_hostenv import lane_calibration_contract

LANE = "nvfp4-native-splitk"
ROWS, VOCAB, LAYERS, HEADS, HANDED_OFF, DIM = 16, 50, 3, 2, 7, 4


def _comparison(seed: int = 0, *, with_kv: bool = True):
    """A real comparison of two random branches (tokens differ at one step) and their KV."""
    rng = np.random.default_rng(seed)
    cold_logits = (rng.standard_normal((ROWS, VOCAB)) * 4).astype(np.float32)
    handoff_logits = (cold_logits + rng.standard_normal((ROWS, VOCAB)) * 1e-2).astype(np.float32)
    cold_tokens = cold_logits.argmax(axis=1).astype(np.int32)
    handoff_tokens = cold_tokens.copy()
    handoff_tokens[5] = (handoff_tokens[5] + 1) % VOCAB
    own = [[rng.standard_normal((HEADS, HANDED_OFF + 2, DIM)).astype(np.float32) for _ in range(LAYERS)]
           for _ in range(2)]
    handed = [[(t[:, :HANDED_OFF] + rng.standard_normal((HEADS, HANDED_OFF, DIM)) * 1e-3).astype(np.float32)
               for t in tensors] for tensors in own]
    return compare_branches(
        DecodeResult(handoff_tokens, handoff_logits), DecodeResult(cold_tokens, cold_logits), "raw",
        maximum_absolute=1.0, maximum_mean_absolute=0.1,
        handoff_kv=(handed[0], handed[1]) if with_kv else None, own_kv=(own[0], own[1]) if with_kv else None)


def _series_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """A series file as the receipt writer stores it (safetensors, sorted names, metadata)."""
    return save({name: tensors[name] for name in sorted(tensors)}, metadata={"run_id": "r", "repetition": "1"})


# --------------------------------------------------------------------------- building


def test_series_of_a_comparison_holds_its_per_position_per_layer_and_token_arrays() -> None:
    comparison = _comparison()
    series = sample_series(comparison)
    assert {name: (array.dtype, array.shape) for name, array in series.items()} == {
        name: (dtype, (ROWS,) if name in ("logit_max_abs_delta", "logit_mean_abs_delta", "cold_top1_top2_margin",
                                          "handoff_tokens", "cold_tokens")
               else (LAYERS,) if name.startswith(("kv_k", "kv_v")) else (HANDED_OFF,))
        for name, dtype in SERIES_DTYPES.items()}
    assert float(series["logit_max_abs_delta"].max()) == comparison.max_abs
    assert np.array_equal(series["logit_mean_abs_delta"], comparison.delta.row_mean_abs)
    assert np.array_equal(series["cold_top1_top2_margin"], comparison.cold_margins)
    assert generated_token_sha256(series["handoff_tokens"]) == comparison.handoff_generated_token_sha256
    assert generated_token_sha256(series["cold_tokens"]) == comparison.cold_generated_token_sha256
    assert not np.array_equal(series["handoff_tokens"], series["cold_tokens"])
    assert comparison.kv is not None
    assert series["kv_k_max_abs_delta"].tolist() == [layer.k for layer in comparison.kv.layers]
    assert series["kv_v_max_abs_delta"].tolist() == [layer.v for layer in comparison.kv.layers]
    assert float(series["kv_position_max_abs_delta"].max()) == max(
        max(layer.k, layer.v) for layer in comparison.kv.layers)


def test_a_series_round_trips_through_the_receipt_files_bytes(tmp_path: Path) -> None:
    series = sample_series(_comparison())
    path = tmp_path / "sample-1.safetensors"
    path.write_bytes(_series_bytes(series))
    for source in (path, str(path), path.read_bytes()):
        read = read_series(source, positions=ROWS, layers=LAYERS, handed_off=HANDED_OFF)
        assert read.keys() == series.keys()
        assert all(np.array_equal(read[name], series[name]) for name in series)


def test_a_comparison_without_kv_deltas_is_refused_a_series() -> None:
    with pytest.raises(Refused, match="no KV deltas"):
        sample_series(_comparison(with_kv=False))


# --------------------------------------------------------------------------- reading untrusted files


def _mutated(change: str) -> bytes:
    series = sample_series(_comparison())
    if change == "wrong dtype":
        series["cold_top1_top2_margin"] = series["cold_top1_top2_margin"].astype(np.float32)
    elif change == "tokens as floats":
        series["cold_tokens"] = series["cold_tokens"].astype(np.float64)
    elif change == "missing tensor":
        del series["kv_v_max_abs_delta"]
    elif change == "extra tensor":
        series["logits"] = np.zeros((ROWS, VOCAB), dtype=np.float64)
    elif change == "shape mismatch":
        series["logit_mean_abs_delta"] = series["logit_mean_abs_delta"][:-1]
    elif change == "two-dimensional":
        series["kv_k_max_abs_delta"] = series["kv_k_max_abs_delta"][None, :]
    elif change == "empty":
        series["kv_position_max_abs_delta"] = series["kv_position_max_abs_delta"][:0]
    elif change == "negative delta":
        series["logit_max_abs_delta"][3] = -1.0
    elif change == "token beyond uint32":
        series["handoff_tokens"][0] = 1 << 32
    else:
        raise AssertionError(change)
    return _series_bytes(series)


@pytest.mark.parametrize(("change", "message"), [
    ("wrong dtype", "'cold_top1_top2_margin' is float32[16], expected 1-D float64"),
    ("tokens as floats", "'cold_tokens' is float64[16], expected 1-D int64"),
    ("missing tensor", "missing tensor 'kv_v_max_abs_delta'"),
    ("extra tensor", "unexpected tensor 'logits'"),
    ("shape mismatch", "'logit_mean_abs_delta' has 15 positions, 'logit_max_abs_delta' has 16"),
    ("two-dimensional", "'kv_k_max_abs_delta' is float64[1, 3], expected 1-D float64"),
    ("empty", "'kv_position_max_abs_delta' is empty"),
    ("negative delta", "'logit_max_abs_delta' holds a negative value"),
    ("token beyond uint32", "'handoff_tokens' holds token ids outside"),
])
def test_read_series_refuses_a_file_not_in_the_documented_format(change: str, message: str) -> None:
    with pytest.raises(Refused, match="^series: .*" + message.replace("[", r"\[").replace("]", r"\]")) as refused:
        read_series(_mutated(change))
    assert "\n" not in str(refused.value)


def test_read_series_refuses_a_dtype_numpy_cannot_read() -> None:
    header = json.dumps({"cold_tokens": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(Refused, match="^series: tensor dtype 'BF16' is not one numpy reads"):
        read_series(struct.pack("<Q", len(header)) + header + bytes(4))


def test_read_series_refuses_lengths_other_than_the_records() -> None:
    data = _series_bytes(sample_series(_comparison()))
    with pytest.raises(Refused, match="'logit_max_abs_delta' has 16 positions, expected 256"):
        read_series(data, positions=256)
    with pytest.raises(Refused, match="'kv_position_max_abs_delta' has 7 handed-off positions, expected 8"):
        read_series(data, handed_off=HANDED_OFF + 1)


@pytest.mark.parametrize("cut", [0, 7, 8, 40, -1], ids=["empty", "inside-length", "no-header", "inside-header",
                                                         "last-byte"])
def test_read_series_refuses_truncated_bytes(cut: int) -> None:
    data = _series_bytes(sample_series(_comparison()))
    with pytest.raises(Refused, match="^series: not a well-formed safetensors file: ") as refused:
        read_series(data[:cut])
    assert "\n" not in str(refused.value)


def test_read_series_refuses_oversized_input_before_parsing(tmp_path: Path) -> None:
    with pytest.raises(Refused, match=f"expected at most {MAX_SERIES_BYTES}"):
        read_series(b"\0" * (MAX_SERIES_BYTES + 1))
    big = tmp_path / "big.safetensors"
    with big.open("wb") as handle:
        handle.truncate(MAX_SERIES_BYTES + 1)
    with pytest.raises(Refused, match=f"larger than {MAX_SERIES_BYTES} bytes"):
        read_series(big)


def test_read_series_refuses_a_missing_file_and_a_directory(tmp_path: Path) -> None:
    with pytest.raises(Refused, match="cannot open"):
        read_series(tmp_path / "absent.safetensors")
    with pytest.raises(Refused, match="not a regular file"):
        read_series(tmp_path)


@functools.cache
def _valid_file() -> bytes:
    return _series_bytes(sample_series(_comparison()))


# Every dtype name safetensors defines (numpy reads only some) and a few it does not.
HEADER_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "U64", "I32", "U32", "I16", "U16", "I8", "U8", "BOOL", "C64",
                 "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F4", "E8", "", "f64"]


def _damaged(data: st.DataObject) -> bytes:
    """A real series file cut, with bytes flipped or spliced in, or one header entry rewritten."""
    damaged = bytearray(_valid_file())
    damage = data.draw(st.sampled_from(["cut", "flip", "splice", "header"]))
    if damage == "cut":
        return bytes(damaged[:data.draw(st.integers(0, len(damaged) - 1))])
    if damage == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            where = data.draw(st.integers(0, len(damaged) - 1))
            damaged[where] ^= data.draw(st.integers(1, 255))
        return bytes(damaged)
    if damage == "splice":
        where = data.draw(st.integers(0, len(damaged)))
        damaged[where:where] = data.draw(st.binary(min_size=1, max_size=64))
        return bytes(damaged)
    length = struct.unpack("<Q", damaged[:8])[0]
    header = json.loads(damaged[8:8 + length])
    body = bytes(damaged[8 + length:])
    name = data.draw(st.sampled_from(sorted(header)))
    entry = header[name] if name != "__metadata__" else {}
    entry["dtype"] = data.draw(st.sampled_from(HEADER_DTYPES))
    entry["shape"] = data.draw(st.lists(st.integers(0, 300), max_size=3))
    if data.draw(st.booleans()):
        low = data.draw(st.integers(0, len(body)))
        entry["data_offsets"] = [low, data.draw(st.integers(low, len(body)))]
    header[data.draw(st.sampled_from([name, "logits"]))] = entry
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


def _read_damaged(data: st.DataObject, fuzz_tally) -> None:
    fuzz_tally.add("examples")
    try:
        series = read_series(_damaged(data))
    except Refused as refused:
        assert "\n" not in str(refused) and str(refused).startswith("series: ")
        fuzz_tally.add("refused")
        return
    fuzz_tally.add("accepted")
    assert {name: array.dtype for name, array in series.items()} == SERIES_DTYPES


FUZZ = {"derandomize": True, "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}


@settings(max_examples=300, **FUZZ)
@given(data=st.data())
def test_read_series_of_a_damaged_file_refuses_in_one_line_or_reads_the_format(data: st.DataObject,
                                                                                 fuzz_tally) -> None:
    """read_series refuses a damaged series in one line or returns exactly the documented names
    and dtypes (a flipped data byte can still be a valid series)."""
    _read_damaged(data, fuzz_tally)


@pytest.mark.slow
@settings(max_examples=5000, **FUZZ)
@given(data=st.data())
def test_read_series_of_many_damaged_files_refuses_in_one_line_or_reads_the_format(data: st.DataObject,
                                                                                     fuzz_tally) -> None:
    _read_damaged(data, fuzz_tally)


# --------------------------------------------------------------------------- the run writes them


class _FailingTransport:
    """A producer that starts and then fails every handoff (no comparison is ever made)."""

    host_facts = None
    host_facts_problem = "test transport: no producer process"
    ready_silence_s = 0.0

    def start(self) -> None:
        pass

    def request_prefill(self, prompt: np.ndarray, request_id: str):
        raise ProducerFailed(f"{request_id}: the test producer failed")

    def close(self) -> None:
        pass


class _NoComparer:
    deferred = False

    def reference(self) -> float:
        return 0.0

    def compare(self, kv, pending, meanwhile):  # pragma: no cover - never reached
        raise AssertionError("a failed handoff is never compared")

    def close(self) -> None:
        pass


def test_a_failed_sample_without_a_comparison_gets_no_series(tmp_path: Path) -> None:
    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path), _contract_with_rule(),
                           transport=lambda setup: _FailingTransport(), comparer=lambda setup: _NoComparer())
    try:
        outcomes = [run.step(label) for label in STEP_LABELS[:4]]
    finally:
        run.close()
    assert [o.passed for o in outcomes] == [True, True, True, False]
    assert "the test producer failed" in outcomes[3].message
    receipt = run.receipt_path
    assert receipt is not None
    assert "the test producer failed" in json.loads((receipt / "samples" / "sample-1.json").read_text())["error"]
    assert not (receipt / "series").exists()


def _contract_with_rule():
    """The shipped lane's calibration contract (its steps run the first calibration cell's prompt)
    with a rule wide enough that every handoff step runs."""
    return dataclasses.replace(lane_calibration_contract(LANE),
                               rule=BoundedDriftRule(maximum_absolute=1.0, maximum_mean_absolute=0.1))


@pytest.mark.slow
def test_a_real_run_leaves_one_series_per_sample_agreeing_with_its_record(tmp_path: Path) -> None:
    """The shipped lane's three handoffs (real producer process, real consumer, reference once):
    every compared sample has its series, agreeing with the record's totals and digests."""
    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path, reference_once=True),
                           _contract_with_rule())
    try:
        outcomes = [run.step(label) for label in STEP_LABELS[:6]]
    finally:
        run.close()
    assert all(o.passed for o in outcomes), [o.message for o in outcomes if not o.passed]
    receipt = run.receipt_path
    assert receipt is not None and verify_receipt(receipt) == []
    assert sorted(p.name for p in (receipt / "series").iterdir()) == [f"sample-{n}.safetensors" for n in (1, 2, 3)]
    for repetition in (1, 2, 3):
        record = json.loads((receipt / "samples" / f"sample-{repetition}.json").read_text())
        localisation = record["localisation"]
        layers = localisation["kv_layer_max_abs"]
        series = read_series(receipt / "series" / f"sample-{repetition}.safetensors",
                             positions=record["output_tokens"], layers=len(layers),
                             handed_off=record["handed_off_positions"])
        assert float(series["logit_max_abs_delta"].max()) == record["max_abs"]
        assert float(series["logit_mean_abs_delta"].mean()) == pytest.approx(record["mean_abs"], rel=1e-12)
        assert generated_token_sha256(series["handoff_tokens"]) == record["handoff_generated_token_sha256"]
        assert generated_token_sha256(series["cold_tokens"]) == record["cold_generated_token_sha256"]
        assert float(series["cold_top1_top2_margin"].min()) == localisation["min_cold_margin"]
        assert series["kv_k_max_abs_delta"].tolist() == [layer["k"] for layer in layers]
        assert series["kv_v_max_abs_delta"].tolist() == [layer["v"] for layer in layers]


# --------------------------------------------------------------------------- a fixture envelope's series


def test_envelope_series_are_the_rows_and_each_layers_k_and_v_by_handed_off_position() -> None:
    comparison = _comparison()
    series = envelope_series(comparison)
    assert series is not None and comparison.kv is not None and comparison.kv.tensor_position_max_abs is not None
    assert {name: (array.dtype, array.shape) for name, array in series.items()} == {
        "row_max_abs": (np.dtype("<f8"), (ROWS,)), "row_mean_abs": (np.dtype("<f8"), (ROWS,)),
        "position_max_abs": (np.dtype("<f8"), (HANDED_OFF,)),
        "tensor_position_max_abs": (np.dtype("<f8"), (2 * LAYERS, HANDED_OFF))}
    assert np.array_equal(series["row_max_abs"], comparison.delta.row_max_abs)
    assert np.array_equal(series["position_max_abs"], comparison.kv.position_max_abs)
    # Layer by layer, K before V: row 2 * layer is that layer's K, its maximum the layer's K delta.
    tensors = series["tensor_position_max_abs"]
    assert [float(tensors[2 * n].max()) for n in range(LAYERS)] == [layer.k for layer in comparison.kv.layers]
    assert [float(tensors[2 * n + 1].max()) for n in range(LAYERS)] == [layer.v for layer in comparison.kv.layers]
    assert np.array_equal(tensors.max(axis=0), series["position_max_abs"])


def test_envelope_rows_are_the_teacher_forced_rows_where_the_tokens_parted() -> None:
    plain = _comparison()
    rng = np.random.default_rng(7)
    forced = (rng.standard_normal((ROWS, VOCAB)) * 4).astype(np.float32)
    comparison = dataclasses.replace(plain, teacher_forced=teacher_forced_drift(forced, forced + np.float32(0.5)))
    series = envelope_series(comparison)
    assert series is not None and comparison.teacher_forced is not None
    assert np.array_equal(series["row_max_abs"], comparison.teacher_forced.row_max_abs)
    assert not np.array_equal(series["row_max_abs"], plain.delta.row_max_abs)


def test_a_comparison_without_per_tensor_series_gives_none() -> None:
    comparison = _comparison()
    assert comparison.kv is not None
    assert envelope_series(dataclasses.replace(comparison, kv=dataclasses.replace(
        comparison.kv, tensor_position_max_abs=None))) is None
    assert envelope_series(_comparison(with_kv=False)) is None


def test_envelope_series_round_trip_through_their_files_bytes() -> None:
    series = envelope_series(_comparison())
    assert series is not None
    read = read_envelope_series(_series_bytes(series), rows=ROWS, positions=HANDED_OFF)
    assert all(np.array_equal(read[name], series[name]) for name in ENVELOPE_TENSORS)


def _envelope_with(**changes: object) -> dict[str, np.ndarray]:
    series = envelope_series(_comparison())
    assert series is not None
    for name, value in changes.items():
        if value is None:
            del series[name]
        else:
            series[name] = value  # type: ignore[assignment]
    return series


@pytest.mark.parametrize("changes", [
    {"row_mean_abs": None},
    {"extra": np.zeros(3)},
    {"row_max_abs": np.zeros(ROWS, dtype=np.float32)},
    {"tensor_position_max_abs": np.zeros(2 * LAYERS * HANDED_OFF)},
    {"row_mean_abs": np.zeros(ROWS - 1)},
    {"tensor_position_max_abs": np.zeros((2 * LAYERS + 1, HANDED_OFF))},
    {"tensor_position_max_abs": np.zeros((2 * LAYERS, HANDED_OFF + 1))},
    {"position_max_abs": np.full(HANDED_OFF, -1.0), "tensor_position_max_abs": np.zeros((2 * LAYERS, HANDED_OFF))},
    {"row_max_abs": np.zeros(0), "row_mean_abs": np.zeros(0)},
])
def test_envelope_series_off_their_form_are_refused_in_one_line(changes: dict[str, object]) -> None:
    with pytest.raises(Refused) as caught:
        read_envelope_series(_series_bytes(_envelope_with(**changes)))
    assert "\n" not in str(caught.value) and str(caught.value).startswith("envelope series: ")


def test_envelope_series_of_other_lengths_than_expected_are_refused() -> None:
    data = _series_bytes(_envelope_with())
    for expected in ({"rows": ROWS + 1}, {"positions": HANDED_OFF - 1}):
        with pytest.raises(Refused):
            read_envelope_series(data, **expected)  # type: ignore[arg-type]


def test_a_nan_in_an_envelope_series_is_kept_for_the_envelope_to_judge() -> None:
    nan_rows = np.zeros(ROWS)
    nan_rows[3] = np.nan
    read = read_envelope_series(_series_bytes(_envelope_with(row_max_abs=nan_rows)))
    assert np.isnan(read["row_max_abs"][3])
