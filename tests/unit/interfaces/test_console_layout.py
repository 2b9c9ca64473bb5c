"""The console at any width: no number is cut to an ellipsis (rich's ``1.2…``, where ``5.68e-05``
seconds read as ``5.…``), long messages wrap under themselves, and output that is not a terminal
is 160 columns unless ``$COLUMNS`` says otherwise."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console, RenderableType

from qualify.interfaces import console as operator
from qualify.interfaces.tables import WRAPPED_TEXT_MIN, Field, FittedTable
from qualify.judge import judge_incomplete, judge_summary
from qualify.run.qualification import STEP_LABELS, StepOutcome
from qualify.run.selftest import FaultResult
from tests.support.receipt_forgery import RULE
from tests.unit.judge.test_judge import rung2_record
from tests.unit.judge.test_scope import scoped

WIDTHS = st.integers(min_value=60, max_value=200)


def render(renderable: RenderableType, width: int) -> str:
    """What a console ``width`` columns wide shows (plain text, as a recording exports it)."""
    console = Console(width=width, record=True, file=io.StringIO(), highlight=False, markup=False, emoji=False)
    console.print(renderable)
    return console.export_text()


def assert_fits(text: str, width: int) -> None:
    assert "…" not in text, text
    assert all(cell_len(line.rstrip()) <= width for line in text.splitlines()), text


# -- sample records as a run (or a hostile receipt) holds them ----------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
measurement = st.one_of(
    finite,
    st.floats(min_value=1e-12, max_value=1e-3),  # phase times below a millisecond: 5.68e-05
    st.floats(min_value=1e6, max_value=1e300),
    st.sampled_from(["NaN", "Infinity", "-Infinity"]),  # non-finite values as records hold them
    st.none(),
)


@st.composite
def sample_records(draw: st.DrawFn) -> list[dict[str, Any]]:
    count = draw(st.integers(min_value=1, max_value=6))
    records = []
    for repetition in range(1, count + 1):
        tokens = draw(st.integers(min_value=0, max_value=10**6))
        record: dict[str, Any] = {
            "repetition": repetition, "output_tokens": tokens,
            "token_agreement_rate": draw(st.floats(min_value=0, max_value=1)),
            "payload_bytes": draw(st.one_of(st.integers(min_value=0, max_value=2**53), st.none())),
            "error": draw(st.one_of(st.none(), st.none(), st.text(min_size=1, max_size=40))),
        }
        for name in ("max_abs", "mean_abs", "payload_gbit_per_s", "producer_compute_s", "transport_s", "verify_s",
                     "install_s", "decode_s", "recompute_s"):
            record[name] = draw(measurement)
        records.append(record)
    return records


def cells_of(records: list[dict[str, Any]]) -> list[str]:
    """Every cell's text of the sample table (what must appear whole)."""
    return [cell if isinstance(cell, str) else cell.plain for record in records for cell in operator._sample_row(record)]


def check_sample_table(records: list[dict[str, Any]], width: int, fuzz_tally: Any) -> None:
    fuzz_tally.add("examples")
    text = render(operator.sample_table(records), width)
    assert_fits(text, width)
    for cell in cells_of(records):
        assert cell in text, (cell, width, text)
    fuzz_tally.add("folded" if "handoff samples (1/" in text else "one table")


FUZZ = {"derandomize": True, "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]}


@settings(max_examples=150, **FUZZ)
@given(records=sample_records(), width=WIDTHS)
def test_sample_table_keeps_every_number_whole_at_every_width(records: list[dict[str, Any]], width: int,
                                                              fuzz_tally: Any) -> None:
    check_sample_table(records, width, fuzz_tally)


@pytest.mark.slow
@settings(max_examples=1000, **FUZZ)
@given(records=sample_records(), width=WIDTHS)
def test_sample_table_keeps_every_number_whole_at_every_width_many(records: list[dict[str, Any]], width: int,
                                                                   fuzz_tally: Any) -> None:
    check_sample_table(records, width, fuzz_tally)


def test_real_run_numbers_stay_whole_at_80_columns() -> None:
    """The numbers users saw cut at 80 columns: drift 1.27860451 / 0.079236013 and an install of
    5.68e-05 s, in a record shaped as a real run's."""
    record = {"repetition": 1, "output_tokens": 256, "token_agreement_rate": 1.0, "max_abs": 1.278604507446289,
              "mean_abs": 0.07923601299503324, "payload_bytes": 8388608, "payload_gbit_per_s": 18.59,
              "producer_compute_s": 1.637, "transport_s": 0.004, "verify_s": 0.016, "install_s": 5.68e-05,
              "decode_s": 2.776, "recompute_s": 9.893, "error": None}
    text = render(operator.sample_table([record]), 80)
    assert_fits(text, 80)
    for number in ("256/256", "1.27860451", "0.079236013", "8.39", "18.59", "5.68e-05", "9.893"):
        assert number in text, text


def test_wide_console_shows_one_table_and_a_narrow_one_folds_it() -> None:
    records = [{"repetition": 1, "output_tokens": 256, "token_agreement_rate": 1.0, "max_abs": 1.2786045,
                "mean_abs": 0.0792360, "payload_bytes": 8388608, "payload_gbit_per_s": 18.59,
                "producer_compute_s": 1.6, "transport_s": 0.004, "verify_s": 0.016, "install_s": 5.68e-05,
                "decode_s": 2.776, "recompute_s": 9.893, "error": None}]
    wide, narrow = render(operator.sample_table(records), 160), render(operator.sample_table(records), 80)
    assert "handoff samples (1/" not in wide and wide.count("│      1 │") == 1
    assert "handoff samples (1/2)" in narrow and "handoff samples (2/2)" in narrow
    assert narrow.count("│      1 │") == 2  # each group repeats the sample number


findings = st.lists(st.one_of(st.from_regex(r"[a-z]{1,12}", fullmatch=True),
                              st.floats(allow_nan=False, allow_infinity=False).map(repr),
                              st.integers(min_value=-10**12, max_value=10**12).map(str)),
                    min_size=1, max_size=30).map(" ".join)


fault_results = st.lists(st.tuples(st.from_regex(r"[a-z][a-z-]{0,14}", fullmatch=True), st.booleans(),
                                   st.booleans(), findings), min_size=1, max_size=6)


def check_selftest_table(results: list[tuple[str, bool, bool, str]], width: int, fuzz_tally: Any) -> None:
    fuzz_tally.add("examples")
    faults = [FaultResult(name, "native-text", caught, localised, finding, None)
              for name, caught, localised, finding in results]
    text = render(operator.selftest_table(faults), width)
    assert_fits(text, width)
    words = set(re.findall(r"\S+", text.replace("│", " ").replace("┃", " ")))
    for fault in faults:
        for word in (fault.fault, *fault.finding.split()):
            assert word in words, (word, width, text)
    fuzz_tally.add("table" if "┃ fault" in text else "blocks")


@settings(max_examples=100, **FUZZ)
@given(results=fault_results, width=WIDTHS)
def test_selftest_table_keeps_every_word_and_number_whole_at_every_width(
    results: list[tuple[str, bool, bool, str]], width: int, fuzz_tally: Any
) -> None:
    check_selftest_table(results, width, fuzz_tally)


@pytest.mark.slow
@settings(max_examples=600, **FUZZ)
@given(results=fault_results, width=WIDTHS)
def test_selftest_table_keeps_every_word_and_number_whole_at_every_width_many(
    results: list[tuple[str, bool, bool, str]], width: int, fuzz_tally: Any
) -> None:
    check_selftest_table(results, width, fuzz_tally)


def test_a_column_that_cannot_fit_beside_the_key_becomes_blocks() -> None:
    table = FittedTable("wide", [Field("key"), Field("value")], [["1", "9" * 70]])
    assert table.layout(60) is None
    text = render(table, 60)
    assert text.count("9") == 70 and "…" not in text  # folded across lines in its block, never cut short


def test_a_wrapping_column_is_never_narrower_than_its_minimum() -> None:
    table = FittedTable("t", [Field("k"), Field("text", wraps=True)], [["1", "word " * 50]])
    assert table.layout(WRAPPED_TEXT_MIN + 2 * 3) is None  # key + borders leave too little room
    assert table.layout(80) is not None


def test_a_long_step_message_wraps_under_itself() -> None:
    outcome = StepOutcome("handoff 1/3", True, "passed: tokens exact (256/256) and bounded drift: max "
                          "1.27860451 <= 1.27860451, mean 0.079236013 <= 0.079236013", 14.35)
    text = render(operator.step_line(outcome), 60)
    assert_fits(text, 60)
    first, *rest = text.rstrip("\n").splitlines()
    assert first.startswith(" ✓ handoff 1/3") and "14.35 s" in first
    indent = first.index("passed:")
    assert rest and all(line[:indent].strip() == "" for line in rest), text
    assert "1.27860451" in text and "0.079236013" in text


def test_a_long_verdict_reason_wraps_under_itself() -> None:
    text = render(operator.bullet("max abs 1.27860451 exceeds the sealed bound 0.125 in samples 1, 2 and 3 "
                                  "of this lane's qualification"), 40)
    assert_fits(text, 40)
    first, *rest = text.rstrip("\n").splitlines()
    assert first.startswith("  - max abs 1.27860451")
    assert rest and all(line.startswith("    ") and line[4] != " " for line in rest), text


def test_blocked_steps_are_one_line() -> None:
    blocked = [StepOutcome(label, False, "blocked: step 'identity sealed' failed", 0.0)
               for label in ("producer ready", "reference computed", "verdict")]
    assert operator.blocked_line(blocked).plain == (
        " · not run (blocked: step 'identity sealed' failed): producer ready, reference computed, verdict")


@pytest.mark.parametrize(("columns", "width"), [(None, 160), ("100", 100), ("60", 60), ("39", 160), ("abc", 160),
                                                ("", 160), ("80x", 160), ("999999", 160)])
def test_output_that_is_not_a_terminal_is_160_columns_unless_columns_says(
    monkeypatch: pytest.MonkeyPatch, columns: str | None, width: int
) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.setattr("sys.stdout", io.StringIO())  # not a terminal
    assert operator.pipe_width() == width
    assert operator.operator_console().width == width


# -- the verdict line ---------------------------------------------------------------------------


def finished_run(verdict: Any) -> Any:
    """What :func:`operator.show_report` reads of a finished run: its verdict, nothing else."""
    from types import SimpleNamespace

    return SimpleNamespace(refused=False, receipt_path=None, records=[], verdict=verdict, outcomes={},
                           labels=STEP_LABELS)


@pytest.mark.parametrize("records", [[rung2_record(n) for n in (1, 2, 3)], [rung2_record(1, max_abs=30.5)]],
                         ids=["qualified", "not qualified"])
@pytest.mark.parametrize("width", [40, 80, 160])
def test_a_scoped_verdict_is_shown_once_whole_with_its_scope_line(records: list[dict[str, Any]], width: int) -> None:
    verdict = scoped(judge_summary(records, RULE))
    text = render(operator.verdict_line(verdict), width)
    assert_fits(text, width)
    assert " ".join(text.split()) == " ".join(verdict.headline.split())  # every word, none cut
    report = _report_text(verdict, width)
    assert report.count("QUALIFIED") == 1, report  # no second headline beside the judge's
    word = "QUALIFIED on fixture" if verdict.passed else "NOT QUALIFIED on fixture"
    assert " ".join(report.split()).startswith(f"{word} python-textwrap (3 × 2048/256)")


def _report_text(verdict: Any, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), highlight=False, markup=False, emoji=False)
    operator.show_report(finished_run(verdict), console)
    return console.export_text()


def test_a_verdict_without_a_scope_is_prefixed_with_its_word() -> None:
    """A run stopped at a step carries no scope; its verdict says QUALIFIED or not once, in front."""
    stopped = judge_incomplete("interrupted by SIGINT during handoff 2/3")
    assert operator.verdict_line(stopped).plain == f"NOT QUALIFIED: {stopped.headline}"
    passed = judge_summary([rung2_record(n) for n in (1, 2, 3)], RULE)
    assert operator.verdict_line(passed).plain == f"QUALIFIED: {passed.headline}"
    assert _report_text(stopped, 80).count("QUALIFIED") == 1
