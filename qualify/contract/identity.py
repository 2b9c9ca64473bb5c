"""The frozen onboarding identity: its one typed model, and loading it fail closed.

The pydantic model :class:`Identity` is the only definition of an identity's shape and rules: the
JSON Schemas ``contracts/onboarding-identity.v5.schema.json`` and ``.v6`` are generated from it
(:func:`identity_json_schema`, written by ``tools/freeze_identity.py --write-schema``) and every
content rule (consistency with the lane table, the rule, the prompt, the derived cache identity)
is one of its validators, so they hold for every identity, sealed or being frozen.

Two schema versions load. v5's digest (:func:`identity_sha256`,
:func:`qualify.core.digests.document_sha256`) is the SHA-256 of the document's RFC 8785 bytes,
reproducible with a stock JCS library; it pins the calibration set, the stated bound (and floor)
rule, the E2 controls criteria and each engine's ABI and known-answer digest
(``qualify.engines.kat``). v6 is v5 plus a declared link-rate floor (``link_floor``): freezing
writes v6 only for an identity that declares one. v1 and v2 are refused as retired (their bounds
were sealed from the fixture itself), v3 and v4 as source-pinned (they pin engine source bytes and
numpy/BLAS versions); their schemas stay in ``contracts/`` for archived receipts.

Loading is layered (``docs/architecture.md``, DESIGN "The frozen onboarding identity"):

a. bytes: strict JSON (:func:`qualify.core.strict_json.read_strict_json`);
b. the generated JSON Schema (draft 2020-12, closed objects);
c. the frozen strict pydantic model, which must serialise back to exactly the document;
d. the seal: the document's digest must equal its lane's sealed digest
   (``qualify/contract/sealed_data.py``), so a relaxed bound changes only by a re-freeze in a
   reviewed commit.

Loading checks the basis receipt URI's shape only; :func:`check_basis_receipt` (given the archive
layer's resolver and verifier) checks the whole basis receipt: its ``manifest.json`` hashes to the
lane's sealed digest and every file matches that manifest, none missing and none extra.
Every refusal is one line ``identity <path>: <field>: found <value>, expected|sealed <value>``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, ValidationError, model_validator
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from qualify.contract import sealed_data
from qualify.contract.lanes import (
    LANES,
    VLLM_VIA_CONNECTOR_LANE,
    ZERO_SHA256,
    LaneKind,
    LaneSpec,
    NativeVariant,
    ProducerMode,
    Recipe,
    check_speculative_draft,
    target_cache_identity,
)
from qualify.contract.rules import (
    BOUND_RULE,
    FIXTURE_ENVELOPE_CEILINGS_DIGEST,
    FIXTURE_ENVELOPE_MINIMUM_HANDOFFS,
    FIXTURE_ENVELOPE_MINIMUM_STARTS,
    FIXTURE_ENVELOPE_RULE,
    FLOOR_RULE,
    STATED_RULES,
    TEACHER_FORCED_BOUND_RULE,
)
from qualify.contract.units import LogitUnits
from qualify.core.assets import CONTRACTS_DIR, RECEIPTS_DIR, require_asset
from qualify.core.digests import canonical_json_bytes, document_sha256, sha256_bytes
from qualify.core.errors import Refused, one_line
from qualify.core.model_choice import pinned_model_name
from qualify.core.strict_json import check_json_values, check_schema, format_path, read_strict_json, render

IdentitySchemaId = Literal["trust-ladder.onboarding-identity.v5", "trust-ladder.onboarding-identity.v6",
                           "trust-ladder.onboarding-identity.v7", "trust-ladder.onboarding-identity.v8"]
IDENTITY_SCHEMA_IDS: tuple[str, ...] = get_args(IdentitySchemaId)
"""Every ``schema`` string an onboarding identity document may declare to load."""
IDENTITY_SCHEMA_ID: str = IDENTITY_SCHEMA_IDS[0]
"""The ``schema`` string freezing writes for an identity without a link-rate floor (v5: each
engine's arithmetic by ABI and known-answer digest, no engine source or numpy/BLAS version pin)."""
LINK_FLOOR_SCHEMA_ID: str = IDENTITY_SCHEMA_IDS[1]
"""The ``schema`` string of an identity that declares a link-rate floor (v6: v5 plus ``link_floor``)."""
TEACHER_FORCED_SCHEMA_ID: str = IDENTITY_SCHEMA_IDS[2]
"""The ``schema`` string of a teacher-forced identity (v7: a rung-2 lane whose tokens may part at
near-ties, judged by ``full_logits`` mode ``teacher-forced``; ``link_floor`` may be null or a floor)."""
NON_DETERMINISTIC_SCHEMA_ID: str = IDENTITY_SCHEMA_IDS[3]
"""The ``schema`` string of an identity whose producer is declared non-deterministic (v8: rung 2,
``require_deterministic_remote_output`` false and a sealed ``fixture_envelope``, no anchor
recheck; ``full_logits`` bounded-drift or teacher-forced; ``link_floor`` null or a floor)."""
RETIRED_IDENTITY_SCHEMA_IDS: tuple[str, ...] = ("trust-ladder.onboarding-identity.v1",
                                                "trust-ladder.onboarding-identity.v2")
"""Versions that no longer load: their bounds were sealed from the fixture itself, with no
calibration set or stated rule behind them (their schemas stay in ``contracts/`` for archived
receipts)."""
SOURCE_PINNED_IDENTITY_SCHEMA_IDS: tuple[str, ...] = ("trust-ladder.onboarding-identity.v3",
                                                      "trust-ladder.onboarding-identity.v4")
"""Versions that no longer load because they pin engine source bytes and numpy/BLAS versions
instead of known answers; ``tools/freeze_identity.py --refreeze`` moves one to v5/v6, numbers kept."""

IDENTITY_SCHEMA_PATHS: Mapping[str, Path] = MappingProxyType({
    schema_id: CONTRACTS_DIR / f"onboarding-identity.{schema_id.rsplit('.', 1)[1]}.schema.json"
    for schema_id in IDENTITY_SCHEMA_IDS
})
"""Schema id -> its committed JSON Schema, generated from :class:`Identity` (a test keeps them equal)."""
IDENTITY_SCHEMA_PATH = IDENTITY_SCHEMA_PATHS[IDENTITY_SCHEMA_ID]
"""The committed JSON Schema of the current version."""

DEFAULT_ARCHIVE_DIR = RECEIPTS_DIR
"""Where a shipped identity's ``receipt://<run-id>/<file>`` basis resolves: ``receipts/<run-id>/<file>``
under the asset root (:mod:`qualify.core.assets`)."""

SHA256_PATTERN = r"^[0-9a-f]{64}$"
RELPATH_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$"
RECEIPT_URI_PATTERN = r"^receipt://[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)+$"
NAME_PATTERN = r"^[\x21-\x7e]+( [\x21-\x7e]+)*$"
LANE_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]*$"
# The patterns are written once, in the subset both JSON Schema (ECMA-262) and Python's re read
# alike; ``fullmatch`` keeps Python's ``$`` from accepting a trailing newline.
RELPATH = re.compile(RELPATH_PATTERN)
RECEIPT_URI = re.compile(RECEIPT_URI_PATTERN)


# --- the model ----------------------------------------------------------------------------------


def _rule_error(field: str, problem: str) -> PydanticCustomError:
    """A content-rule refusal; ``field`` is the dotted path below where the validator runs."""
    return PydanticCustomError("identity_rule", "{field}: {problem}", {"field": field, "problem": problem})


def _not_placeholder(value: str) -> str:
    if value == ZERO_SHA256:
        raise _rule_error("", f"found the placeholder {render(value)}, expected a real SHA-256")
    return value


def _freeze_files(files: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(files))


def _known_lane(name: str) -> str:
    if name not in LANES:
        raise _rule_error("", f"found {render(name)}, expected one of {', '.join(LANES)}")
    return name


Sha256 = Annotated[
    str,
    Field(
        pattern=SHA256_PATTERN,
        description="a SHA-256: 64 lowercase hex characters, not the all-zero placeholder",
        json_schema_extra={"not": {"const": ZERO_SHA256}},
    ),
    AfterValidator(_not_placeholder),
]
RelPath = Annotated[
    str,
    Field(
        pattern=RELPATH_PATTERN,
        min_length=1,
        max_length=255,
        description="a repository-relative path such as model/config.json, without '.' or '..' segments",
    ),
]
ReceiptUri = Annotated[
    str,
    Field(
        pattern=RECEIPT_URI_PATTERN,
        min_length=1,
        max_length=512,
        description="receipt://<run-id>/<file> (resolved under receipts/)",
    ),
]
Name = Annotated[
    str,
    Field(
        pattern=NAME_PATTERN,
        min_length=1,
        max_length=200,
        description="a printable ASCII name (single spaces allowed), at most 200 characters",
    ),
]
EngineAbi = Annotated[
    str,
    Field(
        pattern=NAME_PATTERN,
        min_length=1,
        max_length=400,
        description="an engine's ABI string: printable ASCII (single spaces allowed), at most 400 characters",
    ),
]
"""An ABI names everything an engine's bits depend on; a vLLM ABI carries the host's CPU ISA class,
whose flags alone reach 72 characters on a CPU with AVX-512 FP16 and AMX (208 in all there)."""
LaneName = Annotated[
    str,
    Field(
        pattern=LANE_NAME_PATTERN,
        min_length=1,
        max_length=64,
        description="a lane identity name such as nvfp4-native-splitk",
    ),
    AfterValidator(_known_lane),
]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
FileDigests = Annotated[
    Mapping[RelPath, Sha256],
    Field(min_length=1, max_length=1024),
    AfterValidator(_freeze_files),
    PlainSerializer(dict, return_type=dict),
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class EngineRef(_Frozen):
    """An engine pinned by name, version, ABI string and, for an engine exact by construction, the
    digest of its known-answer check (``qualify.engines.kat``)."""

    name: Name
    version: Name
    abi: EngineAbi
    kat_sha256: Sha256 | None = Field(
        description="null, or the SHA-256 of the engine's KV and logit bits on the fixed known-answer input")


class NamedDigest(_Frozen):
    """An artifact pinned by name and SHA-256 (prompt template, calibration set, controls)."""

    name: Name
    sha256: Sha256


class ConnectorPin(_Frozen):
    """The KV connector a connector lane goes through: the name vLLM knows it by and the RFC 8785
    digest of what resolved it (module, class, distribution and version, config digest)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
                               description="the connector's registered or class name")]
    sha256: Sha256


class Checkpoint(_Frozen):
    """Per-file SHA-256 map (repository-relative paths, e.g. ``model/config.json``; immutable)
    and total bytes; the same map the producer service compares its engine against."""

    files: FileDigests
    total_bytes: PositiveInt


class PromptRef(_Frozen):
    """The qualification prompt: name, token count, ``qualify.core.assets.prompt_sha256`` digest."""

    name: Name
    tokens: PositiveInt
    sha256: Sha256


class ContextPolicy(_Frozen):
    """Positions the producer hands off, and the largest position the lane may use."""

    handoff_positions: PositiveInt
    max_positions: PositiveInt


class Rope(_Frozen):
    """RoPE base and the digest of the cos/sin cache."""

    theta: PositiveFloat
    cache_sha256: Sha256


class DraftGeometry(_Frozen):
    """Speculative draft head geometry (EAGLE-1) and tokens proposed per step."""

    kind: Literal["eagle-1"]
    layers: PositiveInt
    hidden_size: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    proposal_tokens: PositiveInt


class SpeculativeDraft(_Frozen):
    """A rung-3 draft: geometry, acceptance floor, draft weights digest."""

    geometry: DraftGeometry
    acceptance_floor: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
    draft_sha256: Sha256


class BoundedDriftLogits(_Frozen):
    """Rung 2: per-sample full-logit max and mean absolute deltas must stay within these."""

    mode: Literal["bounded-drift"]
    maximum_absolute: PositiveFloat
    maximum_mean_absolute: PositiveFloat


class TeacherForcedLogits(_Frozen):
    """Rung 2 for a lane whose greedy tokens part from the cold recompute at near-ties (rule
    ``teacher-forced-near-tie.v1``): from its first parting the handoff is fed the cold tokens;
    every parting must sit at a cold top-1/top-2 margin at most ``near_tie_margin``, every row's max
    and mean abs delta within ``maximum_absolute`` and ``maximum_mean_absolute``, and the share of
    parted rows within ``maximum_changed_row_share``."""

    mode: Literal["teacher-forced"]
    maximum_absolute: PositiveFloat
    maximum_mean_absolute: PositiveFloat
    near_tie_margin: PositiveFloat
    maximum_changed_row_share: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


class ExactLogits(_Frozen):
    """Rung 3: full logits must be bit-identical (digests equal, deltas zero)."""

    mode: Literal["exact"]


FullLogitsRule = Annotated[BoundedDriftLogits | TeacherForcedLogits | ExactLogits, Field(discriminator="mode")]


def _known_rule(name: str) -> str:
    if name not in STATED_RULES:
        raise _rule_error("", f"found {render(name)}, expected one of {', '.join(STATED_RULES)}")
    return name


class StatedRule(_Frozen):
    """A rule by name, with the words that state it (both pinned by the identity's digest)."""

    name: Annotated[Name, AfterValidator(_known_rule)]
    statement: Annotated[str, Field(min_length=1, max_length=2000)]

    @model_validator(mode="after")
    def _states_the_rule(self) -> StatedRule:
        if self.statement != STATED_RULES[self.name]:
            raise _rule_error("statement", f"differs from rule {self.name}'s statement "
                                           f"(qualify/contract/rules.py): {render(STATED_RULES[self.name])}")
        return self


class CalibrationBasis(_Frozen):
    """How the rule was measured: the calibration set (documents and lengths, never the fixture or a
    control) by the digest of its file, the stated bound rule, and for a draft the floor rule."""

    set: NamedDigest
    bound_rule: StatedRule
    floor_rule: StatedRule | None = Field(description="null, or the rung-3 draft floor's rule")


class LinkFloor(_Frozen):
    """The least payload rate each handoff must cross its network link at (seed 000, section 32.3:
    each handoff's payload rate, against the qualifier's link-rate minimum). Judged on a producer
    reached over TCP; a run whose producer is on the consumer's host crosses no link and is refused."""

    gbit_per_s_minimum: PositiveFloat


EnvelopeMultiple = Annotated[float, Field(ge=2, allow_inf_nan=False,
                                          description="k of one series: twice the larger of 1 and its leave-one-out step")]


class EnvelopeMultipliers(_Frozen):
    """The multiple k of each series of a fixture envelope (rule ``fixture-envelope-loo-range.v1``),
    each at least 2."""

    row_max_abs: EnvelopeMultiple
    row_mean_abs: EnvelopeMultiple
    position_max_abs: EnvelopeMultiple
    tensor_position_max_abs: EnvelopeMultiple


class SealedFixtureEnvelope(_Frozen):
    """A non-deterministic producer's fixture envelope, sealed: its stated rule, the honest fixture
    handoffs and producer starts of the basis receipt it was stated from, each series' multiple and
    the SHA-256 of its ceilings (every load re-derives them from the basis receipt's series)."""

    rule: StatedRule
    handoffs: Annotated[int, Field(ge=FIXTURE_ENVELOPE_MINIMUM_HANDOFFS)]
    producer_starts: Annotated[int, Field(ge=FIXTURE_ENVELOPE_MINIMUM_STARTS)]
    multipliers: EnvelopeMultipliers
    ceilings_sha256: Sha256

    @model_validator(mode="after")
    def _states_its_rule(self) -> SealedFixtureEnvelope:
        if self.rule.name != FIXTURE_ENVELOPE_RULE:
            raise _rule_error("rule.name", f"found {render(self.rule.name)}, expected {FIXTURE_ENVELOPE_RULE}")
        if self.producer_starts > self.handoffs:
            raise _rule_error("producer_starts", f"found {self.producer_starts}, expected at most handoffs "
                                                 f"({self.handoffs}): a start hands off at least once")
        return self


class OnboardingQualification(_Frozen):
    """The qualification rule, written before the run (seed §32.2)."""

    schema_id: str = Field(
        alias="schema",
        description="the recipe's onboarding schema",
        json_schema_extra={"enum": [recipe.onboarding_schema for recipe in Recipe]},
    )
    prompt_tokens: PositiveInt
    output_tokens: PositiveInt
    repetitions: PositiveInt
    prompt_sha256: Sha256
    # The harness judges nothing weaker: both flags are part of every rule; exact tokens are waived
    # only by the teacher-forced rule (v7, v8), which judges every parting instead, and determinism
    # only by a sealed fixture envelope (v8), which holds every row and position instead.
    require_exact_tokens: bool
    require_deterministic_remote_output: bool
    full_logits: FullLogitsRule
    basis: ReceiptUri
    fixture_envelope: SealedFixtureEnvelope | None = Field(
        default=None, description="v8 only, and required there: the sealed fixture envelope a producer declared "
                                  "non-deterministic is held to")


class Identity(_Frozen):
    """The frozen onboarding identity of one producer lane: everything its numbers depend on,
    pinned by SHA-256, plus the qualification rule."""

    model_config = ConfigDict(title="trust-ladder onboarding identity")

    schema_id: IdentitySchemaId = Field(alias="schema")
    lane: LaneName
    lane_kind: LaneKind
    recipe: Recipe
    rung: Literal[2, 3]
    producer_mode: ProducerMode
    native_variant: NativeVariant | None
    onboarding_qualification: OnboardingQualification
    target_cache_identity_sha256: Sha256
    checkpoint: Checkpoint
    producer_engine: EngineRef
    consumer_engine: EngineRef
    connector: ConnectorPin | None = Field(
        description="null, or (lane vllm-via-connector only) the KV connector the lane goes through: its name "
                    "and the SHA-256 of the resolved connector (module, class, distribution and version, config digest)"
    )
    tokenizer_sha256: Sha256
    prompt: PromptRef
    prompt_template: NamedDigest
    context_policy: ContextPolicy
    rope: Rope
    logit_units: LogitUnits
    speculative_draft: SpeculativeDraft | None = Field(
        description="null, or the rung-3 draft (never on a native-mode lane)"
    )
    calibration: CalibrationBasis
    controls: NamedDigest | None = Field(
        description="null, or the preregistered E2 controls criteria file (name and RFC 8785 digest)"
    )
    link_floor: LinkFloor | None = Field(
        default=None, description="v6 only, and required there: the link-rate floor every handoff is judged against"
    )

    @property
    def spec(self) -> LaneSpec:
        """The lane table entry this identity is for."""
        return LANES[self.lane]

    @property
    def model_name(self) -> str | None:
        """The chosen model the identity pins (``models/<name>/...`` checkpoint files), or None for
        the shipped model."""
        return pinned_model_name(self.checkpoint.files, f"identity {self.lane}")

    @property
    def seal_name(self) -> str:
        """Its entry in ``sealed_data``: the lane for the shipped model, ``<model>/<lane>`` for a
        chosen model's (each model's lanes are sealed apart)."""
        name = self.model_name
        lane = self.lane
        if self.connector is not None:  # one identity per connector: sealed apart
            lane = f"{lane}/{self.connector.name}"
        return lane if name is None else f"{name}/{lane}"

    @model_validator(mode="after")
    def _connector_on_its_lane(self) -> Identity:
        """Lane vllm-via-connector pins its connector; no other lane names one."""
        connector_lane = self.lane == VLLM_VIA_CONNECTOR_LANE
        if connector_lane and self.connector is None:
            raise _rule_error("connector", f"null, lane {self.lane} pins the connector it was calibrated through")
        if self.connector is not None and not connector_lane:
            raise _rule_error("connector", f"found {render(self.connector.name)}, only lane "
                                           f"{VLLM_VIA_CONNECTOR_LANE} pins a connector")
        return self

    @model_validator(mode="after")
    def _one_model(self) -> Identity:
        """The checkpoint pins one model's files (never the shipped model's beside another's)."""
        try:
            pinned_model_name(self.checkpoint.files, "checkpoint")
        except Refused as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def teacher_forced(self) -> bool:
        """Judged by the teacher-forced rule (v7) rather than by exact tokens."""
        return isinstance(self.onboarding_qualification.full_logits, TeacherForcedLogits)

    @property
    def deterministic_producer(self) -> bool:
        """The producer is declared deterministic (every version but v8): its anchor is rechecked
        bit for bit; a non-deterministic one is held to its sealed fixture envelope instead."""
        return self.onboarding_qualification.require_deterministic_remote_output

    def document(self) -> dict[str, Any]:
        """The JSON document (plain dicts) this identity was loaded from (a v5 document has no
        ``link_floor``, not a null one, and no version before v8 a ``fixture_envelope``: their
        digests stay what they were sealed as)."""
        exclude: dict[str, Any] = {}
        if self.schema_id == IDENTITY_SCHEMA_ID:
            exclude["link_floor"] = True
        if self.schema_id != NON_DETERMINISTIC_SCHEMA_ID:
            exclude["onboarding_qualification"] = {"fixture_envelope"}
        return self.model_dump(mode="json", by_alias=True, exclude=exclude or None)

    @model_validator(mode="after")
    def _determinism_follows_version(self) -> Identity:
        """v8, and only v8, declares a non-deterministic producer, and then carries its sealed
        fixture envelope; rung 3 is bit-exact, so its producer is always deterministic."""
        rule = self.onboarding_qualification
        declared = not rule.require_deterministic_remote_output
        v8 = self.schema_id == NON_DETERMINISTIC_SCHEMA_ID
        if declared != v8:
            raise _rule_error("onboarding_qualification.require_deterministic_remote_output",
                              f"found {render(rule.require_deterministic_remote_output)}, schema {render(self.schema_id)} "
                              + ("declares a non-deterministic producer (false)" if v8 else
                                 f"declares a deterministic one (true; a non-deterministic producer needs "
                                 f"{render(NON_DETERMINISTIC_SCHEMA_ID)})"))
        if declared and self.rung != 2:
            raise _rule_error("onboarding_qualification.require_deterministic_remote_output",
                              f"found false, rung {self.rung} is bit-exact: only a rung-2 producer may be declared "
                              f"non-deterministic")
        if (rule.fixture_envelope is None) == declared:
            raise _rule_error("onboarding_qualification.fixture_envelope",
                              "found null, expected the sealed fixture envelope a producer declared non-deterministic "
                              "is held to" if declared else
                              "expected null: a deterministic producer is rechecked against its anchor")
        return self

    @model_validator(mode="after")
    def _link_floor_follows_version(self) -> Identity:
        """v6 declares a link floor and v5 none (the schemas say so too; this holds for an
        identity built in Python)."""
        if self.schema_id in (TEACHER_FORCED_SCHEMA_ID, NON_DETERMINISTIC_SCHEMA_ID):
            return self  # v7, v8: a floor or none
        if (self.link_floor is not None) != (self.schema_id == LINK_FLOOR_SCHEMA_ID):
            expected = (f"a floor (schema {LINK_FLOOR_SCHEMA_ID})" if self.schema_id == LINK_FLOOR_SCHEMA_ID
                        else f"none (schema {self.schema_id}; a floor needs {LINK_FLOOR_SCHEMA_ID})")
            raise _rule_error("link_floor", f"expected {expected}")
        return self

    @model_validator(mode="after")
    def _follows_its_lane(self) -> Identity:
        """The lane table fixes kind, recipe, rung, mode, variant and whether a draft is declared."""
        spec = self.spec
        for field, found, expected in (
            ("lane_kind", self.lane_kind, spec.kind),
            ("recipe", self.recipe, spec.recipe),
            ("rung", self.rung, spec.recipe.rung),
            ("producer_mode", self.producer_mode, spec.mode),
            ("native_variant", self.native_variant, spec.variant),
        ):
            if found != expected:
                # render() writes a str-enum member as its JSON value.
                raise _rule_error(field, f"found {render(found)}, lane {spec.name} is {render(expected)}")
        try:
            check_speculative_draft(spec.name, spec.mode, self.speculative_draft is not None)
        except Refused as exc:
            raise _rule_error("", one_line(str(exc))) from None
        if spec.speculative_draft and self.speculative_draft is None:
            raise _rule_error("speculative_draft", f"found null, expected a draft (lane {spec.name} declares one)")
        if not spec.speculative_draft and self.speculative_draft is not None:
            raise _rule_error("speculative_draft", f"found a draft, expected null (lane {spec.name} declares none)")
        return self

    @model_validator(mode="after")
    def _rule_is_consistent(self) -> Identity:
        """The rule matches the recipe, the prompt it names and the context it runs in."""
        rule = self.onboarding_qualification
        recipe = self.recipe
        if rule.schema_id != recipe.onboarding_schema:
            raise _rule_error("onboarding_qualification.schema",
                              f"found {render(rule.schema_id)}, recipe {recipe.value} uses "
                              f"{render(recipe.onboarding_schema)}")
        teacher_forced = isinstance(rule.full_logits, TeacherForcedLogits)
        # v7 judges teacher-forced alone; v8 (a non-deterministic producer) either rung-2 mode.
        allowed = (teacher_forced and self.schema_id == NON_DETERMINISTIC_SCHEMA_ID) or \
            teacher_forced == (self.schema_id == TEACHER_FORCED_SCHEMA_ID)
        if not allowed:
            raise _rule_error("onboarding_qualification.full_logits.mode",
                              f"found {render(rule.full_logits.mode)}, schema {render(self.schema_id)} "
                              + ("judges teacher-forced" if not teacher_forced else
                                 f"does not declare it (teacher-forced needs {render(TEACHER_FORCED_SCHEMA_ID)} "
                                 f"or {render(NON_DETERMINISTIC_SCHEMA_ID)})"))
        if rule.require_exact_tokens == teacher_forced:
            raise _rule_error("onboarding_qualification.require_exact_tokens",
                              f"found {render(rule.require_exact_tokens)}, expected "
                              f"{render(not teacher_forced)} under mode {render(rule.full_logits.mode)}")
        if teacher_forced and recipe.rung == 2:
            pass  # the teacher-forced rule is rung 2's other mode
        elif rule.full_logits.mode != recipe.full_logits_mode:
            raise _rule_error("onboarding_qualification.full_logits.mode",
                              f"found {render(rule.full_logits.mode)}, recipe {recipe.value} judges "
                              f"{render(recipe.full_logits_mode)}")
        bounds = rule.full_logits
        if isinstance(bounds, (BoundedDriftLogits, TeacherForcedLogits)) and \
                bounds.maximum_mean_absolute > bounds.maximum_absolute:
            raise _rule_error("onboarding_qualification.full_logits.maximum_mean_absolute",
                              f"found {bounds.maximum_mean_absolute!r}, expected at most maximum_absolute "
                              f"({bounds.maximum_absolute!r})")
        if self.prompt.sha256 != rule.prompt_sha256:
            raise _rule_error("prompt.sha256", f"found {render(self.prompt.sha256)}, expected "
                                               f"onboarding_qualification.prompt_sha256 {render(rule.prompt_sha256)}")
        if self.prompt.tokens != rule.prompt_tokens:
            raise _rule_error("prompt.tokens", f"found {self.prompt.tokens}, expected "
                                               f"onboarding_qualification.prompt_tokens {rule.prompt_tokens}")
        context = self.context_policy
        if context.handoff_positions >= rule.prompt_tokens:
            raise _rule_error("context_policy.handoff_positions",
                              f"found {context.handoff_positions}, expected fewer than prompt_tokens "
                              f"{rule.prompt_tokens} (the consumer feeds at least one)")
        if context.max_positions < rule.prompt_tokens + rule.output_tokens:
            raise _rule_error("context_policy.max_positions",
                              f"found {context.max_positions}, expected at least prompt_tokens + output_tokens "
                              f"= {rule.prompt_tokens + rule.output_tokens}")
        return self

    @model_validator(mode="after")
    def _calibration_rules_fit(self) -> Identity:
        """The bound rule is the bound rule; a floor rule is stated exactly when a draft is declared."""
        basis = self.calibration
        bound_rule = TEACHER_FORCED_BOUND_RULE if self.teacher_forced else BOUND_RULE
        if basis.bound_rule.name != bound_rule:
            raise _rule_error("calibration.bound_rule.name", f"found {render(basis.bound_rule.name)}, expected {bound_rule}")
        if (basis.floor_rule is None) != (self.speculative_draft is None):
            expected = "null (no draft is declared)" if self.speculative_draft is None else f"rule {FLOOR_RULE}"
            raise _rule_error("calibration.floor_rule", f"expected {expected}")
        if basis.floor_rule is not None and basis.floor_rule.name != FLOOR_RULE:
            raise _rule_error("calibration.floor_rule.name", f"found {render(basis.floor_rule.name)}, expected {FLOOR_RULE}")
        return self

    @model_validator(mode="after")
    def _cache_identity_is_derived(self) -> Identity:
        """The target-cache identity is derived from lane, checkpoint and producer ABI, never stated."""
        derived = target_cache_identity(self.spec, self.checkpoint.files, self.producer_engine.abi)
        if self.target_cache_identity_sha256 != derived:
            raise _rule_error("target_cache_identity_sha256",
                              f"found {render(self.target_cache_identity_sha256)}, expected {derived} (derived "
                              f"from lane kind, mode, variant, checkpoint and producer abi)")
        return self


# --- the generated JSON Schema ------------------------------------------------------------------


class _ContractSchema(GenerateJsonSchema):
    """Pydantic's generator with two changes for a contract schema: no per-field titles (the
    names are the documentation), and a string-keyed map closed by ``propertyNames`` (pydantic
    writes a key pattern as ``patternProperties``, which leaves non-matching keys unchecked)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        json_schema = super().dict_schema(schema)
        if "patternProperties" in json_schema:
            patterns = json_schema.pop("patternProperties")
            ((key_pattern, value_schema),) = patterns.items()
            json_schema["propertyNames"] = {"pattern": key_pattern, **json_schema.get("propertyNames", {})}
            json_schema["additionalProperties"] = value_schema
        return json_schema


_DIGEST_RULES: Mapping[str, str] = MappingProxyType({
    "trust-ladder.onboarding-identity.v5": (
        " Its digest (identity_sha256, sealed per lane) is the SHA-256 of its RFC 8785 (JCS) bytes."
        " Engines are pinned by ABI and known-answer digest, not by source bytes or numpy/BLAS versions."),
    "trust-ladder.onboarding-identity.v6": (
        " Its digest (identity_sha256, sealed per lane) is the SHA-256 of its RFC 8785 (JCS) bytes."
        " Engines are pinned by ABI and known-answer digest, not by source bytes or numpy/BLAS versions."
        " v6 is v5 plus link_floor, the link-rate floor every handoff is judged against."),
    "trust-ladder.onboarding-identity.v7": (
        " Its digest (identity_sha256, sealed per lane) is the SHA-256 of its RFC 8785 (JCS) bytes."
        " Engines are pinned by ABI and known-answer digest, not by source bytes or numpy/BLAS versions."
        " v7 is a rung-2 identity judged teacher-forced: full_logits mode teacher-forced (tokens may part"
        " from the cold recompute at near-ties), require_exact_tokens false, bounds by rule"
        " teacher-forced-cell-max-plus-one-sd.v1; link_floor is null or a floor."),
    "trust-ladder.onboarding-identity.v8": (
        " Its digest (identity_sha256, sealed per lane) is the SHA-256 of its RFC 8785 (JCS) bytes."
        " Engines are pinned by ABI and known-answer digest, not by source bytes or numpy/BLAS versions."
        " v8 is a rung-2 identity whose producer is declared non-deterministic:"
        " require_deterministic_remote_output false, no anchor is rechecked, and every handoff is held to"
        " onboarding_qualification.fixture_envelope, stated by rule fixture-envelope-loo-range.v1 from the"
        " basis receipt's honest fixture handoffs over several producer starts; its ceilings_sha256 is the "
        + FIXTURE_ENVELOPE_CEILINGS_DIGEST + "; full_logits is bounded-drift (require_exact_tokens true) or teacher-forced"
        " (false); link_floor is null or a floor."),
})
"""What a version's schema says about its digest (v1's text predates the rule and stays as committed)."""


def identity_json_schema(schema_id: str = IDENTITY_SCHEMA_ID) -> dict[str, Any]:
    """The JSON Schema of an identity document of one version, generated from :class:`Identity`
    (draft 2020-12): the versions differ in their ``schema`` constant, id and title, and in
    ``link_floor``, which v5 has not and v6 requires."""
    if schema_id not in IDENTITY_SCHEMA_PATHS:
        raise Refused(f"identity schema: found {render(schema_id)}, expected one of "
                      f"{', '.join(render(known) for known in IDENTITY_SCHEMA_IDS)}")
    generated = Identity.model_json_schema(schema_generator=_ContractSchema)  # by alias (pydantic's default)
    version = schema_id.rsplit(".", 1)[1]
    generated["properties"]["schema"] = {"const": schema_id, "type": "string"}
    qualification = generated["$defs"]["OnboardingQualification"]
    rule = qualification["properties"]
    logits = rule["full_logits"]
    if schema_id == NON_DETERMINISTIC_SCHEMA_ID:
        # v8: a rung-2 producer declared non-deterministic, held to its sealed fixture envelope.
        rule["require_deterministic_remote_output"] = {"const": False, "type": "boolean"}
        rule["fixture_envelope"] = {"$ref": "#/$defs/SealedFixtureEnvelope", "description": (
            "the sealed fixture envelope every handoff is held to (no anchor is rechecked)")}
        qualification["required"].append("fixture_envelope")
        logits["oneOf"] = [item for item in logits["oneOf"] if item["$ref"] != "#/$defs/ExactLogits"]
        del logits["discriminator"]["mapping"]["exact"], generated["$defs"]["ExactLogits"]
        generated["properties"]["link_floor"] = {"anyOf": [{"$ref": "#/$defs/LinkFloor"}, {"type": "null"}],
                                                 "description": "null, or the link-rate floor every handoff is judged against"}
        generated["required"].append("link_floor")
        return {**_schema_head(generated, schema_id, version), **generated}
    # v5 to v7 as committed: a deterministic producer, no fixture envelope.
    rule["require_deterministic_remote_output"] = {"const": True, "type": "boolean"}
    del rule["fixture_envelope"]
    for name in ("SealedFixtureEnvelope", "EnvelopeMultipliers"):
        del generated["$defs"][name]
    if schema_id == TEACHER_FORCED_SCHEMA_ID:
        # v7 judges teacher-forced alone: exact tokens waived, the one mode of full_logits.
        rule["require_exact_tokens"] = {"const": False, "type": "boolean"}
        rule["full_logits"] = {"$ref": "#/$defs/TeacherForcedLogits"}
        del generated["$defs"]["BoundedDriftLogits"], generated["$defs"]["ExactLogits"]
        generated["properties"]["link_floor"] = {"anyOf": [{"$ref": "#/$defs/LinkFloor"}, {"type": "null"}],
                                                 "description": "null, or the link-rate floor every handoff is judged against"}
        generated["required"].append("link_floor")
        return {**_schema_head(generated, schema_id, version), **generated}
    # v5 and v6 as committed: exact tokens, and no teacher-forced mode.
    rule["require_exact_tokens"] = {"const": True, "type": "boolean"}
    logits["oneOf"] = [item for item in logits["oneOf"] if item["$ref"] != "#/$defs/TeacherForcedLogits"]
    del logits["discriminator"]["mapping"]["teacher-forced"], generated["$defs"]["TeacherForcedLogits"]
    if schema_id == LINK_FLOOR_SCHEMA_ID:
        generated["properties"]["link_floor"] = {"$ref": "#/$defs/LinkFloor", "description": (
            "the link-rate floor every handoff is judged against")}
        generated["required"].append("link_floor")
    else:
        del generated["properties"]["link_floor"], generated["$defs"]["LinkFloor"]
    return {**_schema_head(generated, schema_id, version), **generated}


def _schema_head(generated: dict[str, Any], schema_id: str, version: str) -> dict[str, Any]:
    """The schema's head (draft, id, title, description), taking title and description out of
    ``generated``."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://trust-ladder.invalid/contracts/{IDENTITY_SCHEMA_PATHS[schema_id].name}",
        "title": f"{generated.pop('title')} {version}",
        "description": generated.pop("description") + _DIGEST_RULES[schema_id],
    }


def identity_schema_text(schema_id: str = IDENTITY_SCHEMA_ID) -> str:
    """The committed form of :func:`identity_json_schema`: two-space indented JSON and a newline."""
    return json.dumps(identity_json_schema(schema_id), indent=2, ensure_ascii=False) + "\n"


# --- loading ------------------------------------------------------------------------------------


def _describe_pydantic_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    location = [part for part in error["loc"] if isinstance(part, (str, int))]
    context = error.get("ctx") or {}
    if error["type"] == "identity_rule":
        field, problem = str(context["field"]), str(context["problem"])  # what _rule_error always sets
        path = location + (field.split(".") if field else [])
        return f"{format_path(path)}: {problem}" if path else problem
    return f"{format_path(location)}: {one_line(error['msg'])}, found {render(error.get('input'))}"


def identity_sha256(identity: Identity) -> str:
    """SHA-256 of the identity document as loaded, in the canonical form its schema version
    declares (:func:`qualify.core.digests.document_sha256`: RFC 8785 for v5): part of the lane
    identity, written into every receipt."""
    if not isinstance(identity, Identity):
        raise Refused(f"identity digest: found {type(identity).__name__}, expected Identity")
    try:
        return document_sha256(identity.document())
    except ValueError as exc:
        raise Refused(f"identity {identity.lane}: {one_line(str(exc))}") from None


def _schema_path_of(document: object, where: str) -> Path:
    """The JSON Schema of the version the document declares; the current one when it declares
    none (the schema layer then names what is missing)."""
    if isinstance(document, dict) and "schema" in document:
        if document["schema"] in RETIRED_IDENTITY_SCHEMA_IDS:
            raise Refused(f"{where}: schema: found {render(document['schema'])}, a retired version whose bounds "
                          f"were sealed from the fixture itself; re-calibrate and re-freeze it as "
                          f"{render(IDENTITY_SCHEMA_ID)} (docs/calibration.md)")
        if document["schema"] in SOURCE_PINNED_IDENTITY_SCHEMA_IDS:
            raise Refused(f"{where}: schema: found {render(document['schema'])}, a retired version that pins "
                          f"engine source bytes and numpy/BLAS versions; re-freeze it as known answers: "
                          f"tools/freeze_identity.py --refreeze (docs/calibration.md)")
        path = IDENTITY_SCHEMA_PATHS.get(document["schema"]) if isinstance(document["schema"], str) else None
        if path is None:
            raise Refused(f"{where}: schema: found {render(document['schema'])}, expected one of "
                          f"{', '.join(render(known) for known in IDENTITY_SCHEMA_IDS)}")
        return path
    return IDENTITY_SCHEMA_PATH


def parse_identity_document(document: object, *, where: str) -> Identity:
    """Layers (b) and (c) on a parsed document: the schema of the version it declares, then the
    strict model, which must serialise back to exactly the document (so its digest is the
    document's). Not sealed."""
    check_json_values(document, where)
    check_schema(document, _schema_path_of(document, where), where)
    try:
        # Strict by the model's own config; check_json_values above has refused NaN and infinities.
        identity = Identity.model_validate_json(json.dumps(document))
    except ValidationError as exc:
        raise Refused(f"{where}: {_describe_pydantic_error(exc)}") from None
    typed = identity.document()
    if canonical_json_bytes(typed) != canonical_json_bytes(document):
        difference = _first_difference(document, typed, ()) or "(document): differs from its typed form"
        raise Refused(f"{where}: {difference}")
    return identity


def _first_difference(found: object, typed: object, path: tuple[str | int, ...]) -> str | None:
    """The first place a document differs from its typed form, type-exact (``11`` is not ``11.0``)."""
    if isinstance(found, dict) and isinstance(typed, dict):
        for key in [*typed, *(key for key in found if key not in typed)]:
            mismatch = _first_difference(found.get(key), typed.get(key), path + (key,))
            if mismatch is not None:
                return mismatch
        return None
    if type(found) is not type(typed) or found != typed:
        return f"{format_path(path)}: found {render(found)}, expected {render(typed)} (its typed form)"
    return None


def check_sealed(identity: Identity, where: str, sealed_identities: Mapping[str, str] | None = None) -> None:
    """Layer (d): the identity's canonical SHA-256 must equal the sealed digest of its lane."""
    table = sealed_data.SEALED_IDENTITIES if sealed_identities is None else sealed_identities
    sealed = table.get(identity.seal_name)
    if sealed is None:
        known = ", ".join(table) or "none yet"
        raise Refused(f"{where}: lane: found {render(identity.seal_name)}, sealed lanes: {known}")
    found = identity_sha256(identity)
    if found != sealed:
        raise Refused(
            f"{where}: lane {identity.seal_name}: identity sha256 found {found}, sealed {sealed}; a sealed identity "
            f"changes only by re-freezing it with tools/freeze_identity.py in a reviewed commit"
        )


def validate_identity_document(
    document: object, *, where: str, sealed_identities: Mapping[str, str] | None = None
) -> Identity:
    """Layers (b)-(d) on an already parsed document; ``where`` starts every refusal."""
    identity = parse_identity_document(document, where=where)
    check_sealed(identity, where, sealed_identities)
    return identity


def load_identity(
    path: str | os.PathLike[str], *, sealed_identities: Mapping[str, str] | None = None
) -> Identity:
    """Read and validate an identity file (layers a-d); any refusal is one-line ``Refused``.

    ``sealed_identities`` (lane -> sealed digest) defaults to
    ``qualify.contract.sealed_data.SEALED_IDENTITIES``.
    """
    where = f"identity {os.fspath(path)}"
    document = read_strict_json(path, "identity")
    return validate_identity_document(document, where=where, sealed_identities=sealed_identities)


ReceiptResolver = Callable[[str, Path], Path]
"""``(receipt_uri, archive_dir) -> file``: the archive layer's ``resolve_receipt_uri``, which verifies
the receipt's manifest (passed in: the contract layer never imports the archive)."""

ReceiptVerifier = Callable[[Path], tuple[list[str], int]]
"""``receipt_dir -> (problems, files covered)``: the archive layer's ``check_receipt``, which
re-hashes every file against the receipt's manifest and reports a missing or extra file (passed
in like :data:`ReceiptResolver`)."""

BASIS_MANIFEST = "manifest.json"
"""The basis receipt's file whose SHA-256 is sealed: it lists every other file's SHA-256."""
BASIS_MANIFEST_MAX_BYTES = 16 << 20
"""Largest basis manifest read (a calibration receipt's lists some tens of files)."""


def _read_basis_manifest(path: Path) -> bytes:
    """The manifest's bytes, bounded (never following a link: a receipt is untrusted input)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    descriptor = os.open(path, flags)
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(0, "not a regular file")
        data = handle.read(BASIS_MANIFEST_MAX_BYTES + 1)
    if len(data) > BASIS_MANIFEST_MAX_BYTES:
        raise OSError(0, f"larger than {BASIS_MANIFEST_MAX_BYTES} bytes")
    return data


def check_basis_receipt(
    identity: Identity,
    resolve: ReceiptResolver,
    verify: ReceiptVerifier,
    *,
    where: str,
    archive_dir: str | os.PathLike[str] | None = None,
    sealed_basis_manifests: Mapping[str, str] | None = None,
) -> Path:
    """Check the identity's whole basis receipt (``onboarding_qualification.basis``) under
    ``archive_dir`` (default :data:`DEFAULT_ARCHIVE_DIR`): the URI resolves (``resolve``), every
    file matches the receipt's manifest with none missing or extra (``verify``), and the
    manifest's bytes hash to the lane's sealed digest, so no file (a sample setting the KV
    envelope, say) changes even with its manifest re-hashed. Returns the basis file's path."""
    field = "onboarding_qualification.basis"
    uri = identity.onboarding_qualification.basis
    table = sealed_data.SEALED_BASIS_MANIFESTS if sealed_basis_manifests is None else sealed_basis_manifests
    sealed = table.get(identity.seal_name)
    if sealed is None:
        raise Refused(f"{where}: {field}: lane {identity.seal_name} has no sealed basis receipt manifest digest")
    archive = Path(DEFAULT_ARCHIVE_DIR if archive_dir is None else archive_dir)
    # The URI pattern makes the run id one plain path segment (no '/', no leading '.').
    run_id = uri.removeprefix("receipt://").partition("/")[0]
    receipt = archive / run_id
    if archive == RECEIPTS_DIR:  # the shipped basis: its absence is a broken install, not a tampered receipt
        require_asset(f"receipts/{run_id}/{BASIS_MANIFEST}")
    try:
        path = Path(resolve(uri, archive))
        problems, _count = verify(receipt)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise Refused(f"{uri}: receipt fails verification: {problems[0]}{more}")
        found = sha256_bytes(_read_basis_manifest(receipt / BASIS_MANIFEST))
    except Refused as exc:
        raise Refused(f"{where}: {field}: {one_line(str(exc))}") from None
    except OSError as exc:
        raise Refused(f"{where}: {field}: {uri}: cannot read its receipt's {BASIS_MANIFEST} "
                      f"({exc.strerror or type(exc).__name__})") from None
    if found != sealed:
        raise Refused(f"{where}: {field}: {uri}: receipt {run_id} file {BASIS_MANIFEST} sha256 found {found}, "
                      f"sealed {sealed} (lane {identity.seal_name}); its files differ from the calibration "
                      f"the rule was frozen from")
    return path


__all__ = [
    "DEFAULT_ARCHIVE_DIR",
    "BASIS_MANIFEST",
    "IDENTITY_SCHEMA_ID",
    "IDENTITY_SCHEMA_IDS",
    "IDENTITY_SCHEMA_PATH",
    "IDENTITY_SCHEMA_PATHS",
    "LINK_FLOOR_SCHEMA_ID",
    "NON_DETERMINISTIC_SCHEMA_ID",
    "RECEIPT_URI",
    "RELPATH",
    "ReceiptResolver",
    "ReceiptVerifier",
    "BoundedDriftLogits",
    "CalibrationBasis",
    "Checkpoint",
    "ContextPolicy",
    "DraftGeometry",
    "EnvelopeMultipliers",
    "EngineRef",
    "ExactLogits",
    "Identity",
    "LinkFloor",
    "NamedDigest",
    "OnboardingQualification",
    "PromptRef",
    "Rope",
    "SealedFixtureEnvelope",
    "SpeculativeDraft",
    "StatedRule",
    "check_basis_receipt",
    "check_sealed",
    "identity_json_schema",
    "identity_schema_text",
    "identity_sha256",
    "load_identity",
    "parse_identity_document",
    "validate_identity_document",
]
