"""The words the operator reads, held in golden files: one per module, ``tests/golden/<module>.txt``.

Each module has a table of cases: a name and an input (a record, a criteria document, an identity
document, a receipt made by the shared helpers in tests/support/) together with the entry point it
goes through. One function, :func:`render`, turns whatever the entry point gives (a verdict, a
calibration or controls judgement, a parity line, a refusal, a receipt check, a command's exit code
and output) into lines: check names, pass or fail and details, reasons, headlines, refusals. A file
is each case's ``== name`` followed by its lines, in table order, with run-specific parts (the
case's own directory, the session's temporary and config directories, the checkout, the signing
key, the harness version) masked. A line that is not one line fails the test: refusals are one line.

A wording change is a diff of a golden file: ``python -m pytest tests/unit/test_operator_words.py
--qualify-update-goldens`` rewrites the files, and the review reads the diff. Whether a check
passes, how many there are and which exit code a command gives are behaviour, asserted in each
layer's own tests (tests/unit/<layer>/); here they are only shown beside the words.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import qualify
from qualify.archive import verify as verify_module
from qualify.archive.verify import ReceiptCheck
from qualify.core.errors import Refused
from qualify.judge import ControlsJudgement, ParityJudgement, Verdict
from tests.support.golden import GOLDEN_DIR, Golden, GoldenMismatch
from tests.unit.archive.test_verify_problems import RUN_A, RUN_B, archive_with_leftovers

REPO = Path(__file__).resolve().parents[2]


# =========================================================================== the table and its rendering


@dataclass
class Workspace:
    """What a case may use: an empty directory of its own, a monkeypatch undone after the case
    (environment faults only: a directory that cannot be listed, a file swapped mid-check), the
    captured standard streams, and masks for what differs from run to run."""

    root: Path
    patch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture[str]
    masks: dict[str, str]

    def mask(self, value: str, placeholder: str) -> None:
        self.masks[value] = placeholder


Produce = Callable[[Workspace], object]


@dataclass(frozen=True)
class Case:
    name: str
    produce: Produce


@dataclass(frozen=True)
class Raised:
    """A refusal a case expects: the exception's type (and an attestation's kind) and its words."""

    kind: str
    words: str


@dataclass(frozen=True)
class CliRun:
    """A command's exit code and what it wrote: to stdout, stderr, and the stream it was given."""

    code: int
    out: str
    err: str
    stream: str | None = None


EXPECTED_REFUSALS = (Refused, ValueError, TypeError)
"""What a refusing case may raise (pydantic's ValidationError is a ValueError); anything else is a
broken case, never a golden line."""


def judged(call: Callable[..., object], *args: Any, **kwargs: Any) -> Produce:
    """A case whose input goes through ``call``; what it returns is rendered."""
    return lambda _workspace: call(*args, **kwargs)


def refused(call: Callable[..., object], *args: Any, **kwargs: Any) -> Produce:
    """A case whose input ``call`` must refuse; the refusal is rendered."""
    def produce(_workspace: Workspace) -> Raised:
        return refusal_of(lambda: call(*args, **kwargs))
    return produce


def refusal_of(action: Callable[[], object]) -> Raised:
    try:
        action()
    except EXPECTED_REFUSALS as exc:
        kind = getattr(exc, "kind", None)
        return Raised(type(exc).__name__ + (f" ({kind})" if kind else ""), str(exc))
    raise AssertionError("the case expects a refusal and got none")


@functools.singledispatch
def render(result: object) -> list[str]:
    """The lines an entry point's result puts in front of an operator."""
    raise TypeError(f"no rendering for {type(result).__name__}")


@render.register
def _(result: str) -> list[str]:
    return [result]


@render.register(list)
@render.register(tuple)
def _(result: Sequence[object]) -> list[str]:
    return [line for item in result for line in render(item)]


@render.register
def _(result: Raised) -> list[str]:
    return [f"raises {result.kind}: {result.words}"]


@render.register
def _(verdict: Verdict) -> list[str]:
    lines = [f"status: {verdict.status}", f"headline: {verdict.headline}"]
    lines += [f"check {'pass' if check.passed else 'FAIL'}  {check.name}: {check.detail}" for check in verdict.checks]
    lines += [f"reason: {reason}" for reason in verdict.reasons]
    if verdict.error is not None:
        lines.append(f"error: {verdict.error}")
    return lines


@render.register
def _(run: CliRun) -> list[str]:
    lines = [f"exit {run.code}"]
    for where, text in (("stream", run.stream), ("stdout", run.out), ("stderr", run.err)):
        lines += [f"{where}: {line}" for line in (text or "").splitlines()]
    return lines


@render.register
def _(check: ReceiptCheck) -> list[str]:
    return [f"{check.state} (recorded status {check.status})", *(f"problem: {problem}" for problem in check.problems)]


@render.register
def _(document: dict) -> list[str]:  # type: ignore[type-arg]
    """A JSON document as ``--json`` prints it (ASCII, indented by two)."""
    return json.dumps(document, indent=2, ensure_ascii=True).splitlines()


def render_case(case: Case, workspace: Workspace) -> str:
    lines = render(case.produce(workspace))
    for line in lines:
        assert "\n" not in line and "\r" not in line, f"{case.name}: operator words must be one line each: {line!r}"
    text = "\n".join(line.rstrip() for line in lines)
    for value, placeholder in sorted(workspace.masks.items(), key=lambda item: -len(item[0])):
        text = text.replace(value, placeholder)
    return f"== {case.name}\n{text}\n"


HEADER = ("# The operator's words of {module}: each case's name, then the lines it produced (tests/unit/"
          "test_operator_words.py).\n# A wording change shows here as a diff; regenerate with: python -m pytest "
          "tests/unit/test_operator_words.py --qualify-update-goldens\n")


# =========================================================================== qualify.judge: handoffs


def judge_handoff_cases() -> list[Case]:
    from qualify.evidence.records import BitExactRule, BoundedDriftRule
    from qualify.judge import (
        judge_failed_step,
        judge_qualification,
        judge_reproduction,
        judge_rung2_sample,
        judge_rung3_sample,
        judge_sample,
        judge_summary,
    )
    from qualify.judge.handoffs import judge_teacher_forced_rows
    from qualify.judge.scope import Scope
    from tests.unit.judge.test_judge import RULE2, RULE3, rung2_record, rung3_record

    def without(record: dict[str, Any], *fields: str) -> dict[str, Any]:
        return {name: value for name, value in record.items() if name not in fields}

    def reproduction(run: list[Any], basis: list[Any], **how: Any) -> Produce:
        return judged(judge_reproduction, run, basis, **{"rung": 2, "deterministic_producer": False, "draft": False,
                                                          **how})

    kv = "kv_layer_max_abs"
    not_graded = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, drift_graded=False)
    graded3 = BitExactRule(acceptance_floor=0.95, drift_graded=True)
    draftless = BitExactRule(acceptance_floor=None)
    anchor = [rung2_record(i, seams_sha256="a" * 64) for i in (1, 2, 3)]
    seams_moved = [rung2_record(1, seams_sha256="a" * 64), rung2_record(2, seams_sha256="b" * 64), anchor[2]]
    all_moved = [rung2_record(1, seams_sha256="b" * 64, payload_sha256="9" * 64), rung2_record(2, seams_sha256="b" * 64),
                 rung2_record(3, seams_sha256="a" * 64)]
    row = "a" * 64
    scope = Scope("python-textwrap", 3, 2048, 256, None)
    three = [rung2_record(i) for i in (1, 2, 3)]
    forced = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, near_tie_margin=0.75,
                              maximum_changed_row_share=0.05)
    tight = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, near_tie_margin=0.75,
                             maximum_changed_row_share=0.01)

    def parted(repetition: int = 1, *, row_max: float = 6.5, row_mean: float = 0.75,
               partings: Sequence[tuple[int, float]] = ((12, 0.125), (30, 0.5)), **teacher: Any) -> dict[str, Any]:
        summary = {"max_abs": row_max, "mean_abs": row_mean / 2, "first_row_over_rule": None,
                   "top1_flips": len(partings), "max_row_mean_abs": row_mean,
                   "partings": [{"row": row, "cold_margin": margin} for row, margin in partings], **teacher}
        return rung2_record(repetition, token_agreement_rate=12 / 256, cold_generated_token_sha256="7" * 64,
                            seams_sha256="a" * 64,
                            localisation={"first_divergence_position": partings[0][0], "teacher_forced": summary})

    forced_three = [parted(i) for i in (1, 2, 3)]
    return [
        # ---- one sample, rung 2
        Case("rung-2 sample: passing", judged(judge_sample, rung2_record(), RULE2)),
        Case("rung-2 sample: failing every check, with its localisation", judged(judge_sample, rung2_record(
            output_tokens=255, token_agreement_rate=0.5, cold_generated_token_sha256="7" * 64, payload_bytes=0,
            handed_off_positions=0, max_abs=12.0,
            localisation={"first_divergence_position": 3, "cold_margin_at_divergence": 0.25,
                          "divergence_class": "near-tie", "first_rule_breaking_row": 7}), RULE2)),
        Case("rung-2 sample: max_abs omitted and mean_abs not finite",
             judged(judge_sample, without(rung2_record(mean_abs=math.nan), "max_abs"), RULE2)),
        Case("rung-2 sample: a payload of one byte", judged(judge_sample, rung2_record(payload_bytes=1), RULE2)),
        Case("rung-2 sample: one handed-off position", judged(judge_sample, rung2_record(handed_off_positions=1), RULE2)),
        *(Case(f"rung-2 sample: {field} {value!r}, out of its range", judged(judge_sample, rung2_record(**{field: value}),
                                                                             RULE2))
          for field, value in [("output_tokens", 0), ("repetition", 0), ("token_agreement_rate", -0.001),
                               ("token_agreement_rate", 1.001), ("payload_gbit_per_s", -0.001), ("max_abs", -0.001),
                               ("mean_abs", -0.001), ("recomputed_positions", -1)]),
        *(Case(f"rung-2 sample: {field} 0.0, inside a range that starts at zero",
               judged(judge_sample, rung2_record(**{field: 0.0}), RULE2))
          for field in ("payload_gbit_per_s", "token_agreement_rate")),
        Case("rung-2 sample: a token count that is text, tokens exact",
             judged(judge_sample, rung2_record(output_tokens="256"), RULE2)),
        Case("rung-2 sample: a token count that is text, tokens diverged",
             judged(judge_sample, rung2_record(output_tokens="256", token_agreement_rate=0.5), RULE2)),
        *(Case(f"rung-2 sample: divergence class {kind!r}, its margin a bool", judged(judge_sample, rung2_record(
            token_agreement_rate=0.5, localisation={"first_divergence_position": 9, "cold_margin_at_divergence": True,
                                                    "divergence_class": kind}), RULE2))
          for kind in ("near-tie", "decisive", "other")),
        Case("rung-2 sample: a rule-breaking row, and a divergence position that is a bool",
             judged(judge_sample, rung2_record(token_agreement_rate=0.5, max_abs=12.0, localisation={
                 "first_rule_breaking_row": 11, "first_divergence_position": True}), RULE2)),
        Case("rung-2 sample: a rule-breaking row that is a bool",
             judged(judge_sample, rung2_record(max_abs=12.0, localisation={"first_rule_breaking_row": True}), RULE2)),
        # ---- default judging (not drift-graded): the first logit digest mismatch
        Case("rung-2 sample, not drift-graded: digests equal in every row and over the block", judged(
            judge_sample, rung2_record(logit_row_digests_equal=True, first_logit_digest_mismatch_row=None,
                                       handoff_logit_block_sha256="3" * 64), not_graded)),
        Case("rung-2 sample, not drift-graded: block digests differ while rows are reported equal", judged(
            judge_sample, rung2_record(logit_row_digests_equal=True, first_logit_digest_mismatch_row=None), not_graded)),
        Case("rung-2 sample, not drift-graded: a mismatch at an unreported row", judged(
            judge_sample, rung2_record(logit_row_digests_equal=False, first_logit_digest_mismatch_row=None), not_graded)),
        Case("rung-2 sample, not drift-graded: a mismatch at row 5",
             judged(judge_sample, rung2_record(first_logit_digest_mismatch_row=5), not_graded)),
        *(Case(f"rung-2 sample, not drift-graded: {absent} null", judged(judge_sample, rung2_record(**{absent: None}),
                                                                         not_graded))
          for absent in ("logit_row_digests_equal", "handoff_logit_block_sha256", "cold_logit_block_sha256")),
        # ---- one sample, rung 3
        Case("rung-3 sample: passing", judged(judge_sample, rung3_record(), RULE3)),
        Case("rung-3 sample: draft acceptance exactly at its floor",
             judged(judge_sample, rung3_record(draft_acceptance_rate=0.95), RULE3)),
        *(Case(f"rung-3 sample: draft acceptance {rate!r}", judged(judge_sample, rung3_record(draft_acceptance_rate=rate),
                                                                   RULE3))
          for rate in (-0.001, 1.001, 0.9500000001, 0.9499999999)),
        Case("rung-3 sample: KV differing at layer 1 V, draft tokens and trace differing, acceptance under its floor",
             judged(judge_sample, rung3_record(
                 draft_acceptance_rate=0.9, cold_draft_tokens_sha256="7" * 64, cold_draft_trace_sha256="8" * 64,
                 localisation={kv: [{"layer": 0, "k": 0.0, "v": 0.0},
                                    {"layer": 1, "k": 0.0, "v": 2.5, "v_position": 17}]}), RULE3)),
        *(Case(f"rung-3 sample: KV evidence {layers!r}", judged(judge_sample, rung3_record(localisation={kv: layers}),
                                                               RULE3))
          for layers in ([{"k": "x", "v": 0.0}], [{"layer": 2, "k": 0.0}], ["not a layer"], [], "0.0")),
        Case("rung-3 sample: a KV delta of thirteen significant digits",
             judged(judge_sample, rung3_record(localisation={kv: [{"layer": 3, "k": 0.0, "v": 0.1234567891234}]}),
                    RULE3)),
        Case("rung-3 sample: no draft declared", judged(judge_sample, rung3_record(), draftless)),
        Case("rung-3 sample, drift-graded: passing", judged(judge_sample, rung3_record(), graded3)),
        Case("rung-3 sample, drift-graded: deltas and a digest mismatch at row 4", judged(judge_sample, rung3_record(
            max_abs=0.5, mean_abs=0.01, logit_row_digests_equal=False, first_logit_digest_mismatch_row=4,
            handoff_logit_block_sha256="9" * 64), graded3)),
        Case("rung-3 sample, drift-graded: mean_abs null", judged(judge_sample, rung3_record(mean_abs=None), graded3)),
        Case("rung-3 sample: nonzero deltas over equal digests",
             judged(judge_sample, rung3_record(max_abs=0.5, mean_abs=0.01), RULE3)),
        Case("rung-3 sample: logit_row_digests_equal null",
             judged(judge_sample, rung3_record(logit_row_digests_equal=None), RULE3)),
        Case("rung-3 sample: only one side of the draft tokens digest",
             judged(judge_sample, rung3_record(cold_draft_tokens_sha256=None), RULE3)),
        *(Case(f"rung-3 sample: recorded row digests, {label}", judged(judge_sample, rung3_record(
            handoff_logit_row_sha256=[row] * 256, cold_logit_row_sha256=cold), RULE3))
          for label, cold in [("agreeing", [row] * 256), ("cold side null", None),
                              ("differing in the last row", [row] * 255 + ["b" * 64]), ("cold side one short", [row] * 255)]),
        # ---- a judge given another rung's rule
        Case("judge_rung2_sample given a bit-exact rule", refused(judge_rung2_sample, rung2_record(), RULE3)),
        Case("judge_rung3_sample given a bounded-drift rule", refused(judge_rung3_sample, rung2_record(), RULE2)),
        Case("judge_teacher_forced_rows given a bit-exact rule", refused(judge_teacher_forced_rows, rung2_record(), RULE3)),
        Case("a sample of another schema", judged(judge_rung2_sample, rung2_record() | {"schema": "trust-ladder.sample.v0"},
                                                  RULE2)),
        # ---- the summary over repetitions
        Case("summary: three passing repetitions", judged(judge_summary, three, RULE2)),
        Case("summary: one repetition, as its rule asks",
             judged(judge_summary, [rung2_record(1)], BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25,
                                                                        repetitions=1))),
        Case("summary, rung 3: acceptance 0.99, 0.97, 0.98 against the floor", judged(judge_summary, [
            rung3_record(1, draft_acceptance_rate=0.99), rung3_record(2), rung3_record(3, draft_acceptance_rate=0.98)],
            RULE3)),
        Case("summary, rung 3: no draft declared", judged(judge_summary, [rung3_record(i) for i in (1, 2, 3)], draftless)),
        Case("summary: a count gap, a stray index, a failing repetition and a non-record", judged(judge_summary, [
            rung2_record(1), rung2_record(2, token_agreement_rate=0.5, max_abs=12.0), rung2_record(5), "x"], RULE2)),
        Case("summary: a repetition seen twice",
             judged(judge_summary, [rung2_record(1), rung2_record(1), rung2_record(3)], RULE2)),
        Case("summary: drift outside the rule in two repetitions", judged(judge_summary, [
            rung2_record(1), rung2_record(2, max_abs=12.5), rung2_record(3, mean_abs=1.5)], RULE2)),
        Case("summary: no samples", judged(judge_summary, [], RULE2)),
        Case("summary: a payload digest differing in repetitions 2 and 3", judged(judge_summary, [
            rung2_record(1), rung2_record(2, payload_sha256="8" * 64), rung2_record(3, payload_sha256="8" * 64)], RULE2)),
        Case("summary: repetitions without an index", judged(judge_summary, [
            without(rung2_record(), "repetition"), rung2_record(2, payload_sha256="8" * 64),
            without(rung2_record(payload_sha256="8" * 64), "repetition")], RULE2)),
        Case("summary: a payload digest missing in repetition 2 and in one without an index", judged(judge_summary, [
            rung2_record(1), without(rung2_record(2), "payload_sha256"),
            without(rung2_record(), "payload_sha256", "repetition")], RULE2)),
        Case("summary: a flag where a payload digest belongs", judged(judge_summary, [
            rung2_record(1), rung2_record(2, payload_sha256=True), rung2_record(3)], RULE2)),
        # ---- the reproduction of the fixture anchor
        Case("reproduction: the anchor reproduced", reproduction(anchor, anchor)),
        Case("reproduction: the anchor reproduced, with a draft", reproduction(anchor, anchor, draft=True)),
        Case("reproduction, rung 2: seams changed in repetition 2", reproduction(seams_moved, anchor)),
        Case("reproduction, rung 3: seams changed in repetition 2", reproduction(seams_moved, anchor, rung=3)),
        Case("reproduction, rung 2, a deterministic producer: seams changed in repetition 2",
             reproduction(seams_moved, anchor, deterministic_producer=True)),
        Case("reproduction: payload tree and seams changed", reproduction(all_moved, anchor)),
        Case("reproduction, a deterministic producer: payload tree and seams changed",
             reproduction(all_moved, anchor, deterministic_producer=True)),
        Case("reproduction: an anchor without a seams digest",
             reproduction(anchor, [rung2_record(i) for i in (1, 2, 3)])),
        Case("reproduction: an anchor whose seams differ among its own samples",
             reproduction(anchor, [anchor[0], rung2_record(2, seams_sha256="c" * 64), anchor[2]])),
        Case("reproduction: a run with no samples", reproduction([], anchor)),
        Case("reproduction: a changed repetition without an index",
             reproduction([anchor[0], without(rung2_record(seams_sha256="b" * 64), "repetition")], anchor)),
        Case("reproduction: no anchor samples", reproduction(anchor, [])),
        Case("reproduction: an anchor with an unreadable sample", reproduction(anchor, [*anchor[:2], "not a record"])),
        # ---- a failed step, and a whole qualification under its scope
        Case("failed step: handoff 2 under a scope",
             judged(judge_failed_step, "handoff 2", "wire refused  the\nmanifest", scope=scope)),
        Case("failed step: handoff 2 without a scope", judged(judge_failed_step, "handoff 2", "refused")),
        Case("qualification: passing under a scope", judged(
            judge_qualification, anchor, RULE2, anchor, deterministic_producer=True, scope=scope)),
        Case("qualification: repetition 2 diverging under a scope", judged(
            judge_qualification, [rung2_record(1, seams_sha256="a" * 64),
                                  rung2_record(2, token_agreement_rate=0.5, seams_sha256="a" * 64),
                                  rung2_record(3, seams_sha256="a" * 64)], RULE2,
            anchor, deterministic_producer=True, scope=scope)),
        # ---- rung 2 judged teacher-forced (tokens may part at near-ties)
        Case("teacher-forced sample: two near-tie partings", judged(judge_sample, parted(), forced)),
        Case("teacher-forced sample: tokens exact", judged(judge_sample, rung2_record(max_row_mean_abs=1.0), forced)),
        Case("teacher-forced sample: tokens exact, every row's mean unrecorded", judged(judge_sample, rung2_record(), forced)),
        Case("teacher-forced sample: a decisive parting, rows over both bounds, too many rows parted", judged(
            judge_sample, parted(row_max=12.5, row_mean=1.5, partings=[(3, 0.2), (9, 0.9), (40, 2.5)]), tight)),
        Case("teacher-forced sample: parted, no teacher-forced rows", judged(
            judge_sample, rung2_record(token_agreement_rate=0.5, cold_generated_token_sha256="7" * 64), forced)),
        Case("teacher-forced sample: tokens exact by agreement, digests differing", judged(
            judge_sample, rung2_record(max_row_mean_abs=1.0, cold_generated_token_sha256="7" * 64), forced)),
        Case("teacher-forced sample: flips and listed partings disagree", judged(
            judge_sample, parted(top1_flips=5), forced)),
        Case("teacher-forced sample: every value one ULP inside its bound", judged(judge_sample, parted(
            row_max=math.nextafter(11.0, 0.0), row_mean=math.nextafter(1.25, 0.0),
            partings=[(12, math.nextafter(0.75, 0.0))]), forced)),
        Case("teacher-forced sample: every value one ULP over its bound", judged(judge_sample, parted(
            row_max=math.nextafter(11.0, 20.0), row_mean=math.nextafter(1.25, 2.0),
            partings=[(12, math.nextafter(0.75, 1.0))]), forced)),
        Case("teacher-forced sample: two of 256 rows parted, the ceiling exactly 2/256", judged(
            judge_sample, parted(), forced.model_copy(update={'maximum_changed_row_share': 2 / 256}))),
        *(Case(f"teacher-forced sample, 3 tokens: one row parted, the ceiling one ULP {side} 1/3", judged(
            judge_sample, {**parted(partings=[(1, 0.125)]), "output_tokens": 3},
            forced.model_copy(update={'output_tokens': 3, 'maximum_changed_row_share': math.nextafter(1 / 3, toward)})))
          for side, toward in (("over", 1.0), ("under", 0.0))),
        Case("teacher-forced sample: tokens parted, generated-token digests equal", judged(
            judge_sample, {**parted(), "cold_generated_token_sha256": rung2_record()["handoff_generated_token_sha256"]},
            forced)),
        Case("qualification, teacher-forced: passing under a scope", judged(
            judge_qualification, forced_three, forced, forced_three, deterministic_producer=True, scope=scope)),
        Case("qualification, teacher-forced: a decisive parting under a scope", judged(
            judge_qualification, [*forced_three[:2], parted(3, partings=[(4, 3.5)])], forced, forced_three,
            deterministic_producer=True, scope=scope)),
    ]


def judge_scope_cases() -> list[Case]:
    from qualify.judge.scope import DocumentOutcome, Scope, length_ranges

    grid = (512, 1024, 2048, 4096, 8192)
    return [
        Case("a control document named with a space", refused(DocumentOutcome, "no spaces", ())),
        Case("service conditions the scope does not know",
             refused(Scope, "python-textwrap", 3, 2048, 256, None, service_conditions="rush-hour")),
        Case("lengths in three runs of the grid", lambda _workspace: length_ranges((512, 2048, 8192), grid)),
        Case("lengths in two runs of the grid", lambda _workspace: length_ranges((512, 1024, 4096, 8192), grid)),
    ]


def judge_service_cases() -> list[Case]:
    from qualify.judge.scope import Scope, scope_line
    from qualify.judge.service import judge_service_conditions
    from tests.unit.judge.test_service import aba, recovery

    def changed(document: dict[str, Any], request: int, **fields: Any) -> dict[str, Any]:
        document["requests"][request].update(fields)
        return document

    not_killed = recovery()
    not_killed["starts"][1] = {"start": 2, "began": "run start"}
    one_prompt = aba()
    one_prompt["requests"] = [dict(request, position=n) for n, request in
                              enumerate((r for r in one_prompt["requests"] if r["prompt"] == "python-textwrap"), 1)]
    scope = Scope(fixture="python-textwrap", repetitions=3, prompt_tokens=2048, output_tokens=256, controls=None,
                  service_conditions="aba")
    return [
        Case("A/B/A: every prompt equal to its solo run", judged(judge_service_conditions, aba())),
        Case("recovery: the handoffs after the kill equal the one before", judged(judge_service_conditions, recovery())),
        Case("A/B/A: prompt B after A differs from its solo run",
             judged(judge_service_conditions, changed(aba(), 1, payload_sha256="0" * 64, seams_sha256="1" * 64))),
        Case("recovery: the handoff after the kill differs",
             judged(judge_service_conditions, changed(recovery(), 1, logit_block_sha256="2" * 64))),
        Case("recovery: no kill", judged(judge_service_conditions, not_killed)),
        Case("A/B/A: one prompt only", judged(judge_service_conditions, one_prompt)),
        Case("unknown conditions", judged(judge_service_conditions, {"conditions": "abc"})),
        Case("the scope line under service conditions",
             lambda _workspace: [scope_line(True, scope), scope_line(False, scope, "why")]),
    ]


def judge_soak_cases() -> list[Case]:
    from qualify.judge.soak import judge_soak
    from tests.unit.judge.test_soak import ANCHOR, handoff

    def soak(records: list[dict[str, Any]], anchor: str | None = ANCHOR) -> Produce:
        return judged(judge_soak, records, handoffs=3, link_floor_gbit_per_s=2.0, anchor_payload_sha256=anchor,
                      link_words="over a Unix socket on this host", criteria="native-text-unix-v1")

    death = {"handoff": 2, "request": "soak-2", "error": "producer failed: closed the connection; exit status killed "
             "by signal 9", "producer_died": True, "exit_status": -9}
    return [
        Case("three handoffs held", soak([handoff(1, 5.0), handoff(2, 3.0), handoff(3, 7.0)])),
        Case("one handoff under the floor", soak([handoff(1), handoff(2, 1.5), handoff(3)])),
        Case("the producer died at handoff 2", soak([handoff(1), death])),
        Case("a payload other than the anchor's", soak([handoff(1), handoff(2, payload_sha256="b" * 64), handoff(3)])),
        Case("no anchor", soak([handoff(1), handoff(2), handoff(3)], anchor=None)),
    ]


def contract_soak_cases() -> list[Case]:
    from qualify.contract.soak import check_command_matches, load_soak_criteria

    criteria = load_soak_criteria()

    def differing(**asked: Any) -> Produce:
        given = {"handoffs": criteria.handoffs, "link_floor_gbit_per_s": criteria.link_floor_gbit_per_s,
                 "network": False, **asked}
        return refused(check_command_matches, criteria, "soak criteria contracts/soak/native-text-unix-v1.json", **given)

    return [
        Case("--handoffs other than the criteria's", differing(handoffs=50)),
        Case("--link-floor other than the criteria's", differing(link_floor_gbit_per_s=2.5)),
        Case("--producer-at under unix-socket criteria", differing(network=True)),
    ]


# =========================================================================== qualify.judge: a served pair


def judge_served_cases() -> list[Case]:
    from qualify.judge.calibration import ZERO_DRIFT_BOUND
    from qualify.judge.served import TOP_K, judge_served_pair, judge_top_k_row
    from tests.unit.judge.test_served_judge import BOUND, COLD, MUST_FAIL, K, branch, cold_of, handoffs, rows, rule

    def verdict_of(*args: Any) -> Verdict:
        return judge_served_pair(*args)[0]

    top = rule(TOP_K, k=4)
    return [
        Case("served: every piece of evidence, full logprobs", judged(verdict_of, COLD, handoffs(), rule())),
        Case("served: top-4 logprobs within the bound", judged(
            verdict_of, branch(cached=0, external=0, logprobs=rows(5)), handoffs(branch(logprobs=rows(5))), top)),
        Case("served: a logprob outside the bound and a token divergence", judged(
            verdict_of, COLD, handoffs(branch(tokens=[0] * 5 + [7] * 3, logprobs=rows(shift=0.5, at=2))), rule())),
        Case("served: the prefill server loaded the prompt, the decode server's prefix cache served half", judged(
            verdict_of, COLD, handoffs(branch(cached=32, external=16, local=16), prefill_external=32), rule())),
        Case("served: no counters anywhere", judged(
            verdict_of, branch(cached=None, external=None, local=None),
            handoffs(branch(cached=None, external=None, local=None), prefill_external=None), rule())),
        Case("served: a handshake pair whose decode server reports the prefill server's cached count", judged(
            verdict_of, COLD, handoffs(branch(cached=0, external=64)), rule())),
        Case("served: the cold branch was loaded", judged(
            verdict_of, branch(cached=32, external=32), handoffs(), rule())),
        Case("served: under the zero bound, one logprob one ulp away", judged(
            verdict_of, COLD, handoffs(branch(logprobs=rows(shift=math.ulp(0.5), at=3))), rule(bound=ZERO_DRIFT_BOUND))),
        Case("served: every entry within the maximum, the mean outside its bound", judged(
            verdict_of, COLD, handoffs(branch(logprobs=tuple({t: v + 5e-4 for t, v in row.items()} for row in rows()))),
            rule(bound=1e-3, mean_bound=1e-4))),
        Case("served: top-2 with ids 1 and 3 exchanged far from the k-th", judged(
            verdict_of, branch(cached=0, external=0, logprobs=rows(5)),
            handoffs(branch(logprobs=tuple({**row, 3: row[1], 1: row[3]} for row in rows(5)))), rule(TOP_K, k=2))),
        *(Case(f"served: the top-k rule must refuse {name}", judged(
            lambda name: judge_top_k_row(cold_of(name), MUST_FAIL[name], K, BOUND).reason, name)) for name in MUST_FAIL),
    ]


def judge_served_calibration_cases() -> list[Case]:
    from qualify.judge.served import TOP_K, Evidence, ServedHandoff
    from qualify.judge.served_calibration import ServedCell, judge_served_calibration
    from tests.unit.judge.test_served_calibration import EVIDENCE, PROMPT, N, branch, cell, rows

    def calibrated(cells: list[Any], evidence: Any = EVIDENCE) -> Produce:
        def produce(_workspace: Workspace) -> list[object]:
            judgement = judge_served_calibration(cells, evidence, output_tokens=N)
            return [*(cell.words() for cell in judgement.cells), judgement.verdict]
        return produce

    cold_rows = tuple({0: -0.1, 1: -1.0, 2: -2.0, 3: -2.0004} for _ in range(N))
    moved = tuple({0: -0.1, 1: -1.0, 3: -2.0001, 2: -2.0003} for _ in range(N))
    top_cells = [ServedCell(name, PROMPT, branch(cold_rows), branch(cold_rows),
                            ServedHandoff(1, 0, 0, branch(moved, external=PROMPT))) for name in ("a", "b")]
    return [
        Case("served calibration: two cells without drift", calibrated([cell("a"), cell("b")])),
        Case("served calibration: three drifting cells", calibrated(
            [cell(f"d{i}", again=branch(rows(a, at=1)), loaded=branch(rows(h, at=2), external=PROMPT))
             for i, (a, h) in enumerate([(0.01, 0.0), (0.0, 0.03), (0.02, 0.005)])])),
        Case("served calibration: top-3 cells with a membership move at the k-th", calibrated(
            top_cells, Evidence(TOP_K, 3, 0))),
        Case("served calibration: the second cold recompute loaded the prompt", calibrated(
            [cell("a"), cell("b", again=branch(external=24))])),
        Case("served calibration: the prefill server loaded the prompt", calibrated(
            [cell("a"), cell("b", prefill_external=24)])),
        Case("served calibration: one cell", calibrated([cell("a")])),
    ]


def served_identity_cases() -> list[Case]:
    from qualify.contract.served_identity import load_served_identity
    from tests.unit.contract.test_served_identity import edited, identity_document

    def loaded(content: Any) -> Produce:
        def produce(workspace: Workspace) -> Raised:
            path = workspace.root / "pair.json"
            if content is not None:
                path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
            return refusal_of(lambda: load_served_identity(path))
        return produce

    return [
        Case("served identity: no such file", loaded(None)),
        Case("served identity: not JSON", loaded("{not json")),
        Case("served identity: its basis missing", loaded(edited(lambda d: d.pop("basis")))),
        Case("served identity: a zero bound", loaded(edited(lambda d: d["rule"].update(maximum_absolute=0.0)))),
        Case("served identity: a bound rule reworded", loaded(
            edited(lambda d: d["rule"]["bound_rule"].update(statement="a bound I chose")))),
        Case("served identity: top_k under full logprobs", loaded(edited(lambda d: d["evidence"].update(top_k=20)))),
        Case("served identity: another schema", loaded(identity_document() | {"schema": "trust-ladder.x.v1"})),
    ]


# =========================================================================== qualify.judge: calibration and parity


def judge_calibration_cases() -> list[Case]:
    from dataclasses import replace

    from qualify.contract.rules import BOUND_RULE
    from qualify.judge.calibration import (
        ANCHOR_PART,
        CALIBRATION_PART,
        bound_problems,
        calibration_cells,
        derive_bounds,
        derive_teacher_forced_bounds,
    )
    from tests.unit.judge.test_calibration_rules import ANCHORS, CELLS, calibrated, evidence, parted, record
    from tests.unit.judge.test_calibration_rules import judged as calibration

    draft_digests = {"handoff_draft_tokens_sha256": "d" * 64, "handoff_draft_trace_sha256": "e" * 64}

    def problems_of(document: Any, records: list[Any]) -> Produce:
        return lambda _workspace: calibration_cells(document, records)[1]

    def judged_calibration(records: list[Any], document: Any, **options: Any) -> Produce:
        return lambda _workspace: calibration(records, document, **options).verdict

    def drafted(draft: dict[str, int] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        document = evidence(CELLS + ANCHORS, draft=draft)
        drifts = [(1.0, 0.05), (1.5, 0.07), (1.25, 0.06), (0.5, 0.05), (0.5, 0.05)]
        return document, [record(index, *drift, **draft_digests) for index, drift in enumerate(drifts, start=1)]

    def one_ulp_relaxed_mean(_workspace: Workspace) -> list[str]:
        document, records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
        bounds = derive_bounds(calibration_cells(document, records)[0])
        assert bounds is not None
        return bound_problems(document, records, maximum_absolute=bounds.maximum_absolute, acceptance_floor=0.5,
                              maximum_mean_absolute=math.nextafter(bounds.maximum_mean_absolute, math.inf))

    def mean_given_maximum_none(_workspace: Workspace) -> list[str]:
        document, records = calibrated([0.25, 0.0, 0.0], [0.0, 0.01, 0.0])
        bounds = derive_bounds(calibration_cells(document, records)[0])
        assert bounds is not None
        return bound_problems(document, records, maximum_absolute=None, acceptance_floor=None,
                              maximum_mean_absolute=bounds.maximum_mean_absolute)

    def tf_one_ulp_over(_workspace: Workspace) -> list[str]:
        records = [parted(1, 2.0, 0.3, [(5, 0.2)]), parted(2, 3.0, 0.4, [(9, 0.4)]),
                   parted(3, 2.5, 0.35, [(7, 0.3)]), parted(4, 2.5, 0.35, [(7, 0.3)])]
        document = evidence(CELLS[:2] + ANCHORS)
        bounds = derive_teacher_forced_bounds(calibration_cells(document, records)[0])
        assert bounds is not None
        over = replace(bounds, near_tie_margin=math.nextafter(bounds.near_tie_margin, math.inf))
        return bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None,
                              acceptance_floor=None, teacher_forced=over)

    def long_rule(_workspace: Workspace) -> list[str]:
        document, records = calibrated([1.0, 1.5], [0.05, 0.07])
        document["rule"] = {"name": BOUND_RULE, "statement": "s" * 200}
        return bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None, acceptance_floor=None)

    def rung3_drifted(_workspace: Workspace) -> list[str]:
        document, records = calibrated([0.25, 0.0, 0.0], [0.0, 0.01, 0.0])
        return bound_problems(document, records, maximum_absolute=None, maximum_mean_absolute=None, acceptance_floor=None)

    clean_document, clean_records = calibrated([1.0, 1.5, 1.25], [0.05, 0.07, 0.06])
    diverged_records = [*clean_records[:3], record(4, 0.5, 0.05, exact=False), record(5, 0.5, 0.05, exact=False)]
    differing_document, differing_records = calibrated([1.0, 1.5], [0.05, 0.07])
    differing_records[-1] = {**differing_records[-1], "payload_sha256": "f" * 64, "seams_sha256": "f" * 64}
    rung3_document, rung3_records = calibrated([0.25, 0.0, 0.0], [0.0, 0.01, 0.0], anchor=(0.0, 0.0))
    counted, uncounted = drafted({"proposed": 255, "accepted": 225}), drafted(None)
    return [
        # ---- calibration cells: what keeps a cell from counting
        Case("cells: an anchor listed first, a malformed entry, a missing sample, a failed handoff, negative drifts",
             problems_of({"handoffs": [
                 {"repetition": 1, "part": ANCHOR_PART, "document": "python-textwrap", "prompt_tokens": 2048},
                 {"repetition": True, "part": CALIBRATION_PART, "document": "doc-a", "prompt_tokens": 512},
                 *({"repetition": index, "part": CALIBRATION_PART, "document": name, "prompt_tokens": 512}
                   for index, name in ((3, "doc-b"), (4, "doc-c"), (5, "doc-d"), (6, "doc-e"))),
                 {"repetition": 7, "part": CALIBRATION_PART, "document": "doc-a", "prompt_tokens": 1024},
                 {"repetition": 8, "part": CALIBRATION_PART, "document": "doc-b", "prompt_tokens": 1024}]},
                 [record(1, 0.5, 0.05), {"repetition": 4, "error": "producer failed:\n  stalled"}, record(5, -0.5, 0.05),
                  record(6, 0.5, -0.05), record(7, 1.0, 0.05), record(8, 19.0, 2.0, exact=False, teacher=(1.25, 0.06))])),
        Case("cells: a malformed entry longer than 120 characters", problems_of(
            {"handoffs": [{"repetition": "1", "document": "d" * 200, "prompt_tokens": 1024, "part": CALIBRATION_PART}]},
            [record(1, 1.0, 0.05)])),
        Case("cells: an empty handoff list", problems_of({"handoffs": []}, [record(1, 1.0, 0.05)])),
        Case("cells: a diverged cell without a teacher-forced drift", problems_of(
            evidence(CELLS[:2] + ANCHORS), [record(1, 19.7, 2.3, exact=False), record(2, 1.5, 0.08), record(3, 0.5, 0.05),
                                            record(4, 0.5, 0.05)])),
        # ---- sealed numbers against their basis
        Case("sealed numbers, rung 3: cells drifting in the maximum only and in the mean only", rung3_drifted),
        Case("sealed numbers: a mean bound given with the maximum None, cells drifting", mean_given_maximum_none),
        Case("sealed numbers: a mean bound one ULP over, a floor without draft counts", one_ulp_relaxed_mean),
        Case("sealed numbers: a stated rule longer than 120 characters", long_rule),
        Case("sealed numbers: one measured cell", judged(lambda: bound_problems(
            *calibrated([1.0], [0.05]), maximum_absolute=1.0, maximum_mean_absolute=0.05, acceptance_floor=None))),
        # ---- a calibration's checks
        *(Case(f"calibration: evidence {broken!r}", judged_calibration([record(1, 1.0, 0.05)], broken,
                                                                      restarts_minimum=0))
          for broken in (None, [], ["handoffs"])),
        Case("calibration: clean", judged_calibration(clean_records, clean_document)),
        Case("calibration: diverged anchors", judged_calibration(diverged_records, clean_document)),
        Case("calibration: anchors differing in payload tree and seams",
             judged_calibration(differing_records, differing_document)),
        Case("calibration: a failed anchor handoff", judged_calibration(
            [record(1, 1.0, 0.05), record(2, 1.5, 0.07), record(3, 1.25, 0.06), record(4, 0.5, 0.05), record(5, 0.5, 0.05),
             {"repetition": 6, "error": "producer failed: stalled"}],
            evidence(CELLS + ANCHORS + [(ANCHOR_PART, "python-textwrap", 2048)]))),
        Case("calibration: a missing cell sample and a failed cell handoff", judged_calibration(
            [{"repetition": 2, "error": "boom"}, record(3, 1.0, 0.05), record(4, 1.5, 0.07), record(5, 0.5, 0.05),
             record(6, 0.5, 0.05)],
            evidence([(CALIBRATION_PART, "doc-a", 512), (CALIBRATION_PART, "doc-b", 512), *CELLS[:2], *ANCHORS]))),
        Case("calibration, rung 3: two drifting cells", judged_calibration(rung3_records, rung3_document, rung=3)),
        Case("calibration, rung 3: every cell bit-exact", judged_calibration(
            *reversed(calibrated([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], anchor=(0.0, 0.0))), rung=3)),
        Case("calibration: too few producer restarts", judged_calibration(
            *reversed(calibrated([1.0, 1.5], [0.05, 0.07])), restarts_minimum=4)),
        Case("calibration: the fixture outside the derived bounds", judged_calibration(
            *reversed(calibrated([1.0, 1.5], [0.05, 0.07], anchor=(9.0, 0.05))))),
        Case("calibration, a draft lane: anchor counts 225/255", judged_calibration(counted[1], counted[0], draft=True)),
        Case("calibration, a draft lane: no anchor counts", judged_calibration(uncounted[1], uncounted[0], draft=True)),
        Case("calibration, a lane without a draft: anchor counts recorded",
             judged_calibration(counted[1], counted[0], draft=False)),
        Case("calibration: the fixture parts at near-ties (teacher-forced)", judged_calibration(
            [parted(1, 2.0, 0.3, [(5, 0.2), (40, 0.1)]), parted(2, 3.0, 0.4, [(9, 0.4)]),
             parted(3, 2.5, 0.35, [(7, 0.3)]), parted(4, 2.5, 0.35, [(7, 0.3)])], evidence(CELLS[:2] + ANCHORS))),
        Case("calibration: the fixture parts decisively (teacher-forced)", judged_calibration(
            [parted(1, 2.0, 0.3, [(5, 0.2)]), parted(2, 3.0, 0.4, [(9, 0.4)]),
             parted(3, 2.5, 0.35, [(7, 3.0)]), parted(4, 2.5, 0.35, [(7, 3.0)])], evidence(CELLS[:2] + ANCHORS))),
        Case("calibration: each anchor parts decisively and over the row bound (teacher-forced)", judged_calibration(
            [parted(1, 2.0, 0.3, [(5, 0.2)]), parted(2, 3.0, 0.4, [(9, 0.4)]),
             parted(3, 9.0, 0.35, [(7, 3.0)]), parted(4, 9.0, 0.35, [(7, 3.0)])], evidence(CELLS[:2] + ANCHORS))),
        Case("sealed numbers, teacher-forced: a near-tie margin one ULP over", tf_one_ulp_over),
        *calibration_envelope_cases(),
    ]


def calibration_envelope_cases() -> list[Case]:
    """A calibration of a producer declared non-deterministic (tests/unit/judge/test_calibration_envelope.py)."""
    from tests.unit.judge.test_calibration_envelope import calibration
    from tests.unit.judge.test_calibration_envelope import judged as envelope_calibrated

    def stated(**options: Any) -> Produce:
        return lambda _workspace: envelope_calibrated(*calibration(), **options).verdict

    def without_series(_workspace: Workspace) -> Verdict:
        document, records, by_repetition = calibration()
        del by_repetition[6]
        return envelope_calibrated(document, records, by_repetition).verdict

    def one_start(_workspace: Workspace) -> Verdict:
        return envelope_calibrated(*calibration(starts=[4, 4, 4, 4])).verdict

    def miscounted(_workspace: Workspace) -> Verdict:
        document, records, by_repetition = calibration()
        document["fixture_envelope"]["handoffs"] = 8
        return envelope_calibrated(document, records, by_repetition).verdict

    def long_entry_and_rule(_workspace: Workspace) -> Verdict:
        document, records, by_repetition = calibration()
        document["handoffs"][3]["producer_start"] = "start " + "s" * 200
        document["fixture_envelope"]["rule"] = {"name": "r" * 200}
        return envelope_calibrated(document, records, by_repetition).verdict

    return [
        Case("non-deterministic calibration: the envelope stated", stated()),
        Case("non-deterministic calibration: a malformed entry and a rule, each longer than 120 characters",
             long_entry_and_rule),
        Case("non-deterministic calibration: an envelope handoff without its series", without_series),
        Case("non-deterministic calibration: one producer start", one_start),
        Case("non-deterministic calibration: a declaration its entries do not show", miscounted),
        Case("non-deterministic calibration: rung 3", stated(rung=3)),
        Case("non-deterministic calibration: next steps", calibration_next_steps),
    ]


def calibration_next_steps(_workspace: Workspace) -> list[str]:
    """What ``qualify calibrate --non-deterministic`` prints after its verdict (no receipt here: the
    freeze commands are tests/unit/run/test_onboarding.py's)."""
    from qualify.run.calibrate import Calibration
    from qualify.run.onboarding import next_steps
    from tests.unit.judge.test_calibration_envelope import calibration
    from tests.unit.judge.test_calibration_envelope import judged as envelope_calibrated

    document, records, by_repetition = calibration()
    judged_calibration = envelope_calibrated(document, records, by_repetition)
    passed = Calibration("lane-x", records, judged_calibration.cells, judged_calibration.proposed_maximum_absolute,
                         judged_calibration.proposed_maximum_mean_absolute, None, None, [], True, False, True,
                         judged_calibration.verdict.headline, envelope=judged_calibration.envelope,
                         non_deterministic=True)
    failed = Calibration("lane-x", records, judged_calibration.cells, None, None, None, None, [], True, False, False,
                         "calibration of lane-x: no envelope", non_deterministic=True)
    return [f"{step.style or 'plain'}: {step.text}" for result in (passed, failed)
            for step in next_steps(result, "nvfp4-native-w4a4", "native-text")]


def judge_envelope_cases() -> list[Case]:
    from qualify.judge import judge_summary
    from qualify.judge.envelope import derive_fixture_envelope, judge_envelope
    from tests.unit.judge.test_envelope import HONEST, series
    from tests.unit.judge.test_judge import RULE2, three

    envelope = derive_fixture_envelope(HONEST, starts=2)
    moved = three()
    moved[1]["payload_sha256"] = "b" * 64
    return [
        Case("envelope: honest handoffs inside", judged(judge_envelope, HONEST, envelope)),
        Case("envelope: a row and a position outside", judged(judge_envelope, [series([1.0, 4.5, 0.001])], envelope)),
        Case("envelope: a series of another length", judged(judge_envelope, [series([1.0, 2.0])], envelope)),
        Case("envelope: no handoffs", judged(judge_envelope, [], envelope)),
        Case("envelope: too few honest handoffs", refused(derive_fixture_envelope, HONEST[:3], starts=2)),
        Case("envelope: one producer start", refused(derive_fixture_envelope, HONEST, starts=1)),
        Case("envelope: an honest NaN", refused(derive_fixture_envelope, [*HONEST[:3], series([1.0, math.nan, 0.0])],
                                                starts=2)),
        Case("summary: non-deterministic producer, payload digest moved",
             judged(judge_summary, moved, RULE2, deterministic_producer=False)),
        *envelope_seal_and_qualification_cases(),
    ]


def envelope_seal_and_qualification_cases() -> list[Case]:
    """A sealed envelope held to its basis's handoffs, a handoff without series, and the verdict
    and scope of a qualification held to its envelope."""
    from dataclasses import replace

    from qualify.judge import judge_qualification
    from qualify.judge.envelope import EnvelopeSeal, derive_fixture_envelope, judge_envelope, seal_problems
    from qualify.judge.scope import EnvelopeScope, Scope
    from qualify.run.fixture_envelope import NO_COMPARISON, NO_TENSOR_SERIES, missing_series
    from tests.unit.judge.test_envelope import HONEST, series
    from tests.unit.judge.test_judge import RULE2, three

    envelope = derive_fixture_envelope(HONEST, starts=2)
    seal = EnvelopeSeal.of(envelope)
    scope = Scope("python-textwrap", 3, 2048, 256, None,
                  envelope=EnvelopeScope(envelope.rule, envelope.handoffs, envelope.starts))
    records = three(seams_sha256="a" * 64)

    def problems(sealed: EnvelopeSeal, handoffs: list[Any]) -> Produce:
        return lambda _workspace: seal_problems(sealed, handoffs, starts=2)[0]

    inside = judge_envelope(HONEST[:3], envelope)
    outside = judge_envelope([*HONEST[:2], series([1.0, 4.5, 0.0])], envelope)
    missing = judge_envelope(HONEST[:2], envelope, missing=[missing_series(3, NO_TENSOR_SERIES)])
    return [
        Case("seal: every field moved", problems(replace(seal, rule="fixture-envelope-max-plus-range.v1", handoffs=8,
                                                         starts=3, multipliers=(2.0, 2.5, 2.0, 2.0),
                                                         ceilings_sha256="ab" * 32), HONEST)),
        Case("seal: one multiplier too few", problems(replace(seal, multipliers=(2.0, 2.0, 2.0)), HONEST)),
        Case("seal: handoffs that state no envelope", problems(seal, HONEST[:3])),
        Case("envelope: a handoff without its series", lambda _workspace: missing),
        Case("envelope: a handoff that failed before its comparison",
             judged(judge_envelope, HONEST[:2], envelope, missing=[missing_series(3, NO_COMPARISON)])),
        Case("qualification held to its envelope: passed",
             judged(judge_qualification, records, RULE2, three(seams_sha256="a" * 64), deterministic_producer=False,
                    scope=scope, envelope=inside)),
        Case("qualification held to its envelope: a row outside",
             judged(judge_qualification, records, RULE2, three(seams_sha256="a" * 64), deterministic_producer=False,
                    scope=scope, envelope=outside)),
        Case("qualification held to its envelope: a handoff without its series",
             judged(judge_qualification, records, RULE2, three(seams_sha256="a" * 64), deterministic_producer=False,
                    scope=scope, envelope=missing)),
    ]


def judge_parity_cases() -> list[Case]:
    from qualify.judge import judge_parity
    from tests.unit.judge.test_parity import CELL_A, CELL_B, cell, p13_cell, shifted

    return [
        Case("parity: exactly at the spread", judged(judge_parity, cell("a-lane", CELL_A), cell("b-lane", CELL_B))),
        Case("parity: a split one ULP inside the spread",
             judged(judge_parity, cell("a-lane", CELL_A), cell("b-lane", shifted(CELL_B, -1)))),
        Case("parity: b one ULP outside the spread, ahead",
             judged(judge_parity, cell("a-lane", CELL_A), cell("b-lane", shifted(CELL_B, 1)))),
        Case("parity: a one ULP outside the spread, ahead",
             judged(judge_parity, cell("a-lane", shifted(CELL_B, 1)), cell("b-lane", CELL_A))),
        Case("parity: rates of six significant digits, percentages of four", judged(
            judge_parity, p13_cell("native-nvfp4", 35.490711722, 0.00130), p13_cell("kquant", 35.439527527, 0.00037))),
        Case("parity refused: a cell with no spread and a measurement that is a bool",
             judged(judge_parity, cell("a", [10.0, 10.0]), cell("b", [True, 3.0]))),
    ]


@render.register
def _(judgement: ParityJudgement) -> list[str]:
    return [f"outcome: {judgement.outcome}", f"words: {judgement.words}"]


# =========================================================================== qualify.judge: controls


@render.register
def _(judgement: ControlsJudgement) -> list[str]:
    from qualify.judge.scope import controls_words

    if judgement.outcome is None:
        lines = ["no outcome"]
    else:
        lines = [f"length effect: {judgement.length_effect}", f"scope: {controls_words(judgement.outcome)}"]
    return lines + [f"problem: {problem}" for problem in judgement.problems]


def judge_controls_cases() -> list[Case]:
    from qualify.core.digests import jcs_sha256
    from qualify.judge import controls as controls_module
    from qualify.judge import judge_controls
    from tests.unit.judge.test_controls_judge import (
        CRITERIA,
        LANE,
        SOURCE,
        WINDOW,
        WINDOWS,
        counts_that_do_not_nest,
        every_cell_and_profile_defect,
        record_for,
        uniform,
        wrong_header,
        zero_record,
    )

    within = "a document is within the E1 gates when none of its four cells exceeds"
    shlex = CRITERIA["documents"][0]

    def criteria_with(**fields: Any) -> dict[str, Any]:
        return {**copy.deepcopy(CRITERIA), **fields}

    def against(criteria: Any) -> Produce:
        """A well-formed record naming ``criteria`` by its digest (when it has one), judged against them."""
        def produce(_workspace: Workspace) -> object:
            record = record_for(uniform(1, 10))
            if isinstance(criteria, dict):
                try:
                    record["criteria"]["sha256"] = jcs_sha256(criteria)
                except (TypeError, ValueError):
                    pass  # criteria with no digest: the criteria themselves are at fault
            return judge_controls(record, criteria, source=SOURCE)
        return produce

    def record_with(change: Callable[[dict[str, Any]], object], **options: Any) -> Produce:
        """The well-formed record after ``change``, judged against the committed criteria."""
        def produce(_workspace: Workspace) -> object:
            record = record_for(uniform(1, 10))
            change(record)
            return judge_controls(record, options.pop("criteria", CRITERIA), source=options.pop("source", SOURCE),
                                  **options)
        return produce

    def unknown_and_repeated(record: dict[str, Any]) -> None:
        shlex_document, news = copy.deepcopy(record["documents"][0]), copy.deepcopy(record["documents"][1])
        record["documents"] = [{"document": "python-textwrap"}, {"document": 3}, *record["documents"], shlex_document, news]

    def windows_not_objects(record: dict[str, Any]) -> None:
        record["documents"][2]["profile"][1] = []
        record["documents"][2]["profile"][3]["stop"] = 1536

    def one_row_windows(_workspace: Workspace) -> object:
        criteria = criteria_with(lengths=[1, 512, 2048, 4096], profile_window=1)
        return judge_controls(zero_record(criteria), criteria, source=SOURCE)

    def one_document_exceeding(_workspace: Workspace) -> object:
        counts = uniform(1, 10)
        counts["prose-idle-news"] = [(0, 0)] * 3 + [(WINDOW, 0)] + [(0, 0)] * 4  # rows 1536..2048 all disagree
        counts["config-idle-keys"] = [(0, 0)] * WINDOWS
        return judge_controls(record_for(counts), CRITERIA, source=SOURCE, lane=LANE)

    def outcome_refused_by_the_scope(workspace: Workspace) -> object:
        def refuse(**_fields: Any) -> None:
            raise ValueError("documents out\nof order")

        workspace.patch.setattr(controls_module, "ControlsOutcome", refuse)
        return judge_controls(record_for(uniform(1, 10)), CRITERIA, source=SOURCE)

    def with_field(field: str, value: object) -> Produce:
        return judged(lambda: judge_controls(record_for(uniform(1, 10)), {**copy.deepcopy(CRITERIA), field: value},
                                             source=SOURCE))

    criteria_defects: list[tuple[str, dict[str, Any]]] = [
        ("another schema", {"schema": "trust-ladder.e2-controls-criteria.v0"}),
        ("a name that is not a name", {"name": "E2 Controls"}),
        ("documents not a list", {"documents": "python-test-shlex"}),
        ("the only document without a digest", {"documents": [{"name": "python-test-shlex", "token_sha256": "nope"}]}),
        ("the only document with a bad name", {"documents": [{"name": "Shlex", "token_sha256": shlex["token_sha256"]}]}),
        ("a document twice", {"documents": [shlex, shlex]}),
        ("a document that is not an object", {"documents": ["python-test-shlex"]}),
        ("a length of zero", {"lengths": [0, 512, 2048, 4096]}),
        ("no lengths", {"lengths": []}),
        ("lengths that are text", {"lengths": "512"}),
        ("lanes that are a number", {"lanes": 5}),
        ("a lane that is no name", {"lanes": ["ok", 7]}),
        ("a criterion that is no text", {"criteria": {"length_effect_supported": ["x"], "document_within": within}}),
        ("a length twice", {"lengths": [512, 512, 2048, 4096]}),
        ("a length not a whole number of windows", {"lengths": [512, 1000, 2048, 4096]}),
        ("a profile window of zero", {"profile_window": 0}),
        ("a profile window that is a bool", {"profile_window": True}),
        ("a yardstick digest that is not one", {"yardstick": {"name": "kquant-q8_0", "sha256": "nope"}}),
        ("a gate rule the judge does not compute", {"gate": {**CRITERIA["gate"], "rule": "wilson-lower-plus-points"}}),
        ("confidence of zero", {"gate": {**CRITERIA["gate"], "confidence": 0.0}}),
        ("points of one", {"gate": {**CRITERIA["gate"], "points": 1.0}}),
        ("another exceedance wording", {"exceedance": "a cell whose lane disagreement is at least its gate"}),
        ("another length-effect wording",
         {"criteria": {**CRITERIA["criteria"], "length_effect_supported": "every control document exceeds at 4096"}}),
        ("a length the criterion names is missing", {"lengths": [512, 1024, 2048, 3072]}),
        ("three lengths", {"lengths": [512, 2048, 4096]}),
        ("another document-within wording", {"criteria": {**CRITERIA["criteria"], "document_within": "no cell exceeds"}}),
        ("a value with no JSON form", {"note": math.nan}),
    ]
    return [
        Case("a well-formed record, every document within its gates", against(CRITERIA)),
        Case("a well-formed record, one document exceeding at 2048 and 4096", one_document_exceeding),
        Case("criteria with a profile window of one row and a length of one row", one_row_windows),
        *(Case(f"criteria: {name}", against(criteria_with(**fields))) for name, fields in criteria_defects),
        Case("criteria: not an object", against("e2-controls-v1")),
        Case("criteria: a name that is not a name, the record naming the committed criteria",
             with_field("name", "E2 Controls")),
        Case("criteria: lanes that are a number, the record naming the committed criteria", with_field("lanes", 5)),
        Case("criteria: lengths that are text, the record naming the committed criteria", with_field("lengths", "y")),
        Case("record: every header field wrong", record_with(wrong_header)),
        Case("record: no documents", record_with(lambda record: record.pop("documents"))),
        Case("record: documents not a list, seconds negative and text", record_with(
            lambda record: record.update(documents="none", seconds={"prefill": -1, "scoring": "3"}))),
        *(Case(f"record: seconds {seconds}", record_with(lambda record, seconds=seconds: record.update(seconds=seconds)))
          for seconds in ({"prefill": 0, "scoring": 0.5}, {"prefill": 0.0, "scoring": 0})),
        Case("record: a source that is not a receipt", record_with(lambda record: None, source="controls.json")),
        *(Case(f"record: not an object, {record!r}", judged(lambda record=record: judge_controls(record, CRITERIA,
                                                                                              source=SOURCE)))
          for record in ("record", 7)),
        Case("record: a lane that is not a string", record_with(lambda record: record.update(lane=5))),
        Case("record: no lane, a lane being judged", record_with(lambda record: record.pop("lane"), lane=LANE)),
        Case("record: every cell and profile defect at once", record_with(every_cell_and_profile_defect)),
        Case("record: counts that do not nest, a short profile, a count over its window", record_with(counts_that_do_not_nest)),
        Case("record: unknown and repeated documents", record_with(unknown_and_repeated)),
        Case("record: a window that is not an object, and a later window of no rows", record_with(windows_not_objects)),
        Case("an outcome the scope refuses", outcome_refused_by_the_scope),
    ]


# =========================================================================== qualify.contract.identity


def identity_cases() -> list[Case]:
    from qualify.contract import identity as identity_module
    from qualify.contract.identity import (
        BASIS_MANIFEST_MAX_BYTES,
        Identity,
        check_sealed,
        identity_json_schema,
        identity_sha256,
        parse_identity_document,
    )
    from qualify.core.digests import sha256_bytes
    from tests.unit.contract.test_identity import (
        BASIS_RUN_ID,
        BASIS_URI,
        basis_identity,
        check_manifest_only,
        digest,
        make_document,
        mutated,
        writer_rescue,
    )

    where = "identity x"

    def parsed(document: Any) -> Produce:
        return refused(parse_identity_document, document, where=where)

    def model_errors(document: dict[str, Any]) -> Produce:
        """The model used directly, with no schema layer in front of it: each error's place, type and words."""
        def produce(_workspace: Workspace) -> list[str]:
            try:
                Identity.model_validate_json(json.dumps(document), strict=True)
            except ValidationError as exc:
                return [f"error at {'.'.join(map(str, error['loc']))} ({error['type']}): {error['msg']}"
                        for error in exc.errors(include_url=False)]
            raise AssertionError("the model accepted the document")
        return produce

    def basis_checked(workspace: Workspace, manifest: Callable[[Path], object], sealed: str,
                      basis: str = BASIS_URI) -> object:
        """The basis check with the archive layer passed in (the URI resolves, every file verifies);
        ``manifest`` makes the basis receipt's manifest.json."""
        receipt = workspace.root / "archive" / BASIS_RUN_ID
        receipt.mkdir(parents=True)
        manifest(receipt / "manifest.json")
        checked = basis_identity(basis)
        return refusal_of(lambda: check_manifest_only(checked, workspace.root / "archive", sealed))

    def oversized(workspace: Workspace) -> object:
        data = b"m" * (BASIS_MANIFEST_MAX_BYTES + 1)
        return basis_checked(workspace, lambda path: path.write_bytes(data), sha256_bytes(data))

    def linked(workspace: Workspace) -> object:
        target = workspace.root / "elsewhere.json"
        target.write_bytes(b"{}")
        return basis_checked(workspace, lambda path: path.symlink_to(target), sha256_bytes(b"{}"))

    def fifo(workspace: Workspace) -> object:
        fifo_path = workspace.root / "archive" / BASIS_RUN_ID / "manifest.json"
        with writer_rescue(fifo_path):  # a read that waited for a writer would end, and fail elsewhere
            return basis_checked(workspace, os.mkfifo, digest("manifest"))

    def nested(workspace: Workspace) -> object:
        return basis_checked(workspace, lambda path: path.write_bytes(b"{}"), digest("another"),
                             basis=f"receipt://{BASIS_RUN_ID}/samples/0.json")

    def no_canonical_form(workspace: Workspace) -> object:
        def fail(_document: object) -> str:
            raise ValueError("no canonical\nform")

        loaded = basis_identity()
        workspace.patch.setattr(identity_module, "document_sha256", fail)
        return refusal_of(lambda: identity_sha256(loaded))

    draft = make_document("kquant-exact-dflash")["speculative_draft"]
    files = {"model/config.json": digest("config"), "models/foo/config.json": digest("weights")}
    return [
        Case("an unknown lane", parsed(mutated(make_document(), "lane", "no-such-lane"))),
        *(Case(f"an unknown {rule} name", parsed(mutated(make_document(), f"calibration.{rule}",
                                                           {"name": "taste.v1", "statement": "by eye"})))
          for rule in ("bound_rule", "floor_rule")),
        Case("a native lane declaring a speculative draft", parsed(mutated(make_document(), "speculative_draft", draft))),
        Case("prompt tokens other than the qualification's", parsed(mutated(make_document(), "prompt.tokens", 2047))),
        Case("a checkpoint mixing two models", parsed(make_document(files=files))),
        *(Case(f"a retired schema {version}",
               parsed(mutated(make_document(), "schema", f"trust-ladder.onboarding-identity.{version}")))
          for version in ("v1", "v2", "v3", "v4")),
        *(Case(f"an unknown schema {value!r}", parsed(mutated(make_document(), "schema", value)))
          for value in ("trust-ladder.onboarding-identity.v9", ["x"], {"v": 3})),
        Case("the model: the placeholder digest", model_errors(mutated(make_document(), "tokenizer_sha256", "0" * 64))),
        Case("the model: prompt tokens other than the qualification's",
             model_errors(mutated(make_document(), "prompt.tokens", 2047))),
        Case("the schema of an unknown version", refused(identity_json_schema, "trust-ladder.onboarding-identity.v2")),
        Case("an unsealed lane", refused(check_sealed, basis_identity(), where,
                                         {"nvfp4-native-f16": digest("a"), "vllm-to-vllm": digest("b")})),
        Case("the basis manifest one byte over its bound", oversized),
        Case("the basis manifest a symbolic link", linked),
        Case("the basis manifest a FIFO", fifo),
        Case("a nested basis URI, its receipt's manifest differing from the seal", nested),
        Case("the digest of a document that is no identity", refused(identity_sha256, {"lane": "x"})),
        Case("the digest of an identity with no canonical form", no_canonical_form),
        *(Case(f"v8: {name}", parsed(make()))
          for name, (make, _field) in non_deterministic_refusals().items()),
        Case("v8, the model: more producer starts than handoffs",
             model_errors(non_deterministic_refusals()["more producer starts than handoffs"][0]())),
        Case("v8, the model: v5 declaring a non-deterministic producer",
             model_errors(non_deterministic_refusals()["v5 declaring a non-deterministic producer"][0]())),
    ]


def non_deterministic_refusals() -> dict[str, Any]:
    """The v8 refusal cases of tests/unit/contract/test_identity_non_deterministic.py: name -> (document maker, field)."""
    from tests.unit.contract.test_identity_non_deterministic import REFUSED

    return REFUSED


# =========================================================================== qualify.archive.verify: receipts verify




class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


def verify_cases() -> list[Case]:
    from qualify.archive.keys import default_trust_path, load_signing_key
    from qualify.archive.layout import MANIFEST, PARTIAL_PREFIX, SUMMARY
    from qualify.archive.verify import verify_document, verify_paths, verify_receipt
    from qualify.interfaces.verify_command import verify_cli
    from tests.support.receipt_forgery import (
        check,
        fail_scandir,
        make_writable,
        operator_key,
        operator_trust,
        rehash_manifest,
        resign,
        write_receipt,
    )
    from tests.unit.archive.test_receipts import committed_receipts
    from tests.unit.archive.test_signed_receipts import consistent_forgery

    def receipt(workspace: Workspace, run: str = RUN_A, archive: str = "archive", writable: bool = False) -> Path:
        """A signed receipt as the qualifier writes one, under ``archive`` in the case's directory."""
        path = write_receipt(workspace.root / archive, run_id=run)
        key = load_signing_key().key_id
        workspace.mask(key, "<key id>")
        workspace.mask(key[:16], "<key id 16>")
        if writable:
            make_writable(path)
        return path

    def legacy_copy(workspace: Workspace) -> Path:
        """A writable copy of the first committed legacy receipt (v1 manifest, no signed statement)."""
        legacy = committed_receipts()[0][0]
        copy_path = workspace.root / "archive" / legacy.name
        shutil.copytree(legacy, copy_path)
        make_writable(copy_path)
        return copy_path

    def cli(workspace: Workspace, argv: list[str]) -> CliRun:
        workspace.capsys.readouterr()
        code = verify_cli(argv)
        captured = workspace.capsys.readouterr()
        return CliRun(code, captured.out, captured.err)

    def walked(workspace: Workspace, paths: list[Path], trust: Any = None) -> CliRun:
        """``verify_paths`` with a stream of its own: what it reports there, and on stdout and stderr."""
        workspace.capsys.readouterr()
        stream = io.StringIO()
        code = verify_paths(paths, trust, stream)
        captured = workspace.capsys.readouterr()
        return CliRun(code, captured.out, captured.err, stream.getvalue())

    def refuse_listing(workspace: Workspace, directory: Path, error: OSError) -> None:
        """``Path.iterdir`` fails on ``directory`` only (as root a mode-000 directory still lists)."""
        real_iterdir = Path.iterdir

        def iterdir(self: Path) -> Iterator[Path]:
            if self == directory:
                raise error
            return real_iterdir(self)

        workspace.patch.setattr(Path, "iterdir", iterdir)

    def help_text(workspace: Workspace) -> object:
        workspace.patch.setenv("COLUMNS", "400")  # one help entry per line, whatever the trust path's length
        return cli(workspace, ["--help"])

    def unlistable_archive(workspace: Workspace) -> object:
        archive = workspace.root / "archive"
        archive.mkdir()
        real_listdir = os.listdir

        def listdir(path: Any = ".") -> list[str]:
            if path is not None and Path(path) == archive:
                raise PermissionError()  # no strerror: the refusal falls back to the exception's name
            return real_listdir(path)

        workspace.patch.setattr(os, "listdir", listdir)
        return cli(workspace, [str(archive)])

    def unlistable_mid_walk(workspace: Workspace) -> object:
        archive = workspace.root / "archive"
        archive.mkdir()
        refuse_listing(workspace, archive, PermissionError())
        return walked(workspace, [archive])

    def empty_paths(workspace: Workspace) -> object:
        first, second = workspace.root / "first", workspace.root / "second"
        first.mkdir()
        second.mkdir()
        return walked(workspace, [first, second])

    def unsigned_beside_untrusted(workspace: Workspace) -> object:
        return walked(workspace, [committed_receipts()[0][0], receipt(workspace)])

    def untrusted_beside_tampered(workspace: Workspace) -> object:
        trusted_elsewhere = receipt(workspace, RUN_A, "one")
        tampered = receipt(workspace, RUN_B, "two", writable=True)
        (tampered / "command.log").write_text("edited")
        return walked(workspace, [trusted_elsewhere, tampered])

    def legacy_altered(workspace: Workspace) -> object:
        legacy = legacy_copy(workspace)
        with open(legacy / "command.log", "a", encoding="utf-8") as log:
            log.write("appended\n")
        return check(legacy)

    def unexpected(error: BaseException) -> Produce:
        def produce(workspace: Workspace) -> object:
            intact = receipt(workspace)
            fail_scandir(workspace.patch, intact, error)
            return verify_receipt(intact)
        return produce

    def summary_resigned(text: str) -> Produce:
        """The operator's own signer over a receipt whose summary is ``text``: every file matches the
        manifest and the statement, so only the conclusion's cross-checks can object."""
        def produce(workspace: Workspace) -> object:
            path = receipt(workspace, writable=True)
            (path / SUMMARY).write_text(text)
            rehash_manifest(path)
            resign(path, operator_key())
            return check(path)
        return produce

    def after_the_manifest_check(workspace: Workspace, action: Callable[[], object]) -> None:
        """Run ``action`` once the files have been checked against the manifest, before the signed
        statement is: a forger racing the verifier."""
        real = verify_module.check_receipt

        def race(*args: Any, **kwargs: Any) -> Any:
            found = real(*args, **kwargs)
            action()
            return found

        workspace.patch.setattr(verify_module, "check_receipt", race)

    def swapped_back(workspace: Workspace) -> object:
        path = receipt(workspace, writable=True)
        manifest, sample = consistent_forgery(path)

        def restore() -> None:
            (path / MANIFEST).write_bytes(manifest)
            (path / "samples" / "sample-2.json").write_bytes(sample)

        after_the_manifest_check(workspace, restore)
        return check(path)

    def manifest_becomes_a_fifo(workspace: Workspace) -> object:
        path = receipt(workspace, writable=True)
        consistent_forgery(path)

        def to_fifo() -> None:
            (path / MANIFEST).unlink()
            os.mkfifo(path / MANIFEST)

        after_the_manifest_check(workspace, to_fifo)
        return check(path)

    def legacy_manifest_swapped(workspace: Workspace) -> object:
        legacy = legacy_copy(workspace)
        after_the_manifest_check(workspace, lambda: (legacy / MANIFEST).write_text("[]"))
        return check(legacy)

    def with_leftovers(workspace: Workspace) -> object:
        archive_with_leftovers(workspace.root / "archive")
        return walked(workspace, [workspace.root / "archive"])

    def with_links_and_hidden_entries(workspace: Workspace) -> object:
        genuine = receipt(workspace)
        archive = genuine.parent
        shutil.copytree(genuine, archive / f".{genuine.name}")
        (archive / RUN_B).symlink_to(genuine, target_is_directory=True)
        return walked(workspace, [archive, archive / RUN_B])

    def claimed_unlistable(workspace: Workspace) -> object:
        archive = workspace.root / "archive"
        archive_with_leftovers(archive)
        refuse_listing(workspace, archive / RUN_A, PermissionError(13, "Permission denied"))
        return walked(workspace, [archive])

    def document_of_a_leftover(workspace: Workspace) -> object:
        archive = workspace.root / "archive"
        (archive / f"{PARTIAL_PREFIX}{RUN_A}").mkdir(parents=True)
        (archive / RUN_A).mkdir()
        return verify_document([archive], None, None)

    def document_verified(trust_given: bool, trust_path_known: bool) -> Produce:
        def produce(workspace: Workspace) -> object:
            intact = receipt(workspace)
            return verify_document([intact.parent], operator_trust() if trust_given else None,
                                   default_trust_path() if trust_path_known else None)
        return produce

    def document_of_nothing(workspace: Workspace) -> object:
        (workspace.root / "empty").mkdir()
        return verify_document([workspace.root / "empty"], None, None)

    def json_output(workspace: Workspace) -> object:
        archive = workspace.root / "archivé"
        write_receipt(archive, run_id=RUN_A)
        receipt(workspace)  # masks the key
        return cli(workspace, ["--json", "--trust", str(default_trust_path()), str(archive)])

    statuses: list[tuple[str, object]] = [
        ("passed", {"passed": True}),
        ("passed with an error", {"passed": True, "error": "refused: no CUDA device"}),
        ("failed", {"passed": False}),
        ("failed with a null error", {"passed": False, "error": None}),
        ("failed with a refusal", {"passed": False, "error": "refused: no CUDA device"}),
        ("failed with an interruption", {"passed": False, "error": "interrupted by SIGINT during handoff 2/3"}),
        ("a passed flag of 1", {"passed": 1}),
        ("an empty object", {}),
        ("its own status beside a passed flag", {"status": "failed", "passed": True}),
    ]
    return [
        # ---- the command line
        Case("receipts verify --help", help_text),
        *(Case(f"receipts verify {' '.join(map(repr, argv))}", lambda workspace, argv=argv: cli(workspace, argv))
          for argv in ([""], ["--trust", "", "archive"], ["--bogus"])),
        Case("receipts verify: an archive that cannot be listed", unlistable_archive),
        # ---- the report and its stream
        Case("a path that does not exist", lambda workspace: walked(workspace, [workspace.root / "gone"])),
        Case("an archive whose listing fails without an OS reason", unlistable_mid_walk),
        Case("two paths holding no receipts", empty_paths),
        Case("an unsigned legacy receipt beside an untrusted one, no trust file", unsigned_beside_untrusted),
        Case("an untrusted receipt beside a tampered one, no trust file", untrusted_beside_tampered),
        Case("a legacy receipt with an altered file", legacy_altered),
        # ---- unexpected errors while checking
        Case("an unexpected error whose text cannot be printed", unexpected(Unprintable("hidden"))),
        Case("an unexpected error without text", unexpected(ValueError())),
        Case("an unexpected error of three lines", unexpected(ValueError("no digest\tin\nthree lines"))),
        # ---- the status a summary records, and the signed statement's cross-checks
        *(Case(f"a re-signed summary: {name}", summary_resigned(json.dumps(summary))) for name, summary in statuses),
        Case("a re-signed summary that is no object", summary_resigned("[]")),
        Case("a re-signed summary that is not JSON", summary_resigned("{")),
        Case("a sample forged and swapped back between the manifest and the statement checks", swapped_back),
        Case("a manifest turned into a FIFO between the manifest and the statement checks", manifest_becomes_a_fifo),
        Case("a legacy manifest swapped for a non-object between the checks", legacy_manifest_swapped),
        # ---- what an archive holds
        Case("an archive with leftovers of killed runs", with_leftovers),
        Case("an archive whose claimed run directory cannot be listed", claimed_unlistable),
        Case("an archive holding a hidden copy and a link, and the link given as a path",
             with_links_and_hidden_entries),
        # ---- the JSON document
        Case("the document of a leftover", document_of_a_leftover),
        Case("the document of a verified archive, its trust file named", document_verified(True, True)),
        Case("the document, trust read from a file of no known path", document_verified(True, False)),
        Case("the document, no trust read", document_verified(False, True)),
        Case("the document of nothing found", document_of_nothing),
        Case("receipts verify --json --trust TRUST ARCHIVE", json_output),
    ]


# =========================================================================== qualify.archive.attestation


def attestation_cases() -> list[Case]:
    from qualify.archive.attestation import ENVELOPE, STATEMENT_TYPE, read_attestation, sign_statement
    from qualify.archive.keys import load_signing_key
    from qualify.archive.layout import SUMMARY
    from tests.support.receipt_forgery import (
        envelope_of,
        forger_key,
        operator_key,
        operator_trust,
        signed_envelope,
        statement_of,
        writable_receipt,
        write_envelope,
    )

    def read_after(forge: Callable[[Path], object]) -> Produce:
        """A genuine signed receipt whose envelope ``forge`` replaces, read under the operator's trust."""
        def produce(workspace: Workspace) -> object:
            receipt = writable_receipt(workspace.root / "archive")
            key = load_signing_key().key_id
            workspace.mask(key, "<key id>")
            workspace.mask(key[:16], "<key id 16>")
            forge(receipt)
            return refusal_of(lambda: read_attestation(receipt, operator_trust()))
        return produce

    def payload(text: str) -> Callable[[Path], None]:
        return lambda receipt: write_envelope(receipt, {**envelope_of(receipt), "payload": text})

    def claiming_the_operators_key(receipt: Path) -> None:
        write_envelope(receipt, signed_envelope(statement_of(receipt), forger_key(), keyid=operator_key().key_id))

    def naming_a_file_twice(receipt: Path) -> None:
        statement = statement_of(receipt)
        statement["subject"] = [*statement["subject"], statement["subject"][0]]
        write_envelope(receipt, signed_envelope(statement, operator_key()))

    return [
        Case("an envelope that is not JSON", read_after(lambda receipt: (receipt / ENVELOPE).write_bytes(b"{not json"))),
        *(Case(f"a payload spelled {text!r}", read_after(payload(text)))
          for text in ("AB==", "AA\nAA", "AA-_", "AAA", "AAAA=")),
        Case("a forger's signature claiming the operator's key", read_after(claiming_the_operators_key)),
        Case("a malformed statement signed by a trusted key",
             read_after(lambda receipt: write_envelope(receipt, signed_envelope({"_type": STATEMENT_TYPE},
                                                                                operator_key())))),
        Case("a statement naming one file twice", read_after(naming_a_file_twice)),
        Case("signing a statement whose predicate has no schema",
             refused(lambda: sign_statement([(SUMMARY, "0" * 64)], {}, operator_key()))),
    ]


# =========================================================================== qualify.run.connector_lane


def connector_lane_cases() -> list[Case]:
    import argparse

    from qualify.contract.identity import parse_identity_document
    from qualify.interfaces.console import connector_request
    from qualify.run.connector_lane import ConnectorRequest
    from qualify.run.run_contract import check_connector_pin
    from tests.unit.contract.test_identity import make_document

    connector_identity = parse_identity_document(make_document("vllm-via-connector"), where="identity x")
    other_identity = parse_identity_document(make_document("vllm-to-vllm"), where="identity x")

    def options(**given: object) -> argparse.Namespace:
        fields = {"connector": None, "connector_config": None, "connector_module": None, "connector_fault": None,
                  "producer_at": None, "fault": None, "producer": "reference", "consumer": "reference"}
        return argparse.Namespace(**{**fields, **given})

    return [
        Case("a config that is not JSON", refused(ConnectorRequest("ExampleConnector", config="{not json").resolve)),
        Case("a config that is a JSON array", refused(ConnectorRequest("ExampleConnector", config="[1]").resolve)),
        Case("the identity pins another connector digest", refused(
            check_connector_pin, connector_identity, ("ExampleConnector", "f" * 64), "identity x")),
        Case("the identity pins another connector", refused(
            check_connector_pin, connector_identity, ("MyConnector", "f" * 64), "identity x")),
        Case("a connector run given another lane's identity", refused(
            check_connector_pin, other_identity, ("ExampleConnector", "f" * 64), "identity x")),
        Case("--connector-config without --connector",
             refused(connector_request, options(connector_config="{}"), "qualify")),
        Case("--producer-at with --connector",
             refused(connector_request, options(connector="ExampleConnector", producer_at="127.0.0.1:1"), "qualify")),
        Case("--fault with --connector",
             refused(connector_request, options(connector="ExampleConnector", fault="k-bit-flip"), "qualify")),
        Case("--producer vllm with --connector",
             refused(connector_request, options(connector="ExampleConnector", producer="vllm"), "qualify")),
    ]


# =========================================================================== qualify.engines.connector_pair, connector_loads


def connector_pair_cases() -> list[Case]:
    from qualify.engines.connector_pair import MAX_TRANSFER_PARAMS_CHARS, returned_transfer_params

    return [
        Case("a producer's kv_transfer_params that are not an object",
             refused(returned_transfer_params, ["do_remote_prefill"])),
        Case("a producer's kv_transfer_params with a number that is not finite",
             refused(returned_transfer_params, {"remote_port": math.nan})),
        Case("a producer's kv_transfer_params too long to forward",
             refused(returned_transfer_params, {"blob": "x" * MAX_TRANSFER_PARAMS_CHARS})),
    ]


def connector_under_test_cases() -> list[Case]:
    from qualify.engines import connector_under_test

    def missing_runtime_package(workspace: Workspace) -> Raised:
        # A package no environment installs stands for nixl, so the words do not depend on this one.
        workspace.patch.setattr(connector_under_test, "RUNTIME_PACKAGES", {"NixlConnector": "qualify_absent_package"})
        return refusal_of(lambda: connector_under_test.runtime_packages("NixlConnector"))

    return [Case("a connector whose transfer package is not installed", missing_runtime_package)]


def connector_loads_cases() -> list[Case]:
    from qualify.engines.connector_loads import NotReceived, received_loads

    @dataclass(frozen=True)
    class Scheduled:
        req_id: str
        loaded_tokens: int
        load_async: bool

    def words() -> str:
        try:
            received_loads([Scheduled("request-7", 2048, True)], set(), "ObservingConnector")
        except NotReceived as exc:
            return f"raises NotReceived: {exc}"
        raise AssertionError("the case expects a refusal and got none")

    return [Case("an asynchronous load computed before its connector reported it received", judged(words))]


# =========================================================================== qualify.engines.kat: known answers


def kat_cases() -> list[Case]:
    from qualify.engines.kat import check_known_answer, check_pinned, host_numerics
    from qualify.engines.reference import ReferenceEngine
    from tests.unit.engines.test_kat import MeasuredElsewhere, NotExact, OneUlpUp, changed_at_one_projection

    pinned = json.loads((REPO / "contracts" / "vllm-to-reference-identity-v1.json").read_bytes())
    digest = pinned["consumer_engine"]["kat_sha256"]

    def checked(engine: Callable[[], object], expected: str | None, role: str, found: str | None = None) -> Produce:
        def produce(workspace: Workspace) -> Raised:
            workspace.mask(host_numerics(), "<numpy, BLAS, kernel, threads, CPU of this host>")
            return refusal_of(lambda: check_known_answer(engine(), expected, role, found=found))
        return produce

    return [
        Case("a consumer whose contraction is one ULP off its pinned known answer",
             checked(lambda: changed_at_one_projection(OneUlpUp), digest, "consumer")),
        Case("an exact engine whose identity pins no known answer",
             checked(ReferenceEngine.from_model_dir, None, "consumer")),
        Case("a known answer pinned for an engine that has none", checked(NotExact, digest, "producer")),
        Case("a vLLM engine whose process measured another known answer",
             checked(MeasuredElsewhere, digest, "consumer", found="0" * 64)),
        Case("an identity that pins no known answer for its vLLM producer",
             lambda workspace: refusal_of(lambda: check_pinned("vllm", None, "producer", "identity lane.json"))),
    ]


# =========================================================================== qualify.run.supervisor


def supervisor_cases() -> list[Case]:
    import subprocess
    import sys
    import time

    from qualify.archive.keys import ensure_signing_key
    from qualify.interfaces.producer_command import producer_health_cli, producer_supervise_cli
    from qualify.run.supervisor import LATCH_FILE, STARTUP_DIR, STARTUP_FILE, write_startup_receipt, write_state

    def cli(workspace: Workspace, handler: Callable[[list[str]], int], argv: list[str]) -> CliRun:
        workspace.capsys.readouterr()
        try:
            code = handler(argv)
        except SystemExit as usage:  # argparse's one-line usage refusal
            code = int(usage.code or 0)
        captured = workspace.capsys.readouterr()
        return CliRun(code, captured.out, captured.err)

    def ready_state(workspace: Workspace) -> Path:
        """A state directory as a supervisor leaves it once its producer is ready (this process
        standing in for both, so both are alive)."""
        key = ensure_signing_key()
        state = workspace.root / "state"
        state.mkdir()
        ready = {"event": "ready", "protocol": "trust-ladder-handoff/1", "pid": os.getpid(),
                 "address": f"unix:{workspace.root}/producer.sock", "lane": "nvfp4-native-w4a4",
                 "producer_mode": "native", "key_id": "ab" * 32, "warmup_s": 0.25}
        startup = write_startup_receipt(state, key, ready, started=time.time(), restarts=2,
                                        serve_argv=("--lane", "nvfp4-native-w4a4"))
        write_state(state, "ready", producer_pid=os.getpid())
        workspace.mask(str(os.getpid()), "<pid>")
        workspace.mask(startup["ready_utc"], "<utc>")
        workspace.mask(key.key_id[:16], "<key id 16>")
        return state

    def health(workspace: Workspace, state: Path, *options: str) -> CliRun:
        return cli(workspace, producer_health_cli, ["--state-dir", str(state), *options])

    def tampered(workspace: Workspace) -> CliRun:
        state = ready_state(workspace)
        receipt = state / STARTUP_DIR / STARTUP_FILE
        receipt.write_bytes(receipt.read_bytes().replace(b'"native"', b'"exact"'))
        return health(workspace, state)

    def gone(workspace: Workspace, status: str) -> CliRun:
        """A state directory whose supervisor's process id no process holds now (it was reaped)."""
        state = workspace.root / "state"
        state.mkdir()
        write_state(state, status)
        finished = subprocess.Popen([sys.executable, "-c", "pass"])
        finished.wait()
        document = json.loads((state / "state.json").read_text())
        document["supervisor_pid"] = finished.pid
        (state / "state.json").write_text(json.dumps(document))
        workspace.mask(str(finished.pid), "<pid>")
        return health(workspace, state)

    def latched(workspace: Workspace, handler: str) -> CliRun:
        state = workspace.root / "state"
        state.mkdir()
        (state / LATCH_FILE).write_text(json.dumps({"reason": "3 consecutive failures, the last exit 2 before "
                                                              "becoming ready"}))
        if handler == "health":
            return health(workspace, state)
        return cli(workspace, producer_supervise_cli, ["--state-dir", str(state), "--", *serve_arguments(workspace)])

    def serve_arguments(workspace: Workspace, key: list[str] | None = None) -> list[str]:
        from tests.unit.handoff.test_handoff_service import EXPECTATION

        (workspace.root / "expect.json").write_text(json.dumps(EXPECTATION.to_document()))
        (workspace.root / "run.key").write_text("00" * 32)
        (workspace.root / "run.key").chmod(0o600)
        key = ["--key-file", str(workspace.root / "run.key")] if key is None else key
        return ["--lane", "nvfp4-native-w4a4", "--mode", "native", "--expect", str(workspace.root / "expect.json"),
                *key, "--socket", str(workspace.root / "producer.sock")]

    def supervise(workspace: Workspace, before: list[str], after: list[str] | None) -> CliRun:
        argv = ["--state-dir", str(workspace.root / "state"), *before]
        if after is not None:
            argv += ["--", *serve_arguments(workspace), *after]
        return cli(workspace, producer_supervise_cli, argv)

    return [
        Case("health of a ready producer", lambda workspace: health(workspace, ready_state(workspace))),
        Case("health of a ready producer, --json", lambda workspace: health(workspace, ready_state(workspace), "--json")),
        Case("health of a startup receipt edited after it was signed", tampered),
        Case("health when the supervisor is gone", lambda workspace: gone(workspace, "ready")),
        Case("health after the supervisor stopped", lambda workspace: gone(workspace, "stopped")),
        Case("health of a state directory with no state",
             lambda workspace: health(workspace, workspace.root / "nothing-here")),
        Case("health of a latched producer", lambda workspace: latched(workspace, "health")),
        Case("supervise on a latched state directory", lambda workspace: latched(workspace, "supervise")),
        Case("supervise without -- before the producer's arguments",
             lambda workspace: supervise(workspace, ["--lane", "x"], None)),
        Case("supervise given --ready-fd for the producer", lambda workspace: supervise(workspace, [], ["--ready-fd", "1"])),
        Case("supervise given a producer argument serve refuses",
             lambda workspace: supervise(workspace, [], ["--mode", "fast"])),
        Case("supervise given --backoff-s 1_0", lambda workspace: supervise(workspace, ["--backoff-s", "1_0"], [])),
        Case("supervise given --failures-to-latch 0",
             lambda workspace: supervise(workspace, ["--failures-to-latch", "0"], [])),
        Case("supervise given --key-fd for the producer",
             lambda workspace: cli(workspace, producer_supervise_cli, ["--state-dir", str(workspace.root / "state"), "--",
                                                                      *serve_arguments(workspace, ["--key-fd", "0"])])),
    ]


# =========================================================================== qualify.run.fixture_envelope


def fixture_envelope_cases() -> list[Case]:
    from qualify.evidence.series import envelope_file_name
    from qualify.run.fixture_envelope import basis_envelope, basis_envelope_series
    from tests.unit.run.test_fixture_envelope import basis, honest_envelope, sealed_identity

    def refused_basis(change: Callable[[Path, dict[str, Any]], None], **sealed: Any) -> Produce:
        def produce(workspace: Workspace) -> Raised:
            receipt, evidence = basis(workspace.root)
            change(receipt, evidence)
            return refusal_of(lambda: basis_envelope(sealed_identity(honest_envelope(), **sealed), receipt, evidence,
                                                     where="identity x"))
        return produce

    def unchanged(_receipt: Path, _evidence: dict[str, Any]) -> None:
        pass

    def deleted(receipt: Path, _evidence: dict[str, Any]) -> None:
        (receipt / "series" / envelope_file_name(6)).unlink()

    def malformed(receipt: Path, _evidence: dict[str, Any]) -> None:
        (receipt / "series" / envelope_file_name(6)).write_bytes(b"not safetensors")

    def undeclared(_receipt: Path, evidence: dict[str, Any]) -> None:
        del evidence["fixture_envelope"]

    def unstarted(_receipt: Path, evidence: dict[str, Any]) -> None:
        del evidence["handoffs"][4]["producer_start"]

    def series_of_undeclared(workspace: Workspace) -> Raised:
        receipt, evidence = basis(workspace.root)
        del evidence["fixture_envelope"]
        return refusal_of(lambda: basis_envelope_series(receipt, evidence))

    return [
        Case("a sealed ceilings digest the basis does not give", refused_basis(unchanged, ceilings_sha256="ab" * 32)),
        Case("sealed counts the basis does not give", refused_basis(unchanged, handoffs=5, producer_starts=3)),
        Case("an envelope handoff's series file missing", refused_basis(deleted)),
        Case("an envelope handoff's series file not safetensors", refused_basis(malformed)),
        Case("a basis that declares no envelope", refused_basis(undeclared)),
        Case("a basis envelope handoff without its producer start", refused_basis(unstarted)),
        Case("the series of a basis that declares no envelope", series_of_undeclared),
    ]


# =========================================================================== the golden files


MODULES: dict[str, Callable[[], list[Case]]] = {
    "judge.handoffs": judge_handoff_cases,
    "judge.scope": judge_scope_cases,
    "judge.service": judge_service_cases,
    "judge.soak": judge_soak_cases,
    "contract.soak": contract_soak_cases,
    "judge.served": judge_served_cases,
    "judge.served_calibration": judge_served_calibration_cases,
    "contract.served_identity": served_identity_cases,
    "judge.calibration": judge_calibration_cases,
    "judge.parity": judge_parity_cases,
    "judge.envelope": judge_envelope_cases,
    "judge.controls": judge_controls_cases,
    "contract.identity": identity_cases,
    "engines.kat": kat_cases,
    "archive.verify": verify_cases,
    "archive.attestation": attestation_cases,
    "run.connector_lane": connector_lane_cases,
    "engines.connector_pair": connector_pair_cases,
    "engines.connector_loads": connector_loads_cases,
    "engines.connector_under_test": connector_under_test_cases,
    "run.supervisor": supervisor_cases,
    "run.fixture_envelope": fixture_envelope_cases,
}


@pytest.mark.parametrize("module", list(MODULES))
def test_the_operator_words_of_each_module_are_its_golden_file(
        module: str, golden: Golden, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    cases = MODULES[module]()
    names = [case.name for case in cases]
    assert sorted(set(names)) == sorted(names), f"{module}: a case name appears twice"
    blocks = []
    for index, case in enumerate(cases):
        root = tmp_path / f"case-{index}"
        root.mkdir()
        masks = {str(root): "<case>", str(tmp_path_factory.getbasetemp()): "<tmp>", str(REPO): "<repo>",
                 os.environ["XDG_CONFIG_HOME"]: "<config home>", qualify.__version__: "<harness version>"}
        with pytest.MonkeyPatch.context() as patch:
            blocks.append(render_case(case, Workspace(root, patch, capsys, masks)))
    failure = None
    try:
        golden.check(f"{module}.txt", HEADER.format(module=module) + "\n" + "\n".join(blocks))
    except GoldenMismatch as mismatch:
        failure = str(mismatch)
    if failure is not None:
        pytest.fail(failure, pytrace=False)


# --------------------------------------------------------------------------- the golden machinery itself


def test_a_rendering_that_differs_from_its_golden_file_fails_with_a_unified_diff(tmp_path: Path) -> None:
    (tmp_path / "words.txt").write_text("== case\nold words\n", encoding="utf-8")
    with pytest.raises(GoldenMismatch) as mismatch:
        Golden(update=False, directory=tmp_path).check("words.txt", "== case\nnew words\n")
    assert "--qualify-update-goldens" in str(mismatch.value)
    assert "\n-old words\n+new words\n" in str(mismatch.value)
    assert (tmp_path / "words.txt").read_text(encoding="utf-8") == "== case\nold words\n"


def test_a_missing_golden_file_fails_and_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(GoldenMismatch, match="missing"):
        Golden(update=False, directory=tmp_path).check("words.txt", "== case\nwords\n")
    assert not (tmp_path / "words.txt").exists()


def test_updating_writes_a_missing_or_differing_file_names_each_and_leaves_an_equal_one(tmp_path: Path) -> None:
    golden = Golden(update=True, directory=tmp_path)
    assert golden.check("new.txt", "a\n") == "created"
    assert golden.check("new.txt", "b\n") == "rewritten"
    assert golden.check("new.txt", "b\n") == "unchanged"
    assert (tmp_path / "new.txt").read_text(encoding="utf-8") == "b\n"
    assert golden.written == [str(tmp_path / "new.txt")] * 2


def test_each_module_has_its_golden_file_and_no_golden_file_is_orphaned() -> None:
    assert sorted(path.name for path in GOLDEN_DIR.glob("*.txt")) == sorted(f"{module}.txt" for module in MODULES)
