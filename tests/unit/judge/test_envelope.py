"""A non-deterministic producer's fixture envelope (fixture-envelope-loo-range.v1): derived
index by index from the fixture's honest handoffs, every judged row and position held inside it;
and the summary of a producer declared non-deterministic, which compares only the cold digests."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.contract.rules import FIXTURE_ENVELOPE_RULE
from qualify.core.errors import Refused
from qualify.judge import judge_qualification, judge_summary
from qualify.judge.envelope import (
    MINIMUM_ENVELOPE_HANDOFFS,
    EnvelopeSeal,
    FixtureEnvelope,
    HandoffSeries,
    ceilings_sha256,
    derive_fixture_envelope,
    judge_envelope,
    leave_one_out_exceedance,
    seal_problems,
)
from tests.unit.judge.test_judge import RULE2, three


def series(row_max: list[float], row_mean: list[float] | None = None,
           positions: list[float] | None = None, tensors: list[float] | None = None) -> HandoffSeries:
    """One handoff's series; by default its positions are half its rows' maxima and its one
    layer's K and V each a quarter of them."""
    positions = positions if positions is not None else [x / 2 for x in row_max]
    return HandoffSeries(tuple(row_max), tuple(row_mean if row_mean is not None else [x / 8 for x in row_max]),
                         tuple(positions), tuple(tensors if tensors is not None else [x / 2 for x in positions] * 2))


HONEST = [series([1.0, 2.0, 0.0]), series([1.5, 2.0, 0.0]), series([1.25, 1.0, 0.0]), series([1.0, 2.0, 0.0])]


def test_each_ceiling_is_the_largest_value_plus_k_ranges_at_its_index() -> None:
    # Row max at index 0 is 1.0, 1.5, 1.25, 1.0: left out, 1.5 rose one range (0.25) above the others'
    # largest, so k = 2 * max(1, 1.0) = 2; index 1 (2, 2, 1, 2) never rose above the others.
    envelope = derive_fixture_envelope(HONEST, starts=2)
    assert envelope.multipliers == (2.0, 2.0, 2.0, 2.0)
    assert envelope.row_max_abs == (2.5, 4.0, 0.0)  # 1.5 + 2 * 0.5, 2 + 2 * 1, 0 + 0
    assert envelope.row_mean_abs == (0.3125, 0.5, 0.0)
    assert envelope.position_max_abs == (1.25, 2.0, 0.0)
    assert (envelope.handoffs, envelope.starts, envelope.rule) == (4, 2, FIXTURE_ENVELOPE_RULE)


def test_k_is_twice_the_largest_leave_one_out_step_past_the_others() -> None:
    # Left out, 4 rose 3 of the others' ranges (0..1) above their largest: k = 6 for row max only.
    handoffs = [series([0.0], row_mean=[0.5], positions=[0.5]), series([1.0], row_mean=[0.5], positions=[0.5]),
                series([1.0], row_mean=[0.5], positions=[0.5]), series([4.0], row_mean=[0.5], positions=[0.5])]
    assert leave_one_out_exceedance([[0.0], [1.0], [1.0], [4.0]]) == 3.0
    envelope = derive_fixture_envelope(handoffs, starts=2)
    assert envelope.multipliers == (6.0, 2.0, 2.0, 2.0)
    assert envelope.row_max_abs == (4.0 + 6.0 * 4.0,)
    assert leave_one_out_exceedance([[1.0, 5.0], [1.0, 5.0], [1.0, 5.0]]) == 0.0  # no range: no step


def test_a_producer_whose_runs_agree_gets_exactly_its_measured_values() -> None:
    same = [series([0.5, 0.75])] * MINIMUM_ENVELOPE_HANDOFFS
    envelope = derive_fixture_envelope(same, starts=2)
    assert envelope.row_max_abs == (0.5, 0.75)
    assert judge_envelope(same, envelope).passed
    nudged = series([0.5, math.nextafter(0.75, 1.0)], row_mean=[0.5 / 8, 0.75 / 8], positions=[0.25, 0.375])
    assert not judge_envelope([nudged], envelope).passed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=3, max_size=3),
                min_size=MINIMUM_ENVELOPE_HANDOFFS, max_size=8))
def test_every_honest_handoff_lies_inside_the_envelope_it_states(rows: list[list[float]]) -> None:
    honest = [series(row) for row in rows]
    assert judge_envelope(honest, derive_fixture_envelope(honest, starts=2)).passed


def test_a_row_above_its_ceiling_fails_naming_the_handoff_index_value_and_ceiling() -> None:
    envelope = derive_fixture_envelope(HONEST, starts=2)
    faulty = series([1.0, 2.0, 0.001])  # row 2's ceiling is 0: honest runs never moved it
    verdict = judge_envelope([HONEST[0], faulty], envelope)
    assert not verdict.passed
    assert verdict.reasons == ["handoff 2: row max |delta logit| outside the fixture envelope at 1 of 3 indices, "
                               "first at 2 (0.001 > 0)",
                               "handoff 2: row mean |delta logit| outside the fixture envelope at 1 of 3 indices, "
                               "first at 2 (0.000125 > 0)",
                               "handoff 2: handed-off position max |delta K or V| outside the fixture envelope at 1 "
                               "of 3 indices, first at 2 (0.0005 > 0)",
                               "handoff 2: layer K or V position max |delta| outside the fixture envelope at 2 of 6 "
                               "indices, first at layer 0 K position 2 (0.00025 > 0)"]


def test_one_tensors_position_alone_outside_fails_named_by_layer_tensor_and_position() -> None:
    """A fault in one layer's V at one position, under another layer's larger delta there: the
    all-layer position series cannot see it, the tensor's own series does."""
    honest = [series([1.0], row_mean=[0.1], positions=[4.0], tensors=[4.0, 0.5 + i / 64, 0.25, 0.25])
              for i in range(4)]  # layer 0 K, layer 0 V, layer 1 K, layer 1 V at the one position
    envelope = derive_fixture_envelope(honest, starts=2)
    faulty = series([1.0], row_mean=[0.1], positions=[4.0], tensors=[4.0, 0.5, 0.25, 0.5])
    verdict = judge_envelope([faulty], envelope)
    assert verdict.reasons == ["handoff 1: layer K or V position max |delta| outside the fixture envelope at 1 of 4 "
                               "indices, first at layer 1 V position 0 (0.5 > 0.25)"]


def test_one_position_alone_outside_fails() -> None:
    envelope = derive_fixture_envelope(HONEST, starts=2)
    verdict = judge_envelope([series([1.0, 2.0, 0.0], positions=[0.5, 2.1, 0.0])], envelope)
    assert [check.passed for check in verdict.checks] == [False]
    assert "handed-off position max |delta K or V| outside the fixture envelope at 1 of 3 indices, first at 1" \
        in verdict.reasons[0]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_value_lies_outside(value: float) -> None:
    envelope = FixtureEnvelope(4, 2, (1.0,), (1.0,), (1.0,), (1.0, 1.0))
    assert judge_envelope([series([0.5], row_mean=[0.5], positions=[0.5])], envelope).passed
    for where in ({"row_max": [value]}, {"row_mean": [value]}, {"positions": [value]}):
        measured = {"row_max": [0.5], "row_mean": [0.5], "positions": [0.5], **where}
        assert not judge_envelope([series(**measured)], envelope).passed, where


def test_a_series_of_another_length_or_no_handoff_fails() -> None:
    envelope = derive_fixture_envelope(HONEST, starts=2)
    short = judge_envelope([series([1.0, 2.0])], envelope)
    assert not short.passed and "handoff 1: 2 row_max_abs values, the envelope has 3" in short.reasons
    empty = judge_envelope([], envelope)
    assert not empty.passed and empty.reasons == ["no handoffs to hold to the fixture envelope"]


def test_a_passing_verdict_names_how_near_the_nearest_index_came() -> None:
    """Its words are in tests/golden/judge.envelope.txt; here, the figure: 1.5 of a 2.5 ceiling."""
    verdict = judge_envelope(HONEST, derive_fixture_envelope(HONEST, starts=2))
    assert verdict.passed and "nearest at 0.6 of its ceiling" in verdict.headline
    alone = judge_envelope([series([1.0, 1.0, 0.0], row_mean=[0.0] * 3, positions=[0.0] * 3)],
                           derive_fixture_envelope(HONEST, starts=2))
    assert "nearest at 0.4 of its ceiling" in alone.headline  # 1.0 of 2.5; zero ceilings are not ratios


@pytest.mark.parametrize(("handoffs", "starts", "words"), [
    (HONEST[:3], 2, "honest handoffs: found 3, expected at least 4"),
    (HONEST, 1, "producer starts: found 1, expected 2 to 4"),
    (HONEST, 5, "producer starts: found 5, expected 2 to 4"),
    ([*HONEST[:3], series([1.0, 2.0])], 2, "row_max_abs: lengths [2, 3] across the honest handoffs"),
    ([*HONEST[:3], series([1.0, math.nan, 0.0])], 2, "row_max_abs[1] of honest handoff 4 is nan, expected a finite"),
    ([*HONEST[:3], series([1.0, 2.0, 0.0], positions=[0.0, -1.0, 0.0])], 2,
     "position_max_abs[1] of honest handoff 4 is -1.0, expected a finite"),
])
def test_an_envelope_is_stated_only_from_enough_clean_honest_handoffs(
        handoffs: list[HandoffSeries], starts: int, words: str) -> None:
    with pytest.raises(Refused) as refused:
        derive_fixture_envelope(handoffs, starts=starts)
    assert str(refused.value).startswith("fixture envelope: ") and words in str(refused.value)


# --------------------------------------------------------------------------- the summary, non-deterministic


def test_a_non_deterministic_producer_may_change_its_digests_across_repetitions() -> None:
    records = three()
    records[1]["payload_sha256"] = "b" * 64
    records[2]["handoff_logit_block_sha256"] = "c" * 64
    assert not judge_summary(records, RULE2).passed
    verdict = judge_summary(records, RULE2, deterministic_producer=False)
    assert verdict.passed, verdict.reasons
    assert verdict.headline.endswith("; cold digests equal across repetitions (the producer is declared "
                                     "non-deterministic)")


@pytest.mark.parametrize("field", ["cold_logit_block_sha256", "cold_generated_token_sha256", "payload_bytes"])
def test_the_cold_recompute_and_the_payload_size_stay_exact_for_a_non_deterministic_producer(field: str) -> None:
    records = three()
    records[2][field] = 1 if field == "payload_bytes" else "f" * 64
    if field == "cold_generated_token_sha256":
        records[2]["handoff_generated_token_sha256"] = records[2][field]  # tokens still exact in the sample
    verdict = judge_summary(records, RULE2, deterministic_producer=False)
    assert not verdict.passed
    assert any("differs across repetitions (repetition 3 vs 1)" in reason for reason in verdict.reasons)


def test_a_non_deterministic_qualification_is_judged_by_its_envelope_and_fails_without_one() -> None:
    records, anchors = three(seams_sha256="a" * 64), three(seams_sha256="a" * 64)
    records[1]["payload_sha256"] = "b" * 64  # not the anchor's: reported, not failed
    inside = judge_envelope(HONEST, derive_fixture_envelope(HONEST, starts=2))
    outside = judge_envelope([series([1.0, 4.5, 0.0])], derive_fixture_envelope(HONEST, starts=2))
    assert judge_qualification(records, RULE2, anchors, deterministic_producer=False, envelope=inside).passed
    refused = judge_qualification(records, RULE2, anchors, deterministic_producer=False, envelope=outside)
    assert not refused.passed and refused.reasons == outside.reasons
    bare = judge_qualification(records, RULE2, anchors, deterministic_producer=False)
    assert not bare.passed and bare.reasons == [
        "no fixture envelope for a producer declared non-deterministic: its drift has nothing tighter than a "
        "cross-document maximum to be judged by"]
    assert not judge_qualification(records, RULE2, anchors, deterministic_producer=True, envelope=inside).passed


def test_as_many_starts_as_handoffs_and_one_row_series_are_enough() -> None:
    one_row = [series([x]) for x in (1.0, 2.0, 1.5, 1.25)]
    envelope = derive_fixture_envelope(one_row, starts=len(one_row))
    assert (envelope.starts, envelope.row_max_abs) == (4, (4.0,))  # 2 + 2 * (2 - 1)


def test_the_nearest_figure_counts_small_ceilings_and_a_value_exactly_at_its_ceiling() -> None:
    small = [series([0.25, 0.5], row_mean=[0.0, 0.0], positions=[0.0, 0.0])] * MINIMUM_ENVELOPE_HANDOFFS
    envelope = derive_fixture_envelope(small, starts=2)  # ceilings 0.25 and 0.5: every one below 1
    at_ceiling = judge_envelope(small, envelope)
    assert at_ceiling.passed and "nearest at 1 of its ceiling" in at_ceiling.headline
    halfway = judge_envelope([series([0.125, 0.25], row_mean=[0.0, 0.0], positions=[0.0, 0.0])], envelope)
    assert "nearest at 0.5 of its ceiling" in halfway.headline


def test_a_value_a_hair_above_its_ceiling_never_prints_as_equal_to_it() -> None:
    ceiling = 0.1 + 0.2  # 0.30000000000000004: nine digits print it as 0.3
    envelope = FixtureEnvelope(4, 2, (ceiling,), (1.0,), (1.0,), (1.0, 1.0))
    verdict = judge_envelope([series([math.nextafter(ceiling, 1.0)], row_mean=[0.5], positions=[0.5])], envelope)
    assert not verdict.passed and f"({math.nextafter(ceiling, 1.0)!r} > 0.3)" in verdict.reasons[0]


def test_a_missing_envelope_is_a_failed_check_of_its_own() -> None:
    bare = judge_qualification(three(seams_sha256="a" * 64), RULE2, three(seams_sha256="a" * 64),
                               deterministic_producer=False)
    assert [(check.name, check.passed) for check in bare.checks if check.name == "inside the fixture envelope"] == [
        ("inside the fixture envelope", False)]


def loo_by_definition(columns: list[list[float]]) -> float:
    """The leave-one-out step by its words: each handoff left out in turn, against the others."""
    largest = 0.0
    for index in range(len(columns[0])):
        values = [column[index] for column in columns]
        for left_out in range(len(values)):
            others = values[:left_out] + values[left_out + 1:]
            spread = max(others) - min(others)
            if spread > 0 and values[left_out] > max(others):
                largest = max(largest, (values[left_out] - max(others)) / spread)
    return largest


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 8.0]), min_size=2, max_size=2),
                min_size=3, max_size=6))
def test_the_leave_one_out_step_is_what_its_words_define(columns: list[list[float]]) -> None:
    assert leave_one_out_exceedance(columns) == loo_by_definition(columns)


def test_a_tensor_index_is_named_by_its_layer_tensor_and_position_over_several_positions() -> None:
    # Two positions, two layers: index 4 is layer 1, K, position 0 (layer by layer, K before V, each
    # over every position).
    honest = [series([1.0], row_mean=[0.1], positions=[1.0, 1.0], tensors=[0.5] * 8)] * MINIMUM_ENVELOPE_HANDOFFS
    envelope = derive_fixture_envelope(honest, starts=2)
    faulty = series([1.0], row_mean=[0.1], positions=[1.0, 1.0], tensors=[0.5] * 4 + [0.75] + [0.5] * 3)
    assert judge_envelope([faulty], envelope).reasons == [
        "handoff 1: layer K or V position max |delta| outside the fixture envelope at 1 of 8 indices, first at "
        "layer 1 K position 0 (0.75 > 0.5)"]


# --------------------------------------------------------------------------- the seal an identity carries


def digest_by_definition(envelope: FixtureEnvelope) -> str:
    """FIXTURE_ENVELOPE_CEILINGS_DIGEST's words, followed with numpy's own byte forms."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for name in ("row_max_abs", "row_mean_abs", "position_max_abs", "tensor_position_max_abs"):
        values = getattr(envelope, name)
        digest.update(name.encode("ascii") + b"\0" + np.uint64(len(values)).astype("<u8").tobytes())
        digest.update(np.asarray(values, dtype="<f8").tobytes())
    return digest.hexdigest()


def test_the_ceilings_digest_is_what_its_stated_words_compute() -> None:
    envelope = derive_fixture_envelope(HONEST, starts=2)
    assert ceilings_sha256(envelope) == digest_by_definition(envelope)


def test_the_ceilings_digest_moves_with_one_ulp_of_one_ceiling_and_with_where_a_value_sits() -> None:
    envelope = derive_fixture_envelope(HONEST, starts=2)
    nudged = replace(envelope, row_mean_abs=(envelope.row_mean_abs[0], math.nextafter(envelope.row_mean_abs[1], 1.0),
                                             envelope.row_mean_abs[2]))
    assert ceilings_sha256(nudged) != ceilings_sha256(envelope)
    # The same values, one moved from the end of one series to the start of the next: lengths are digested.
    shifted = replace(envelope, row_max_abs=envelope.row_max_abs[:-1],
                      row_mean_abs=envelope.row_max_abs[-1:] + envelope.row_mean_abs)
    assert ceilings_sha256(shifted) != ceilings_sha256(envelope)


def test_a_seal_of_the_envelope_its_handoffs_give_follows_from_them() -> None:
    envelope = derive_fixture_envelope(HONEST, starts=2)
    assert seal_problems(EnvelopeSeal.of(envelope), HONEST, starts=2) == ([], envelope)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("rule", "fixture-envelope-max-plus-range.v1", "fixture_envelope.rule.name"),
    ("handoffs", 8, "fixture_envelope.handoffs"),
    ("starts", 3, "fixture_envelope.producer_starts"),
    ("multipliers", (2.0, 2.0, 2.5, 2.0), "fixture_envelope.multipliers.position_max_abs"),
    ("multipliers", (2.0, 2.0, 2.0), "fixture_envelope.multipliers"),
    ("ceilings_sha256", "ab" * 32, "fixture_envelope.ceilings_sha256"),
])
def test_each_sealed_field_the_handoffs_do_not_give_is_named(field: str, value: Any, named: str) -> None:
    sealed = replace(EnvelopeSeal.of(derive_fixture_envelope(HONEST, starts=2)), **{field: value})
    problems, envelope = seal_problems(sealed, HONEST, starts=2)
    assert envelope is not None and [problem.split(":")[0] for problem in problems] == [named]


def test_handoffs_that_state_no_envelope_give_no_seal() -> None:
    sealed = EnvelopeSeal.of(derive_fixture_envelope(HONEST, starts=2))
    problems, envelope = seal_problems(sealed, HONEST[:3], starts=2)
    assert envelope is None and len(problems) == 1 and problems[0].startswith("fixture_envelope: ")


def test_a_handoff_without_its_series_fails_even_when_every_other_is_inside() -> None:
    envelope = derive_fixture_envelope(HONEST, starts=2)
    verdict = judge_envelope(HONEST[:2], envelope, missing=["handoff 3: no series"])
    assert not verdict.passed and verdict.reasons == ["handoff 3: no series"]
    assert not judge_envelope([], envelope, missing=["handoff 1: no series"]).passed


def test_a_non_deterministic_qualification_rechecks_no_anchor() -> None:
    """The envelope judges instead: anchors that differ from every sample name no check."""
    records, anchors = three(seams_sha256="a" * 64), three(seams_sha256="a" * 64)
    for anchor in anchors:
        anchor["payload_sha256"] = "c" * 64
    inside = judge_envelope(HONEST, derive_fixture_envelope(HONEST, starts=2))
    verdict = judge_qualification(records, RULE2, anchors, deterministic_producer=False, envelope=inside)
    assert verdict.passed and not any(check.name.endswith("as anchored") for check in verdict.checks)
    deterministic = judge_qualification(records, RULE2, anchors, deterministic_producer=True)
    assert not deterministic.passed and any(check.name.endswith("as anchored") for check in deterministic.checks)


def test_the_leave_one_out_step_refuses_handoffs_of_different_lengths() -> None:
    # derive_fixture_envelope refuses such series first; the step itself never pairs a value with
    # another handoff's neighbour either.
    with pytest.raises(ValueError, match="zip"):
        leave_one_out_exceedance([[1.0, 2.0], [1.0, 2.0], [1.0]])
