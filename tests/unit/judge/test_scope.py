"""What a verdict covers, in words derived from the judgement (qualify/judge/scope.py): the scope
line names its fixture, the controls' counts and exactly the exceeding documents with their
length runs, and nothing else; read back with a grammar, never compared with free text. Its JSON
form (the summary's, ``--json``'s, JUnit's) carries the same facts and the line's two halves word
for word. Helpers here (:data:`SCOPE`, :func:`scoped`) give the surface tests a scoped verdict."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.archive.writer import ScopeRecord
from qualify.core.assets import CONTRACTS_DIR
from qualify.judge import Verdict
from qualify.judge.scope import (
    ControlsOutcome,
    DocumentOutcome,
    EnvelopeScope,
    Scope,
    controls_words,
    fixture_words,
    length_ranges,
    scope_document,
    scope_line,
)
from tests.support.fuzz_budget import fuzz_examples

GRID = (512, 1024, 2048, 4096)
SCOPE = Scope("python-textwrap", 3, 2048, 256, ControlsOutcome(
    "e2-controls-v1", GRID,
    (DocumentOutcome("python-test-shlex", ()), DocumentOutcome("prose-idle-news", (1024, 2048, 4096)),
     DocumentOutcome("config-idle-keys", ())),
    "receipt://20261201T000000Z-0123456789abcdef/evidence/controls.json"))
"""A lane's scope as the issue states one: 2 of 3 documents within, one exceeding at 1024-4096."""


def scoped(verdict: Verdict, scope: Scope = SCOPE) -> Verdict:
    """``verdict`` as a qualification's, carrying ``scope``: its headline opens with the scope
    line (the failing reason in it), then the evidence, as ``judge_qualification`` words it."""
    reason = None if verdict.passed else (verdict.reasons[0] if verdict.reasons else None)
    return dataclasses.replace(verdict, scope=scope,
                               headline=f"{scope_line(verdict.passed, scope, reason)}. Evidence: {verdict.headline}")


# --------------------------------------------------------------------------- reading a line back

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
LINE = re.compile(
    rf"(?P<word>QUALIFIED|NOT QUALIFIED) on fixture (?P<fixture>{_NAME}) "
    r"\((?P<repetitions>[0-9]+) × (?P<prompt>[0-9]+)/(?P<output>[0-9]+)\)"
    r"(?:: (?P<reason>[^;]+))?; "
    r"(?:(?P<none>controls: none declared for this lane)"
    rf"|controls \((?P<criteria>{_NAME})\): (?P<within>[0-9]+) of (?P<total>[0-9]+) documents within E1 gates"
    rf"(?P<exceeding>(?:; {_NAME} exceeds at [0-9–, and]+ \(published\))*))")
EXCEEDING = re.compile(rf"; (?P<document>{_NAME}) exceeds at (?P<runs>[0-9–, and]+) \(published\)")


def read_runs(text: str) -> list[tuple[int, int]]:
    """"1024–4096", "512 and 2048", "512, 1024–2048 and 4096" as (first, last) pairs."""
    *leading, last = text.split(" and ") if " and " in text else [text]
    assert len(leading) <= 1, text
    words = [*(leading[0].split(", ") if leading else []), last]
    return [(int(word.split("–")[0]), int(word.split("–")[-1])) for word in words]


def read_line(line: str) -> dict[str, Any]:
    """Every fact a scope line states, read with the grammar above (a line it does not match in
    full says something else, and fails)."""
    found = LINE.fullmatch(line)
    assert found is not None, f"not a scope line: {line!r}"
    facts: dict[str, Any] = {
        "passed": found["word"] == "QUALIFIED", "reason": found["reason"], "fixture": found["fixture"],
        "repetitions": int(found["repetitions"]), "prompt_tokens": int(found["prompt"]),
        "output_tokens": int(found["output"]), "controls": None}
    if found["none"] is None:
        exceeding = found["exceeding"]
        documents = [(m["document"], read_runs(m["runs"])) for m in EXCEEDING.finditer(exceeding)]
        assert "".join(m[0] for m in EXCEEDING.finditer(exceeding)) == exceeding  # nothing between them
        facts["controls"] = {"criteria": found["criteria"], "within": int(found["within"]),
                             "total": int(found["total"]), "exceeding": documents}
    return facts


def expected_runs(lengths: tuple[int, ...], grid: tuple[int, ...]) -> list[tuple[int, int]]:
    """The maximal runs of consecutive grid entries among ``lengths`` (the test's own reckoning)."""
    runs: list[tuple[int, int]] = []
    for index, length in enumerate(grid):
        if length not in lengths:
            continue
        if runs and index > 0 and runs[-1][1] == grid[index - 1]:
            runs[-1] = (runs[-1][0], length)
        else:
            runs.append((length, length))
    return runs


# --------------------------------------------------------------------------- scopes of every shape

NAMES = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,20}\Z")
COUNTS = st.integers(min_value=1, max_value=1 << 20)


@st.composite
def controls_outcomes(draw: st.DrawFn) -> ControlsOutcome:
    grid = tuple(sorted(draw(st.sets(st.integers(min_value=1, max_value=1 << 16), min_size=1, max_size=7))))
    names = draw(st.lists(NAMES, min_size=1, max_size=5, unique=True))
    documents = tuple(DocumentOutcome(name, tuple(sorted(draw(st.sets(st.sampled_from(grid))))))
                      for name in names)
    return ControlsOutcome(draw(NAMES), grid, documents, f"receipt://{draw(NAMES)}/evidence/controls.json")


SCOPES = st.builds(Scope, NAMES, COUNTS, COUNTS, COUNTS, st.none() | controls_outcomes())
REASONS = st.none() | st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9 .,:=<>/|()-]{0,60}\Z")
FUZZ = settings(derandomize=True, max_examples=fuzz_examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(scope=SCOPES, passed=st.booleans(), reason=REASONS)
def test_the_line_states_exactly_the_scope_it_was_built_from(scope: Scope, passed: bool, reason: str | None,
                                                             fuzz_tally: Any) -> None:
    fuzz_tally.add("examples")
    line = scope_line(passed, scope, reason)
    facts = read_line(line)
    assert (facts["passed"], facts["fixture"], facts["repetitions"], facts["prompt_tokens"], facts["output_tokens"]) \
        == (passed, scope.fixture, scope.repetitions, scope.prompt_tokens, scope.output_tokens)
    assert facts["reason"] == (reason if not passed else None)  # a qualified line gives no reason
    controls = scope.controls
    if controls is None:
        fuzz_tally.add("no controls")
        assert facts["controls"] is None
        return
    fuzz_tally.add("every document within" if controls.within == len(controls.documents) else "some exceed")
    assert facts["controls"]["criteria"] == controls.criteria
    assert (facts["controls"]["within"], facts["controls"]["total"]) == (
        sum(not document.exceeding_lengths for document in controls.documents), len(controls.documents))
    assert facts["controls"]["exceeding"] == [  # exactly the exceeding documents, in order, each run maximal
        (document.document, expected_runs(document.exceeding_lengths, controls.lengths))
        for document in controls.documents if document.exceeding_lengths]


@FUZZ
@given(scope=SCOPES, passed=st.booleans())
def test_the_json_form_carries_the_lines_facts_and_its_halves_word_for_word(scope: Scope, passed: bool) -> None:
    document = scope_document(scope, passed)
    assert document["line"] == scope_line(passed, scope)
    word = "QUALIFIED" if passed else "NOT QUALIFIED"
    assert document["line"] == f"{word} on {document['fixture_words']}; {document['controls_words']}"
    assert (document["fixture_words"], document["controls_words"]) == (fixture_words(scope),
                                                                        controls_words(scope.controls))
    facts = read_line(document["line"])
    assert document["fixture"] == {"name": facts["fixture"], "repetitions": facts["repetitions"],
                                   "prompt_tokens": facts["prompt_tokens"], "output_tokens": facts["output_tokens"]}
    if scope.controls is None:
        assert document["controls"] is None
    else:
        controls = document["controls"]
        assert (controls["criteria"], controls["documents_within"], controls["documents_total"]) == (
            facts["controls"]["criteria"], facts["controls"]["within"], facts["controls"]["total"])
        assert [(d["document"], expected_runs(tuple(d["exceeding_lengths"]), tuple(controls["lengths"])))
                for d in controls["documents"] if not d["within"]] == facts["controls"]["exceeding"]
    # The form the receipts and --json hold: the model and the committed schema both accept it.
    assert ScopeRecord.model_validate_json(json.dumps(document)).model_dump(mode="json") == document
    assert list(scope_validator().iter_errors(document)) == []


def scope_validator() -> jsonschema.Draft202012Validator:
    defs = json.loads((CONTRACTS_DIR / "validation-summary.v3.schema.json").read_text(encoding="utf-8"))["$defs"]
    return jsonschema.Draft202012Validator({"$ref": "#/$defs/ScopeRecord", "$defs": defs})


def test_the_issues_example_reads_as_the_issue_words_it() -> None:
    """The issue's example, with this harness's naming of the criteria in it."""
    assert scope_line(True, SCOPE) == (
        "QUALIFIED on fixture python-textwrap (3 × 2048/256); controls (e2-controls-v1): 2 of 3 documents within "
        "E1 gates; prose-idle-news exceeds at 1024–4096 (published)")
    assert scope_line(False, dataclasses.replace(SCOPE, controls=None), "max abs 2.5 > 1.25") == (
        "NOT QUALIFIED on fixture python-textwrap (3 × 2048/256): max abs 2.5 > 1.25; controls: none declared "
        "for this lane")


@pytest.mark.parametrize(("lengths", "words"), [
    ((1024, 2048, 4096), "1024–4096"), ((512, 2048), "512 and 2048"), ((4096,), "4096"),
    ((512, 1024, 4096), "512–1024 and 4096"), ((512, 2048, 4096), "512 and 2048–4096"),
    ((4096, 512, 512), "512 and 4096"),
])
def test_length_ranges_are_runs_of_the_grid(lengths: tuple[int, ...], words: str) -> None:
    assert length_ranges(lengths, GRID) == words
    assert read_runs(words) == expected_runs(tuple(lengths), GRID)


# --------------------------------------------------------------------------- what a scope refuses


def controls(**changes: Any) -> ControlsOutcome:
    fields = {"criteria": "e2-controls-v1", "lengths": GRID, "source": "receipt://r/evidence/controls.json",
              "documents": (DocumentOutcome("prose-idle-news", (1024,)),)}
    return ControlsOutcome(**(fields | changes))


@pytest.mark.parametrize(("build", "expected"), [
    (lambda: Scope("python-textwrap", 0, 2048, 256, None), "repetitions 0, expected a whole number >= 1"),
    (lambda: Scope("python-textwrap", True, 2048, 256, None), "repetitions True"),
    (lambda: Scope("python-textwrap", 3, 2048.0, 256, None), "prompt_tokens 2048.0"),
    (lambda: Scope("python textwrap", 3, 2048, 256, None), "fixture 'python textwrap'"),
    (lambda: Scope("a;b", 3, 2048, 256, None), "fixture 'a;b'"),
    (lambda: Scope("x" * 129, 3, 2048, 256, None), "fixture 'xxx"),
    (lambda: Scope("", 3, 2048, 256, None), "fixture ''"),
    (lambda: Scope("python-textwrap", 3, 2048, 256, "e2"), "controls str"),  # type: ignore[arg-type]
    (lambda: Scope("python-textwrap", 3, 2048, 256, None, calibrated_on="receipts/r"),
     "calibrated on 'receipts/r', expected receipt://"),
    (lambda: Scope("python-textwrap", 3, 2048, 256, None, envelope="fixture-envelope"),  # type: ignore[arg-type]
     "envelope str, expected an EnvelopeScope"),
    (lambda: controls(lengths=()), "lengths (), expected a non-empty tuple"),
    (lambda: controls(lengths=(1024, 512)), "expected increasing lengths"),
    (lambda: controls(lengths=(512, 512)), "expected increasing lengths"),
    (lambda: controls(lengths=[512, 1024]), "expected a non-empty tuple"),
    (lambda: controls(documents=()), "documents (), expected a non-empty tuple"),
    (lambda: controls(documents=(DocumentOutcome("a", ()), DocumentOutcome("a", (512,)))), "named twice"),
    (lambda: controls(documents=(DocumentOutcome("a", (768,)),)), "a exceeds at [768]"),
    (lambda: controls(source=""), "source ''"),
    (lambda: controls(source="receipt://r\nx"), "source"),
    (lambda: controls(criteria="e2 controls"), "controls criteria 'e2 controls'"),
    (lambda: DocumentOutcome("a", (1024, 512)), "expected increasing lengths, each once"),
    (lambda: DocumentOutcome("a", (512, 512)), "expected increasing lengths, each once"),
    (lambda: DocumentOutcome("a", (0,)), "exceeding length 0"),
    (lambda: DocumentOutcome("a", [512]), "expected a tuple"),  # type: ignore[arg-type]
    (lambda: DocumentOutcome("no spaces", ()), "control document 'no spaces'"),
])
def test_a_scope_that_cannot_be_worded_one_way_is_refused_naming_the_field(build: Any, expected: str) -> None:
    with pytest.raises(ValueError) as refused:
        build()
    message = str(refused.value)
    assert message.startswith("scope: ") and expected in message and "\n" not in message, message


def test_the_bounds_of_a_scope_are_accepted() -> None:
    """Exactly at each bound: one of each count, a name of 128 characters, one grid length."""
    edge = Scope("x" * 128, 1, 1, 1, controls(lengths=(1,), documents=(DocumentOutcome("d", (1,)),)))
    assert read_line(scope_line(False, edge))["repetitions"] == 1
    assert scope_line(False, edge).endswith("0 of 1 documents within E1 gates; d exceeds at 1 (published)")


def test_a_scope_calibrated_on_a_receipt_names_it_in_its_fixture_half_and_its_record_validates():
    calibrated = dataclasses.replace(SCOPE, calibrated_on="receipt://20261205T090000Z-0123456789abcdef")
    assert "receipt://20261205T090000Z-0123456789abcdef" in fixture_words(calibrated)
    assert "receipt://" not in fixture_words(SCOPE)
    document = scope_document(calibrated, True)
    assert document["fixture_words"] == fixture_words(calibrated) and document["fixture_words"] in document["line"]
    ScopeRecord.model_validate(document)


@pytest.mark.parametrize("calibrated_on", ["receipt:/x", "20261205T090000Z-0123", "receipt://a b", ""])
def test_a_scope_refuses_a_calibration_that_is_not_a_receipt(calibrated_on):
    with pytest.raises(ValueError):
        dataclasses.replace(SCOPE, calibrated_on=calibrated_on)


@pytest.mark.parametrize("passed", [True, False])
def test_the_json_form_carries_the_envelope_a_scope_was_held_to(passed: bool) -> None:
    held = dataclasses.replace(SCOPE, envelope=EnvelopeScope("fixture-envelope-loo-range.v1", 8, 2))
    assert scope_document(held, passed)["envelope"] == {
        "rule": "fixture-envelope-loo-range.v1", "handoffs": 8, "producer_starts": 2}
    assert scope_document(SCOPE, passed)["envelope"] is None
