"""The preregistered E2 controls criteria and the calibration set: typed models, loaded fail closed.

Both files were committed before anything was measured on them (seed 000 §32.10: a criterion is
worth something only when it was written down before the run). Loading is layered like an
identity's: strict JSON (:func:`qualify.core.strict_json.read_strict_json`), the committed JSON
Schema (draft 2020-12, closed objects), a frozen strict pydantic model that must give back exactly
the document, then the files it names: every document's token ids must hash to its entry's
``token_sha256`` and hold the tokens its lengths need, and the yardstick file must hash to its
``sha256``. A file's digest is the SHA-256 of its RFC 8785 bytes (what a controls record names).

The calibration set and the controls must share no document (by name or source), and neither may
hold the qualification fixture: a bound calibrated on a control, or a control measured on the
fixture, would judge the lane on what set its own yardstick. Every refusal is one line
``<label> <path>: <field>: found ..., expected ...``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from qualify.contract.lanes import LANES
from qualify.core import model_choice
from qualify.core.assets import CONTRACTS_DIR, MAIN_PROMPT, chosen_model_tokens, prompt_sha256, require_asset
from qualify.core.digests import jcs_bytes, sha256_bytes, sha256_file
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import check_schema, format_path, read_strict_json, render

CRITERIA_SCHEMA_ID = "trust-ladder.e2-controls-criteria.v1"
CALIBRATION_SET_SCHEMA_ID = "trust-ladder.calibration-set.v1"
CONTROLS_RECORD_SCHEMA_ID = "trust-ladder.controls-record.v1"
CRITERIA_SCHEMA_PATH = CONTRACTS_DIR / "e2-controls-criteria.v1.schema.json"
CALIBRATION_SET_SCHEMA_PATH = CONTRACTS_DIR / "calibration-set.v1.schema.json"
CONTROLS_RECORD_SCHEMA_PATH = CONTRACTS_DIR / "controls-record.v1.schema.json"
CRITERIA_PATH = CONTRACTS_DIR / "e2-controls-v2.json"
"""The committed E2 controls criteria (what :func:`load_controls_criteria` reads by default)."""
CALIBRATION_SET_PATH = CONTRACTS_DIR / "calibration-set-v1.json"
"""The committed calibration set (what :func:`load_calibration_set` reads by default)."""
MODEL_CRITERIA_FILE = "e2-controls-v1.json"
MODEL_CALIBRATION_SET_FILE = "calibration-set-v1.json"
"""A chosen model's criteria and calibration set files in ``contracts/models/<name>/``
(``tools/model_contracts.py``)."""

FIXTURE_PROMPT_FILE = f"model/prompts/{MAIN_PROMPT}.json"
"""The qualification fixture's file: its name and source are barred from both sets."""
DOCUMENT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
TOKEN_ID_LIMIT = 1 << 32
"""Token ids are hashed as little-endian uint32 (``qualify.core.assets.prompt_bytes``): each must fit."""

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=64)]
Words = Annotated[str, Field(min_length=1, max_length=2000)]
ModelT = TypeVar("ModelT", bound=BaseModel)


def _rule(problem: str) -> PydanticCustomError:
    """A content rule's refusal; ``problem`` starts with the field it names."""
    return PydanticCustomError("controls_rule", "{problem}", {"problem": problem})


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class HeldOutDocument(_Frozen):
    """A document entry of either set: the file holding its token ids and their digest."""

    name: Name
    kind: Words
    source: Words
    source_sha256: Sha256
    tokens: int = Field(ge=1)
    token_sha256: Sha256
    file: str

    @model_validator(mode="after")
    def _file_is_named_for_the_document(self) -> HeldOutDocument:
        if self.file != document_file(self.name):
            raise _rule(f"file: found {render(self.file)}, expected {render(document_file(self.name))}")
        return self


def _check_lengths(lengths: Sequence[int], field: str) -> None:
    """Lengths must be positive and strictly increasing (the cells nest in this order)."""
    for index, length in enumerate(lengths):
        if length < 1:
            raise _rule(f"{field}[{index}]: found {length}, expected a positive length")
        if index and length <= lengths[index - 1]:
            raise _rule(f"{field}[{index}]: found {length} after {lengths[index - 1]}, expected strictly increasing lengths")


def _check_documents(documents: Sequence[HeldOutDocument], needed: int, field: str) -> None:
    """Names and sources are unique, and every document holds ``needed`` tokens at least."""
    seen: dict[str, int] = {}
    for index, document in enumerate(documents):
        for key, value in (("name", document.name), ("source", document.source),
                           ("source_sha256", document.source_sha256)):
            earlier = seen.get(f"{key}:{value}")
            if earlier is not None:
                raise _rule(f"documents[{index}].{key}: found {render(value)}, already documents[{earlier}]'s")
            seen[f"{key}:{value}"] = index
        if document.tokens < needed:
            raise _rule(f"documents[{index}].tokens: found {document.tokens}, expected at least {needed} ({field})")


class MeasureWords(_Frozen):
    rows: Words
    reference: Words
    disagreement: Words
    nesting: Words


class Yardstick(_Frozen):
    """E1's yardstick: a second real quantization whose disagreement sets every cell's gate."""

    name: Name
    description: Words
    file: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")
    sha256: Sha256


GateRuleName = Literal["wilson-upper-plus-points"]


class GateRule(_Frozen):
    """A cell's gate: the Wilson upper bound of the yardstick's rate at ``confidence``, plus ``points``."""

    rule: GateRuleName
    statement: Words
    confidence: float = Field(gt=0.0, lt=1.0)
    points: float = Field(ge=0.0, lt=1.0)


class CriteriaWords(_Frozen):
    length_effect_supported: Words
    length_effect_rejected: Words
    document_within: Words


class ControlsCriteria(_Frozen):
    """The preregistered E2 controls (``contracts/e2-controls-v2.json``)."""

    model_config = ConfigDict(title="trust-ladder E2 controls criteria")

    schema_id: Literal["trust-ladder.e2-controls-criteria.v1"] = Field(alias="schema")
    name: Name
    written: Words
    question: Words
    hypothesis: Words
    measure: MeasureWords
    documents: tuple[HeldOutDocument, ...] = Field(min_length=1)
    lengths: tuple[int, ...] = Field(min_length=1)
    profile_window: int = Field(ge=1)
    yardstick: Yardstick
    gate: GateRule
    exceedance: Words
    criteria: CriteriaWords
    lanes: tuple[Name, ...] = Field(min_length=1)
    disposition: Words

    @model_validator(mode="after")
    def _consistent(self) -> ControlsCriteria:
        _check_lengths(self.lengths, "lengths")
        # A cell of length L sums the profile windows below L, so every L is a whole number of windows.
        for index, length in enumerate(self.lengths):
            if length % self.profile_window:
                raise _rule(f"lengths[{index}]: found {length}, expected a multiple of profile_window "
                            f"{self.profile_window}")
        _check_documents(self.documents, self.lengths[-1], f"the longest length {self.lengths[-1]}")
        for index, lane in enumerate(self.lanes):
            if lane not in LANES:
                raise _rule(f"lanes[{index}]: found {render(lane)}, expected a lane of the lane table")
            if index and lane in self.lanes[:index]:
                raise _rule(f"lanes[{index}]: found {render(lane)} twice, expected each lane once")
        return self

    def document(self) -> dict[str, Any]:
        """The JSON document this model was read from."""
        return self.model_dump(mode="json", by_alias=True)


class CalibrationSet(_Frozen):
    """The preregistered calibration set (``contracts/calibration-set-v1.json``)."""

    model_config = ConfigDict(title="trust-ladder calibration set")

    schema_id: Literal["trust-ladder.calibration-set.v1"] = Field(alias="schema")
    name: Name
    purpose: Words
    documents: tuple[HeldOutDocument, ...] = Field(min_length=1)
    prompt_lengths: tuple[int, ...] = Field(min_length=1)
    output_tokens: int = Field(ge=1)
    producer_restarts_minimum: int = Field(ge=1)
    handoff: Words

    @model_validator(mode="after")
    def _consistent(self) -> CalibrationSet:
        _check_lengths(self.prompt_lengths, "prompt_lengths")
        _check_documents(self.documents, self.prompt_lengths[-1],
                         f"the longest prompt length {self.prompt_lengths[-1]}")
        return self

    def document(self) -> dict[str, Any]:
        """The JSON document this model was read from."""
        return self.model_dump(mode="json", by_alias=True)


class DocumentFile(_Frozen):
    """``model/documents/<name>.json`` as ``tools/build_documents.py`` writes it."""

    name: Name
    kind: Words
    set: Literal["calibration", "control"]
    source: Words
    source_sha256: Sha256
    rule: Words
    tokens: int = Field(ge=1)
    token_sha256: Sha256
    token_ids: tuple[int, ...]

    @model_validator(mode="after")
    def _ids_match(self) -> DocumentFile:
        if len(self.token_ids) != self.tokens:
            raise _rule(f"token_ids: found {len(self.token_ids)} ids, expected tokens = {self.tokens}")
        for index, token in enumerate(self.token_ids):
            if not 0 <= token < TOKEN_ID_LIMIT:
                raise _rule(f"token_ids[{index}]: found {token}, expected a token id in 0..{TOKEN_ID_LIMIT - 1}")
        digest = prompt_sha256(np.asarray(self.token_ids, dtype=np.int64))
        if digest != self.token_sha256:
            raise _rule(f"token_sha256: found {self.token_sha256}, the token ids hash to {digest}")
        return self


def document_file(name: str) -> str:
    """The asset name of a held-out document's file."""
    return f"model/documents/{name}.json"


def _describe_pydantic_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    location = [part for part in error["loc"] if isinstance(part, (str, int))]
    if error["type"] == "controls_rule":
        problem = str((error.get("ctx") or {}).get("problem", ""))
        return f"{format_path(location)}.{problem}" if location else problem
    return f"{format_path(location)}: {one_line(error['msg'])}, found {render(error.get('input'))}"


def _jcs(document: object, where: str) -> bytes:
    """The document's RFC 8785 bytes (its digest's input), refused in one line when it has none."""
    try:
        return jcs_bytes(document)
    except ValueError as exc:
        raise Refused(f"{where}: {one_line(str(exc))}") from None


def _typed(model: type[ModelT], document: object, where: str) -> ModelT:
    """``document`` as ``model``, which must give back exactly the document (nothing dropped or coerced)."""
    # Validated as JSON (arrays are the models' tuples), from the bytes the digest is taken over.
    data = _jcs(document, where)
    try:
        typed = model.model_validate_json(data)
    except ValidationError as exc:
        raise Refused(f"{where}: {_describe_pydantic_error(exc)}") from None
    if jcs_bytes(typed.model_dump(mode="json", by_alias=True)) != data:
        raise Refused(f"{where}: differs from its typed form; expected exactly the fields of {model.__name__}")
    return typed


def read_document_file(name: str) -> DocumentFile:
    """The held-out document ``name`` as its typed file, its ids checked against its ``token_sha256``."""
    if not isinstance(name, str) or DOCUMENT_NAME.fullmatch(name) is None:
        raise Refused(f"document: name found {render(name)}, expected a document name ([a-z0-9][a-z0-9_-]*)")
    relpath = document_file(name)
    path = require_asset(relpath)
    where = f"document {relpath}"
    typed = _typed(DocumentFile, read_strict_json(path, "document"), where)
    if typed.name != name:
        raise Refused(f"{where}: name: found {render(typed.name)}, expected {render(name)}")
    return typed


def load_document(name: str) -> np.ndarray:
    """The token ids (int64) of held-out document ``name`` (``model/documents/<name>.json``),
    refused unless they hash to the file's ``token_sha256``; under a chosen ``--model``, the
    file's rule applied under that model's tokenizer."""
    return chosen_model_tokens(name, np.asarray(read_document_file(name).token_ids, dtype=np.int64))


def _check_document_files(documents: Sequence[HeldOutDocument], role: str, where: str) -> None:
    """Each entry agrees with the file it names: same ids digest, count, source and set."""
    for index, entry in enumerate(documents):
        at = f"{where}: documents[{index}]"
        found = read_document_file(entry.name)
        digest = prompt_sha256(load_document(entry.name))
        if digest != entry.token_sha256:
            raise Refused(f"{at}.token_sha256: found {entry.token_sha256}, {entry.file}'s ids hash to {digest}")
        for field in ("tokens", "source", "source_sha256", "kind"):
            if getattr(entry, field) != getattr(found, field):
                raise Refused(f"{at}.{field}: found {render(getattr(entry, field))}, {entry.file} has "
                              f"{render(getattr(found, field))}")
        if found.set != role:
            raise Refused(f"{at}.name: {entry.file} is a {found.set} document, expected a {role} document")


def _check_no_fixture(documents: Sequence[HeldOutDocument], where: str) -> None:
    """No entry is the qualification fixture, by name or by source."""
    fixture = read_strict_json(require_asset(FIXTURE_PROMPT_FILE), "fixture")
    fixture_source = fixture.get("source") if isinstance(fixture, dict) else None
    fixture_source_sha256 = fixture.get("source_sha256") if isinstance(fixture, dict) else None
    if not isinstance(fixture_source, str) or not isinstance(fixture_source_sha256, str):
        raise Refused(f"fixture {FIXTURE_PROMPT_FILE}: source, source_sha256: missing, expected the fixture's source")
    for index, entry in enumerate(documents):
        for field, value, barred in (("name", entry.name, MAIN_PROMPT), ("source", entry.source, fixture_source),
                                     ("source_sha256", entry.source_sha256, fixture_source_sha256)):
            if value == barred:
                raise Refused(f"{where}: documents[{index}].{field}: found {render(value)}, which is the "
                              f"qualification fixture's ({MAIN_PROMPT}); expected a held-out document")




def model_contracts_dir() -> Path:
    """Where the process's model keeps its calibration set, controls criteria and identities:
    ``contracts/`` for the shipped model, ``contracts/models/<name>/`` for a chosen ``--model``."""
    choice = model_choice.chosen()
    return CONTRACTS_DIR if choice is None else CONTRACTS_DIR / model_choice.MODELS_PREFIX / choice.name


def load_controls_criteria(path: str | os.PathLike[str] | None = None) -> tuple[ControlsCriteria, str]:
    """The E2 controls criteria (default: the committed ``contracts/e2-controls-v2.json``, or a chosen
    model's ``contracts/models/<name>/e2-controls-v1.json``) and the
    SHA-256 of its RFC 8785 bytes (what a controls record names); any doubt is a one-line refusal."""
    default = CRITERIA_PATH if model_choice.chosen() is None else model_contracts_dir() / MODEL_CRITERIA_FILE
    file = default if path is None else Path(path)
    where = f"controls criteria {os.fspath(file)}"
    document = read_strict_json(file, "controls criteria")
    check_schema(document, CRITERIA_SCHEMA_PATH, where)
    criteria = _typed(ControlsCriteria, document, where)
    _check_no_fixture(criteria.documents, where)
    _check_document_files(criteria.documents, "control", where)
    if model_choice.chosen() is not None:
        # A chosen model's yardstick is derived in process: the engines check its digest when
        # they build it (qualify.evidence.controls_measure.yardstick_identity).
        return criteria, sha256_bytes(_jcs(document, where))
    yardstick = require_asset(criteria.yardstick.file)
    found = sha256_file(yardstick)
    if found != criteria.yardstick.sha256:
        raise Refused(f"{where}: yardstick.sha256: found {criteria.yardstick.sha256}, {criteria.yardstick.file} "
                      f"hashes to {found}")
    return criteria, sha256_bytes(_jcs(document, where))


def load_calibration_set(path: str | os.PathLike[str] | None = None) -> tuple[CalibrationSet, str]:
    """The calibration set (default: the committed ``contracts/calibration-set-v1.json``) and the
    SHA-256 of its RFC 8785 bytes; any doubt is a one-line refusal."""
    default = (CALIBRATION_SET_PATH if model_choice.chosen() is None
               else model_contracts_dir() / MODEL_CALIBRATION_SET_FILE)
    file = default if path is None else Path(path)
    where = f"calibration set {os.fspath(file)}"
    document = read_strict_json(file, "calibration set")
    check_schema(document, CALIBRATION_SET_SCHEMA_PATH, where)
    calibration = _typed(CalibrationSet, document, where)
    _check_no_fixture(calibration.documents, where)
    _check_document_files(calibration.documents, "calibration", where)
    return calibration, sha256_bytes(_jcs(document, where))


def check_disjoint(criteria: ControlsCriteria, calibration: CalibrationSet) -> None:
    """Refuse a calibration set sharing a document (by name, source or source digest) with the
    controls, or either holding the qualification fixture."""
    _check_no_fixture(criteria.documents, f"controls criteria {criteria.name}")
    _check_no_fixture(calibration.documents, f"calibration set {calibration.name}")
    controls = {(field, getattr(entry, field)): entry.name for entry in criteria.documents
                for field in ("name", "source", "source_sha256")}
    for index, entry in enumerate(calibration.documents):
        for field in ("name", "source", "source_sha256"):
            control = controls.get((field, getattr(entry, field)))
            if control is not None:
                raise Refused(f"calibration set {calibration.name}: documents[{index}].{field}: found "
                              f"{render(getattr(entry, field))}, which is control document {control}'s in "
                              f"{criteria.name}; expected no document shared with the controls")


def check_controls_record(document: object, where: str) -> None:
    """Refuse a controls record that breaks ``contracts/controls-record.v1.schema.json`` (what the
    measurement checks before writing; the judge re-checks everything against the criteria)."""
    check_schema(document, CONTROLS_RECORD_SCHEMA_PATH, where)


__all__ = [
    "CALIBRATION_SET_PATH", "CALIBRATION_SET_SCHEMA_ID", "CALIBRATION_SET_SCHEMA_PATH", "CONTROLS_RECORD_SCHEMA_ID",
    "CONTROLS_RECORD_SCHEMA_PATH", "CRITERIA_PATH", "CRITERIA_SCHEMA_ID", "CRITERIA_SCHEMA_PATH", "CalibrationSet",
    "ControlsCriteria", "DocumentFile", "GateRule", "HeldOutDocument", "Yardstick", "check_controls_record",
    "check_disjoint", "document_file", "load_calibration_set", "load_controls_criteria", "load_document",
    "read_document_file",
]
