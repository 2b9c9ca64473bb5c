"""The words a calibration and a parity judgement put in front of a reader: every check's name,
outcome and detail, the problems that keep a calibration cell from counting, the refusals of sealed
numbers that do not follow from their basis, and the one line a throughput comparison prints
(qualify/judge/calibration.py, qualify/judge/parity.py)."""

from __future__ import annotations

import math
from typing import Any

from qualify.contract.rules import BOUND_RULE, FLOOR_RULE
from qualify.judge.calibration import (
    ANCHOR_PART,
    CALIBRATION_PART,
    ZERO_DRIFT_BOUND,
    CellDrift,
    bound_problems,
    calibration_cells,
    cell_table,
    derive_acceptance_floor,
    derive_bounds,
)
from qualify.judge.parity import judge_parity
from tests.unit.judge.test_calibration_rules import ANCHORS, CELLS, calibrated, check, evidence, judged, record
from tests.unit.judge.test_parity import CELL_A, CELL_B, cell, p13_cell, shifted

HANDOFFS_MISSING = "calibration evidence: handoffs missing or not a list of objects"
DRAFT_DIGESTS = {"handoff_draft_tokens_sha256": "d" * 64, "handoff_draft_trace_sha256": "e" * 64}


def first_checks(result: Any) -> list[tuple[str, bool, str]]:
    """The calibration's own checks (the anchors' per-digest checks follow them)."""
    names = {"handoffs", "producer restarts", "rule stated", "calibration cells", "bit-exact cells",
             "anchor tokens exact", "anchor reproduced", "draft counts"}
    return [(c.name, c.passed, c.detail) for c in result.verdict.checks if c.name in names]


def said(result: Any, name: str) -> tuple[str, bool, str]:
    found = check(result, name)
    return found.name, found.passed, found.detail


# --------------------------------------------------------------------------- calibration cells


def test_each_cell_problem_is_named_and_never_stops_the_cells_after_it() -> None:
    """An anchor listed first, a malformed entry, a missing sample, a failed handoff and two
    negative drifts each keep only their own cell out; the two good cells after them still count."""
    document = {"handoffs": [
        {"repetition": 1, "part": ANCHOR_PART, "document": "python-textwrap", "prompt_tokens": 2048},
        {"repetition": True, "part": CALIBRATION_PART, "document": "doc-a", "prompt_tokens": 512},
        {"repetition": 3, "part": CALIBRATION_PART, "document": "doc-b", "prompt_tokens": 512},
        {"repetition": 4, "part": CALIBRATION_PART, "document": "doc-c", "prompt_tokens": 512},
        {"repetition": 5, "part": CALIBRATION_PART, "document": "doc-d", "prompt_tokens": 512},
        {"repetition": 6, "part": CALIBRATION_PART, "document": "doc-e", "prompt_tokens": 512},
        {"repetition": 7, "part": CALIBRATION_PART, "document": "doc-a", "prompt_tokens": 1024},
        {"repetition": 8, "part": CALIBRATION_PART, "document": "doc-b", "prompt_tokens": 1024},
    ]}
    records = [record(1, 0.5, 0.05), {"repetition": 4, "error": "producer failed:\n  stalled"},
               record(5, -0.5, 0.05), record(6, 0.5, -0.05), record(7, 1.0, 0.05),
               record(8, 19.0, 2.0, exact=False, teacher=(1.25, 0.06))]
    cells, problems = calibration_cells(document, records)
    assert problems[:3] == [
        "calibration evidence: a handoff entry is malformed: "
        "{'repetition': True, 'part': 'calibration', 'document': 'doc-a', 'prompt_tokens': 512}",
        "cell doc-b@512: sample 3 missing",
        "cell doc-c@512: handoff failed: producer failed: stalled",
    ]
    # A negative delta (in the maximum alone, or in the mean alone) is no drift at all.
    assert len(problems) == 5
    assert problems[3].startswith("cell doc-d@512: sample 5 ") and problems[4].startswith("cell doc-e@512: sample 6 ")
    assert cell_table(cells) == [
        {"document": "doc-a", "prompt_tokens": 1024, "max_abs": 1.0, "mean_abs": 0.05, "tokens_exact": True},
        {"document": "doc-b", "prompt_tokens": 1024, "max_abs": 1.25, "mean_abs": 0.06, "tokens_exact": False},
    ]


def test_a_malformed_entry_is_quoted_to_120_characters() -> None:
    entry = {"repetition": "1", "document": "d" * 200, "prompt_tokens": 1024, "part": CALIBRATION_PART}
    _, problems = calibration_cells({"handoffs": [entry]}, [record(1, 1.0, 0.05)])
    quoted = "{'repetition': '1', 'document': '" + "d" * 87
    assert len(quoted) == 120
    assert problems == [f"calibration evidence: a handoff entry is malformed: {quoted}"]


def test_an_empty_handoff_list_is_named_as_missing() -> None:
    assert calibration_cells({"handoffs": []}, [record(1, 1.0, 0.05)]) == ([], [HANDOFFS_MISSING])


def test_zero_drift_everywhere_adds_no_spread() -> None:
    cells = [CellDrift(1, "doc-a", 1024, 0.0, 0.0, True), CellDrift(2, "doc-b", 1024, 0.0, 0.0, True)]
    bounds = derive_bounds(cells)
    assert bounds is not None
    assert (bounds.maximum_absolute, bounds.max_abs_spread) == (ZERO_DRIFT_BOUND, 0.0)
    assert (bounds.maximum_mean_absolute, bounds.mean_abs_spread) == (ZERO_DRIFT_BOUND, 0.0)


# --------------------------------------------------------------------------- sealed numbers against their basis


def test_rung3_names_a_cell_drifting_in_its_maximum_only_and_one_drifting_in_its_mean_only() -> None:
    document, records = calibrated([0.25, 0.0, 0.0], [0.0, 0.01, 0.0])
    drifted = "rung 3 is bit-exact but calibration cells drifted: doc-a@1024, doc-a@1792"
    assert bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None,
                          acceptance_floor=None) == [drifted]
    # A None maximum alone still declares the bit-exact rule for it: the drift is refused.
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None
    assert drifted in bound_problems(document, records, maximum_absolute=None,
                                     maximum_mean_absolute=bounds.maximum_mean_absolute, acceptance_floor=None)


def test_a_mean_bound_one_ulp_off_and_a_floor_without_draft_counts_are_each_named() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    bounds = derive_bounds(calibration_cells(document, records)[0])
    assert bounds is not None
    relaxed = math.nextafter(bounds.maximum_mean_absolute, math.inf)
    assert bound_problems(document, records, maximum_absolute=bounds.maximum_absolute, maximum_mean_absolute=relaxed,
                          acceptance_floor=0.5) == [
        f"maximum_mean_absolute: sealed {relaxed!r}, the basis gives {bounds.maximum_mean_absolute!r} by rule {BOUND_RULE}",
        "acceptance floor: the basis anchor recorded no draft counts",
    ]


def test_a_long_stated_rule_is_quoted_to_120_characters() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    document["rule"] = {"name": BOUND_RULE, "statement": "s" * 200}
    prefix = f"{{'name': '{BOUND_RULE}', 'statement': '"
    quoted = prefix + "s" * (120 - len(prefix))
    assert bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None,
                          acceptance_floor=None)[0] == f"calibration evidence: rule: found {quoted}, expected {BOUND_RULE} as stated"


def test_evidence_that_is_not_an_object_fails_in_words_never_an_exception() -> None:
    for broken in (None, [], ["handoffs"]):
        result = judged([record(1, 1.0, 0.05)], broken, restarts_minimum=0)  # type: ignore[arg-type]
        assert not result.verdict.passed
        assert check(result, "rule stated").detail == (
            f"calibration evidence: rule: found None, expected {BOUND_RULE} as stated")
        assert check(result, "calibration cells").detail == HANDOFFS_MISSING


# --------------------------------------------------------------------------- a calibration's checks


def test_a_clean_calibration_says_what_held_and_returns_its_bounds() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    result = judged(records, document)
    assert first_checks(result)[4:] == [
        ("anchor tokens exact", True, "the fixture's greedy tokens exact in every anchor handoff"),
        ("anchor reproduced", True, "every deterministic digest equal across 2 anchor handoffs"),
    ]
    assert result.bounds is not None and result.bounds == derive_bounds(result.cells)
    assert (result.proposed_maximum_absolute, result.bounds.maximum_absolute) == (1.75, 1.75)
    assert [c.tokens_exact for c in result.cells] == [True, True, True]
    assert result.acceptance_floor is None and "acceptance floor" not in result.verdict.headline


def test_diverged_anchors_fail_in_words_and_the_headline_gives_no_fixture_drift() -> None:
    document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    records[3:] = [record(4, 0.5, 0.05, exact=False), record(5, 0.5, 0.05, exact=False)]
    result = judged(records, document)
    diverged = "the fixture's greedy tokens diverged in an anchor handoff: no rule can qualify this lane on it"
    assert said(result, "anchor tokens exact") == ("anchor tokens exact", False, diverged)
    assert result.verdict.reasons == [diverged]
    bounds = derive_bounds(result.cells)
    assert bounds is not None
    # Neither anchor has a teacher-forced drift, so the headline says nothing of the fixture's.
    assert result.verdict.headline == (
        f"calibration of lane-x: 3 cells over 2 documents, 2 fixture anchors, 4 producer restarts; rule {BOUND_RULE} "
        f"gives maximum_absolute 1.75, maximum_mean_absolute {bounds.maximum_mean_absolute!r}")


def test_anchors_that_differ_name_every_digest_that_differs() -> None:
    document, records = calibrated([1.0, 1.5], [0.05, 0.07])
    records[-1]["payload_sha256"] = "f" * 64
    records[-1]["seams_sha256"] = "f" * 64
    result = judged(records, document)
    differ = ("the anchors differ (or fewer than 2): anchor: payload tree digest differs among its own samples; "
              "anchor: per-layer seams digest differs among its own samples")
    assert said(result, "anchor reproduced") == ("anchor reproduced", False, differ)
    assert result.verdict.reasons == [differ]


def test_a_failed_anchor_handoff_is_left_out_of_the_anchors() -> None:
    document = evidence(CELLS + ANCHORS + [(ANCHOR_PART, "python-textwrap", 2048)])
    records = [record(1, 1.0, 0.05), record(2, 1.5, 0.07), record(3, 1.25, 0.06), record(4, 0.5, 0.05),
               record(5, 0.5, 0.05), {"repetition": 6, "error": "producer failed: stalled"}]
    result = judged(records, document)
    assert first_checks(result) == [
        ("handoffs", False, "1 of 6 handoffs failed"),
        ("producer restarts", True, "5 producer restarts (at least 2)"),
        ("rule stated", True, f"rule {BOUND_RULE}"),
        ("calibration cells", True, "3 cells measured"),
        ("anchor tokens exact", True, "the fixture's greedy tokens exact in every anchor handoff"),
        ("anchor reproduced", True, "every deterministic digest equal across 2 anchor handoffs"),
    ]
    assert result.verdict.reasons == ["handoff failed: producer failed: stalled"]
    assert "2 fixture anchors" in result.verdict.headline


def test_cell_problems_are_joined_in_the_detail_and_each_is_its_own_reason() -> None:
    document = evidence([(CALIBRATION_PART, "doc-a", 512), (CALIBRATION_PART, "doc-b", 512), *CELLS[:2], *ANCHORS])
    records = [{"repetition": 2, "error": "boom"}, record(3, 1.0, 0.05), record(4, 1.5, 0.07),
               record(5, 0.5, 0.05), record(6, 0.5, 0.05)]
    result = judged(records, document)
    missing, failed = "cell doc-a@512: sample 1 missing", "cell doc-b@512: handoff failed: boom"
    assert said(result, "calibration cells") == ("calibration cells", False, f"{missing}; {failed}")
    assert result.verdict.reasons == ["handoff failed: boom", missing, failed]


def test_rung3_names_every_drifting_cell_in_the_check() -> None:
    document, records = calibrated([0.25, 0.0, 0.0], [0.0, 0.01, 0.0], anchor=(0.0, 0.0))
    result = judged(records, document, rung=3)
    drifted = "rung 3 needs bit-exact handoffs; drifted: doc-a@1024, doc-a@1792"
    assert said(result, "bit-exact cells") == ("bit-exact cells", False, drifted)
    assert result.verdict.reasons == [drifted]


# --------------------------------------------------------------------------- a lane with a draft


def drafted(draft: dict[str, int] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    document = evidence(CELLS + ANCHORS, draft=draft)
    records = [record(index, *drift, **DRAFT_DIGESTS)
               for index, drift in enumerate([(1.0, 0.05), (1.5, 0.07), (1.25, 0.06), (0.5, 0.05), (0.5, 0.05)], start=1)]
    return document, records


def test_a_draft_calibration_states_the_anchor_counts_and_the_floor_they_give() -> None:
    document, records = drafted({"proposed": 255, "accepted": 225})
    result = judged(records, document, draft=True)
    assert result.verdict.passed
    assert said(result, "draft counts") == ("draft counts", True, "anchor draft acceptance 225/255")
    floor = derive_acceptance_floor(255, 225)
    assert 0.84 < floor < 225 / 255
    assert result.acceptance_floor == floor
    assert f"; acceptance floor {floor!r} by {FLOOR_RULE}; the fixture's own drift" in result.verdict.headline


def test_a_draft_calibration_whose_anchor_recorded_no_counts_fails_in_words() -> None:
    document, records = drafted(None)
    result = judged(records, document, draft=True)
    assert said(result, "draft counts") == ("draft counts", False, "the anchor recorded no draft counts")
    assert result.verdict.reasons == ["the anchor recorded no draft counts"]
    assert result.acceptance_floor is None and "acceptance floor" not in result.verdict.headline


def test_a_lane_without_a_draft_derives_no_floor_even_when_the_anchor_recorded_counts() -> None:
    document, records = drafted({"proposed": 255, "accepted": 225})
    result = judged(records, document, draft=False)
    assert result.verdict.passed and result.acceptance_floor is None
    assert "draft counts" not in [c.name for c in result.verdict.checks]
    assert "acceptance floor" not in result.verdict.headline


# --------------------------------------------------------------------------- parity words


def test_a_split_one_ulp_inside_the_spread_prints_split_bound_and_gap_in_full() -> None:
    judgement = judge_parity(cell("a-lane", CELL_A), cell("b-lane", shifted(CELL_B, -1)))
    assert judgement.outcome == "parity"
    # At four digits the split and the bound would both read 16.67 %: printed in full, the split is
    # visibly inside the bound.
    assert judgement.words == (
        "parity: a-lane 10 tokens/s (CV 10 %) and b-lane 12 tokens/s (CV 8.333 %), 3 interleaved runs each of "
        "decode 256 tokens; split -16.666666666666654 % of b-lane is inside the cells' spread (16.666666666666668 %; "
        "gap 1.9999999999999982 <= summed sd 2.0 tokens/s); neither lane is ahead")


def test_a_lead_one_ulp_outside_the_spread_prints_lead_and_spread_in_full() -> None:
    judgement = judge_parity(cell("a-lane", CELL_A), cell("b-lane", shifted(CELL_B, 1)))
    assert judgement.outcome == "b-ahead"
    assert judgement.words == (
        "b-lane ahead of a-lane by 20.000000000000018 % (outside both cells' CV: b-lane CV 8.333 %, a-lane CV 10 %, "
        "spread 20.0 % of a-lane; gap 2.0000000000000018 > summed sd 2.0 tokens/s): b-lane 12 tokens/s vs "
        "a-lane 10 tokens/s, 3 interleaved runs each of decode 256 tokens")


def test_rates_are_printed_to_six_significant_digits_and_percentages_to_four() -> None:
    judgement = judge_parity(p13_cell("native-nvfp4", 35.490711722, 0.00130), p13_cell("kquant", 35.439527527, 0.00037))
    assert judgement.words == (
        "parity: native-nvfp4 35.4907 tokens/s (CV 0.13 %) and kquant 35.4395 tokens/s (CV 0.037 %), 3 interleaved "
        "runs each of decode 256 tokens; split +0.1444 % of kquant is inside the cells' spread (0.1672 %; "
        "gap 0.0511842 <= summed sd 0.0592506 tokens/s); neither lane is ahead")


def test_a_refusal_lists_every_problem_separated_by_semicolons() -> None:
    judgement = judge_parity(cell("a", [10.0, 10.0]), cell("b", [True, 3.0]))
    assert judgement.words == (
        "refused: no parity judgement from these cells: cell A ('a') has no spread: all 2 measurements are 10.0, "
        "expected measured noise to bound a split; cell B ('b') measurement 1 is True, expected a number (not a bool)")
