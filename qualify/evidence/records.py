"""Sample records, qualification rules and the validation summary (frozen pydantic models).

Pure data: nothing here compares logits or touches an engine (the records are built from a
comparison in :mod:`qualify.evidence.sample`), so the judge can read records without numpy.
:class:`SampleRecord` is the one definition of a record's field types: the judge reads plain
records against it (:func:`sample_field_fits`) and judges finiteness and ranges itself.

A :class:`SampleRecord` is the evidence one handoff sample leaves in its receipt. Records are
written to JSON (:func:`record_json`) and judged from plain dicts read back from it, so the judge
never trusts a model's defaults: a field that is absent or null is *omitted evidence*. In the JSON
form every field is present (null when not measured), and non-finite floats are written as the
strings ``"NaN"``/``"Infinity"`` so they reach the judge and are refused there rather than being
silently dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal, Protocol, runtime_checkable

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from qualify.core.errors import Refused, one_line

SAMPLE_SCHEMA: Final = "trust-ladder.sample-record.v1"
SUMMARY_SCHEMA: Final = "trust-ladder.validation-summary.v2"
"""v2 adds ``status``; v1 summaries (no status) stay readable."""
LEGACY_SUMMARY_SCHEMA: Final = "trust-ladder.validation-summary.v1"

Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0)]
Position = Annotated[int, Field(ge=0)]
RunStatus = Literal["passed", "failed", "refused", "incomplete"]
"""What a receipt concluded (its summary's and its signed statement's ``status``)."""

PHASE_FIELDS: tuple[str, ...] = (
    "producer_compute_s",
    "serialize_s",
    "transport_s",
    "verify_s",
    "install_s",
    "decode_s",
    "recompute_s",
)
"""Per-sample phase times in seconds, in pipeline order."""

REQUIRED_SAMPLE_FIELDS: tuple[str, ...] = (
    "repetition",
    "output_tokens",
    "token_agreement_rate",
    "max_abs",
    "mean_abs",
    "handoff_generated_token_sha256",
    "cold_generated_token_sha256",
    "handoff_logit_block_sha256",
    "cold_logit_block_sha256",
    "payload_sha256",
    "payload_bytes",
    "payload_gbit_per_s",
    "handed_off_positions",
    "recomputed_positions",
    *PHASE_FIELDS,
)
"""Fields every sample must carry with a value; the judge refuses a sample that omits one."""

LOGIT_DIGEST_FIELDS: tuple[str, ...] = ("logit_row_digests_equal", "first_logit_digest_mismatch_row")
"""Logit digest comparison; required by rung 3 and by any rule that is not drift-graded.
``first_logit_digest_mismatch_row`` must be present; null there means no row differs."""

RUNG3_DRAFT_FIELDS: tuple[str, ...] = (
    "handoff_draft_tokens_sha256",
    "cold_draft_tokens_sha256",
    "handoff_draft_trace_sha256",
    "cold_draft_trace_sha256",
    "draft_acceptance_rate",
)
"""Speculative-draft evidence a rung-3 sample must carry with a value."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", ser_json_inf_nan="strings")


# --------------------------------------------------------------------------- rules


def _finite_positive(value: float, name: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, found {value!r}")
    return value


class BoundedDriftRule(_Frozen):
    """Rung 2 (``native-text``): exact tokens, full-logit drift inside the identity's bounds.

    ``drift_graded`` False means the default judging: any logit digest mismatch is refused.
    """

    rung: Literal[2] = 2
    repetitions: Annotated[int, Field(ge=1)] = 3
    output_tokens: Annotated[int, Field(ge=1)] = 256
    maximum_absolute: float
    maximum_mean_absolute: float
    drift_graded: bool = True
    near_tie_margin: float | None = None
    maximum_changed_row_share: float | None = None

    @property
    def teacher_forced(self) -> bool:
        """Judged by the teacher-forced rule (tokens may part at near-ties; every row's max and
        mean judged, and the share of parted rows) rather than by exact tokens."""
        return self.near_tie_margin is not None

    @model_serializer(mode="wrap")
    def _without_unused_clauses(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """An exact-token rule is written as it was before the teacher-forced clauses existed (no
        null keys): its receipts keep their form, and only a teacher-forced rule names them."""
        dumped: dict[str, Any] = handler(self)
        if self.near_tie_margin is None:
            dumped.pop("near_tie_margin", None)
            dumped.pop("maximum_changed_row_share", None)
        return dumped

    @model_validator(mode="after")
    def _bounds_finite(self) -> BoundedDriftRule:
        _finite_positive(self.maximum_absolute, "maximum_absolute")
        _finite_positive(self.maximum_mean_absolute, "maximum_mean_absolute")
        if (self.near_tie_margin is None) != (self.maximum_changed_row_share is None):
            raise ValueError("near_tie_margin and maximum_changed_row_share: both or neither")
        if self.near_tie_margin is not None and self.maximum_changed_row_share is not None:
            _finite_positive(self.near_tie_margin, "near_tie_margin")
            _finite_positive(self.maximum_changed_row_share, "maximum_changed_row_share")
        return self


class BitExactRule(_Frozen):
    """Rung 3 (``kquant-target-plus-dflash``): exact tokens, exact full logits, exact draft
    tokens and trace, draft acceptance at or above the sealed floor.

    ``acceptance_floor`` None means the identity declares no speculative draft (the draftless
    ``kquant-exact`` lane, or the fault lane); the draft checks then do not apply and the verdict
    says so.
    """

    rung: Literal[3] = 3
    repetitions: Annotated[int, Field(ge=1)] = 3
    output_tokens: Annotated[int, Field(ge=1)] = 256
    acceptance_floor: float | None
    drift_graded: bool = False

    @model_validator(mode="after")
    def _floor_in_range(self) -> BitExactRule:
        floor = self.acceptance_floor
        if floor is not None and not (math.isfinite(floor) and 0 < floor <= 1):
            raise ValueError(f"acceptance_floor must be in (0, 1], found {floor!r}")
        return self


QualificationRule = Annotated[BoundedDriftRule | BitExactRule, Field(discriminator="rung")]
_RULE_ADAPTER: TypeAdapter[BoundedDriftRule | BitExactRule] = TypeAdapter(QualificationRule)


@runtime_checkable
class DriftBounds(Protocol):
    """A bounded-drift full-logit rule as an identity declares it."""

    @property
    def maximum_absolute(self) -> float: ...

    @property
    def maximum_mean_absolute(self) -> float: ...


class DeclaredQualification(Protocol):
    """The part of an identity's ``onboarding_qualification`` a judging rule is made from."""

    @property
    def repetitions(self) -> int: ...

    @property
    def output_tokens(self) -> int: ...

    @property
    def full_logits(self) -> object: ...


class DeclaredDraft(Protocol):
    """A speculative draft as an identity declares it: only its sealed acceptance floor matters here."""

    @property
    def acceptance_floor(self) -> float: ...


class RuleSource(Protocol):
    """What :func:`rule_from_identity` reads from an identity (``qualify.contract.identity.Identity``
    satisfies it; a Protocol keeps this module free of the contract layer's imports)."""

    @property
    def rung(self) -> int: ...

    @property
    def onboarding_qualification(self) -> DeclaredQualification: ...

    @property
    def speculative_draft(self) -> DeclaredDraft | None: ...


def _rule_refusal(what: str, error: ValidationError, *, tagged: bool) -> Refused:
    """One line naming the first invalid field of a rule and why; ``tagged`` when the location
    starts with the union's rung tag, which names no field."""
    first = error.errors()[0]
    location = first["loc"][1:] if tagged else first["loc"]
    where = ".".join(str(part) for part in location) or "(rule)"
    message = str(first["msg"]).removeprefix("Value error, ")
    return Refused(one_line(f"{what}: {where}: {message}"))


def rule_from_identity(identity: RuleSource, *, drift_graded: bool) -> BoundedDriftRule | BitExactRule:
    """The judging rule an onboarding identity declares.

    Rung 2 takes the bounded-drift bounds; rung 3 the draft's sealed acceptance floor (None when
    the identity declares no draft). ``drift_graded`` is the run's ``--drift-graded`` flag.
    """
    qualification = identity.onboarding_qualification
    try:
        if identity.rung == 2:
            logits = qualification.full_logits
            if not isinstance(logits, DriftBounds):
                raise Refused("identity onboarding_qualification.full_logits: a rung-2 identity must declare "
                              "maximum_absolute and maximum_mean_absolute")
            return BoundedDriftRule(
                repetitions=qualification.repetitions,
                output_tokens=qualification.output_tokens,
                maximum_absolute=logits.maximum_absolute,
                maximum_mean_absolute=logits.maximum_mean_absolute,
                drift_graded=drift_graded,
                near_tie_margin=getattr(logits, "near_tie_margin", None),
                maximum_changed_row_share=getattr(logits, "maximum_changed_row_share", None),
            )
        if identity.rung == 3:
            draft = identity.speculative_draft
            return BitExactRule(
                repetitions=qualification.repetitions,
                output_tokens=qualification.output_tokens,
                acceptance_floor=None if draft is None else draft.acceptance_floor,
                drift_graded=drift_graded,
            )
    except ValidationError as error:
        raise _rule_refusal("identity rule", error, tagged=False) from None
    raise Refused(f"identity rung: found {identity.rung!r}, expected 2 or 3")


def parse_rule(rule: Mapping[str, Any] | BoundedDriftRule | BitExactRule) -> BoundedDriftRule | BitExactRule:
    """A rule model from a model or a plain dict (e.g. read back from a validation summary);
    an invalid dict is refused, naming its first bad field."""
    if isinstance(rule, (BoundedDriftRule, BitExactRule)):
        return rule
    if not isinstance(rule, Mapping):
        raise Refused(f"rule: found {type(rule).__name__}, expected a rule object")
    try:
        return _RULE_ADAPTER.validate_python(dict(rule))
    except ValidationError as error:
        raise _rule_refusal("rule", error, tagged=True) from None


# --------------------------------------------------------------------------- localisation


class Parting(_Frozen):
    """A teacher-forced row whose top token differs from the cold recompute's, and the cold
    top-1 minus top-2 margin there (contract units): what a near-tie is judged by."""

    row: Position
    cold_margin: float


class TeacherForcedSummary(_Frozen):
    """Teacher-forced drift: the handoff branch fed the cold tokens, against the cold logits.
    ``max_row_mean_abs`` and ``partings`` are what the teacher-forced rule judges (null in
    receipts from before it)."""

    max_abs: float
    mean_abs: float
    first_row_over_rule: Position | None
    top1_flips: Count
    max_row_mean_abs: float | None = None
    partings: tuple[Parting, ...] | None = None


class KVLayerMaxAbs(_Frozen):
    """One layer's handed-off K and V max abs delta against the consumer's own prefill."""

    layer: Count
    k: float
    v: float
    k_position: Position | None = None
    v_position: Position | None = None


class KVOverEnvelope(_Frozen):
    """A handed-off tensor whose max abs delta exceeds the lane's calibrated KV envelope (the
    largest delta that layer's K or V showed in the basis receipt's samples)."""

    layer: Count
    tensor: Literal["K", "V"]
    delta: float
    envelope: float
    position: Position | None = None


class Localisation(_Frozen):
    """Where and why a sample disagrees (present on failures); null means not applicable."""

    first_divergence_position: Position | None
    cold_margin_at_divergence: float | None
    drift_at_divergence: float | None
    divergence_class: Literal["near-tie", "decisive"] | None
    first_rule_breaking_row: Position | None
    min_cold_margin: float | None
    teacher_forced: TeacherForcedSummary | None = None
    kv_layer_max_abs: tuple[KVLayerMaxAbs, ...] | None = None
    kv_first_position_over_threshold: Position | None = None
    kv_threshold: float | None = None
    kv_over_envelope: tuple[KVOverEnvelope, ...] | None = None


# --------------------------------------------------------------------------- sample record


class SampleRecord(_Frozen):
    """One handoff sample's evidence. Every field of :data:`REQUIRED_SAMPLE_FIELDS` must hold a
    value unless ``error`` says why the sample failed (then missing evidence stays null)."""

    schema_: Literal["trust-ladder.sample-record.v1"] = Field(default=SAMPLE_SCHEMA, alias="schema")
    repetition: Annotated[int, Field(ge=1)]
    output_tokens: Count | None = None
    token_agreement_rate: float | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    max_row_mean_abs: float | None = Field(default=None, description=(
        "the largest per-row mean abs logit delta of the free-running branch (the teacher-forced rule "
        "judges every row's mean; null in receipts from before it)"))
    handoff_generated_token_sha256: Sha256Hex | None = None
    cold_generated_token_sha256: Sha256Hex | None = None
    handoff_logit_block_sha256: Sha256Hex | None = None
    cold_logit_block_sha256: Sha256Hex | None = None
    logit_row_digests_equal: bool | None = None
    first_logit_digest_mismatch_row: Position | None = None
    handoff_logit_row_sha256: tuple[Sha256Hex, ...] | None = None
    cold_logit_row_sha256: tuple[Sha256Hex, ...] | None = None
    payload_sha256: Sha256Hex | None = None
    # SHA-256 of the manifest's per-layer seam digests (canonical JSON): which layers' K/V the
    # producer sent, comparable with the basis receipt's (seed 000's G3 recheck).
    seams_sha256: Sha256Hex | None = None
    payload_bytes: Count | None = None
    payload_gbit_per_s: float | None = None
    handed_off_positions: Count | None = None
    recomputed_positions: Count | None = None
    producer_compute_s: float | None = None
    serialize_s: float | None = None
    transport_s: float | None = None
    verify_s: float | None = None
    install_s: float | None = None
    decode_s: float | None = None
    recompute_s: float | None = None
    handoff_draft_tokens_sha256: Sha256Hex | None = None
    cold_draft_tokens_sha256: Sha256Hex | None = None
    handoff_draft_trace_sha256: Sha256Hex | None = None
    cold_draft_trace_sha256: Sha256Hex | None = None
    draft_acceptance_rate: float | None = None
    localisation: Localisation | None = None
    # The longest the producer sent nothing during this handoff when it was a stall it recovered
    # from (at least protocol.STALL_NOTE_S, 2 s); null when there was none.
    producer_stall_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    error: str | None = None

    model_config = ConfigDict(populate_by_name=True)

    @model_validator(mode="after")
    def _complete_unless_failed(self) -> SampleRecord:
        if self.error is None:
            for name in REQUIRED_SAMPLE_FIELDS:
                if getattr(self, name) is None:
                    raise ValueError(f"sample omits {name} (set error to record a failed sample)")
        elif not self.error.strip():
            raise ValueError("error must say why the sample failed")
        return self


def _declared_type(field: FieldInfo) -> Any:
    return Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation


_FIELD_TYPES: Final[Mapping[str, TypeAdapter[Any]]] = MappingProxyType({
    name: TypeAdapter(_declared_type(field), config=ConfigDict(strict=True))
    for name, field in SampleRecord.model_fields.items()
})
"""Each sample record field's declared type, strict, as one value is checked against it."""

_RANGE_ERRORS: Final = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


def sample_field_fits(name: str, value: object) -> bool:
    """Whether ``value`` has the type :class:`SampleRecord` declares for its field ``name`` (a
    number, a whole number, a SHA-256 hex digest, true or false): the one definition of a sample
    record's field types, which the judge reads plain records against. A number need not be
    finite, and ranges are not checked here: whether a value is acceptable is the judge's to say."""
    try:
        _FIELD_TYPES[name].validate_python(value)
    except ValidationError as error:
        return all(problem["type"] in _RANGE_ERRORS for problem in error.errors())
    return True


def record_json(record: SampleRecord) -> dict[str, Any]:
    """The JSON form of a record as a plain dict: every field present, non-finite as strings."""
    document: dict[str, Any] = json.loads(record.model_dump_json(by_alias=True))
    return document


def failed_sample_record(repetition: int, error: str, **measured: Any) -> SampleRecord:
    """A record for a sample that failed (producer error, refused handoff), keeping whatever was
    measured before the failure; the judge refuses it on ``error``."""
    message = one_line(error) or "sample failed without a message"
    return SampleRecord(repetition=repetition, error=message, **measured)


# --------------------------------------------------------------------------- summary


class CheckRecord(_Frozen):
    """One judged check: its name, whether it held, and the plain-words detail."""

    name: str
    passed: bool
    detail: str


class ValidationSummary(_Frozen):
    """What a receipt's ``validation-summary.json`` holds: the verdict over the run's samples."""

    schema_: Literal["trust-ladder.validation-summary.v2", "trust-ladder.validation-summary.v1"] = Field(
        default=SUMMARY_SCHEMA, alias="schema")
    run_id: str
    recipe: str
    # The lane run; null only in a refused run whose identity never loaded and whose lane the
    # operator's choice does not name (an --identity file that is not a valid identity).
    lane: str | None
    rung: Literal[1, 2, 3] | None
    # Null only when the run was refused before its identity loaded (the receipt then holds no
    # identity.json): status must be refused.
    identity_sha256: Sha256Hex | None
    passed: bool
    # passed: qualified; failed: judged, not qualified; refused: refused before any evidence (exit
    # 2); incomplete: ended before its verdict (a failed step, an interrupt). None only in v1.
    status: RunStatus | None = None
    verdict: str
    reasons: tuple[str, ...]
    checks: tuple[CheckRecord, ...]
    rule: dict[str, Any] | None
    samples: Count
    started_utc: str
    finished_utc: str
    error: str | None = None

    model_config = ConfigDict(populate_by_name=True)

    @model_validator(mode="after")
    def _status_matches(self) -> ValidationSummary:
        if self.schema_ == SUMMARY_SCHEMA and self.status is None:
            raise ValueError(f"a {SUMMARY_SCHEMA} summary states its status")
        if self.status is not None and (self.status == "passed") != self.passed:
            raise ValueError(f"status {self.status} contradicts passed={self.passed}")
        if self.identity_sha256 is None and self.status != "refused":
            raise ValueError(f"identity_sha256 is null, status {self.status}: only a run refused before its "
                             f"identity loaded has no identity")
        if self.lane is None and self.identity_sha256 is not None:
            raise ValueError(f"lane is null under identity {self.identity_sha256}: a run with an identity names its lane")
        return self
