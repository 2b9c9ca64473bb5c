"""Judging a lane's E2 controls against their E1 gates: exact gates at the boundary, the
preregistered length-effect criterion word for word, and every defect of a record or criteria
named, with no table and no outcome (fail closed)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.contract.controls import check_controls_record
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.digests import jcs_sha256
from qualify.core.errors import Refused
from qualify.core.stats import wilson_interval
from qualify.judge import judge_controls
from qualify.judge.controls import cell_gate, exceeds_gate
from qualify.judge.scope import controls_words
from tests.support.fuzz_budget import fuzz_examples

CRITERIA: dict[str, Any] = json.loads((CONTRACTS_DIR / "e2-controls-v1.json").read_text(encoding="utf-8"))
LENGTHS: list[int] = CRITERIA["lengths"]
WINDOW: int = CRITERIA["profile_window"]
WINDOWS = LENGTHS[-1] // WINDOW
NAMES = [document["name"] for document in CRITERIA["documents"]]
SOURCE = "receipt://controls-20261201/controls.json"
LANE = "nvfp4-native-w4a4"

Windows = list[tuple[int, int]]
"""(lane, yardstick) disagreeing rows per profile window of one document."""


def record_for(windows: dict[str, Windows], criteria: dict[str, Any] = CRITERIA) -> dict[str, Any]:
    """A well-formed record whose cells are the sums of its profile windows (the cells nest)."""
    documents = []
    for entry in criteria["documents"]:
        counts = windows[entry["name"]]
        profile = [{"start": index * WINDOW, "stop": (index + 1) * WINDOW, "lane_disagreeing": lane,
                    "yardstick_disagreeing": yardstick} for index, (lane, yardstick) in enumerate(counts)]
        cells = [{"length": length, "rows": length,
                  "lane_disagreeing": sum(lane for lane, _ in counts[:length // WINDOW]),
                  "yardstick_disagreeing": sum(yardstick for _, yardstick in counts[:length // WINDOW])}
                 for length in criteria["lengths"]]
        documents.append({"document": entry["name"], "token_sha256": entry["token_sha256"], "rows": LENGTHS[-1],
                          "cells": cells, "profile": profile,
                          "top_tokens_sha256": {"reference": "a" * 64, "lane": "b" * 64, "yardstick": "c" * 64}})
    return {"schema": "trust-ladder.controls-record.v1",
            "criteria": {"name": criteria["name"], "sha256": jcs_sha256(criteria)},
            "lane": LANE,
            "yardstick": {"name": criteria["yardstick"]["name"], "sha256": criteria["yardstick"]["sha256"]},
            "documents": documents,
            "seconds": {"prefill": 12.5, "scoring": 3.25}}


def uniform(lane: int, yardstick: int) -> dict[str, Windows]:
    return {name: [(lane, yardstick)] * WINDOWS for name in NAMES}


def judged_exceeding(counts: dict[str, Windows]) -> dict[str, tuple[int, ...]]:
    judgement = judge_controls(record_for(counts), CRITERIA, source=SOURCE)
    assert judgement.problems == () and judgement.outcome is not None
    return {document.document: document.exceeding_lengths for document in judgement.outcome.documents}


# --- a well-formed record -----------------------------------------------------------------------------


def test_a_well_formed_record_gives_every_cell_its_gate_and_an_outcome():
    judgement = judge_controls(record_for(uniform(lane=1, yardstick=10)), CRITERIA, source=SOURCE, lane=LANE)
    assert judgement.problems == ()
    assert judgement.lane == LANE and judgement.criteria_sha256 == jcs_sha256(CRITERIA)
    outcome = judgement.outcome
    assert outcome is not None
    assert (outcome.criteria, outcome.lengths, outcome.source) == ("e2-controls-v1", (512, 1024, 2048, 4096), SOURCE)
    assert [document.document for document in outcome.documents] == NAMES
    for document in judgement.documents:
        assert [cell.length for cell in document.cells] == LENGTHS
        assert len(document.profile) == WINDOWS and document.profile[-1].stop == LENGTHS[-1]
        for cell in document.cells:
            k = cell.length // WINDOW * 10
            upper = wilson_interval(k, cell.length, confidence=0.95, sides=2)[1]
            assert (cell.yardstick_disagreeing, cell.yardstick_upper, cell.gate) == (k, upper, upper + 0.02)
            assert cell.lane_rate == 1 / WINDOW and not cell.exceeds
    assert outcome.within == 3 and judgement.length_effect == "rejected"


def test_the_gate_is_the_wilson_score_upper_end_plus_points():
    # The Wilson upper end u is the root above the observed rate p of n (p - u)^2 = z^2 u (1 - u),
    # z the two-sided 95 % normal quantile: checked from that definition, not from the formula used.
    k, n, z = 10, 512, 1.959963984540054
    upper, gate = cell_gate(k, n, confidence=0.95, points=0.02)
    assert upper > k / n
    assert math.isclose(n * (k / n - upper) ** 2, z * z * upper * (1 - upper), rel_tol=1e-12)
    assert gate == upper + 0.02


def test_the_gate_reads_confidence_and_points_from_the_criteria():
    criteria = copy.deepcopy(CRITERIA)
    criteria["gate"]["confidence"], criteria["gate"]["points"] = 0.99, 0.05
    judgement = judge_controls(record_for(uniform(1, 10), criteria), criteria, source=SOURCE)
    cell = judgement.documents[0].cells[0]
    upper = wilson_interval(10, 512, confidence=0.99, sides=2)[1]
    assert (cell.yardstick_upper, cell.gate) == (upper, upper + 0.05)
    assert judgement.document()["gate"] == {"confidence": 0.99, "points": 0.05}


# --- the boundary: exactly at the gate is within, one ULP over exceeds ------------------------------


def criteria_with_gate(lane_disagreeing: int, target: float) -> dict[str, Any]:
    """Criteria whose points put the 512 cell's gate (yardstick 0 of 512) at exactly ``target``."""
    upper = wilson_interval(0, 512, confidence=0.95, sides=2)[1]
    points = target - upper
    for _ in range(64):  # walk points by ULPs until upper + points rounds to the target exactly
        if upper + points == target:
            break
        points = math.nextafter(points, math.inf if upper + points < target else -math.inf)
    assert upper + points == target
    criteria = copy.deepcopy(CRITERIA)
    criteria["gate"]["points"] = points
    return criteria


@pytest.mark.parametrize("gate, exceeds", [
    (Fraction(40, 512), False),                                   # rate exactly at the gate: within
    (math.nextafter(40 / 512, -math.inf), True),                   # the gate one ULP under the rate: exceeds
    (math.nextafter(40 / 512, math.inf), False),                   # one ULP above the rate: within
])
def test_a_rate_exactly_at_the_gate_is_within_and_one_ulp_over_exceeds(gate: float | Fraction, exceeds: bool):
    target = float(gate)
    criteria = criteria_with_gate(40, target)
    counts = {name: [(40, 0)] + [(0, 0)] * (WINDOWS - 1) for name in NAMES}
    judgement = judge_controls(record_for(counts, criteria), criteria, source=SOURCE)
    assert judgement.problems == ()
    cell = judgement.documents[0].cells[0]
    assert cell.gate == target and cell.lane_rate == 40 / 512
    assert cell.exceeds is exceeds
    assert (512 in judgement.documents[0].exceeding_lengths) is exceeds


def test_exceedance_is_exact_where_the_float_rate_would_round():
    # 1/3 as a float64 is below one third: the rate 1 of 3 is strictly greater than that gate,
    # though the rounded quotient 1 / 3 compares equal to it.
    assert 1 / 3 == float(1 / 3)
    assert exceeds_gate(1, 3, 1 / 3)
    assert not exceeds_gate(1, 3, math.nextafter(1 / 3, math.inf))
    assert not exceeds_gate(0, 512, 0.0) and exceeds_gate(1, 512, 0.0)


# --- the preregistered length-effect criterion ----------------------------------------------------


def test_the_length_effect_is_supported_only_when_every_document_exceeds_at_2048_and_4096_and_not_at_512():
    # Every window from 1024 on fully disagreeing: each document exceeds at 1024, 2048 and 4096,
    # within at 512.
    late = {name: [(0, 0)] + [(WINDOW, 0)] * (WINDOWS - 1) for name in NAMES}
    judgement = judge_controls(record_for(late), CRITERIA, source=SOURCE)
    assert {document.exceeding_lengths for document in judgement.documents} == {(1024, 2048, 4096)}
    assert judgement.length_effect == "supported"
    assert judgement.outcome is not None and judgement.outcome.within == 0


def test_the_length_effect_ignores_1024_which_the_criterion_does_not_name():
    # Exceeding at 2048 and 4096 only (the bursts start at 1536): 1024 is within, still supported.
    late = {name: [(0, 0)] * 3 + [(WINDOW, 0)] * (WINDOWS - 3) for name in NAMES}
    judgement = judge_controls(record_for(late), CRITERIA, source=SOURCE)
    assert {document.exceeding_lengths for document in judgement.documents} == {(2048, 4096)}
    assert judgement.length_effect == "supported"


@pytest.mark.parametrize("spoiler, exceeding", [
    ([(WINDOW, 0)] * WINDOWS, (512, 1024, 2048, 4096)),             # one document exceeds at 512 too
    ([(0, 0)] * 7 + [(WINDOW, 0)], (4096,)),                         # one document within at 2048
    ([(0, 0)] * WINDOWS, ()),                                        # one document within everywhere
])
def test_one_document_breaking_the_criterion_rejects_the_length_effect(spoiler: Windows, exceeding: tuple[int, ...]):
    counts = {name: [(0, 0)] + [(WINDOW, 0)] * (WINDOWS - 1) for name in NAMES}
    counts[NAMES[1]] = spoiler
    judgement = judge_controls(record_for(counts), CRITERIA, source=SOURCE)
    assert judgement.documents[1].exceeding_lengths == exceeding
    assert judgement.length_effect == "rejected"


def test_a_content_local_exceedance_is_published_in_the_scope_line():
    counts = uniform(0, 0)
    counts["prose-idle-news"] = [(0, 0)] * 3 + [(WINDOW, 0)] + [(0, 0)] * 4   # rows 1536..2048 only
    judgement = judge_controls(record_for(counts), CRITERIA, source=SOURCE)
    assert judgement.length_effect == "rejected"
    news = judgement.documents[1]
    assert news.exceeding_lengths == (2048, 4096) and news.within_lengths == (512, 1024)
    assert [window.lane_disagreeing for window in news.profile] == [0, 0, 0, WINDOW, 0, 0, 0, 0]
    assert judgement.outcome is not None
    words = controls_words(judgement.outcome)
    assert "2 of 3 documents within E1 gates" in words and "prose-idle-news exceeds at 2048–4096" in words
    carried = judgement.document()["documents"][1]
    assert carried["exceeding_lengths"] == [2048, 4096] and len(carried["profile"]) == WINDOWS


# --- the outcome's exceeding lengths are exactly the cells whose rate exceeds the gate -------------


window_counts = st.lists(st.tuples(st.integers(0, WINDOW), st.integers(0, WINDOW)), min_size=WINDOWS, max_size=WINDOWS)


@settings(max_examples=fuzz_examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({name: window_counts for name in NAMES}),
       st.sampled_from([0.0, 0.02, 0.05]), st.sampled_from([0.9, 0.95, 0.99]))
def test_exceeding_lengths_are_exactly_the_cells_whose_rate_exceeds_the_gate(
        counts: dict[str, Windows], points: float, confidence: float):
    criteria = copy.deepcopy(CRITERIA)
    criteria["gate"]["points"], criteria["gate"]["confidence"] = points, confidence
    judgement = judge_controls(record_for(counts, criteria), criteria, source=SOURCE)
    assert judgement.problems == () and judgement.outcome is not None
    every_document_supports = True
    for document, outcome in zip(judgement.documents, judgement.outcome.documents, strict=True):
        expected = []
        for length in LENGTHS:
            lane = sum(lane for lane, _ in counts[document.document][:length // WINDOW])
            yardstick = sum(yardstick for _, yardstick in counts[document.document][:length // WINDOW])
            gate = wilson_interval(yardstick, length, confidence=confidence, sides=2)[1] + points
            if Fraction(lane, length) > Fraction(gate):
                expected.append(length)
        assert outcome.exceeding_lengths == document.exceeding_lengths == tuple(expected)
        every_document_supports &= {2048, 4096} <= set(expected) and 512 not in expected
    assert judgement.length_effect == ("supported" if every_document_supports else "rejected")


# --- fail closed: every defect named, no table, no outcome -------------------------------------------


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Mutation:
    def mutate(record: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = record
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return mutate


def _delete(path: str) -> Mutation:
    def mutate(record: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = record
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        del target[int(last) if isinstance(target, list) else last]
    return mutate


RECORD_DEFECTS: list[tuple[str, Mutation, str]] = [
    ("wrong schema", _set("schema", "trust-ladder.controls-record.v2"), "record.schema: found"),
    ("another criteria digest", _set("criteria/sha256", "0" * 63 + "1"), "record.criteria.sha256: found"),
    ("another criteria name", _set("criteria/name", "e2-controls-v2"), "record.criteria.name: found"),
    ("a lane the criteria do not cover", _set("lane", "kquant-native"), "record.lane: found \"kquant-native\""),
    ("another yardstick", _set("yardstick/name", "kquant-q6_k"), "record.yardstick.name: found"),
    ("another yardstick file", _set("yardstick/sha256", "f" * 64), "record.yardstick.sha256: found"),
    ("a missing document", _delete("documents/2"), "record.documents: no document config-idle-keys"),
    ("an unknown document", _set("documents/2/document", "python-textwrap"), "record.documents[2].document: found"),
    ("another document's tokens", _set("documents/0/token_sha256", "e" * 64), "record.documents[0].token_sha256"),
    ("a short pass", _set("documents/0/rows", 2048), "record.documents[0].rows: found 2048"),
    ("a missing cell", _delete("documents/0/cells/3"), "record.documents[0].cells: no cell of length 4096"),
    ("a cell of another length", _set("documents/0/cells/1/length", 1000), "cells[1].length: found 1000"),
    ("rows not L", _set("documents/0/cells/1/rows", 1023), "cells[1].rows: found 1023, expected L = 1024"),
    ("a count over rows", _set("documents/0/cells/0/lane_disagreeing", 513), "cells[0].lane_disagreeing: found 513"),
    ("a negative count", _set("documents/0/cells/0/yardstick_disagreeing", -1), "cells[0].yardstick_disagreeing: found -1"),
    ("a bool count", _set("documents/0/cells/0/lane_disagreeing", True), "cells[0].lane_disagreeing: found true"),
    ("a float count", _set("documents/0/cells/0/lane_disagreeing", 8.0), "cells[0].lane_disagreeing: found 8.0"),
    ("a string count", _set("documents/0/cells/0/lane_disagreeing", "8"), "cells[0].lane_disagreeing: found \"8\""),
    ("a null count", _set("documents/0/cells/0/lane_disagreeing", None), "cells[0].lane_disagreeing: found null"),
    ("a cell not summing its profile", _set("documents/0/cells/2/lane_disagreeing", 5),
     "length 2048 counts (lane 5, yardstick 40) differ from the profile's sums over rows 0..2048 (lane 4"),
    ("a profile window out of place", _set("documents/1/profile/3/start", 1024), "profile[3]: found rows 1024..2048"),
    ("a profile window missing", _delete("documents/1/profile/7"), "profile: found 7 windows, expected 8"),
    ("an empty profile", _set("documents/1/profile", []), "profile: found 0 windows, expected 8"),
    ("a window count over its rows", _set("documents/1/profile/0/yardstick_disagreeing", 600),
     "profile[0].yardstick_disagreeing: found 600, expected a whole count in 0..512"),
    ("a bad top-token digest", _set("documents/0/top_tokens_sha256/lane", "XYZ"), "top_tokens_sha256.lane: found"),
    ("an extra record field", _set("verdict", "pass"), "record.\"verdict\": found an unexpected field"),
    ("an extra cell field", _set("documents/0/cells/0/rate", 0.1), "cells[0].\"rate\": found an unexpected field"),
    ("a missing record field", _delete("seconds"), "record.seconds: missing"),
    ("a missing cell field", _delete("documents/0/cells/0/yardstick_disagreeing"), "cells[0].yardstick_disagreeing: missing"),
    ("negative seconds", _set("seconds/prefill", -0.5), "record.seconds.prefill: found -0.5"),
    ("bool seconds", _set("seconds/scoring", False), "record.seconds.scoring: found false"),
    ("documents not a list", _set("documents", {"python-test-shlex": {}}), "record.documents: found"),
    ("a document not an object", _set("documents/0", "python-test-shlex"), "record.documents[0].document: found null"),
]


@pytest.mark.parametrize("mutate, expected", [(m, e) for _, m, e in RECORD_DEFECTS],
                         ids=[name for name, _, _ in RECORD_DEFECTS])
def test_a_defective_record_is_named_and_gets_no_table_and_no_outcome(mutate: Mutation, expected: str):
    record = record_for(uniform(1, 10))
    mutate(record)
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.outcome is None and judgement.documents == () and judgement.length_effect is None
    assert any(expected in problem for problem in judgement.problems), judgement.problems
    assert all("\n" not in problem for problem in judgement.problems)


def test_a_duplicate_document_or_cell_is_named():
    record = record_for(uniform(1, 10))
    record["documents"].append(copy.deepcopy(record["documents"][0]))
    record["documents"][1]["cells"].append(copy.deepcopy(record["documents"][1]["cells"][0]))
    problems = judge_controls(record, CRITERIA, source=SOURCE).problems
    assert "record.documents[3].document: found python-test-shlex twice, expected each document once" in problems
    assert "record.documents[1].cells[4].length: found 512 twice, expected each length once" in problems


def test_every_defect_is_named_not_only_the_first():
    record = record_for(uniform(1, 10))
    record["lane"] = "vllm-to-vllm"
    record["documents"][0]["cells"][0]["lane_disagreeing"] = True
    record["documents"][2]["rows"] = 4095
    judgement = judge_controls(record, CRITERIA, source="controls.json")
    assert [problem.split(":")[0] for problem in judgement.problems] == [
        "source", "record.lane", "record.documents[0].cells[0].lane_disagreeing", "record.documents[2].rows"]


def test_the_record_must_name_the_lane_being_judged():
    record = record_for(uniform(1, 10))
    assert judge_controls(record, CRITERIA, source=SOURCE, lane=LANE).outcome is not None
    judgement = judge_controls(record, CRITERIA, source=SOURCE, lane="nvfp4-native-f16")
    assert judgement.outcome is None
    assert judgement.problems == (f"record.lane: found \"{LANE}\", expected the lane judged, nvfp4-native-f16",)


@pytest.mark.parametrize("source", ["", "receipt://", "controls.json", "receipt://a b", "receipt://a\n", None])
def test_the_source_must_be_the_measuring_receipt(source: Any):
    judgement = judge_controls(record_for(uniform(1, 10)), CRITERIA, source=source)
    assert judgement.outcome is None and judgement.problems[0].startswith("source: found")


@pytest.mark.parametrize("record", [None, [], "record", 3, True])
def test_a_record_that_is_not_an_object_is_named(record: Any):
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.outcome is None
    assert judgement.problems[0].startswith("record: found")


CRITERIA_DEFECTS: list[tuple[str, Mutation, str]] = [
    ("an unknown gate rule", _set("gate/rule", "wilson-lower-plus-points"), "criteria.gate.rule: found"),
    ("confidence at 1", _set("gate/confidence", 1.0), "criteria.gate.confidence: found 1.0"),
    ("confidence as a string", _set("gate/confidence", "0.95"), "criteria.gate.confidence: found"),
    ("points as a bool", _set("gate/points", True), "criteria.gate.points: found true"),
    ("negative points", _set("gate/points", -0.02), "criteria.gate.points: found -0.02"),
    ("another exceedance wording", _set("exceedance", "a cell whose lane disagreement is at least its gate"),
     "criteria.exceedance: found"),
    ("another length criterion", _set("criteria/length_effect_supported", "every control document exceeds at 4096"),
     "criteria.criteria.length_effect_supported: found"),
    ("lengths out of order", _set("lengths", [512, 2048, 1024, 4096]), "criteria.lengths: found"),
    ("a length not a whole window", _set("lengths", [512, 1000, 2048, 4096]), "expected multiples of profile_window 512"),
    ("a criterion length missing", _set("lengths", [512, 1024, 2048, 3072]), "names lengths [512, 2048, 4096]"),
    ("a bad document digest", _set("documents/0/token_sha256", "nope"), "criteria.documents[0].token_sha256: found"),
    ("wrong schema", _set("schema", "trust-ladder.e2-controls-criteria.v0"), "criteria.schema: found"),
    ("a missing yardstick", _delete("yardstick"), "criteria.yardstick.name: found null"),
    ("no lanes", _set("lanes", []), "criteria.lanes: found []"),
]


@pytest.mark.parametrize("mutate, expected", [(m, e) for _, m, e in CRITERIA_DEFECTS],
                         ids=[name for name, _, _ in CRITERIA_DEFECTS])
def test_criteria_the_judge_cannot_evaluate_are_named_not_guessed(mutate: Mutation, expected: str):
    criteria = copy.deepcopy(CRITERIA)
    mutate(criteria)
    record = record_for(uniform(1, 10))
    record["criteria"]["sha256"] = jcs_sha256(criteria)   # the record names these criteria: only they are at fault
    judgement = judge_controls(record, criteria, source=SOURCE)
    assert judgement.outcome is None and judgement.documents == ()
    assert any(expected in problem for problem in judgement.problems), judgement.problems


@pytest.mark.parametrize("criteria", [None, [], "e2-controls-v1"])
def test_criteria_that_are_not_a_document_are_named(criteria: Any):
    judgement = judge_controls(record_for(uniform(1, 10)), criteria, source=SOURCE)
    assert judgement.outcome is None and judgement.problems[0].startswith("criteria: found")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8)


def corrupted(data: st.DataObject, document: Any) -> Any:
    """``document`` with one place, drawn at random at any depth, replaced by a random JSON value."""
    parent: Any = None
    key: Any = None
    node: Any = document
    for _ in range(data.draw(st.integers(0, 5))):
        if isinstance(node, dict) and node:
            step: Any = data.draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node:
            step = data.draw(st.integers(0, len(node) - 1))
        else:
            break
        parent, key, node = node, step, node[step]
    replacement = data.draw(json_values)
    if parent is None:
        return replacement
    parent[key] = replacement
    return document


def assert_all_or_nothing(judgement: Any) -> None:
    assert (judgement.outcome is None) == bool(judgement.problems)
    json.dumps(judgement.document(), allow_nan=False)   # what a receipt carries, refused or not
    if judgement.outcome is None:
        assert judgement.documents == () and judgement.length_effect is None


@settings(max_examples=fuzz_examples(200), deadline=None)
@given(st.data())
def test_any_corruption_of_a_record_is_named_never_raised(data: st.DataObject):
    record = corrupted(data, record_for(uniform(1, 10)))
    assert_all_or_nothing(judge_controls(record, CRITERIA, source=SOURCE))


@settings(max_examples=fuzz_examples(100), deadline=None)
@given(st.data())
def test_any_corruption_of_the_criteria_is_named_never_raised(data: st.DataObject):
    record = record_for(uniform(1, 10))
    criteria = corrupted(data, copy.deepcopy(CRITERIA))
    if isinstance(criteria, dict):
        record["criteria"]["sha256"] = jcs_sha256(criteria)
    assert_all_or_nothing(judge_controls(record, criteria, source=SOURCE))


# --- the record schema the measurement writes against -------------------------------------------


def test_the_record_schema_admits_a_well_formed_record():
    check_controls_record(record_for(uniform(1, 10)), "controls record")


@pytest.mark.parametrize("mutate, expected", [
    (_set("documents/0/cells/0/lane_disagreeing", True), "documents[0].cells[0].lane_disagreeing: found true, expected type integer"),
    (_set("documents/0/cells/0/yardstick_disagreeing", -1), "documents[0].cells[0].yardstick_disagreeing: found -1"),
    (_set("documents/0/profile/0/stop", 512.0), "documents[0].profile[0].stop: found 512.0, expected type integer"),
    (_set("verdict", "pass"), "verdict: found unexpected field"),
    (_delete("seconds"), "seconds: missing, expected this field"),
    (_set("criteria/sha256", "A" * 64), "criteria.sha256: found"),
    (_set("seconds/prefill", -1.0), "seconds.prefill: found -1.0, expected a number >= 0"),
])
def test_the_record_schema_refuses_what_the_judge_refuses(mutate: Mutation, expected: str):
    record = record_for(uniform(1, 10))
    mutate(record)
    with pytest.raises(Refused) as refused:
        check_controls_record(record, "controls record")
    assert str(refused.value).startswith("controls record: ") and expected in str(refused.value)
    assert judge_controls(record, CRITERIA, source=SOURCE).outcome is None


# --- what a refused judgement still carries, and what a receipt carries for a judged lane ---------------
# (the problems' words are held in tests/golden/judge.controls.txt; the records below are its inputs too)

CRITERIA_SHA256 = jcs_sha256(CRITERIA)
TOP_TOKENS = {"reference": "a" * 64, "lane": "b" * 64, "yardstick": "c" * 64}


def zero_record(criteria: dict[str, Any]) -> dict[str, Any]:
    """A well-formed record with no disagreeing row, for criteria of any lengths and profile window."""
    window, longest = criteria["profile_window"], criteria["lengths"][-1]
    documents = [{"document": entry["name"], "token_sha256": entry["token_sha256"], "rows": longest,
                  "cells": [{"length": length, "rows": length, "lane_disagreeing": 0, "yardstick_disagreeing": 0}
                            for length in criteria["lengths"]],
                  "profile": [{"start": start, "stop": start + window, "lane_disagreeing": 0, "yardstick_disagreeing": 0}
                              for start in range(0, longest, window)],
                  "top_tokens_sha256": dict(TOP_TOKENS)} for entry in criteria["documents"]]
    return {"schema": "trust-ladder.controls-record.v1",
            "criteria": {"name": criteria["name"], "sha256": jcs_sha256(criteria)}, "lane": LANE,
            "yardstick": {"name": criteria["yardstick"]["name"], "sha256": criteria["yardstick"]["sha256"]},
            "documents": documents, "seconds": {"prefill": 1.0, "scoring": 1.0}}


def wrong_header(record: dict[str, Any]) -> None:
    """Every header field wrong, and a field no record has."""
    record.update(schema="trust-ladder.controls-record.v2", criteria={"name": "e2-controls-v2", "sha256": "0" * 64},
                  lane="kquant-native", yardstick={"name": "kquant-q6_k", "sha256": "f" * 64}, seconds=5, verdict="pass")


def every_cell_and_profile_defect(record: dict[str, Any]) -> None:
    """Twelve defects in two documents: a cell that is no object, an unknown, a repeated and a short
    cell, a wrong token digest, a bad top-token digest; a window that is no object, two misplaced
    windows and three counts over their window's rows."""
    first = record["documents"][0]
    cells = first["cells"]
    first["cells"] = ["cell", cells[0], {**cells[1], "length": 1000}, cells[0], {**cells[1], "rows": 1023}, cells[2],
                      cells[3]]
    first["token_sha256"] = "e" * 64
    first["top_tokens_sha256"]["lane"] = "XYZ"
    profile = record["documents"][1]["profile"]
    profile[0] = 5
    profile[2]["stop"] = 2000
    profile[3]["start"] = 0
    profile[4]["lane_disagreeing"] = 513
    profile[5]["yardstick_disagreeing"] = 513
    profile[6]["lane_disagreeing"] = 600


def counts_that_do_not_nest(record: dict[str, Any]) -> None:
    """A cell whose count is not its windows' sum, a profile one window short, a count over its cell."""
    record["documents"][0]["cells"][2]["lane_disagreeing"] = 5
    del record["documents"][1]["profile"][7]
    record["documents"][2]["cells"][0]["yardstick_disagreeing"] = 513


def carried(judgement: Any) -> tuple[Any, ...]:
    return (judgement.criteria, judgement.criteria_sha256, judgement.lane, judgement.yardstick, judgement.source,
            judgement.confidence, judgement.points)


def test_a_profile_window_of_one_row_and_a_length_of_one_row_are_accepted():
    criteria = copy.deepcopy(CRITERIA)
    criteria.update(lengths=[1, 512, 2048, 4096], profile_window=1)
    judgement = judge_controls(zero_record(criteria), criteria, source=SOURCE)
    assert judgement.problems == ()
    assert [cell.length for cell in judgement.documents[0].cells] == [1, 512, 2048, 4096]
    assert len(judgement.documents[0].profile) == 4096 and judgement.documents[0].within


def test_criteria_that_cannot_be_read_leave_a_judgement_with_the_record_lane_and_source_only():
    criteria = copy.deepcopy(CRITERIA)
    criteria["name"] = "E2 Controls"
    judgement = judge_controls(record_for(uniform(1, 10)), criteria, source=SOURCE)
    document = judgement.document()
    assert len(document.pop("problems")) == 1 and judgement.outcome is None
    assert document == {"criteria": {"name": "", "sha256": ""}, "lane": LANE, "yardstick": "", "source": SOURCE,
                        "gate": {"confidence": None, "points": None}, "length_effect": None, "documents": []}


def test_a_record_refused_for_its_header_still_says_what_it_was_judged_under():
    record = record_for(uniform(1, 10))
    wrong_header(record)
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert len(judgement.problems) == 8 and judgement.outcome is None and judgement.documents == ()
    assert carried(judgement) == ("e2-controls-v1", CRITERIA_SHA256, "kquant-native", "kquant-q8_0", SOURCE, 0.95, 0.02)


def test_a_record_without_documents_is_one_problem_and_never_read():
    record = record_for(uniform(1, 10))
    del record["documents"]
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert len(judgement.problems) == 1 and judgement.outcome is None and judgement.documents == ()


@pytest.mark.parametrize("seconds", [{"prefill": 0, "scoring": 0.5}, {"prefill": 0.0, "scoring": 0}])
def test_timings_of_zero_and_under_one_second_are_accepted(seconds: dict[str, float]):
    record = record_for(uniform(1, 10))
    record["seconds"] = seconds
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert judgement.problems == () and judgement.outcome is not None


def test_a_refused_source_is_still_carried_with_the_lane():
    judgement = judge_controls(record_for(uniform(1, 10)), CRITERIA, source="controls.json")
    assert len(judgement.problems) == 1 and (judgement.source, judgement.lane) == ("controls.json", LANE)


@pytest.mark.parametrize("record", ["record", 7])
def test_a_record_that_is_not_an_object_keeps_the_criteria_and_no_lane(record: Any):
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert len(judgement.problems) == 1
    assert carried(judgement) == ("e2-controls-v1", CRITERIA_SHA256, "", "kquant-q8_0", SOURCE, 0.95, 0.02)


def test_a_lane_that_is_not_a_string_is_not_carried():
    record = record_for(uniform(1, 10))
    record["lane"] = 5
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert len(judgement.problems) == 1 and judgement.lane == ""


def test_every_cell_and_profile_defect_is_its_own_problem_and_the_lane_and_gate_are_still_carried():
    record = record_for(uniform(1, 10))
    every_cell_and_profile_defect(record)
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert len(judgement.problems) == 12 and judgement.outcome is None
    assert judgement.lane == LANE and (judgement.confidence, judgement.points) == (0.95, 0.02)


def test_counts_that_do_not_nest_are_each_a_problem_and_the_criteria_lane_and_source_are_still_carried():
    record = record_for(uniform(1, 10))
    counts_that_do_not_nest(record)
    judgement = judge_controls(record, CRITERIA, source=SOURCE)
    assert len(judgement.problems) == 3 and judgement.outcome is None
    assert (judgement.criteria, judgement.lane, judgement.source) == ("e2-controls-v1", LANE, SOURCE)


@pytest.mark.parametrize(("field", "value"), [("lanes", 5), ("lengths", "y")])
def test_a_criteria_list_that_is_no_list_is_named_once(field: str, value: object) -> None:
    criteria = copy.deepcopy(CRITERIA)
    criteria[field] = value
    problems = judge_controls(record_for(uniform(1, 10)), criteria, source=SOURCE).problems
    assert len([problem for problem in problems if problem.startswith(f"criteria.{field}:")]) == 1


def test_a_record_without_its_lane_is_named_once_even_when_a_lane_is_judged() -> None:
    record = record_for(uniform(1, 10))
    del record["lane"]
    problems = judge_controls(record, CRITERIA, source=SOURCE, lane=LANE).problems
    assert len([problem for problem in problems if problem.startswith("record.lane")]) == 1


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
    assert carried(refused)[:5] == (judged.criteria, judged.criteria_sha256, LANE, judged.yardstick, SOURCE)


def test_the_receipt_document_carries_every_cell_window_and_digest_under_its_name():
    counts = uniform(1, 10)
    counts["prose-idle-news"] = [(0, 0)] * 3 + [(WINDOW, 0)] + [(0, 0)] * 4   # rows 1536..2048 all disagree
    counts["config-idle-keys"] = [(0, 0)] * WINDOWS
    judgement = judge_controls(record_for(counts), CRITERIA, source=SOURCE, lane=LANE)
    carried_document = judgement.document()
    assert {key: value for key, value in carried_document.items() if key != "documents"} == {
        "criteria": {"name": "e2-controls-v1", "sha256": CRITERIA_SHA256}, "lane": LANE, "yardstick": "kquant-q8_0",
        "source": SOURCE, "gate": {"confidence": 0.95, "points": 0.02}, "length_effect": "rejected", "problems": []}
    tokens = {document["name"]: document["token_sha256"] for document in CRITERIA["documents"]}
    lane_rates = {"python-test-shlex": [1 / 512] * 4, "prose-idle-news": [0.0, 0.0, 0.25, 0.125],
                  "config-idle-keys": [0.0] * 4}
    exceeding = {"python-test-shlex": [], "prose-idle-news": [2048, 4096], "config-idle-keys": []}
    assert [document["document"] for document in carried_document["documents"]] == NAMES
    for document, judged in zip(carried_document["documents"], judgement.documents, strict=True):
        name = document["document"]
        assert document["token_sha256"] == tokens[name] and document["rows"] == 4096
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
