"""The words a controls judgement shows: each defect of a criteria document or a controls record named
in full (where, what was found, what was expected), what a refused judgement still carries, and the
JSON a receipt carries for a judged lane, key by key."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from qualify.core.digests import jcs_sha256
from qualify.judge import judge_controls
from tests.unit.judge.test_controls_judge import CRITERIA, LANE, NAMES, SOURCE, WINDOW, WINDOWS, _set, record_for, uniform

CRITERIA_SHA256 = jcs_sha256(CRITERIA)
NAME_PATTERN = "^[a-z0-9][a-z0-9_-]{0,63}$"
WITHIN_WORDS = "a document is within the E1 gates when none of its four cells exceeds"
TOKENS = {document["name"]: document["token_sha256"] for document in CRITERIA["documents"]}
TOP_TOKENS = {"reference": "a" * 64, "lane": "b" * 64, "yardstick": "c" * 64}


def criteria_with(**fields: Any) -> dict[str, Any]:
    criteria = copy.deepcopy(CRITERIA)
    criteria.update(fields)
    return criteria


def problems_for(criteria: Any) -> tuple[str, ...]:
    """The problems of judging a well-formed record against ``criteria`` (the record names them)."""
    record = record_for(uniform(1, 10))
    if isinstance(criteria, dict):
        try:
            record["criteria"]["sha256"] = jcs_sha256(criteria)
        except (TypeError, ValueError):
            pass   # criteria with no digest: the criteria themselves are at fault
    judgement = judge_controls(record, criteria, source=SOURCE)
    assert judgement.outcome is None and judgement.documents == () and judgement.length_effect is None
    return judgement.problems


def zero_record(criteria: dict[str, Any]) -> dict[str, Any]:
    """A well-formed record with no disagreeing row, for criteria of any lengths and profile window."""
    window, longest = criteria["profile_window"], criteria["lengths"][-1]
    documents = [{"document": entry["name"], "token_sha256": entry["token_sha256"], "rows": longest,
                  "cells": [{"length": length, "rows": length, "lane_disagreeing": 0, "yardstick_disagreeing": 0}
                            for length in criteria["lengths"]],
                  "profile": [{"start": start, "stop": start + window, "lane_disagreeing": 0, "yardstick_disagreeing": 0}
                              for start in range(0, longest, window)],
                  "top_tokens_sha256": dict(TOP_TOKENS)} for entry in criteria["documents"]]
    return {"schema": "trust-ladder.controls-record.v1", "criteria": {"name": criteria["name"], "sha256": jcs_sha256(criteria)},
            "lane": LANE, "yardstick": {"name": criteria["yardstick"]["name"], "sha256": criteria["yardstick"]["sha256"]},
            "documents": documents, "seconds": {"prefill": 1.0, "scoring": 1.0}}


# --- criteria: each defect in full words --------------------------------------------------------------


SHLEX = CRITERIA["documents"][0]
CRITERIA_WORDS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("another schema", {"schema": "trust-ladder.e2-controls-criteria.v0"},
     ('criteria.schema: found "trust-ladder.e2-controls-criteria.v0", expected trust-ladder.e2-controls-criteria.v1',)),
    ("a name that is not a name", {"name": "E2 Controls"},
     (f'criteria.name: found "E2 Controls", expected a name ({NAME_PATTERN})',)),
    ("documents not a list", {"documents": "python-test-shlex"},
     ('criteria.documents: found "python-test-shlex", expected a list',
      "criteria.documents: found none, expected the control documents")),
    # A named document without a usable digest is not a control document: none is left.
    ("the only document without a digest", {"documents": [{"name": "python-test-shlex", "token_sha256": "nope"}]},
     ('criteria.documents[0].token_sha256: found "nope", expected a SHA-256 (64 lowercase hex)',
      "criteria.documents: found none, expected the control documents")),
    ("the only document with a bad name", {"documents": [{"name": "Shlex", "token_sha256": SHLEX["token_sha256"]}]},
     (f'criteria.documents[0].name: found "Shlex", expected a name ({NAME_PATTERN})',
      "criteria.documents: found none, expected the control documents")),
    ("a document twice", {"documents": [SHLEX, SHLEX]},
     ('criteria.documents[1].name: found "python-test-shlex" twice, expected each document once',)),
    ("a length of zero", {"lengths": [0, 512, 2048, 4096]},
     ("criteria.lengths: found [0, 512, 2048, 4096], expected positive whole lengths, strictly increasing",)),
    ("no lengths", {"lengths": []},
     ("criteria.lengths: found [], expected positive whole lengths, strictly increasing",)),
    ("a lane that is no name", {"lanes": ["ok", 7]},
     ('criteria.lanes: found ["ok", 7], expected the lane names the controls apply to',)),
    ("a criterion that is no text", {"criteria": {"length_effect_supported": ["x"], "document_within": WITHIN_WORDS}},
     ("criteria.criteria.length_effect_supported: found [\"x\"], expected a criterion this judge evaluates: "
      "'every control document exceeds its gate at 2048 and at 4096 and stays within it at 512'",)),
    ("a length twice", {"lengths": [512, 512, 2048, 4096]},
     ("criteria.lengths: found [512, 512, 2048, 4096], expected positive whole lengths, strictly increasing",)),
    ("a length not a whole number of windows", {"lengths": [512, 1000, 2048, 4096]},
     ("criteria.lengths: found [512, 1000, 2048, 4096], expected multiples of profile_window 512",)),
    ("a profile window of zero", {"profile_window": 0},
     ("criteria.profile_window: found 0, expected a positive whole number of rows",)),
    ("a profile window that is a bool", {"profile_window": True},
     ("criteria.profile_window: found true, expected a positive whole number of rows",)),
    ("a yardstick digest that is not one", {"yardstick": {"name": "kquant-q8_0", "sha256": "nope"}},
     ('criteria.yardstick.sha256: found "nope", expected a SHA-256',)),
    ("a gate rule the judge does not compute", {"gate": {**CRITERIA["gate"], "rule": "wilson-lower-plus-points"}},
     ('criteria.gate.rule: found "wilson-lower-plus-points", expected a rule this judge computes: '
      "wilson-upper-plus-points",)),
    ("confidence of zero", {"gate": {**CRITERIA["gate"], "confidence": 0.0}},
     ("criteria.gate.confidence: found 0.0, expected a number in (0, 1)",)),
    ("points of one", {"gate": {**CRITERIA["gate"], "points": 1.0}},
     ("criteria.gate.points: found 1.0, expected a number in [0, 1)",)),
    ("another exceedance wording", {"exceedance": "a cell whose lane disagreement is at least its gate"},
     ('criteria.exceedance: found "a cell whose lane disagreement is at least its gate", expected the definition '
      "this judge implements: 'a cell whose lane disagreement (disagreeing rows / L) is strictly greater than its gate'",)),
    ("another length-effect wording",
     {"criteria": {**CRITERIA["criteria"], "length_effect_supported": "every control document exceeds at 4096"}},
     ('criteria.criteria.length_effect_supported: found "every control document exceeds at 4096", expected a criterion '
      "this judge evaluates: 'every control document exceeds its gate at 2048 and at 4096 and stays within it at 512'",)),
    ("a length the criterion names is missing", {"lengths": [512, 1024, 2048, 3072]},
     ("criteria.criteria.length_effect_supported: names lengths [512, 2048, 4096], not all in criteria.lengths "
      "[512, 1024, 2048, 3072]",)),
    # Exactly the criterion's three lengths is enough for the criterion; only "four cells" is broken.
    ("three lengths", {"lengths": [512, 2048, 4096]},
     (f'criteria.criteria.document_within: found "{WITHIN_WORDS}" over 3 lengths, expected {WITHIN_WORDS!r} '
      "over four lengths",)),
    ("another document-within wording", {"criteria": {**CRITERIA["criteria"], "document_within": "no cell exceeds"}},
     (f'criteria.criteria.document_within: found "no cell exceeds" over 4 lengths, expected {WITHIN_WORDS!r} '
      "over four lengths",)),
    ("a value with no JSON form", {"note": math.nan},
     ("criteria: has no RFC 8785 form, expected a JSON document",)),
]


@pytest.mark.parametrize("fields, expected", [(f, e) for _, f, e in CRITERIA_WORDS],
                         ids=[name for name, _, _ in CRITERIA_WORDS])
def test_each_criteria_defect_is_named_in_full_words(fields: dict[str, Any], expected: tuple[str, ...]):
    assert problems_for(criteria_with(**fields)) == expected


@pytest.mark.parametrize("fields, expected", [
    ({"lengths": "512"}, 'criteria.lengths: found "512", expected a list'),
    ({"lanes": 5}, "criteria.lanes: found 5, expected a list"),
])
def test_a_criteria_list_that_is_not_a_list_is_named_with_what_was_found(fields: dict[str, Any], expected: str):
    assert expected in problems_for(criteria_with(**fields))


def test_a_criteria_document_that_is_not_an_object_is_named_not_raised():
    problems = problems_for(criteria_with(documents=["python-test-shlex"]))
    assert problems[-1] == "criteria.documents: found none, expected the control documents"
    assert {problem.split(":")[0] for problem in problems[:-1]} == \
        {"criteria.documents[0].name", "criteria.documents[0].token_sha256"}


def test_criteria_that_are_not_an_object_are_named_with_what_was_found():
    assert problems_for("e2-controls-v1") == \
        ('criteria: found "e2-controls-v1", expected the parsed criteria document',)


def test_a_profile_window_of_one_row_and_a_length_of_one_row_are_accepted():
    criteria = criteria_with(lengths=[1, 512, 2048, 4096], profile_window=1)
    judgement = judge_controls(zero_record(criteria), criteria, source=SOURCE)
    assert judgement.problems == ()
    assert [cell.length for cell in judgement.documents[0].cells] == [1, 512, 2048, 4096]
    assert len(judgement.documents[0].profile) == 4096 and judgement.documents[0].within


def test_criteria_that_cannot_be_read_leave_a_judgement_with_the_record_lane_and_source_only():
    record = record_for(uniform(1, 10))
    judgement = judge_controls(record, criteria_with(name="E2 Controls"), source=SOURCE)
    assert judgement.document() == {
        "criteria": {"name": "", "sha256": ""}, "lane": LANE, "yardstick": "", "source": SOURCE,
        "gate": {"confidence": None, "points": None}, "length_effect": None,
        "problems": [f'criteria.name: found "E2 Controls", expected a name ({NAME_PATTERN})'], "documents": []}
    assert judgement.outcome is None


# --- the record's header: each defect in full words ----------------------------------------------------


def test_every_header_defect_is_named_with_what_was_found_and_what_was_expected():
    record = record_for(uniform(1, 10))
    record.update(schema="trust-ladder.controls-record.v2", criteria={"name": "e2-controls-v2", "sha256": "0" * 64},
                  lane="kquant-native", yardstick={"name": "kquant-q6_k", "sha256": "f" * 64}, seconds=5, verdict="pass")
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.problems == (
        'record."verdict": found an unexpected field, expected only schema, criteria, lane, yardstick, documents, seconds',
        'record.schema: found "trust-ladder.controls-record.v2", expected trust-ladder.controls-record.v1',
        'record.criteria.name: found "e2-controls-v2", expected e2-controls-v1',
        f'record.criteria.sha256: found "{"0" * 64}", expected the criteria\'s {CRITERIA_SHA256}',
        'record.lane: found "kquant-native", expected one of the criteria\'s lanes '
        "nvfp4-native-w4a4, nvfp4-native-f16, nvfp4-native-splitk",
        'record.yardstick.name: found "kquant-q6_k", expected kquant-q8_0',
        f'record.yardstick.sha256: found "{"f" * 64}", expected the criteria\'s {CRITERIA["yardstick"]["sha256"]}',
        "record.seconds: found 5, expected an object with prefill, scoring",
    )
    # Refused, yet the judgement still says which criteria, lane, yardstick and gate it was judged under.
    assert (judgement.criteria, judgement.criteria_sha256, judgement.lane, judgement.yardstick, judgement.source,
            judgement.confidence, judgement.points) == \
        ("e2-controls-v1", CRITERIA_SHA256, "kquant-native", "kquant-q8_0", SOURCE, 0.95, 0.02)
    assert judgement.outcome is None and judgement.documents == ()


def test_a_record_without_documents_is_named_once_and_never_read():
    record = record_for(uniform(1, 10))
    del record["documents"]
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.problems == ("record.documents: missing, expected this field",)
    assert judgement.outcome is None and judgement.documents == ()


def test_documents_not_a_list_and_bad_seconds_are_named():
    record = record_for(uniform(1, 10))
    record["documents"], record["seconds"] = "none", {"prefill": -1, "scoring": "3"}
    assert judge_controls(record, CRITERIA, source=SOURCE).problems == (
        "record.seconds.prefill: found -1, expected a finite number >= 0",
        'record.seconds.scoring: found "3", expected a finite number >= 0',
        'record.documents: found "none", expected a list',
        *(f"record.documents: no document {name}, expected every control document of e2-controls-v1" for name in NAMES),
    )


@pytest.mark.parametrize("seconds", [{"prefill": 0, "scoring": 0.5}, {"prefill": 0.0, "scoring": 0}])
def test_timings_of_zero_and_under_one_second_are_accepted(seconds: dict[str, float]):
    record = record_for(uniform(1, 10))
    record["seconds"] = seconds
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.problems == () and judgement.outcome is not None


def test_a_source_that_is_not_a_receipt_is_named_with_what_was_found():
    judgement = judge_controls(record_for(uniform(1, 10)), CRITERIA, source="controls.json")
    assert judgement.problems == ('source: found "controls.json", expected the measuring receipt (receipt://...)',)
    assert judgement.source == "controls.json" and judgement.lane == LANE


@pytest.mark.parametrize("record, found", [("record", '"record"'), (7, "7")])
def test_a_record_that_is_not_an_object_keeps_the_criteria_and_no_lane(record: Any, found: str):
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.problems == (f"record: found {found}, expected a trust-ladder.controls-record.v1 object",)
    assert (judgement.criteria, judgement.criteria_sha256, judgement.lane, judgement.yardstick, judgement.source,
            judgement.confidence, judgement.points) == \
        ("e2-controls-v1", CRITERIA_SHA256, "", "kquant-q8_0", SOURCE, 0.95, 0.02)


def test_a_lane_that_is_not_a_string_is_named_and_not_carried():
    record = record_for(uniform(1, 10))
    record["lane"] = 5
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.problems == ("record.lane: found 5, expected one of the criteria's lanes "
                                  "nvfp4-native-w4a4, nvfp4-native-f16, nvfp4-native-splitk",)
    assert judgement.lane == ""


# --- documents, cells and profiles: each defect in full words -------------------------------------------


def test_every_cell_and_profile_defect_is_named_not_only_the_first():
    record = record_for(uniform(1, 10))
    shlex = record["documents"][0]
    cells = shlex["cells"]
    shlex["cells"] = ["cell", cells[0], {**cells[1], "length": 1000}, cells[0], {**cells[1], "rows": 1023}, cells[2], cells[3]]
    shlex["token_sha256"] = "e" * 64
    shlex["top_tokens_sha256"]["lane"] = "XYZ"
    profile = record["documents"][1]["profile"]
    profile[0] = 5
    profile[2]["stop"] = 2000
    profile[3]["start"] = 0
    profile[4]["lane_disagreeing"] = 513
    profile[5]["yardstick_disagreeing"] = 513
    profile[6]["lane_disagreeing"] = 600
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    first, second = "record.documents[0]", "record.documents[1]"
    assert judgement.problems == (
        f'{first}.token_sha256: found "{"e" * 64}", the criteria\'s python-test-shlex is {TOKENS["python-test-shlex"]}',
        f'{first}.cells[0]: found "cell", expected an object with length, rows, lane_disagreeing, yardstick_disagreeing',
        f"{first}.cells[2].length: found 1000, expected one of the criteria's lengths [512, 1024, 2048, 4096]",
        f"{first}.cells[3].length: found 512 twice, expected each length once",
        f"{first}.cells[4].rows: found 1023, expected L = 1024",
        f'{first}.top_tokens_sha256.lane: found "XYZ", expected a SHA-256',
        f"{second}.profile[0]: found 5, expected an object with start, stop, lane_disagreeing, yardstick_disagreeing",
        f"{second}.profile[2]: found rows 1024..2000, expected 1024..1536",
        f"{second}.profile[3]: found rows 0..2048, expected 1536..2048",
        # Windows past the first are bounded by their own 512 rows, not by where they end.
        f"{second}.profile[4].lane_disagreeing: found 513, expected a whole count in 0..512",
        f"{second}.profile[5].yardstick_disagreeing: found 513, expected a whole count in 0..512",
        f"{second}.profile[6].lane_disagreeing: found 600, expected a whole count in 0..512",
    )
    assert judgement.lane == LANE and (judgement.confidence, judgement.points) == (0.95, 0.02)


def test_counts_that_do_not_nest_and_a_short_profile_are_named_with_both_sides():
    record = record_for(uniform(1, 10))
    record["documents"][0]["cells"][2]["lane_disagreeing"] = 5
    del record["documents"][1]["profile"][7]
    record["documents"][2]["cells"][0]["yardstick_disagreeing"] = 513
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.problems == (
        "record.documents[0].cells: length 2048 counts (lane 5, yardstick 40) differ from the profile's sums "
        "over rows 0..2048 (lane 4, yardstick 40)",
        "record.documents[1].profile: found 7 windows, expected 8 of 512 rows",
        "record.documents[2].cells[0].yardstick_disagreeing: found 513, expected a whole count in 0..512",
    )
    assert (judgement.criteria, judgement.lane, judgement.source) == ("e2-controls-v1", LANE, SOURCE)


def test_every_unknown_and_every_repeated_document_is_named():
    record = record_for(uniform(1, 10))
    shlex, news = copy.deepcopy(record["documents"][0]), copy.deepcopy(record["documents"][1])
    record["documents"] = [{"document": "python-textwrap"}, {"document": 3}, *record["documents"], shlex, news]
    assert judge_controls(record, CRITERIA, source=SOURCE).problems == (
        'record.documents[0].document: found "python-textwrap", expected one of the criteria\'s documents '
        "python-test-shlex, prose-idle-news, config-idle-keys",
        "record.documents[1].document: found 3, expected one of the criteria's documents "
        "python-test-shlex, prose-idle-news, config-idle-keys",
        "record.documents[5].document: found python-test-shlex twice, expected each document once",
        "record.documents[6].document: found prose-idle-news twice, expected each document once",
    )


def test_a_window_that_is_not_an_object_does_not_stop_the_later_windows_being_checked():
    record = record_for(uniform(1, 10))
    _set("documents/2/profile/1", [])(record)
    record["documents"][2]["profile"][3]["stop"] = 1536
    assert judge_controls(record, CRITERIA, source=SOURCE).problems == (
        "record.documents[2].profile[1]: found [], expected an object with start, stop, lane_disagreeing, "
        "yardstick_disagreeing",
        "record.documents[2].profile[3]: found rows 1536..1536, expected 1536..2048",
    )


# --- what a receipt carries for a judged lane ------------------------------------------------------------


def test_the_receipt_document_carries_every_cell_window_and_digest_under_its_name():
    counts = uniform(1, 10)
    counts["prose-idle-news"] = [(0, 0)] * 3 + [(WINDOW, 0)] + [(0, 0)] * 4   # rows 1536..2048 all disagree
    counts["config-idle-keys"] = [(0, 0)] * WINDOWS
    judgement = judge_controls(record_for(counts), CRITERIA, source=SOURCE, lane=LANE)
    carried = judgement.document()
    assert {key: value for key, value in carried.items() if key != "documents"} == {
        "criteria": {"name": "e2-controls-v1", "sha256": CRITERIA_SHA256}, "lane": LANE, "yardstick": "kquant-q8_0",
        "source": SOURCE, "gate": {"confidence": 0.95, "points": 0.02}, "length_effect": "rejected", "problems": []}
    lane_rates = {"python-test-shlex": [1 / 512] * 4, "prose-idle-news": [0.0, 0.0, 0.25, 0.125],
                  "config-idle-keys": [0.0] * 4}
    exceeding = {"python-test-shlex": [], "prose-idle-news": [2048, 4096], "config-idle-keys": []}
    assert [document["document"] for document in carried["documents"]] == NAMES
    for document, judged in zip(carried["documents"], judgement.documents, strict=True):
        name = document["document"]
        assert document["token_sha256"] == TOKENS[name] and document["rows"] == 4096
        assert document["top_tokens_sha256"] == TOP_TOKENS
        assert document["within"] is (not exceeding[name])
        assert document["exceeding_lengths"] == exceeding[name]
        assert document["within_lengths"] == [length for length in (512, 1024, 2048, 4096) if length not in exceeding[name]]
        assert document["cells"] == [
            {"length": length, "rows": length,
             "yardstick_disagreeing": sum(yardstick for _, yardstick in counts[name][:length // WINDOW]),
             "yardstick_upper": cell.yardstick_upper, "gate": cell.gate,
             "lane_disagreeing": sum(lane for lane, _ in counts[name][:length // WINDOW]),
             "lane_rate": rate, "exceeds": length in exceeding[name]}
            for length, rate, cell in zip((512, 1024, 2048, 4096), lane_rates[name], judged.cells, strict=True)]
        assert document["profile"] == [
            {"start": index * WINDOW, "stop": (index + 1) * WINDOW, "lane_disagreeing": lane, "yardstick_disagreeing": yardstick}
            for index, (lane, yardstick) in enumerate(counts[name])]
    assert judgement.documents[0].top_tokens_sha256 == TOP_TOKENS


@pytest.mark.parametrize(("field", "value", "words"), [
    ("lanes", 5, "criteria.lanes: found 5, expected a list"),
    ("lengths", "y", 'criteria.lengths: found "y", expected a list'),
])
def test_a_criteria_list_that_is_no_list_is_named_once_as_what_it_is(field: str, value: object, words: str) -> None:
    criteria = copy.deepcopy(CRITERIA)
    criteria[field] = value
    problems = judge_controls(record_for(uniform(1, 10)), criteria, source=SOURCE).problems
    assert [problem for problem in problems if problem.startswith(f"criteria.{field}:")] == [words]


def test_a_record_without_its_lane_is_named_once_even_when_a_lane_is_judged() -> None:
    record = record_for(uniform(1, 10))
    del record["lane"]
    problems = judge_controls(record, CRITERIA, source=SOURCE, lane=LANE).problems
    assert [problem for problem in problems if problem.startswith("record.lane")] == ["record.lane: missing, expected this field"]


def test_an_outcome_the_scope_refuses_is_the_judgements_one_problem_never_raised(monkeypatch):
    from qualify.judge import controls as controls_module

    record = record_for(uniform(1, 10))
    judged = judge_controls(record, CRITERIA, source=SOURCE)
    assert judged.outcome is not None and judged.problems == ()

    def refuse(**_fields: Any) -> None:
        raise ValueError("documents out\nof order")

    monkeypatch.setattr(controls_module, "ControlsOutcome", refuse)
    refused = judge_controls(record, CRITERIA, source=SOURCE)
    assert refused.problems == ("documents out of order",) and refused.outcome is None
    assert (refused.criteria, refused.criteria_sha256, refused.lane, refused.source) == (
        judged.criteria, judged.criteria_sha256, LANE, SOURCE)
