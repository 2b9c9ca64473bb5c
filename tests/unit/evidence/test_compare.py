"""qualify.evidence.compare against straightforward numpy on random data, localisation included."""

from __future__ import annotations

import hashlib
import json
import math
import tracemalloc

import numpy as np
import pytest

from qualify.core.errors import Refused
from qualify.engines.base import DecodeResult
from qualify.evidence import compare
from qualify.evidence.compare import (
    KVComparison,
    classify_divergence,
    compare_branches,
    compare_kv,
    compare_logit_blocks,
    draft_acceptance_rate,
    draft_tokens_sha256,
    draft_trace_sha256,
    first_digest_mismatch,
    generated_token_sha256,
    logit_digests,
    parse_logit_transform,
    teacher_forced_drift,
    token_agreement,
    top1_top2_margins,
    transform_between,
)
from qualify.evidence.records import PHASE_FIELDS, BoundedDriftRule, SampleRecord, record_json
from qualify.evidence.sample import kv_over_envelope, sample_record
from qualify.judge import judge_sample

ROWS, VOCAB = 64, 1000


def _blocks(seed: int = 0, rows: int = ROWS, vocab: int = VOCAB, noise: float = 1e-2):
    rng = np.random.default_rng(seed)
    cold = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    handoff = (cold + rng.standard_normal((rows, vocab)) * noise).astype(np.float32)
    return handoff, cold


def _softcap(x: np.ndarray, cap: float) -> np.ndarray:
    c = np.float32(cap)
    return (np.tanh(x / c) * c).astype(np.float32)


@pytest.fixture(params=[compare.CHUNK_BYTES, 4 * VOCAB * 3, 100], ids=["default-chunk", "3-row-chunk", "sub-row-chunk"])
def chunk_bytes(request, monkeypatch):
    """Exercise the default chunking, several rows per chunk, and one row per chunk."""
    monkeypatch.setattr(compare, "CHUNK_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("spec", ["raw", "tanh-softcap:30.0", "tanh-softcap:5"])
def test_logit_deltas_match_numpy(spec, chunk_bytes):
    handoff, cold = _blocks()
    transform = parse_logit_transform(spec)
    if transform.cap is None:
        a, b = handoff, cold
    else:
        a, b = _softcap(handoff, transform.cap), _softcap(cold, transform.cap)
    expected = np.abs(a - b)
    result = compare_logit_blocks(handoff, cold, spec, maximum_absolute=0.03, maximum_mean_absolute=0.0085)
    assert result.max_abs == float(expected.max())
    assert result.mean_abs == pytest.approx(float(expected.astype(np.float64).mean()), rel=1e-6)
    np.testing.assert_array_equal(result.row_max_abs, expected.max(axis=1))
    np.testing.assert_allclose(result.row_mean_abs, expected.astype(np.float64).mean(axis=1), rtol=1e-6)
    breaking = np.flatnonzero((expected.max(axis=1) > 0.03) | (expected.astype(np.float64).mean(axis=1) > 0.0085))
    assert result.first_row_over_rule == (int(breaking[0]) if breaking.size else None)


def test_first_row_over_rule_locates_the_first_breaking_row():
    handoff, cold = _blocks(noise=1e-4)
    handoff[17, 3] += 5.0  # max rule
    handoff[29] += 0.5  # mean rule only
    by_max = compare_logit_blocks(handoff, cold, maximum_absolute=1.0, maximum_mean_absolute=1.0)
    assert by_max.first_row_over_rule == 17
    by_mean = compare_logit_blocks(handoff, cold, maximum_absolute=10.0, maximum_mean_absolute=0.1)
    assert by_mean.first_row_over_rule == 29
    assert compare_logit_blocks(handoff, cold).first_row_over_rule is None  # no rule given


def test_identical_blocks_have_exactly_zero_deltas():
    _, cold = _blocks()
    result = compare_logit_blocks(cold.copy(), cold, maximum_absolute=1e-30, maximum_mean_absolute=1e-30)
    assert result.max_abs == 0.0 and result.mean_abs == 0.0
    assert result.first_row_over_rule is None


def test_non_finite_logits_propagate_and_break_the_rule():
    handoff, cold = _blocks()
    handoff[5, 7] = np.nan
    result = compare_logit_blocks(handoff, cold, maximum_absolute=100.0, maximum_mean_absolute=100.0)
    assert math.isnan(result.max_abs) and math.isnan(result.mean_abs)
    assert result.first_row_over_rule == 5
    handoff[5, 7] = cold[5, 7]
    handoff[9, 1] = np.inf
    delta = compare_logit_blocks(handoff, cold, maximum_absolute=100.0, maximum_mean_absolute=100.0)
    assert delta.first_row_over_rule == 9


def test_digests_are_of_little_endian_float32_rows_and_block(chunk_bytes):
    handoff, _ = _blocks()
    digests = logit_digests(handoff)
    assert digests.row_sha256 == tuple(hashlib.sha256(row.astype("<f4").tobytes()).hexdigest() for row in handoff)
    assert digests.block_sha256 == hashlib.sha256(handoff.astype("<f4").tobytes()).hexdigest()
    big_endian = handoff.astype(">f4")
    assert logit_digests(big_endian.astype(np.float32)) == digests


def test_first_digest_mismatch():
    handoff, _ = _blocks()
    other = handoff.copy()
    assert first_digest_mismatch(logit_digests(handoff), logit_digests(other)) is None
    other[40, 0] = np.nextafter(other[40, 0], np.float32(np.inf))  # one ULP
    assert first_digest_mismatch(logit_digests(handoff), logit_digests(other)) == 40


def test_generated_token_digest_is_little_endian_uint32():
    tokens = np.array([0, 1, 4095, 70000], dtype=np.int64)
    assert generated_token_sha256(tokens) == hashlib.sha256(tokens.astype("<u4").tobytes()).hexdigest()
    with pytest.raises(Refused):
        generated_token_sha256(np.array([-1]))
    with pytest.raises(Refused):
        generated_token_sha256(np.array([1.0]))


def test_token_agreement():
    cold = np.arange(256)
    handoff = cold.copy()
    assert token_agreement(handoff, cold).rate == 1.0
    assert token_agreement(handoff, cold).first_divergence is None
    handoff[[40, 41, 200]] += 1
    result = token_agreement(handoff, cold)
    assert result.rate == 253 / 256 and result.first_divergence == 40
    with pytest.raises(Refused, match="shapes differ"):
        token_agreement(handoff[:-1], cold)


@pytest.mark.parametrize("spec", ["raw", "tanh-softcap:7.5"])
def test_margins_match_numpy(spec, chunk_bytes):
    _, cold = _blocks()
    cold[3, [10, 20]] = 50.0  # exact tie at the top
    transform = parse_logit_transform(spec)
    units = cold if transform.cap is None else _softcap(cold, transform.cap)
    ordered = np.sort(units, axis=1)
    expected = ordered[:, -1].astype(np.float64) - ordered[:, -2].astype(np.float64)
    margins = top1_top2_margins(cold, spec)
    np.testing.assert_array_equal(margins, expected)
    assert margins[3] == 0.0


def test_teacher_forced_drift_matches_numpy(chunk_bytes):
    forced, cold = _blocks(noise=0.3)
    expected = np.abs(forced - cold)
    result = teacher_forced_drift(forced, cold, maximum_absolute=1.2, maximum_mean_absolute=0.25)
    assert result.max_abs == float(expected.max())
    assert result.mean_abs == pytest.approx(float(expected.astype(np.float64).mean()), rel=1e-6)
    assert result.top1_flips == int(np.count_nonzero(forced.argmax(axis=1) != cold.argmax(axis=1)))
    assert result.top1_flips > 0
    over = np.flatnonzero((expected.max(axis=1) > 1.2) | (expected.astype(np.float64).mean(axis=1) > 0.25))
    assert result.first_row_over_rule == (int(over[0]) if over.size else None)


def _decode_pair(seed: int = 1, noise: float = 0.05, rows: int = ROWS):
    """Cold and handoff greedy branches; the handoff branch diverges where its argmax differs."""
    handoff_logits, cold_logits = _blocks(seed=seed, rows=rows, noise=noise)
    cold = DecodeResult(cold_logits.argmax(axis=1).astype(np.int32), cold_logits)
    handoff = DecodeResult(handoff_logits.argmax(axis=1).astype(np.int32), handoff_logits)
    return handoff, cold


@pytest.mark.parametrize("spec", ["raw", "tanh-softcap:30.0"])
def test_compare_branches_matches_numpy_including_localisation(spec, chunk_bytes):
    handoff, cold = _decode_pair(noise=0.6)
    forced = handoff.logits.copy()  # stands in for the teacher-forced logits
    transform = parse_logit_transform(spec)
    units = (lambda x: x) if transform.cap is None else (lambda x: _softcap(x, transform.cap))
    result = compare_branches(
        handoff, cold, spec, maximum_absolute=1.5, maximum_mean_absolute=0.3, teacher_forced_logits=forced
    )
    delta = np.abs(units(handoff.logits) - units(cold.logits))
    equal = handoff.tokens == cold.tokens
    first = int(np.flatnonzero(~equal)[0])
    assert result.output_tokens == ROWS and result.vocab == VOCAB and result.transform == spec
    assert result.token_agreement_rate == equal.mean()
    assert result.first_divergence == first
    assert result.max_abs == float(delta.max())
    assert result.mean_abs == pytest.approx(float(delta.astype(np.float64).mean()), rel=1e-6)
    ordered = np.sort(units(cold.logits), axis=1).astype(np.float64)
    np.testing.assert_array_equal(result.cold_margins, ordered[:, -1] - ordered[:, -2])
    assert result.cold_margin_at_divergence == result.cold_margins[first]
    assert result.drift_at_divergence == float(delta[first].max())
    assert result.divergence_class == classify_divergence(
        result.cold_margin_at_divergence, result.drift_at_divergence, 1.5)
    assert result.handoff_digests == logit_digests(handoff.logits)
    assert result.cold_digests == logit_digests(cold.logits)
    assert result.first_logit_digest_mismatch == 0 and not result.logit_row_digests_equal
    assert result.handoff_generated_token_sha256 == generated_token_sha256(handoff.tokens)
    assert result.cold_generated_token_sha256 == generated_token_sha256(cold.tokens)
    tf = result.teacher_forced
    assert tf is not None and tf.max_abs == result.max_abs
    assert tf.top1_flips == int(np.count_nonzero(forced.argmax(axis=1) != cold.logits.argmax(axis=1)))


def test_compare_branches_bit_identical_branches():
    _, cold = _decode_pair()
    same = DecodeResult(cold.tokens.copy(), cold.logits.copy(), draft_trace=[((1, 2, 3), 3), ((4, 5), 1)])
    cold.draft_trace = [((1, 2, 3), 3), ((4, 5), 1)]
    result = compare_branches(same, cold, "raw", maximum_absolute=1.0, maximum_mean_absolute=0.1)
    assert result.token_agreement_rate == 1.0 and result.first_divergence is None
    assert result.max_abs == 0.0 and result.mean_abs == 0.0
    assert result.logit_row_digests_equal and result.first_logit_digest_mismatch is None
    assert result.divergence_class is None and result.cold_margin_at_divergence is None
    assert result.handoff_draft_tokens_sha256 == result.cold_draft_tokens_sha256
    assert result.handoff_draft_trace_sha256 == result.cold_draft_trace_sha256
    assert result.draft_acceptance_rate == 4 / 5


def test_compare_branches_refuses_mismatched_inputs():
    handoff, cold = _decode_pair()
    with pytest.raises(Refused, match="float32"):
        compare_branches(DecodeResult(handoff.tokens, handoff.logits.astype(np.float64)), cold, "raw",
                         maximum_absolute=1.0, maximum_mean_absolute=1.0)
    with pytest.raises(Refused, match="shapes differ"):
        compare_branches(DecodeResult(handoff.tokens[:-1], handoff.logits[:-1]), cold, "raw",
                         maximum_absolute=1.0, maximum_mean_absolute=1.0)
    with pytest.raises(Refused, match="logit rows"):
        compare_branches(DecodeResult(handoff.tokens[:-1], handoff.logits), cold, "raw",
                         maximum_absolute=1.0, maximum_mean_absolute=1.0)
    with pytest.raises(Refused, match="teacher-forced"):
        compare_branches(handoff, cold, "raw", maximum_absolute=1.0, maximum_mean_absolute=1.0,
                         teacher_forced_logits=handoff.logits[:-1])


def test_divergence_uses_teacher_forced_drift_at_that_row():
    handoff, cold = _decode_pair(noise=0.6)
    forced = cold.logits.copy()
    first = int(np.flatnonzero(handoff.tokens != cold.tokens)[0])
    forced[first] += np.float32(0.25)
    result = compare_branches(handoff, cold, "raw", maximum_absolute=5.0, maximum_mean_absolute=1.0,
                              teacher_forced_logits=forced)
    assert result.drift_at_divergence == pytest.approx(0.25, rel=1e-5)
    assert result.divergence_class == ("near-tie" if result.cold_margin_at_divergence <= 0.5 else "decisive")


@pytest.mark.parametrize(
    ("margin", "drift", "bound", "expected"),
    [
        (0.05, 0.1, 1.0, "near-tie"),  # well inside what the drift can flip
        (0.2, 0.1, 1.0, "near-tie"),  # exactly 2·D: two logits moved by D can just swap
        (0.2000001, 0.1, 1.0, "decisive"),  # beyond 2·D: the measured drift cannot flip it
        (1.5, 5.0, 0.5, "decisive"),  # needs drift beyond the lane's declared envelope
        (0.9, 5.0, 0.5, "near-tie"),
        (math.nan, 0.1, 1.0, "decisive"),
        (0.1, math.inf, 1.0, "decisive"),
    ],
)
def test_classify_divergence(margin, drift, bound, expected):
    assert classify_divergence(margin, drift, bound) == expected


def test_kv_layer_deltas_match_numpy():
    rng = np.random.default_rng(3)
    own_keys = [rng.standard_normal((4, 50, 8)).astype(np.float32) for _ in range(3)]
    own_values = [rng.standard_normal((4, 50, 8)).astype(np.float32) for _ in range(3)]
    handed_keys = [k[:, :48] + rng.standard_normal((4, 48, 8)).astype(np.float32) * 0.01 for k in own_keys]
    handed_values = [v[:, :48].copy() for v in own_values]
    handed_keys[1][2, 30, 5] += 3.0
    handed_values[2][0, 7, 0] -= 2.0
    result = compare_kv(handed_keys, handed_values, own_keys, own_values)
    for layer, item in enumerate(result.layers):
        k_delta = np.abs(handed_keys[layer] - own_keys[layer][:, :48])
        v_delta = np.abs(handed_values[layer] - own_values[layer][:, :48])
        assert item.layer == layer
        assert item.k == float(k_delta.max()) and item.v == float(v_delta.max())
        assert item.k_position == int(k_delta.max(axis=(0, 2)).argmax())
        assert item.v_position == int(v_delta.max(axis=(0, 2)).argmax()) if item.v > 0 else True
    assert result.layers[1].k_position == 30 and result.layers[2].v_position == 7
    pairs = zip(handed_keys + handed_values, own_keys + own_values, strict=True)
    profile = np.max([np.abs(h - o[:, :48]).max(axis=(0, 2)) for h, o in pairs], axis=0)
    np.testing.assert_array_equal(result.position_max_abs, profile)
    assert result.first_position_over(1.0) == 7
    # Each tensor's own per-position maxima, layer by layer, K before V.
    tensors = [np.abs(h - o[:, :48]).max(axis=(0, 2)) for layer in range(3)
               for h, o in ((handed_keys[layer], own_keys[layer]), (handed_values[layer], own_values[layer]))]
    assert result.tensor_position_max_abs is not None
    np.testing.assert_array_equal(result.tensor_position_max_abs, np.stack(tensors))
    assert result.tensor_position_max_abs.shape == (6, 48)


def test_kv_refusals_and_nan():
    good = [np.zeros((2, 5, 4), np.float32)]
    with pytest.raises(Refused, match="layer counts"):
        compare_kv(good, good, good + good, good + good)
    with pytest.raises(Refused, match="does not fit"):
        compare_kv([np.zeros((2, 6, 4), np.float32)], [np.zeros((2, 6, 4), np.float32)], good, good)
    with pytest.raises(Refused, match="kv_heads"):
        compare_kv([np.zeros((5, 4), np.float32)], good, good, good)
    bad = [np.zeros((2, 5, 4), np.float32)]
    bad[0][1, 3, 2] = np.nan
    result = compare_kv(bad, good, good, good)
    assert math.isnan(result.layers[0].k)
    assert result.first_position_over(1e9) == 3


@pytest.mark.parametrize("own_shape", [(3, 5, 4), (2, 5, 5), (2, 4, 4), (2, 5, 4, 1)])
def test_own_kv_of_another_head_count_head_dim_or_fewer_positions_does_not_fit(own_shape):
    handed = [np.zeros((2, 5, 4), np.float32)]
    with pytest.raises(Refused, match=r"kv layer 0 K: handed-off shape \[2, 5, 4\] does not fit own prefill"):
        compare_kv(handed, handed, [np.zeros(own_shape, np.float32)], handed)


def test_own_kv_with_more_positions_compares_only_the_handed_off_ones():
    own = np.zeros((2, 9, 4), np.float32)
    own[:, 5:] = 100.0  # beyond the handed-off positions: not compared
    result = compare_kv([np.zeros((2, 5, 4), np.float32)], [np.zeros((2, 5, 4), np.float32)], [own], [own])
    assert (result.layers[0].k, result.layers[0].v) == (0.0, 0.0)


@pytest.mark.parametrize("positions", [0, 1])
def test_a_one_or_zero_position_handoff_reports_its_delta(positions):
    handed = np.full((2, positions, 4), 0.5, np.float32)
    own = np.zeros((2, positions, 4), np.float32)
    result = compare_kv([handed], [own], [own], [own])
    assert (result.layers[0].k, result.layers[0].k_position) == (0.5 if positions else 0.0, 0)
    assert (result.layers[0].v, result.layers[0].v_position) == (0.0, 0)
    assert result.position_max_abs.shape == (positions,)


def test_half_precision_kv_is_subtracted_in_float32_and_does_not_overflow():
    handed = np.full((1, 2, 4), 65504.0, np.float16)  # float16's largest finite value
    own = np.full((1, 2, 4), -65504.0, np.float16)
    result = compare_kv([handed], [own], [own], [own])
    assert result.layers[0].k == 131008.0 and result.layers[0].v == 0.0


def test_draft_digests():
    trace = [((5, 6, 7), 2), ((8,), 0)]
    assert draft_tokens_sha256(trace) == hashlib.sha256(np.array([5, 6, 7, 8], "<u4").tobytes()).hexdigest()
    canonical = json.dumps([[[5, 6, 7], 2], [[8], 0]], separators=(",", ":")).encode()
    assert draft_trace_sha256(trace) == hashlib.sha256(canonical).hexdigest()
    assert draft_trace_sha256(trace) != draft_trace_sha256([((5, 6, 7), 3), ((8,), 0)])
    assert draft_acceptance_rate(trace) == 0.5
    assert draft_tokens_sha256(None) is None and draft_acceptance_rate([]) is None


@pytest.mark.parametrize(
    "spec", ["", "softcap:30", "tanh-softcap:0", "tanh-softcap:-1", "tanh-softcap:nan", "tanh-softcap:inf", "RAW"])
def test_parse_logit_transform_refuses(spec):
    with pytest.raises(Refused, match="logit transform"):
        parse_logit_transform(spec)


def test_transform_between():
    assert transform_between("raw", "raw").cap is None
    assert transform_between("tanh-softcap:30.0", "tanh-softcap:30").cap is None
    assert transform_between("raw", "tanh-softcap:30.0").cap == 30.0
    with pytest.raises(Refused, match="cannot be undone"):
        transform_between("tanh-softcap:30.0", "raw")


def test_compare_branches_memory_is_per_chunk_not_per_block():
    """A [256, 32768] comparison (32 MiB per block) must not allocate a block-sized delta."""
    rows, vocab = 256, 32768
    handoff, cold = _decode_pair(rows=rows, noise=0.01)
    wide = np.broadcast_to(handoff.logits[:, :1], (rows, vocab)) + np.zeros((rows, vocab), np.float32)
    handoff = DecodeResult(handoff.tokens, np.ascontiguousarray(wide))
    cold = DecodeResult(handoff.tokens.copy(), handoff.logits + np.float32(0.001))
    forced = cold.logits.copy()
    tracemalloc.start()
    try:
        compare_branches(handoff, cold, "tanh-softcap:30.0", maximum_absolute=1.0, maximum_mean_absolute=1.0,
                         teacher_forced_logits=forced)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    block = rows * vocab * 4
    assert peak < block / 4, f"peak {peak} bytes against a {block}-byte block"


# --------------------------------------------------------------------------- judged from a comparison


PAYLOAD_SHA = "4" * 64
RULE2 = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25)


def test_kv_over_envelope_lists_only_tensors_above_their_layers_envelope():
    kv = compare_kv([np.zeros((1, 3, 2), np.float32)] * 2, [np.zeros((1, 3, 2), np.float32)] * 2,
                    [np.zeros((1, 3, 2), np.float32), np.full((1, 3, 2), 0.25, np.float32)],
                    [np.full((1, 3, 2), 0.5, np.float32), np.full((1, 3, 2), np.nan, np.float32)])
    over = kv_over_envelope(kv, [(0.0, 1.0)])
    # layer 0: K 0 and V 0.5 inside (0, 1); layer 1 has no envelope (0) and a NaN V: both over
    assert [(item.layer, item.tensor) for item in over] == [(1, "K"), (1, "V")]
    assert over[0].delta == 0.25 and over[0].envelope == 0.0 and math.isnan(over[1].delta)


def test_model_records_and_json_round_trips_judge_alike():
    handoff_logits = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    tokens = handoff_logits.argmax(axis=1)
    cold = DecodeResult(tokens, handoff_logits + np.float32(0.5))
    handoff = DecodeResult(tokens.copy(), handoff_logits)
    comparison = compare_branches(handoff, cold, "raw", maximum_absolute=11.0, maximum_mean_absolute=1.25)
    model = sample_record(
        repetition=1, comparison=comparison, payload_sha256=PAYLOAD_SHA, payload_bytes=100,
        payload_gbit_per_s=1.0, handed_off_positions=2047, recomputed_positions=0,
        phases={name: 0.0 for name in PHASE_FIELDS},
    )
    as_json = json.loads(json.dumps(record_json(model)))
    assert judge_sample(model, RULE2).passed
    assert judge_sample(as_json, RULE2).passed
    assert judge_sample(model, RULE2).headline == judge_sample(as_json, RULE2).headline


def test_a_nan_measured_by_compare_reaches_the_judge_through_json():
    logits = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    tokens = logits.argmax(axis=1)
    broken = logits.copy()
    broken[3, 3] = np.nan
    comparison = compare_branches(DecodeResult(tokens, broken), DecodeResult(tokens, logits), "raw",
                                  maximum_absolute=11.0, maximum_mean_absolute=1.25)
    model = sample_record(
        repetition=1, comparison=comparison, payload_sha256=PAYLOAD_SHA, payload_bytes=100,
        payload_gbit_per_s=1.0, handed_off_positions=2047, recomputed_positions=0,
        phases={name: 0.0 for name in PHASE_FIELDS},
    )
    as_json = record_json(model)
    assert as_json["max_abs"] == "NaN"
    verdict = judge_sample(as_json, RULE2)
    assert "sample max_abs is not finite: NaN" in verdict.reasons
    assert "sample mean_abs is not finite: NaN" in verdict.reasons


# --------------------------------------------------------------------------- records built from a comparison


def _comparison_with_divergence():
    rng = np.random.default_rng(5)
    cold_logits = rng.standard_normal((256, 64)).astype(np.float32)
    handoff_logits = (cold_logits + rng.standard_normal((256, 64)).astype(np.float32) * 0.3).astype(np.float32)
    cold = DecodeResult(cold_logits.argmax(axis=1), cold_logits)
    handoff = DecodeResult(handoff_logits.argmax(axis=1), handoff_logits)
    kv = ([np.zeros((2, 10, 4), np.float32)], [np.zeros((2, 10, 4), np.float32)])
    own = ([np.zeros((2, 11, 4), np.float32)], [np.full((2, 11, 4), 0.5, np.float32)])
    return compare_branches(
        handoff, cold, "raw", maximum_absolute=11.0, maximum_mean_absolute=1.25,
        teacher_forced_logits=handoff_logits, handoff_kv=kv, own_kv=own,
    )


def test_sample_record_builder_carries_localisation_and_round_trips():
    comparison = _comparison_with_divergence()
    assert comparison.first_divergence is not None
    model = sample_record(
        repetition=2, comparison=comparison, payload_sha256=PAYLOAD_SHA, payload_bytes=100,
        payload_gbit_per_s=1.0, handed_off_positions=10, recomputed_positions=1,
        phases={name: 0.25 for name in PHASE_FIELDS}, kv_threshold=0.1,
    )
    where = model.localisation
    assert where is not None
    assert where.first_divergence_position == comparison.first_divergence
    assert where.cold_margin_at_divergence == comparison.cold_margin_at_divergence
    assert where.divergence_class == comparison.divergence_class
    assert where.teacher_forced.top1_flips == comparison.teacher_forced.top1_flips
    assert [(item.layer, item.k, item.v) for item in where.kv_layer_max_abs] == [(0, 0.0, 0.5)]
    assert where.kv_first_position_over_threshold == 0
    assert SampleRecord.model_validate_json(model.model_dump_json(by_alias=True)) == model
    verdict = judge_sample(record_json(model), RULE2)
    assert not verdict.passed
    assert any(r.startswith("tokens diverge") and f"first divergence at token {comparison.first_divergence}" in r
               for r in verdict.reasons)


def test_sample_record_builder_refuses_missing_or_unknown_phases():
    comparison = _comparison_with_divergence()
    phases = {name: 0.0 for name in PHASE_FIELDS}
    del phases["verify_s"]
    with pytest.raises(Refused, match="sample phases: omits verify_s"):
        sample_record(repetition=1, comparison=comparison, payload_sha256=PAYLOAD_SHA, payload_bytes=1,
                      payload_gbit_per_s=1.0, handed_off_positions=1, recomputed_positions=0, phases=phases)
    with pytest.raises(Refused, match="unknown phase 'warmup_s'"):
        sample_record(repetition=1, comparison=comparison, payload_sha256=PAYLOAD_SHA, payload_bytes=1,
                      payload_gbit_per_s=1.0, handed_off_positions=1, recomputed_positions=0,
                      phases={**{name: 0.0 for name in PHASE_FIELDS}, "warmup_s": 1.0})


# --------------------------------------------------------------------------- boundaries (issue 20)

# Dyadic deltas: row 1 of the handoff block is the cold row plus [0.5, 0, 0, 0], so that row's max
# abs delta is exactly 0.5 and its mean exactly 0.125 (every other row is equal).
EXACT_MAX, EXACT_MEAN = 0.5, 0.125


def _dyadic_blocks() -> tuple[np.ndarray, np.ndarray]:
    cold = np.arange(12, dtype=np.float32).reshape(3, 4)
    handoff = cold.copy()
    handoff[1, 0] += np.float32(EXACT_MAX)
    return handoff, cold


def test_a_row_exactly_at_both_bounds_is_within_the_rule():
    handoff, cold = _dyadic_blocks()
    delta = compare_logit_blocks(handoff, cold, maximum_absolute=EXACT_MAX, maximum_mean_absolute=EXACT_MEAN)
    assert (float(delta.row_max_abs[1]), float(delta.row_mean_abs[1])) == (EXACT_MAX, EXACT_MEAN)
    assert delta.first_row_over_rule is None


@pytest.mark.parametrize(
    ("maximum_absolute", "maximum_mean_absolute"),
    [(math.nextafter(EXACT_MAX, 0.0), EXACT_MEAN), (EXACT_MAX, math.nextafter(EXACT_MEAN, 0.0))],
    ids=["max-one-ulp-over", "mean-one-ulp-over"],
)
def test_a_row_one_ulp_over_either_bound_breaks_the_rule(maximum_absolute, maximum_mean_absolute):
    handoff, cold = _dyadic_blocks()
    delta = compare_logit_blocks(handoff, cold, maximum_absolute=maximum_absolute,
                                 maximum_mean_absolute=maximum_mean_absolute)
    assert delta.first_row_over_rule == 1


@pytest.mark.parametrize("bound", ["max", "mean"])
def test_only_one_bound_given_still_locates_a_row_over_it(bound):
    handoff, cold = _dyadic_blocks()
    if bound == "max":
        delta = compare_logit_blocks(handoff, cold, maximum_absolute=math.nextafter(EXACT_MAX, 0.0))
    else:
        delta = compare_logit_blocks(handoff, cold, maximum_mean_absolute=math.nextafter(EXACT_MEAN, 0.0))
    assert delta.first_row_over_rule == 1


def test_teacher_forced_drift_locates_a_row_over_the_mean_bound_alone():
    forced, cold = _dyadic_blocks()
    under_mean = math.nextafter(EXACT_MEAN, 0.0)
    drift = teacher_forced_drift(forced, cold, maximum_absolute=EXACT_MAX, maximum_mean_absolute=under_mean)
    assert drift.first_row_over_rule == 1
    at_mean = teacher_forced_drift(forced, cold, maximum_absolute=EXACT_MAX, maximum_mean_absolute=EXACT_MEAN)
    assert at_mean.first_row_over_rule is None


def test_compare_branches_locates_a_teacher_forced_row_over_the_mean_bound_alone():
    forced, cold = _dyadic_blocks()
    tokens = np.asarray(cold.argmax(axis=1), dtype=np.int64)
    same = DecodeResult(tokens=tokens, logits=cold.copy())
    comparison = compare_branches(same, DecodeResult(tokens=tokens, logits=cold), "raw",
                                  maximum_absolute=EXACT_MAX, maximum_mean_absolute=math.nextafter(EXACT_MEAN, 0.0),
                                  teacher_forced_logits=forced)
    assert comparison.teacher_forced is not None
    assert comparison.teacher_forced.first_row_over_rule == 1
    assert comparison.delta.first_row_over_rule is None  # the free-running branches are equal


def _kv_with_one_delta(at: float) -> KVComparison:
    """One layer, positions 0..3; the handed-off K differs from the consumer's own by ``at`` at position 2."""
    own = np.zeros((1, 4, 2), dtype=np.float64)
    handed = own.copy()
    handed[0, 2, 1] = at
    return compare_kv([handed], [own.copy()], [own], [own])


def test_first_position_over_is_none_exactly_at_the_threshold_and_found_one_ulp_over():
    comparison = _kv_with_one_delta(0.25)
    assert comparison.first_position_over(0.25) is None
    assert comparison.first_position_over(math.nextafter(0.25, 0.0)) == 2
    assert comparison.first_position_over(0.0) == 2


def test_compare_kv_keeps_k_and_v_apart():
    own_keys = [np.zeros((2, 5, 3), np.float32)]
    own_values = [np.full((2, 5, 3), 10.0, np.float32)]
    handed_keys = [own_keys[0].copy()]
    handed_values = [own_values[0].copy()]
    handed_keys[0][1, 1, 0] = 0.5  # K: 0.5 at position 1
    handed_values[0][0, 3, 2] = 12.0  # V: 2.0 at position 3
    [layer] = compare_kv(handed_keys, handed_values, own_keys, own_values).layers
    assert (layer.k, layer.k_position, layer.v, layer.v_position) == (0.5, 1, 2.0, 3)


@pytest.mark.parametrize("tensor", ["K", "V"])
def test_compare_kv_refusals_name_the_tensor_at_fault(tensor):
    good = np.zeros((2, 5, 4), np.float32)
    longer = np.zeros((2, 6, 4), np.float32)
    flat = np.zeros((5, 4), np.float32)
    keys, values = ([flat], [good]) if tensor == "K" else ([good], [flat])
    with pytest.raises(Refused, match=f"^kv layer 0 {tensor}: expected \\[kv_heads, positions, head_dim\\]"):
        compare_kv(keys, values, [good], [good])
    keys, values = ([longer], [good]) if tensor == "K" else ([good], [longer])
    if tensor == "K":
        with pytest.raises(Refused, match="^kv layer 0 V: 5 handed-off positions, layer 0 has 6$"):
            compare_kv(keys, values, [good], [good])
    else:
        with pytest.raises(Refused, match="^kv layer 0 V: 6 handed-off positions, layer 0 has 5$"):
            compare_kv(keys, values, [good], [good])
    own_short = np.zeros((2, 4, 4), np.float32)
    own_keys, own_values = ([own_short], [good]) if tensor == "K" else ([good], [own_short])
    with pytest.raises(Refused, match=f"^kv layer 0 {tensor}: handed-off shape \\[2, 5, 4\\] does not fit"):
        compare_kv([good], [good], own_keys, own_values)


# --------------------------------------------------------------------------- teacher-forced partings (the teacher-forced rule)

PARTED_ROWS = (0, 5, 17, 63)
"""Rows whose teacher-forced top token is made to differ from the cold one (first and last included)."""


def _forced_with_partings(cold_logits: np.ndarray, rows: tuple[int, ...] = PARTED_ROWS, noise: float = 1e-3,
                          seed: int = 7) -> np.ndarray:
    """Teacher-forced logits: the cold logits plus a little noise, with the cold runner-up lifted
    above the cold top token at ``rows`` (a row of the noise may part as well: the expectation is
    computed from the argmaxes, never assumed)."""
    rng = np.random.default_rng(seed)
    forced = (cold_logits + rng.standard_normal(cold_logits.shape) * noise).astype(np.float32)
    for row in rows:
        ranked = np.argsort(cold_logits[row])
        forced[row, ranked[-2]] = forced[row, ranked[-1]] + np.float32(1.0)
    return forced


def _expected_partings(forced: np.ndarray, cold_logits: np.ndarray, spec: str) -> tuple[tuple[int, float], ...]:
    """Rows whose emitted argmax differs, with numpy's top-1 minus top-2 of the cold row in contract units."""
    transform = parse_logit_transform(spec)
    units = cold_logits if transform.cap is None else _softcap(cold_logits, transform.cap)
    ordered = np.sort(units, axis=1).astype(np.float64)
    margins = ordered[:, -1] - ordered[:, -2]
    rows = np.flatnonzero(forced.argmax(axis=1) != cold_logits.argmax(axis=1))
    return tuple((int(row), float(margins[row])) for row in rows)


@pytest.mark.parametrize("spec", ["raw", "tanh-softcap:5"])
def test_compare_branches_records_each_parting_with_its_cold_margin(spec: str, chunk_bytes: int) -> None:
    handoff, cold = _decode_pair(noise=0.6)
    forced = _forced_with_partings(cold.logits)
    result = compare_branches(handoff, cold, spec, maximum_absolute=1.5, maximum_mean_absolute=0.3,
                              teacher_forced_logits=forced)
    tf = result.teacher_forced
    assert tf is not None
    expected = _expected_partings(forced, cold.logits, spec)
    assert set(PARTED_ROWS) <= {row for row, _ in expected}
    assert tf.partings == expected
    assert tf.top1_flips == len(tf.partings)
    assert [row for row, _ in tf.partings] == sorted({row for row, _ in tf.partings})
    # each margin is the cold row's, the one the comparison reports for that row
    assert all(margin == float(result.cold_margins[row]) for row, margin in tf.partings)


@pytest.mark.parametrize("spec", ["raw", "tanh-softcap:5"])
def test_teacher_forced_drift_gives_the_partings_compare_branches_gives(spec: str, chunk_bytes: int) -> None:
    handoff, cold = _decode_pair(noise=0.6)
    forced = _forced_with_partings(cold.logits)
    branches = compare_branches(handoff, cold, spec, maximum_absolute=1.5, maximum_mean_absolute=0.3,
                                teacher_forced_logits=forced).teacher_forced
    alone = teacher_forced_drift(forced, cold.logits, spec, maximum_absolute=1.5, maximum_mean_absolute=0.3)
    assert branches is not None
    assert alone.partings == branches.partings == _expected_partings(forced, cold.logits, spec)
    assert alone.top1_flips == branches.top1_flips
    assert alone.max_row_mean_abs == branches.max_row_mean_abs


def test_no_parting_is_recorded_where_every_teacher_forced_top_token_is_the_cold_one(chunk_bytes: int) -> None:
    handoff, cold = _decode_pair(noise=0.6)
    forced = cold.logits.copy()
    forced[3] += np.float32(0.25)  # drift that moves no top token
    result = compare_branches(handoff, cold, "raw", maximum_absolute=1.5, maximum_mean_absolute=0.3,
                              teacher_forced_logits=forced)
    assert result.teacher_forced is not None
    assert result.teacher_forced.partings == () and result.teacher_forced.top1_flips == 0
    assert teacher_forced_drift(forced, cold.logits).partings == ()


def test_a_parting_at_a_saturated_soft_cap_records_the_margin_in_contract_units() -> None:
    """Under a soft cap the margin is the capped one: two raw logits far apart but both deep in the
    cap's saturation part by a margin far smaller than their raw gap."""
    cold = np.zeros((2, 8), dtype=np.float32)
    cold[0, [1, 2]] = [60.0, 40.0]
    cold[1, [3, 4]] = [1.0, 0.5]
    forced = cold.copy()
    forced[0, 2] = 70.0  # the runner-up overtakes: a parting at row 0
    drift = teacher_forced_drift(forced, cold, "tanh-softcap:5")
    capped = _softcap(cold[0], 5.0).astype(np.float64)
    assert drift.partings == ((0, float(capped[1] - capped[2])),)
    assert drift.partings[0][1] < 1e-3  # far below the raw gap of 20
    assert teacher_forced_drift(forced, cold, "raw").partings == ((0, 20.0),)


@pytest.mark.parametrize("spec", ["raw", "tanh-softcap:5"])
def test_max_row_mean_abs_is_the_largest_per_row_mean_abs_delta(spec: str, chunk_bytes: int) -> None:
    handoff, cold = _decode_pair(noise=0.6)
    forced = _forced_with_partings(cold.logits)
    forced[11] += np.float32(0.5)  # one row whose mean stands out above the block's
    transform = parse_logit_transform(spec)
    units = (lambda x: x) if transform.cap is None else (lambda x: _softcap(x, transform.cap))
    per_row = np.abs(units(forced) - units(cold.logits)).astype(np.float64).mean(axis=1)
    result = compare_branches(handoff, cold, spec, maximum_absolute=1.5, maximum_mean_absolute=0.3,
                              teacher_forced_logits=forced)
    tf = result.teacher_forced
    assert tf is not None
    assert int(per_row.argmax()) == 11
    assert tf.max_row_mean_abs == pytest.approx(float(per_row.max()), rel=1e-6)
    assert tf.max_row_mean_abs == float(tf.row_mean_abs.max())
    assert tf.max_row_mean_abs > tf.mean_abs


def test_largest_is_nan_when_any_row_is_and_zero_when_there_is_none() -> None:
    assert compare.largest(np.array([0.5, 2.0, 1.0])) == 2.0
    assert math.isnan(compare.largest(np.array([0.5, math.nan, 2.0])))
    assert math.isnan(compare.largest(np.array([math.nan])))
    assert compare.largest(np.array([])) == 0.0


def test_a_nan_teacher_forced_row_makes_the_largest_row_mean_nan() -> None:
    _, cold = _blocks()
    forced = cold.copy()
    forced[9, 4] = np.nan
    assert math.isnan(teacher_forced_drift(forced, cold).max_row_mean_abs)


def test_partings_at_lists_rows_in_order_with_their_margins() -> None:
    margins = np.array([0.5, 0.25, 1.0, 0.125])
    assert compare.partings_at(np.array([3, 0, 2]), margins) == ((0, 0.5), (2, 1.0), (3, 0.125))
    assert compare.partings_at(np.array([], dtype=np.int64), margins) == ()


def test_the_sample_record_carries_the_partings_and_both_largest_row_means() -> None:
    handoff, cold = _decode_pair(noise=0.6, rows=256)
    forced = _forced_with_partings(cold.logits)
    comparison = compare_branches(handoff, cold, "raw", maximum_absolute=11.0, maximum_mean_absolute=1.25,
                                  teacher_forced_logits=forced)
    model = sample_record(
        repetition=1, comparison=comparison, payload_sha256=PAYLOAD_SHA, payload_bytes=100,
        payload_gbit_per_s=1.0, handed_off_positions=2047, recomputed_positions=0,
        phases={name: 0.0 for name in PHASE_FIELDS},
    )
    tf = comparison.teacher_forced
    assert tf is not None and model.localisation is not None and model.localisation.teacher_forced is not None
    summary = model.localisation.teacher_forced
    assert [(p.row, p.cold_margin) for p in summary.partings or ()] == list(tf.partings)
    assert summary.max_row_mean_abs == tf.max_row_mean_abs
    assert model.max_row_mean_abs == float(comparison.delta.row_mean_abs.max())
    as_json = record_json(model)
    assert as_json["localisation"]["teacher_forced"]["partings"] == [
        {"row": row, "cold_margin": margin} for row, margin in tf.partings]
    # judged by the teacher-forced rule: near-ties up to the largest margin pass, one below it does not
    largest_margin = max(margin for _, margin in tf.partings)
    wide = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, near_tie_margin=largest_margin,
                            maximum_changed_row_share=1.0)
    narrow = wide.model_copy(update={"near_tie_margin": math.nextafter(largest_margin, 0.0)})
    assert judge_sample(as_json, wide).passed
    assert not judge_sample(as_json, narrow).passed
