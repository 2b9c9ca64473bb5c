"""Judging of handoffs: pure functions from sample records and a rule to a verdict.

Where is each rung judged?

* rung 2 (``native-text``, bounded drift): :func:`judge_rung2_sample` per sample,
  :func:`judge_summary` over the repetitions;
* rung 3 (``kquant-target-plus-dflash``, bit-exact): :func:`judge_rung3_sample` per sample,
  :func:`judge_summary` over the repetitions;
* the whole run: :func:`judge_qualification` (summary, then :func:`judge_reproduction` against
  the fixture anchor in the basis receipt, then :func:`judge_link_floor` when the identity
  declares a link-rate floor); a run that stopped before its verdict: :func:`judge_incomplete`;
* a draft-acceptance measurement over documents: :func:`judge_draft_acceptance` (a calibration
  is judged in :mod:`qualify.judge.calibration`).

No module outside this one builds a :class:`Verdict`.

Records are judged as plain dicts (a sample read back from its receipt JSON); a pydantic record
is dumped to that form first, so the judge never relies on a model's defaults. A field that is
absent or null is refused as ``sample omits <field>``: absent evidence is failed evidence, never
read as zero. Non-finite numbers are refused. Nothing here does I/O.

Wording discipline (seed §32.2, §32.5): a rung-2 verdict says "bounded drift: max X <= A, mean
Y <= M" and never "zero drift"; only rung 3 may say "bit-exact".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from qualify.contract.rules import TEACHER_FORCED_RULE
from qualify.core.errors import one_line
from qualify.evidence.records import (
    LOGIT_DIGEST_FIELDS,
    PHASE_FIELDS,
    REQUIRED_SAMPLE_FIELDS,
    RUNG3_DRAFT_FIELDS,
    SAMPLE_SCHEMA,
    BitExactRule,
    BoundedDriftRule,
    parse_rule,
    sample_field_fits,
)
from qualify.judge.scope import Scope, scope_line

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NON_FINITE_TEXT = {"nan", "infinity", "-infinity", "inf", "-inf", "+infinity", "+inf"}

Rule = BoundedDriftRule | BitExactRule | Mapping[str, Any]
Record = Mapping[str, Any] | BaseModel
_RuleT = TypeVar("_RuleT", BoundedDriftRule, BitExactRule)


@dataclass(frozen=True)
class Check:
    """One judged check: its name, whether it held, and what was found, in plain words."""

    name: str
    passed: bool
    detail: str

    def __post_init__(self) -> None:
        # A receipt records every check: one without a name, a yes/no or words is a judging bug,
        # refused where it is made rather than archived.
        if not isinstance(self.name, str) or not self.name or type(self.passed) is not bool or not isinstance(self.detail, str):
            raise TypeError(f"malformed check: name {self.name!r}, passed {self.passed!r}, detail {self.detail!r}")


@dataclass(frozen=True)
class Verdict:
    """A judgement: ``passed``; ``headline`` (one line); ``reasons`` in plain words (what failed
    when failed, what held when passed); ``checks`` with per-check details; ``error`` says why the
    run ended before it could be judged (only :func:`judge_incomplete` and :func:`judge_refused` set
    it); ``refused``: the lane could not run here, so nothing was judged (exit 2, not 1); ``scope``:
    the fixture and controls a qualification's verdict covers (:mod:`qualify.judge.scope`)."""

    passed: bool
    headline: str
    reasons: list[str]
    checks: list[Check] = field(default_factory=list)
    error: str | None = None
    refused: bool = False
    scope: Scope | None = None

    def __post_init__(self) -> None:
        if (
            type(self.passed) is not bool
            or not isinstance(self.headline, str)
            or not self.headline
            or not isinstance(self.reasons, list)
            or not all(isinstance(reason, str) for reason in self.reasons)
            or not isinstance(self.checks, list)
            or not all(isinstance(check, Check) for check in self.checks)
        ):
            raise TypeError(f"malformed verdict: passed {self.passed!r}, headline {self.headline!r}, "
                            f"reasons {self.reasons!r}, checks of {type(self.checks).__name__}")

    @property
    def status(self) -> Literal["passed", "failed", "refused", "incomplete"]:
        """What a receipt records: refused (nothing judged), incomplete (ended before its
        verdict), passed, or failed (judged, not qualified)."""
        if self.refused:
            return "refused"
        if self.error is not None:
            return "incomplete"
        return "passed" if self.passed else "failed"


def _num(value: float | int | None, against: float | None = None) -> str:
    """A number as written in verdicts: ints as ints, floats to 9 significant digits, or in
    full when that would print ``value`` equal to the bound it is compared ``against``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    text = f"{float(value):.9g}"
    if against is not None and float(value) != float(against) and text == f"{float(against):.9g}":
        return repr(float(value))
    return text


def _plain(record: Record) -> Any:
    if isinstance(record, BaseModel):
        return record.model_dump(by_alias=True)  # python mode: values as they are
    return record


def _finite(value: object) -> float | int | None:
    """``value`` itself when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


class _Evidence:
    """Reads one sample's fields, collecting refusals; invalid or absent fields read as None. A
    field's type is the one :class:`~qualify.evidence.records.SampleRecord` declares
    (:func:`~qualify.evidence.records.sample_field_fits`); finiteness and ranges are judged here."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        self.record = record
        self.omitted: list[str] = []
        self.invalid: list[str] = []

    def has(self, name: str) -> bool:
        return self.record.get(name) is not None

    def require(self, names: Sequence[str]) -> None:
        for name in names:
            if not self.has(name):
                self.omitted.append(f"sample omits {name}")

    def require_key(self, name: str) -> None:
        """A field whose null is meaningful (e.g. 'no mismatching row') must still be present."""
        if name not in self.record:
            self.omitted.append(f"sample omits {name}")

    def number(self, name: str, *, minimum: float | None = None, maximum: float | None = None) -> float | None:
        value = self.record.get(name)
        if value is None:
            return None
        if isinstance(value, str) and value.strip().lower() in _NON_FINITE_TEXT:
            self.invalid.append(f"sample {name} is not finite: {value}")
            return None
        if not sample_field_fits(name, value):
            self.invalid.append(f"sample {name} is not a number: {value!r}")
            return None
        if not math.isfinite(value):
            self.invalid.append(f"sample {name} is not finite: {value!r}")
            return None
        if minimum is not None and value < minimum:
            self.invalid.append(f"sample {name} is {_num(value)}, below {_num(minimum)}")
            return None
        if maximum is not None and value > maximum:
            self.invalid.append(f"sample {name} is {_num(value)}, above {_num(maximum)}")
            return None
        return float(value)

    def whole(self, name: str, *, minimum: int = 0) -> int | None:
        value = self.record.get(name)
        if value is None:
            return None
        if not sample_field_fits(name, value):
            if isinstance(value, float) and not math.isfinite(value):
                self.invalid.append(f"sample {name} is not finite: {value!r}")
            else:
                self.invalid.append(f"sample {name} is not a whole number: {value!r}")
            return None
        if value < minimum:
            self.invalid.append(f"sample {name} is {value}, below {minimum}")
            return None
        return int(value)

    def digest(self, name: str) -> str | None:
        value = self.record.get(name)
        if value is None:
            return None
        if not sample_field_fits(name, value):
            self.invalid.append(f"sample {name} is not a SHA-256 hex digest: {value!r}")
            return None
        return str(value)

    def flag(self, name: str) -> bool | None:
        value = self.record.get(name)
        if value is None:
            return None
        if not sample_field_fits(name, value):
            self.invalid.append(f"sample {name} is not true or false: {value!r}")
            return None
        return bool(value)


@dataclass
class _Judgement:
    """Accumulates checks; failed checks contribute their reasons."""

    checks: list[Check] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)

    def check(self, name: str, passed: bool, detail: str, *, reasons: Sequence[str] = ()) -> bool:
        self.checks.append(Check(name, passed, detail))
        if passed:
            self.held.append(detail)
        else:
            self.failures.extend(reasons or [detail])
        return passed

    def failed(self) -> Verdict:
        """The failed verdict, headed by the first failure: what a return after a failed check gives."""
        more = f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        return Verdict(False, f"failed: {self.failures[0]}{more}", list(self.failures), list(self.checks))

    def verdict(self, pass_headline: str) -> Verdict:
        """The failed verdict when any check failed, else passed under ``pass_headline``."""
        if self.failures:
            return self.failed()
        return Verdict(True, f"passed: {pass_headline}", list(self.held), list(self.checks))


# --------------------------------------------------------------------------- per sample


def _localisation_words(record: Mapping[str, Any], *, tokens: bool) -> str:
    """A short plain-words pointer to where a failing sample disagrees (from its localisation):
    the first divergence (``tokens``) or the first rule-breaking logit row."""
    where = record.get("localisation")
    if not isinstance(where, Mapping):
        return ""
    if tokens:
        position = where.get("first_divergence_position")
        if not isinstance(position, int) or isinstance(position, bool):
            return ""
        text = f"first divergence at token {position}"
        margin = where.get("cold_margin_at_divergence")
        if isinstance(margin, (int, float)) and not isinstance(margin, bool):
            text += f", cold margin {_num(margin)}"
        kind = where.get("divergence_class")
        return text + (f" ({kind})" if kind in ("near-tie", "decisive") else "")
    row = where.get("first_rule_breaking_row")
    return f"first rule-breaking logit row {row}" if isinstance(row, int) and not isinstance(row, bool) else ""


def _common_sample_checks(
    evidence: _Evidence, judgement: _Judgement, rule: BoundedDriftRule | BitExactRule, extra_required: Sequence[str]
) -> dict[str, Any] | None:
    """Schema, error, omissions, value types, token exactness, payload and phases.

    Returns the validated values, or None when the sample failed before its values could be read.
    """
    record = evidence.record
    if record.get("schema") != SAMPLE_SCHEMA:
        judgement.check("record", False, f"sample schema: found {record.get('schema')!r}, expected {SAMPLE_SCHEMA!r}")
        return None
    error = record.get("error")
    if error is not None:
        judgement.check("error", False, f"sample failed: {' '.join(str(error).split())}")
        return None

    evidence.require(REQUIRED_SAMPLE_FIELDS)
    evidence.require(extra_required)
    if not rule.drift_graded or rule.rung == 3:
        evidence.require(LOGIT_DIGEST_FIELDS[:1])
        evidence.require_key(LOGIT_DIGEST_FIELDS[1])
    judgement.check(
        "evidence", not evidence.omitted,
        "every required field present" if not evidence.omitted else "; ".join(evidence.omitted),
        reasons=evidence.omitted,
    )

    # Validated, not read here: the summary reads each sample's repetition, and the link rate is a
    # figure for the receipt, not a judged one.
    evidence.whole("repetition", minimum=1)
    evidence.number("payload_gbit_per_s", minimum=0.0)
    values: dict[str, Any] = {
        "output_tokens": evidence.whole("output_tokens", minimum=1),
        "token_agreement_rate": evidence.number("token_agreement_rate", minimum=0.0, maximum=1.0),
        "max_abs": evidence.number("max_abs", minimum=0.0),
        "mean_abs": evidence.number("mean_abs", minimum=0.0),
        "payload_bytes": evidence.whole("payload_bytes"),
        "handed_off_positions": evidence.whole("handed_off_positions"),
        "recomputed_positions": evidence.whole("recomputed_positions"),
        "logit_row_digests_equal": evidence.flag("logit_row_digests_equal"),
        "first_logit_digest_mismatch_row": evidence.whole("first_logit_digest_mismatch_row"),
        "draft_acceptance_rate": evidence.number("draft_acceptance_rate", minimum=0.0, maximum=1.0),
    }
    for name in PHASE_FIELDS:
        values[name] = evidence.number(name, minimum=0.0)
    for name in (
        "handoff_generated_token_sha256", "cold_generated_token_sha256",
        "handoff_logit_block_sha256", "cold_logit_block_sha256", "payload_sha256",
        *RUNG3_DRAFT_FIELDS[:4],
    ):
        values[name] = evidence.digest(name)
    judgement.check(
        "values", not evidence.invalid,
        "every value finite and well-formed" if not evidence.invalid else "; ".join(evidence.invalid),
        reasons=evidence.invalid,
    )

    tokens = values["output_tokens"]
    if tokens is not None:
        judgement.check(
            "output tokens", tokens == rule.output_tokens,
            f"decoded {tokens} tokens"
            + ("" if tokens == rule.output_tokens else f", rule requires {rule.output_tokens}"),
        )
    rate = values["token_agreement_rate"]
    parting_allowed = isinstance(rule, BoundedDriftRule) and rule.teacher_forced
    if rate is not None and not parting_allowed:
        where = _localisation_words(record, tokens=True)
        if rate == 1.0:
            detail = f"tokens exact: {tokens}/{tokens}" if tokens is not None else "tokens exact"
        else:
            agreed = f" ({round(rate * tokens)}/{tokens})" if tokens is not None else ""
            detail = f"tokens diverge: agreement {_num(rate)}{agreed}" + (f"; {where}" if where else "")
        judgement.check("tokens exact", rate == 1.0, detail)
    handoff_tokens, cold_tokens = values["handoff_generated_token_sha256"], values["cold_generated_token_sha256"]
    if handoff_tokens is not None and cold_tokens is not None and parting_allowed and rate is not None:
        # Tokens may part, but the digests must say what the agreement says.
        agrees = (handoff_tokens == cold_tokens) == (rate == 1.0)
        judgement.check(
            "generated-token digest", agrees,
            "generated-token digest agrees with the token agreement" if agrees
            else f"generated-token digest {'differs from' if handoff_tokens != cold_tokens else 'equals'} the cold "
                 f"run's while the token agreement is {_num(rate)}")
    if handoff_tokens is not None and cold_tokens is not None and not parting_allowed:
        judgement.check(
            "generated-token digest", handoff_tokens == cold_tokens,
            "generated-token digest equals the cold run's" if handoff_tokens == cold_tokens
            else "generated-token digest differs from the cold run's",
        )
    payload = values["payload_bytes"]
    if payload is not None:
        judgement.check("payload", payload > 0,
                        f"payload {payload} bytes" if payload > 0 else "payload is empty (0 bytes)")
    handed_off = values["handed_off_positions"]
    if handed_off is not None:
        judgement.check(
            "handed-off positions", handed_off > 0,
            f"{handed_off} positions handed off, {values['recomputed_positions']} recomputed"
            if handed_off > 0 else "no positions handed off: the handoff qualified nothing",
        )
    return values


def _rule_of(rule: Rule, rule_type: type[_RuleT], judge_name: str) -> _RuleT:
    """``rule`` parsed; a rule of another rung is a programming error."""
    parsed = parse_rule(rule)
    if not isinstance(parsed, rule_type):
        raise TypeError(f"{judge_name} needs a {rule_type.__name__}")
    return parsed


def _open_sample(record: Record) -> tuple[_Judgement, _Evidence | None]:
    """A fresh judgement and ``record``'s evidence; the evidence is None, and the judgement
    already failed, when the record is not a mapping."""
    plain = _plain(record)
    judgement = _Judgement()
    if not isinstance(plain, Mapping):
        judgement.check("record", False, f"sample is not a record: {type(plain).__name__}")
        return judgement, None
    return judgement, _Evidence(plain)


def judge_rung2_sample(record: Record, rule: Rule) -> Verdict:
    """Rung 2, one sample: complete finite evidence, exact tokens, drift inside the identity's
    bounds (and, when not drift-graded, no logit digest mismatch)."""
    parsed = _rule_of(rule, BoundedDriftRule, "judge_rung2_sample")
    judgement, evidence = _open_sample(record)
    if evidence is None:
        return judgement.failed()
    values = _common_sample_checks(evidence, judgement, parsed, ())
    if values is None:
        return judgement.failed()
    if parsed.teacher_forced:
        return _judge_teacher_forced(evidence.record, values, parsed, judgement)
    maximum, mean = values["max_abs"], values["mean_abs"]
    bound, mean_bound = parsed.maximum_absolute, parsed.maximum_mean_absolute
    if maximum is not None and mean is not None:
        inside = maximum <= bound and mean <= mean_bound
        if inside:
            detail = (f"bounded drift: max {_num(maximum, bound)} <= {_num(bound)}, "
                      f"mean {_num(mean, mean_bound)} <= {_num(mean_bound)}")
        else:
            where = _localisation_words(evidence.record, tokens=False)
            detail = (
                f"native full-logit drift exceeds its identity rule: max={_num(maximum, bound)}, "
                f"mean={_num(mean, mean_bound)} (rule: max <= {_num(bound)}, mean <= {_num(mean_bound)})"
                + (f"; {where}" if where else "")
            )
        judgement.check("bounded drift", inside, detail)
    if not parsed.drift_graded:
        _check_logit_digests_refuse_first(values, judgement)
    tokens = values["output_tokens"]
    return judgement.verdict(
        f"tokens exact ({tokens}/{tokens}) and bounded drift: max {_num(maximum, bound)} <= {_num(bound)}, "
        f"mean {_num(mean, mean_bound)} <= {_num(mean_bound)}"
    )


@dataclass(frozen=True)
class TeacherForcedRows:
    """What the teacher-forced rule reads from one sample: every row's largest max and mean abs
    delta, and its partings as ``(row, cold margin)``. Tokens that never parted need no forcing:
    the free-running rows then score the cold context (decode equals teacher forcing on its own
    tokens), so they are read from the sample itself."""

    max_abs: float
    max_row_mean_abs: float
    partings: tuple[tuple[int, float], ...]
    first_row_over_rule: int | None = None


def teacher_forced_rows(record: Mapping[str, Any]) -> TeacherForcedRows | str:
    """The sample's teacher-forced rows, or why they cannot be read (absent evidence fails)."""
    rate = _finite(record.get("token_agreement_rate"))
    where = record.get("localisation")
    teacher = where.get("teacher_forced") if isinstance(where, Mapping) else None
    if rate == 1.0:
        if teacher is not None:
            return "tokens exact, yet the sample records teacher-forced rows: contradictory evidence"
        maximum, mean = _finite(record.get("max_abs")), _finite(record.get("max_row_mean_abs"))
        if maximum is None or mean is None or maximum < 0 or mean < 0:
            return "sample omits max_abs or max_row_mean_abs as a finite number >= 0"
        return TeacherForcedRows(float(maximum), float(mean), ())
    if not isinstance(teacher, Mapping):
        return "tokens parted and the sample omits localisation.teacher_forced"
    maximum, mean = _finite(teacher.get("max_abs")), _finite(teacher.get("max_row_mean_abs"))
    if maximum is None or mean is None or maximum < 0 or mean < 0:
        return "sample localisation.teacher_forced omits max_abs or max_row_mean_abs as a finite number >= 0"
    listed = teacher.get("partings")
    if not isinstance(listed, (list, tuple)):
        return "sample localisation.teacher_forced omits partings"
    partings: list[tuple[int, float]] = []
    for item in listed:
        row = item.get("row") if isinstance(item, Mapping) else None
        margin = _finite(item.get("cold_margin")) if isinstance(item, Mapping) else None
        if type(row) is not int or row < 0 or margin is None or margin < 0:
            return f"sample localisation.teacher_forced.partings: malformed entry {one_line(repr(item))[:80]}"
        partings.append((row, float(margin)))
    rows = [row for row, _ in partings]
    tokens = record.get("output_tokens")
    if rows != sorted(set(rows)) or not partings or type(tokens) is not int or rows[-1] >= tokens:
        return (f"sample localisation.teacher_forced.partings: expected rows in increasing order below "
                f"output_tokens {tokens!r}, at least one")
    flips = teacher.get("top1_flips")
    if type(flips) is not int or flips != len(partings):
        return (f"sample localisation.teacher_forced: top1_flips {teacher.get('top1_flips')!r} but "
                f"{len(partings)} partings listed")
    over = teacher.get("first_row_over_rule")
    return TeacherForcedRows(float(maximum), float(mean), tuple(partings), over if type(over) is int else None)


def _judge_teacher_forced(record: Mapping[str, Any], values: Mapping[str, Any], rule: BoundedDriftRule,
                          judgement: _Judgement) -> Verdict:
    """Rung 2 under the teacher-forced rule (:data:`~qualify.contract.rules.TEACHER_FORCED_RULE`):
    every parting a near-tie, every row's max and mean within the bounds, the parted share within
    its ceiling."""
    rows = _check_teacher_forced_rows(record, values["output_tokens"], rule, judgement)
    if rows is None:
        return judgement.failed()
    if not rule.drift_graded:
        _check_logit_digests_refuse_first(values, judgement)
    partings = f"{_partings(len(rows.partings))}, each a near-tie" if rows.partings else "tokens exact"
    return judgement.verdict(
        f"teacher-forced: {partings}; every row within max {_num(rule.maximum_absolute)} and mean "
        f"{_num(rule.maximum_mean_absolute)}")


def _partings(count: int) -> str:
    return f"{count} parting" + ("" if count == 1 else "s")


def judge_teacher_forced_rows(record: Record, rule: Rule) -> Verdict:
    """The teacher-forced rule's own clauses alone (partings, rows, parted share) on one sample:
    what a calibration asks of its fixture anchors under the rule its cells give."""
    parsed = _rule_of(rule, BoundedDriftRule, "judge_teacher_forced_rows")
    judgement, evidence = _open_sample(record)
    if evidence is None:
        return judgement.failed()
    tokens = evidence.whole("output_tokens", minimum=1)
    if tokens is None:
        judgement.check("output tokens", False, "sample omits output_tokens as a whole number >= 1")
        return judgement.failed()
    rows = _check_teacher_forced_rows(evidence.record, tokens, parsed, judgement)
    if rows is None:
        return judgement.failed()
    return judgement.verdict(f"teacher-forced: {_partings(len(rows.partings))}, each a near-tie" if rows.partings
                             else "teacher-forced: tokens exact")


def _check_teacher_forced_rows(record: Mapping[str, Any], tokens: int | None, rule: BoundedDriftRule,
                               judgement: _Judgement) -> TeacherForcedRows | None:
    """The three clauses of the teacher-forced rule; None when the rows cannot be read."""
    if rule.near_tie_margin is None or rule.maximum_changed_row_share is None:
        raise TypeError("the teacher-forced clauses need a teacher-forced rule")
    rows = teacher_forced_rows(record)
    if isinstance(rows, str):
        judgement.check("teacher-forced rows", False, rows)
        return None
    margin = rule.near_tie_margin
    decisive = [(row, cold) for row, cold in rows.partings if cold > margin]
    if decisive:
        row, cold = decisive[0]
        detail = (f"decisive parting at step {row}: cold margin {_num(cold, margin)} > near-tie margin {_num(margin)}"
                  + (f" ({len(decisive)} decisive partings)" if len(decisive) > 1 else ""))
    elif rows.partings:
        widest = max(cold for _, cold in rows.partings)
        detail = (f"{_partings(len(rows.partings))}, each a near-tie (cold margin at most {_num(widest, margin)}"
                  f" <= {_num(margin)}), first at step {rows.partings[0][0]}")
    else:
        detail = "no parting: tokens exact"
    judgement.check("near-tie partings", not decisive, detail)
    bound, mean_bound = rule.maximum_absolute, rule.maximum_mean_absolute
    inside = rows.max_abs <= bound and rows.max_row_mean_abs <= mean_bound
    where = "" if rows.first_row_over_rule is None else f"; first row over the rule {rows.first_row_over_rule}"
    judgement.check(
        "teacher-forced drift", inside,
        f"every row within: max {_num(rows.max_abs, bound)} <= {_num(bound)}, row mean "
        f"{_num(rows.max_row_mean_abs, mean_bound)} <= {_num(mean_bound)}" if inside
        else f"teacher-forced drift exceeds its identity rule: max={_num(rows.max_abs, bound)}, row mean="
             f"{_num(rows.max_row_mean_abs, mean_bound)} (rule: every row max <= {_num(bound)}, mean <= "
             f"{_num(mean_bound)}){where}")
    if tokens is not None:
        share, ceiling = len(rows.partings) / tokens, rule.maximum_changed_row_share
        judgement.check(
            "parted rows", share <= ceiling,
            f"{len(rows.partings)}/{tokens} rows parted (share {_num(share, ceiling)} "
            f"{'<=' if share <= ceiling else 'exceeds the ceiling'} {_num(ceiling)})")
    return rows


def _check_logit_digests_refuse_first(values: Mapping[str, Any], judgement: _Judgement) -> bool:
    """Default (not drift-graded) judging: refuse on the first logit digest mismatch."""
    equal = values["logit_row_digests_equal"]
    row = values["first_logit_digest_mismatch_row"]
    handoff_block, cold_block = values["handoff_logit_block_sha256"], values["cold_logit_block_sha256"]
    if equal is None or handoff_block is None or cold_block is None:
        return False
    if equal and row is None and handoff_block == cold_block:
        return judgement.check("logit digests", True, "logit digests equal in every row and over the block")
    if row is not None:
        detail = f"logit digest mismatch at row {row}"
    elif handoff_block != cold_block and equal:
        detail = "logit digest mismatch: block digests differ while every row digest is reported equal"
    else:
        detail = "logit digest mismatch at an unreported row"
    return judgement.check("logit digests", False, detail)


def judge_rung3_sample(record: Record, rule: Rule) -> Verdict:
    """Rung 3, one sample: exact tokens, bit-exact full logits (digests equal, deltas exactly 0),
    exact draft tokens and trace, draft acceptance at or above the sealed floor.

    Not drift-graded (the default): the first logit digest mismatch is refused as such. Drift-
    graded: the deltas are reported and judged (they must still be exactly 0).
    """
    parsed = _rule_of(rule, BitExactRule, "judge_rung3_sample")
    judgement, evidence = _open_sample(record)
    if evidence is None:
        return judgement.failed()
    draft_declared = parsed.acceptance_floor is not None
    values = _common_sample_checks(evidence, judgement, parsed, RUNG3_DRAFT_FIELDS if draft_declared else ())
    if values is None:
        return judgement.failed()

    _check_row_digest_lists(evidence.record, values, judgement)
    maximum, mean = values["max_abs"], values["mean_abs"]
    if not parsed.drift_graded:
        digests_equal = _check_logit_digests_refuse_first(values, judgement)
        if digests_equal and maximum is not None and mean is not None:
            exact = maximum == 0 and mean == 0
            judgement.check(
                "logit deltas", exact,
                "full-logit deltas exactly 0" if exact
                else f"full logits not bit-exact despite equal digests: max={_num(maximum)}, mean={_num(mean)}",
            )
    else:
        if maximum is not None and mean is not None:
            exact = maximum == 0 and mean == 0
            row = values["first_logit_digest_mismatch_row"]
            judgement.check(
                "logit deltas", exact,
                "full-logit deltas exactly 0" if exact
                else f"full logits differ: max={_num(maximum)}, mean={_num(mean)} (bit-exact requires 0)"
                + (f"; logit digest mismatch at row {row}" if row is not None else ""),
            )
        equal = values["logit_row_digests_equal"]
        blocks = (values["handoff_logit_block_sha256"], values["cold_logit_block_sha256"])
        if equal is not None and None not in blocks:
            same = equal and values["first_logit_digest_mismatch_row"] is None and blocks[0] == blocks[1]
            row = values["first_logit_digest_mismatch_row"]
            judgement.check(
                "logit digests", same,
                "logit digests equal in every row and over the block" if same
                else f"logit digest mismatch at row {row}" if row is not None else "logit block digests differ",
            )

    _check_kv_bit_exact(evidence.record, judgement)
    if draft_declared:
        for what, left, right, differ in (
            ("draft tokens", "handoff_draft_tokens_sha256", "cold_draft_tokens_sha256", "differ"),
            ("draft trace", "handoff_draft_trace_sha256", "cold_draft_trace_sha256", "differs"),
        ):
            if values[left] is not None and values[right] is not None:
                same = values[left] == values[right]
                judgement.check(what, same,
                                f"{what} equal to the cold run's" if same else f"{what} {differ} from the cold run's")
        acceptance = values["draft_acceptance_rate"]
        floor = parsed.acceptance_floor
        if acceptance is not None and floor is not None:
            judgement.check(
                "draft acceptance", acceptance >= floor,
                f"draft acceptance {_num(acceptance, floor)} >= floor {_num(floor)}" if acceptance >= floor
                else f"draft acceptance {_num(acceptance, floor)} is below the sealed floor {_num(floor)}",
            )
    else:
        judgement.check("draft", True, "no speculative draft declared by the identity")
    tokens = values["output_tokens"]
    return judgement.verdict(
        f"bit-exact: tokens {tokens}/{tokens}, full-logit digests equal, deltas 0"
        + ("; draft tokens and trace equal, acceptance at or above the floor" if draft_declared else "")
    )


def _check_kv_bit_exact(record: Mapping[str, Any], judgement: _Judgement) -> None:
    """Rung 3: the handed-off KV must equal the consumer's own prefill in every layer, K and V.

    A one-ULP change can vanish downstream (activation quantization absorbs it) and leave the
    logits bit-exact; the handoff is still not the consumer's computation. Missing KV evidence
    is refused, never read as zero.
    """
    where = record.get("localisation")
    # A model dumped in Python mode holds tuples where the JSON form holds lists.
    layers = where.get("kv_layer_max_abs") if isinstance(where, Mapping) else None
    if not isinstance(layers, (list, tuple)) or not layers:
        judgement.check("kv", False,
                        "sample omits kv_layer_max_abs (per-layer KV deltas against the consumer's own prefill)")
        return
    for item in layers:
        entry: Mapping[str, Any] = item if isinstance(item, Mapping) else {}
        for tensor in ("k", "v"):
            delta = entry.get(tensor)
            if _finite(delta) is None or delta != 0:
                position = entry.get(f"{tensor}_position")
                judgement.check(
                    "kv", False,
                    f"handed-off KV differs from the consumer's own prefill at layer {entry.get('layer', '?')} "
                    # repr() only for a non-number: `!r` there would quote the formatted number too.
                    f"{tensor.upper()} (max abs delta {_num(delta) if isinstance(delta, (int, float)) else repr(delta)}"
                    + (f" at position {position})" if position is not None else ")"),
                )
                return
    judgement.check("kv", True, "handed-off KV equals the consumer's own prefill in every layer (K and V)")


def _digest_list(value: object) -> list[str] | None:
    """``value`` as a list of SHA-256 hex digests, or None when it is not one."""
    if not isinstance(value, (list, tuple)):
        return None
    digests = [row for row in value if isinstance(row, str) and _SHA256.fullmatch(row)]
    return digests if len(digests) == len(value) else None


def _check_row_digest_lists(record: Mapping[str, Any], values: Mapping[str, Any], judgement: _Judgement) -> None:
    """When per-row digests are recorded, both sides must be lists of SHA-256 hex digests that agree
    with the reported first mismatch; one side alone, or anything else, is malformed evidence."""
    if record.get("handoff_logit_row_sha256") is None and record.get("cold_logit_row_sha256") is None:
        return
    handoff_rows = _digest_list(record.get("handoff_logit_row_sha256"))
    cold_rows = _digest_list(record.get("cold_logit_row_sha256"))
    if handoff_rows is None or cold_rows is None:
        judgement.check("row digests", False, "sample row digests are malformed")
        return
    # Lists of unequal length are evidence too: the shorter one ends at the first mismatch.
    first = next((i for i, (a, b) in enumerate(zip(handoff_rows, cold_rows, strict=False)) if a != b), None)
    if first is None and len(handoff_rows) != len(cold_rows):
        first = min(len(handoff_rows), len(cold_rows))
    consistent = first == values["first_logit_digest_mismatch_row"] and (
        values["output_tokens"] is None or len(handoff_rows) == values["output_tokens"]
    )
    judgement.check(
        "row digests", consistent,
        "recorded row digests agree with the reported first mismatch" if consistent
        else f"recorded row digests disagree with the reported first mismatch (rows say {first})",
    )


def judge_sample(record: Record, rule: Rule) -> Verdict:
    """One sample under its rule's rung (2 or 3)."""
    rule = parse_rule(rule)
    return judge_rung3_sample(record, rule) if rule.rung == 3 else judge_rung2_sample(record, rule)


# --------------------------------------------------------------------------- summary


NON_DETERMINISTIC_FIELDS: frozenset[str] = frozenset(
    {"handoff_generated_token_sha256", "payload_sha256", "handoff_logit_block_sha256"})
"""The digests a producer declared non-deterministic may change across repetitions (its bytes and
what the consumer decodes from them); the cold recompute's stay exact."""


def judge_summary(records: Sequence[Record], rule: Rule, *, deterministic_producer: bool = True) -> Verdict:
    """Over all repetitions: the right number, every sample passing its rung's per-sample
    judgement (tokens exact in each, drift inside the rule or bit-exact), and determinism: the
    generated-token, payload and logit block digests equal across repetitions (for a rung-2
    producer declared non-deterministic, the cold recompute's digests only)."""
    rule = parse_rule(rule)
    deterministic_producer = deterministic_producer or rule.rung == 3  # bit-exact is deterministic
    judgement = _Judgement()
    plain = [_plain(record) for record in records]
    count = len(plain)
    indices = [r.get("repetition") if isinstance(r, Mapping) else None for r in plain]
    expected = list(range(1, rule.repetitions + 1))
    valid = [i for i in indices if isinstance(i, int) and not isinstance(i, bool)]
    problems = []
    if count != rule.repetitions:
        problems.append(f"expected {rule.repetitions} repetitions, found {count}")
    for index in expected:
        seen = valid.count(index)
        if seen == 0:
            problems.append(f"repetition {index} missing")
        elif seen > 1:
            problems.append(f"repetition {index} appears {seen} times")
    strays = sorted({repr(i) for i in indices if isinstance(i, bool) or i not in expected})  # True == 1, yet no index
    if strays:
        problems.append(f"unexpected repetition index {', '.join(strays)}")
    judgement.check(
        "repetitions", not problems,
        f"{rule.repetitions}/{rule.repetitions} repetitions present" if not problems else "; ".join(problems),
        reasons=problems,
    )

    sample_verdicts = [judge_sample(record, rule) for record in plain]
    failing: list[str] = []
    for position, verdict in enumerate(sample_verdicts):
        label = indices[position] if isinstance(indices[position], int) else f"#{position + 1}"
        if not verdict.passed:
            failing.extend(f"repetition {label}: {reason}" for reason in verdict.reasons)
    judgement.check(
        "samples", not failing and count > 0,
        f"every sample passes its rung-{rule.rung} judgement" if not failing and count > 0
        else "no samples" if count == 0
        else f"{sum(not v.passed for v in sample_verdicts)} of {count} samples refused",
        reasons=failing,
    )

    mappings = [r for r in plain if isinstance(r, Mapping)]
    rates = [r.get("token_agreement_rate") for r in mappings]
    exact_everywhere = count > 0 and len(rates) == count and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x == 1.0 for x in rates
    )
    teacher_forced = isinstance(rule, BoundedDriftRule) and rule.teacher_forced
    if not teacher_forced:
        judgement.check(
            "tokens exact in every repetition", exact_everywhere,
            "token agreement exactly 1.0 in every repetition" if exact_everywhere
            else "token agreement is not exactly 1.0 in every repetition",
        )

    if isinstance(rule, BoundedDriftRule) and not teacher_forced:
        maxima = [x for x in (_finite(r.get("max_abs")) for r in mappings) if x is not None]
        means = [y for y in (_finite(r.get("mean_abs")) for r in mappings) if y is not None]
        numeric = count > 0 and len(maxima) == count and len(means) == count
        bound, mean_bound = rule.maximum_absolute, rule.maximum_mean_absolute
        inside = numeric and all(x <= bound for x in maxima) and all(y <= mean_bound for y in means)
        worst_max = max(maxima) if numeric else None
        worst_mean = max(means) if numeric else None
        judgement.check(
            "bounded drift in every repetition", inside,
            f"bounded drift: max {_num(worst_max, bound)} <= {_num(bound)}, "
            f"mean {_num(worst_mean, mean_bound)} <= {_num(mean_bound)} in every repetition"
            if inside else "full-logit drift is not inside the identity rule in every repetition"
            + (f": worst max={_num(worst_max, bound)}, mean={_num(worst_mean, mean_bound)}" if numeric else ""),
        )

    for name, words in (
        ("handoff_generated_token_sha256", "generated-token digest"),
        ("payload_sha256", "payload digest"),
        ("payload_bytes", "payload size"),
        ("handoff_logit_block_sha256", "handoff logit block digest"),
        ("cold_generated_token_sha256", "cold generated-token digest"),
        ("cold_logit_block_sha256", "cold logit block digest"),
        *(
            (("handoff_draft_tokens_sha256", "draft tokens digest"),
             ("handoff_draft_trace_sha256", "draft trace digest"))
            if isinstance(rule, BitExactRule) and rule.acceptance_floor is not None else ()
        ),
    ):
        if deterministic_producer or name not in NON_DETERMINISTIC_FIELDS:
            _check_equal_across(judgement, mappings, count, name, words)
    digests = ("generated-token and payload digests equal across repetitions" if deterministic_producer
               else "cold digests equal across repetitions (the producer is declared non-deterministic)")

    if teacher_forced:
        partings = near_tie_partings(mappings, rule)  # a passing summary's partings are all near-ties
        headline = (f"{count}/{rule.repetitions} handoffs judged teacher-forced: "
                    + (f"{partings[1]} partings, each a near-tie" if partings is not None else "partings unread")
                    + f"; {digests}")
    elif isinstance(rule, BoundedDriftRule):
        headline = (
            f"{count}/{rule.repetitions} handoffs with exact tokens and "
            + next(c.detail for c in judgement.checks if c.name == "bounded drift in every repetition")
            + f"; {digests}"
        )
    else:
        acceptance_rates = [x for x in (_finite(r.get("draft_acceptance_rate")) for r in mappings) if x is not None]
        measured = _num(min(acceptance_rates, default=None))  # none only when a sample has failed already
        acceptance = (f", draft tokens and trace equal, acceptance {measured} (floor {_num(rule.acceptance_floor)})"
                      if rule.acceptance_floor is not None else "")
        headline = (
            f"{count}/{rule.repetitions} handoffs bit-exact: tokens, full logits (digests equal, deltas 0)"
            + acceptance + "; digests equal across repetitions"
        )
    return judgement.verdict(headline)


def near_tie_partings(records: Sequence[Record], rule: Rule) -> tuple[int, int] | None:
    """(near-tie partings, all partings) over ``records`` under a teacher-forced rule; None when
    any record's rows cannot be read (its sample judgement says why)."""
    parsed = parse_rule(rule)
    if not isinstance(parsed, BoundedDriftRule) or parsed.near_tie_margin is None:
        return None
    near = total = 0
    for record in (_plain(r) for r in records):
        rows = teacher_forced_rows(record) if isinstance(record, Mapping) else "not a record"
        if isinstance(rows, str):
            return None
        total += len(rows.partings)
        near += sum(1 for _, cold in rows.partings if cold <= parsed.near_tie_margin)
    return near, total


def _check_equal_across(
    judgement: _Judgement, records: Sequence[Mapping[str, Any]], count: int, name: str, words: str
) -> None:
    values = [record.get(name) for record in records]
    present = count > 0 and len(values) == count and all(v is not None and not isinstance(v, bool) for v in values)
    if not present:
        missing = [str(record.get("repetition", "?")) for record in records if record.get(name) is None]
        detail = f"{words} missing in repetition {', '.join(missing)}" if missing else f"{words} missing"
        judgement.check(f"{words} across repetitions", False, detail)
        return
    first = values[0]
    differing = [str(records[i].get("repetition", i + 1)) for i, value in enumerate(values) if value != first]
    judgement.check(
        f"{words} across repetitions", not differing,
        f"{words} equal across {count} repetitions" if not differing
        else f"{words} differs across repetitions (repetition {', '.join(differing)} "
        f"vs {records[0].get('repetition', 1)}): output is not deterministic",
    )


REPRODUCTION_FIELDS: tuple[tuple[str, str], ...] = (
    ("payload_sha256", "payload tree"),
    ("seams_sha256", "per-layer seams"),
    ("handoff_logit_block_sha256", "handoff logit block"),
    ("cold_logit_block_sha256", "cold logit block"),
    ("handoff_generated_token_sha256", "generated tokens"),
    ("cold_generated_token_sha256", "cold generated tokens"),
)
"""The deterministic digests a qualification must share with its anchor (seed 000's G3
recheck); the draft's tokens and trace join them on a lane with a draft."""
DRAFT_REPRODUCTION_FIELDS: tuple[tuple[str, str], ...] = (
    ("handoff_draft_tokens_sha256", "draft tokens"),
    ("handoff_draft_trace_sha256", "draft trace"),
)


def judge_reproduction(records: Sequence[Record], basis_records: Sequence[Record], *, rung: int,
                       deterministic_producer: bool, draft: bool) -> Verdict:
    """Did the run reproduce its anchor bit for bit (the fixture handoffs its basis receipt
    retained)? Every sample's deterministic digests (:data:`REPRODUCTION_FIELDS`) must equal the
    anchor's, which must agree among themselves. A difference fails rung 3, and rung 2 when the identity declares a deterministic
    producer (its output changed since calibration); otherwise it is reported, not failed."""
    judgement = _Judgement()
    fields = REPRODUCTION_FIELDS + (DRAFT_REPRODUCTION_FIELDS if draft else ())
    run = [r for r in (_plain(record) for record in records) if isinstance(r, Mapping)]
    basis = [r for r in (_plain(record) for record in basis_records) if isinstance(r, Mapping)]
    changed: list[str] = []
    if not basis or len(basis) != len(basis_records):
        judgement.check("anchor samples", False, "the basis receipt has no readable anchor samples")
        changed.append("anchor samples")
    for name, words in fields if basis else ():
        basis_values = {record.get(name) for record in basis}
        if len(basis_values) != 1 or None in basis_values:
            detail = (f"anchor: {words} digest missing" if None in basis_values
                      else f"anchor: {words} digest differs among its own samples")
            judgement.check(f"{words} as anchored", False, detail)
            changed.append(words)
            continue
        calibrated = next(iter(basis_values))
        differing = [str(record.get("repetition", "?")) for record in run if record.get(name) != calibrated]
        if not run:
            differing = ["(no samples)"]
        judgement.check(
            f"{words} as anchored", not differing,
            f"{words} digest equal to the anchor's in every repetition" if not differing
            else f"{words} digest differs from the anchor's (repetition {', '.join(differing)})")
        if differing:
            changed.append(words)
    if not changed:
        return Verdict(True, "reproduced its anchor bit for bit (payload tree, seams, logit blocks "
                             "and generated tokens equal the fixture anchor's in the basis receipt)",
                       [check.detail for check in judgement.checks], judgement.checks)
    words = f"did not reproduce its anchor bit for bit: {', '.join(changed)} differ from the fixture anchor in the basis receipt"
    if rung == 3:
        return Verdict(False, f"{words}; rung 3 requires it", [words], judgement.checks)
    if deterministic_producer:
        return Verdict(False, f"{words}: the producer's output changed since calibration "
                              "(the identity declares a deterministic producer)", [words], judgement.checks)
    return Verdict(True, words, [words], judgement.checks)


def judge_link_floor(records: Sequence[Record], gbit_per_s_minimum: float) -> Verdict:
    """Did every handoff cross its link at the identity's floor or faster (seed 000, section 32.3:
    each handoff's payload rate)? Each sample's ``payload_gbit_per_s`` must be a finite number at
    least ``gbit_per_s_minimum``; a sample without one fails, as does a run with no samples."""
    judgement = _Judgement()
    floor = _num(gbit_per_s_minimum)
    rates: list[tuple[object, float | int | None]] = []
    for position, record in enumerate(_plain(record) for record in records):
        values = record if isinstance(record, Mapping) else {}
        rates.append((values.get("repetition", f"#{position + 1}"), _finite(values.get("payload_gbit_per_s"))))
    missing = [str(repetition) for repetition, rate in rates if rate is None]
    slow = [f"{repetition} ({_num(rate, gbit_per_s_minimum)} Gbit/s)" for repetition, rate in rates
            if rate is not None and rate < gbit_per_s_minimum]
    problems = ([f"payload rate missing or not a number in repetition {', '.join(missing)}"] if missing else []) + (
        [f"payload rate below the link floor {floor} Gbit/s in repetition {', '.join(slow)}"] if slow else [])
    if not rates:
        problems = ["no samples to judge the link floor on"]
    judgement.check("link floor", not problems,
                    "; ".join(problems) if problems else
                    f"payload rate at or above the link floor {floor} Gbit/s in every repetition (slowest "
                    f"{_num(min(rate for _, rate in rates if rate is not None))} Gbit/s)",
                    reasons=problems)
    return judgement.verdict(judgement.checks[0].detail)


def judge_qualification(records: Sequence[Record], rule: Rule, anchor_records: Sequence[Record], *,
                        deterministic_producer: bool, scope: Scope | None = None,
                        link_floor_gbit_per_s: float | None = None,
                        service: Verdict | None = None, envelope: Verdict | None = None) -> Verdict:
    """The whole run's verdict: :func:`judge_summary` over the repetitions, then
    :func:`judge_reproduction` against the anchor (the fixture handoffs its basis receipt
    retained), then :func:`judge_link_floor` when the identity declares a floor, then ``service``,
    a run's service conditions as :func:`qualify.judge.service.judge_service_conditions` judged them. With a
    ``scope``, the headline is its scope line (:func:`qualify.judge.scope.scope_line`) followed
    by the evidence: what the verdict covers is never left out of the words. A producer declared
    non-deterministic needs ``envelope``, its samples held to the fixture envelope
    (:func:`qualify.judge.envelope.judge_envelope`): without it drift would be judged by a
    cross-document maximum alone, so its absence fails. Such a producer on rung 2 has no anchor:
    ``anchor_records`` are not rechecked for it."""
    parsed = parse_rule(rule)
    summary = judge_summary(records, parsed, deterministic_producer=deterministic_producer)
    parts = [summary]
    if deterministic_producer or parsed.rung == 3:  # a non-deterministic producer has no anchor to recheck
        parts.append(judge_reproduction(
            records, anchor_records, rung=parsed.rung, deterministic_producer=deterministic_producer,
            draft=isinstance(parsed, BitExactRule) and parsed.acceptance_floor is not None))
    if envelope is not None:
        parts.append(envelope)
    elif not deterministic_producer and parsed.rung == 2:
        parts.append(Verdict(False, "failed: no fixture envelope for a producer declared non-deterministic",
                             ["no fixture envelope for a producer declared non-deterministic: its drift has "
                              "nothing tighter than a cross-document maximum to be judged by"],
                             [Check("inside the fixture envelope", False, "no fixture envelope")]))
    if link_floor_gbit_per_s is not None:
        parts.append(judge_link_floor(records, link_floor_gbit_per_s))
    if service is not None:
        parts.append(service)
    passed = all(verdict.passed for verdict in parts)
    failing = [r for verdict in parts if not verdict.passed for r in verdict.reasons]
    evidence = "; ".join(verdict.headline for verdict in parts)
    if scope is not None and isinstance(parsed, BoundedDriftRule) and parsed.teacher_forced:
        scope = replace(scope, judged_by=TEACHER_FORCED_RULE, partings=near_tie_partings(records, parsed))
    if scope is not None:
        line = scope_line(passed, scope, failing[0] if failing else None)  # a passed run has no failing reason
        headline = f"{line}. Evidence: {evidence}"
    else:
        headline = evidence
    return Verdict(passed, headline,
                   failing if not passed else summary.reasons + [verdict.headline for verdict in parts[1:]],
                   [check for verdict in parts for check in verdict.checks], scope=scope)




# --------------------------------------------------------------------------- a run that stopped early


def judge_incomplete(reason: str) -> Verdict:
    """A run that ended before its verdict (a failed step, an exception, no verdict given): not
    qualified, whatever its samples showed; ``reason`` says why, in one line."""
    line = one_line(reason) or "run ended before its verdict without a reason"
    return Verdict(False, f"not qualified: {line}", [line], [Check("verdict reached", False, line)], error=line)


def judge_failed_step(label: str, reason: str, sample: Verdict | None = None, scope: Scope | None = None) -> Verdict:
    """A run stopped by a failed step (a handoff the judge or the wire refused, a producer that
    failed): judged and not qualified, so its status is ``failed``, not ``incomplete``. A failing
    ``sample`` judgement lends its reasons and checks; a qualification's ``scope`` leads the headline."""
    line = one_line(reason) or "step failed without a reason"
    reasons = [f"{label}: {line}", *(sample.reasons if sample is not None and not sample.passed else [])]
    checks = [Check(label, False, line), *(sample.checks if sample is not None and not sample.passed else [])]
    headline = (scope_line(False, scope, f"{label}: {line}") if scope is not None
                else f"not qualified: {label}: {line}")
    return Verdict(False, headline, reasons, checks, scope=scope)


REFUSED_PREFIX = "refused: "
"""How a refused run's receipt says so: its summary's ``verdict`` and ``error`` start with it."""


def judge_refused(reason: str) -> Verdict:
    """A run refused before any evidence (the lane cannot run here: no GPU, no vLLM, the producer
    refused to start): not qualified and not failed either; ``reason`` says why, in one line."""
    line = one_line(reason) or "run refused without a reason"
    return Verdict(False, f"{REFUSED_PREFIX}{line}", [line], [Check("lane runs here", False, line)],
                   error=f"{REFUSED_PREFIX}{line}", refused=True)


# --------------------------------------------------------------------------- draft acceptance


def judge_draft_acceptance(documents: Mapping[str, Mapping[str, Any]], *, proposal_tokens: int) -> Verdict:
    """A measurement of the speculative draft's acceptance (the basis a sealed floor is taken from):
    per document ``proposed`` and ``accepted`` drafted-token counts. It holds when every document
    proposed at least one token and accepted no more than it proposed; the headline states the
    pooled rate (sum accepted / sum proposed) and the lowest document's."""
    judgement = _Judgement()
    rates: dict[str, float] = {}
    proposed_total = accepted_total = 0
    for name, document in sorted(documents.items()):
        proposed, accepted = document.get("proposed"), document.get("accepted")
        if (not isinstance(proposed, int) or not isinstance(accepted, int) or isinstance(proposed, bool)
                or isinstance(accepted, bool) or not 0 <= accepted <= proposed or proposed == 0):
            judgement.check(f"document {name}", False,
                            f"document {name}: found proposed {proposed!r}, accepted {accepted!r}; expected whole "
                            "counts with 0 <= accepted <= proposed and at least one proposed token")
            continue
        rates[name] = accepted / proposed
        proposed_total += proposed
        accepted_total += accepted
        judgement.check(f"document {name}", True, f"document {name}: acceptance {rates[name]:.6f}")
    if not documents:
        judgement.check("documents", False, "no documents measured")
    if judgement.failures:
        return judgement.failed()
    pooled = accepted_total / proposed_total
    headline = (f"draft acceptance measured at k={proposal_tokens}: pooled {pooled:.6f} over {len(rates)} "
                f"documents, minimum document {min(rates.values()):.6f}")
    return Verdict(True, headline, [headline], judgement.checks)
