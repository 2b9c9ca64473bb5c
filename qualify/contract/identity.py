"""Load a frozen onboarding identity, fail closed, before any engine starts.

Validation is layered (``docs/architecture.md``, DESIGN "The frozen onboarding identity"):

a. bytes: a regular file of at most 1 MiB, strict UTF-8 without BOM, strict JSON (no NaN or
   Infinity, no duplicate keys, nesting at most 32 deep, no control characters in strings);
b. JSON Schema ``contracts/onboarding-identity.v1.schema.json`` (draft 2020-12, closed objects);
c. frozen strict pydantic models (the typed view the code uses, :class:`Identity`);
d. exact equality with the sealed constants of the lane (``qualify/contract/sealed.py``): every field of
   the document, type included (``11`` is not ``11.0``), and the ``basis`` receipt, which must
   resolve under ``receipts/`` and hash to the sealed ``basis_sha256``.

Every refusal is one line ``identity <path>: <field>: found <value>, sealed|expected <value>``.
The identity digest (:func:`identity_sha256`) is the canonical SHA-256
(:func:`qualify.core.digests.canonical_sha256`) of the document as loaded; load_identity guarantees the
typed model serialises back to exactly that document, so the digest can be taken from either.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, cast

import jsonschema
from jsonschema.exceptions import ValidationError as SchemaError
from jsonschema.exceptions import best_match
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, ValidationError

from qualify.contract import sealed as sealed_module
from qualify.contract.lanes import (
    LANES,
    LaneKind,
    LaneSpec,
    NativeVariant,
    ProducerMode,
    Recipe,
    check_speculative_draft,
)
from qualify.contract.sealed import RECEIPT_URI, RELPATH, SealedIdentity, is_sealable_sha256
from qualify.core.assets import CONTRACTS_DIR, REPO_ROOT
from qualify.core.digests import canonical_json_bytes, canonical_sha256, sha256_file
from qualify.core.errors import Refused, one_line

MAX_DOCUMENT_BYTES = 1 << 20
"""Largest identity or registry file read (1 MiB); an identity is a few kilobytes."""

MAX_NESTING_DEPTH = 32
"""Deepest array/object nesting accepted; an identity is 4 levels deep."""

IDENTITY_SCHEMA_PATH = CONTRACTS_DIR / "onboarding-identity.v1.schema.json"
DEFAULT_ARCHIVE_DIR = REPO_ROOT / "receipts"
"""Where ``receipt://<run-id>/<file>`` resolves: ``receipts/<run-id>/<file>``."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRUCTURE_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


# --- (a) strict JSON bytes ----------------------------------------------------------------------


class _NonStandardConstant:
    """Stands in for NaN/Infinity while parsing so the walk can name the field that held it."""

    def __init__(self, text: str) -> None:
        self.text = text


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise _DuplicateKey(key)
        document[key] = value
    return document


def format_path(parts: Sequence[str | int]) -> str:
    """A JSON path as ``a.b["x/y"][0]``; the empty path is ``(document)``."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text or "(document)"


def render(value: Any, limit: int = 96) -> str:
    """A short one-line JSON rendering of a value for refusal messages."""
    if isinstance(value, _NonStandardConstant):
        return value.text
    try:
        text = json.dumps(value, ensure_ascii=True, sort_keys=False, allow_nan=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    text = one_line(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_nesting(text: str, where: str) -> None:
    depth = 0
    for match in _STRUCTURE_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                raise Refused(
                    f"{where}: nesting deeper than {MAX_NESTING_DEPTH} levels at character "
                    f"{match.start()}; expected a flat JSON document"
                )
        elif token in "]}":
            depth -= 1


def _walk_values(document: Any, where: str) -> None:
    """Refuse NaN/Infinity, overflowing numbers, control characters and lone surrogates."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _NonStandardConstant):
            raise Refused(
                f"{where}: {format_path(path)}: found {value.text}, expected a finite number "
                f"(NaN and Infinity are not JSON)"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise Refused(
                f"{where}: {format_path(path)}: found a number that overflows to infinity, "
                f"expected a finite number"
            )
        if isinstance(value, str):
            _check_text(value, where, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where, path + (key,), is_key=True)
                stack.append((path + (key,), item))
        elif isinstance(value, list):
            stack.extend((path + (index,), item) for index, item in enumerate(value))


def _check_text(text: str, where: str, path: tuple[str | int, ...], is_key: bool = False) -> None:
    what = "key" if is_key else "string"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused(
            f"{where}: {format_path(path)}: {what} holds a lone UTF-16 surrogate, expected text"
        ) from None
    control = _CONTROL.search(text)
    if control is not None:
        raise Refused(
            f"{where}: {format_path(path)}: {what} holds control character "
            f"U+{ord(control.group()):04X}, expected printable text"
        )


def read_strict_json(path: str | os.PathLike[str], label: str = "identity") -> Any:
    """Parse a small JSON file strictly, refusing anything odd with one line naming the file.

    ``label`` starts every refusal (``identity <path>: ...``, ``registry <path>: ...``).
    """
    where = f"{label} {os.fspath(path)}"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise Refused(f"{where}: no such file") from None
    except OSError as exc:
        raise Refused(f"{where}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if stat.S_ISDIR(info.st_mode):
        raise Refused(f"{where}: is a directory, expected a JSON file")
    if not stat.S_ISREG(info.st_mode):
        raise Refused(f"{where}: not a regular file, expected a JSON file")
    if info.st_size > MAX_DOCUMENT_BYTES:
        raise Refused(
            f"{where}: file is {info.st_size} bytes, expected at most {MAX_DOCUMENT_BYTES} (1 MiB)"
        )
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise Refused(f"{where}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise Refused(f"{where}: file grew past {MAX_DOCUMENT_BYTES} bytes while reading")
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise Refused(
            f"{where}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            f"expected a UTF-8 JSON document"
        ) from None
    if text.startswith("\ufeff"):
        raise Refused(f"{where}: starts with a byte-order mark; expected UTF-8 JSON without BOM")
    _check_nesting(text, where)
    try:
        document = json.loads(
            text, object_pairs_hook=_refuse_duplicates, parse_constant=_NonStandardConstant
        )
    except _DuplicateKey as exc:
        raise Refused(f"{where}: duplicate key {exc.key!r}; each key may appear once") from None
    except json.JSONDecodeError as exc:
        raise Refused(
            f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise Refused(f"{where}: nesting too deep; expected a flat JSON document") from None
    except ValueError as exc:
        raise Refused(f"{where}: not JSON ({one_line(str(exc))[:120]})") from None
    _walk_values(document, where)
    return document


# --- (b) JSON Schema ----------------------------------------------------------------------------


@lru_cache(maxsize=8)
def schema_validator(schema_path: Path) -> jsonschema.Draft202012Validator:
    """The draft 2020-12 validator for a contract schema file (checked once, cached)."""
    try:
        schema = json.loads(Path(schema_path).read_text(encoding="utf-8"))
        jsonschema.Draft202012Validator.check_schema(schema)
    except (OSError, ValueError, jsonschema.SchemaError) as exc:
        raise Refused(f"contract schema {schema_path}: unusable ({type(exc).__name__})") from None
    return jsonschema.Draft202012Validator(schema)


def describe_schema_error(error: SchemaError) -> str:
    """One line naming the JSON path, what was found and what the schema expects."""
    path = list(error.absolute_path)
    keyword = error.validator
    instance = error.instance
    expected = error.schema.get("description") if isinstance(error.schema, dict) else None
    if keyword == "required" and isinstance(instance, dict):
        missing = [key for key in error.validator_value if key not in instance]
        return f"{format_path(path + missing[:1])}: missing, expected this field"
    if keyword == "additionalProperties" and isinstance(instance, dict):
        known = error.schema.get("properties", {})
        extra = [key for key in instance if key not in known]
        if extra:
            return (
                f"{format_path(path + extra[:1])}: found unexpected field, expected only "
                f"{', '.join(known) or 'declared fields'}"
            )
    if keyword == "propertyNames":
        return f"{format_path(path)}: key {render(instance)}: expected {expected or 'a valid key'}"
    if keyword == "type":
        return f"{format_path(path)}: found {render(instance)}, expected type {error.validator_value}"
    if keyword == "const":
        return f"{format_path(path)}: found {render(instance)}, expected {render(error.validator_value)}"
    if keyword == "enum":
        choices = ", ".join(render(choice) for choice in error.validator_value)
        return f"{format_path(path)}: found {render(instance)}, expected one of {choices}"
    if keyword in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        relation = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
        return (
            f"{format_path(path)}: found {render(instance)}, expected a number "
            f"{relation[keyword]} {error.validator_value}"
        )
    if keyword == "not" and expected:
        return f"{format_path(path)}: found the placeholder {render(instance)}, expected {expected}"
    if expected and keyword in ("pattern", "minLength", "maxLength", "not"):
        return f"{format_path(path)}: found {render(instance)}, expected {expected}"
    return f"{format_path(path)}: {one_line(error.message)[:200]}"


def check_schema(document: Any, schema_path: Path, where: str) -> None:
    """Refuse a document that breaks its contract schema, reporting the best-matching error."""
    error = best_match(schema_validator(schema_path).iter_errors(document))
    if error is not None:
        raise Refused(f"{where}: {describe_schema_error(error)}")


# --- (c) frozen strict pydantic models ----------------------------------------------------------


def _sha256(value: str) -> str:
    if not is_sealable_sha256(value):
        raise ValueError("expected a non-zero 64-character lowercase hex SHA-256")
    return value


def _relpath(value: str) -> str:
    if not RELPATH.fullmatch(value):
        raise ValueError("expected a relative path without '.' or '..' segments")
    return value


def _freeze_files(files: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(files))


Sha256 = Annotated[str, AfterValidator(_sha256)]
RelPath = Annotated[str, AfterValidator(_relpath)]
Name = Annotated[str, Field(min_length=1, max_length=200)]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
FileDigests = Annotated[
    Mapping[RelPath, Sha256],
    Field(min_length=1),
    AfterValidator(_freeze_files),
    PlainSerializer(dict, return_type=dict),
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class EngineRef(_Frozen):
    """An engine pinned by name, version and ABI string."""

    name: Name
    version: Name
    abi: Name


class NamedDigest(_Frozen):
    """An artifact pinned by name and SHA-256 (adapter, prompt template)."""

    name: Name
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


class RawLogitUnits(_Frozen):
    """Bounds are in raw logits."""

    transform: Literal["raw"]


class SoftcapLogitUnits(_Frozen):
    """Bounds are in ``cap * tanh(logit / cap)`` units, applied by both engines (seed §32.6)."""

    transform: Literal["tanh-softcap"]
    cap: PositiveFloat


LogitUnits = Annotated[RawLogitUnits | SoftcapLogitUnits, Field(discriminator="transform")]


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
    """A rung-3 draft: geometry, sealed acceptance floor, draft weights digest."""

    geometry: DraftGeometry
    acceptance_floor: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
    draft_sha256: Sha256


class BoundedDriftLogits(_Frozen):
    """Rung 2: per-sample full-logit max and mean absolute deltas must stay within these."""

    mode: Literal["bounded-drift"]
    maximum_absolute: PositiveFloat
    maximum_mean_absolute: PositiveFloat


class ExactLogits(_Frozen):
    """Rung 3: full logits must be bit-identical (digests equal, deltas zero)."""

    mode: Literal["exact"]


FullLogitsRule = Annotated[BoundedDriftLogits | ExactLogits, Field(discriminator="mode")]


class OnboardingQualification(_Frozen):
    """The qualification rule, written before the run (seed §32.2)."""

    schema_id: str = Field(alias="schema")
    prompt_tokens: PositiveInt
    output_tokens: PositiveInt
    repetitions: PositiveInt
    prompt_sha256: Sha256
    require_exact_tokens: bool
    require_deterministic_remote_output: bool
    full_logits: FullLogitsRule
    basis: Annotated[str, Field(min_length=1, max_length=512)]


class Identity(_Frozen):
    """The typed, immutable view of a validated onboarding identity document."""

    schema_id: str = Field(alias="schema")
    lane: Name
    lane_kind: LaneKind
    recipe: Recipe
    rung: Literal[2, 3]
    producer_mode: ProducerMode
    native_variant: NativeVariant | None
    checkpoint: Checkpoint
    producer_engine: EngineRef
    consumer_engine: EngineRef
    adapter: NamedDigest
    tokenizer_sha256: Sha256
    prompt: PromptRef
    prompt_template: NamedDigest
    context_policy: ContextPolicy
    rope: Rope
    logit_units: LogitUnits
    target_cache_identity_sha256: Sha256
    speculative_draft: SpeculativeDraft | None
    onboarding_qualification: OnboardingQualification

    @property
    def spec(self) -> LaneSpec:
        """The lane table entry this identity is for."""
        return LANES[self.lane]

    def document(self) -> dict[str, Any]:
        """The JSON document (plain dicts) this identity was loaded from."""
        return self.model_dump(mode="json", by_alias=True)


def identity_sha256(identity: Identity) -> str:
    """Canonical SHA-256 of the identity document as loaded: part of the lane identity,
    written into every receipt (``qualify.core.digests.canonical_sha256``)."""
    if not isinstance(identity, Identity):
        raise Refused(f"identity digest: found {type(identity).__name__}, expected Identity")
    return canonical_sha256(identity.document())


def _describe_pydantic_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    location = format_path([part for part in error["loc"] if isinstance(part, (str, int))])
    return f"{location}: {one_line(error['msg'])}, found {render(error.get('input'))}"


# --- (d) sealed constants -----------------------------------------------------------------------


def _sealed_mismatch(found: Any, sealed: Any, path: tuple[str | int, ...]) -> str | None:
    """The first field where ``found`` differs from ``sealed`` (type-exact), as one line."""
    if isinstance(sealed, dict):
        if not isinstance(found, dict):
            return f"{format_path(path)}: found {render(found)}, sealed {render(sealed)}"
        for key, sealed_value in sealed.items():
            if key not in found:
                return f"{format_path(path + (key,))}: missing, sealed {render(sealed_value)}"
            mismatch = _sealed_mismatch(found[key], sealed_value, path + (key,))
            if mismatch is not None:
                return mismatch
        for key in found:
            if key not in sealed:
                return f"{format_path(path + (key,))}: found {render(found[key])}, sealed no such field"
        return None
    if type(found) is not type(sealed) or found != sealed:
        return f"{format_path(path)}: found {render(found)}, sealed {render(sealed)}"
    return None


def _receipt_resolver(context: str) -> Callable[[str, Path], Any] | None:
    """``qualify.archive.receipts.resolve_receipt_uri`` if that module exists; a broken one refuses."""
    name = "qualify.archive.receipts"
    try:
        present = name in sys.modules or importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        present = True
    if not present:
        return None
    try:
        resolver: object = importlib.import_module(name).resolve_receipt_uri
    except Exception as exc:  # a broken verifier must not be skipped: fail closed
        raise Refused(
            f"{context}: {name} is unusable ({type(exc).__name__}: {one_line(str(exc))[:120]})"
        ) from None
    if not callable(resolver):
        raise Refused(f"{context}: {name}.resolve_receipt_uri is not callable")
    return cast(Callable[[str, Path], Any], resolver)


def resolve_basis(uri: str, archive_dir: Path, sealed_sha256: str, where: str) -> Path:
    """Resolve ``receipt://<run-id>/<file>`` to an archived file whose SHA-256 is sealed.

    Uses ``qualify.archive.receipts.resolve_receipt_uri`` (which verifies the receipt manifest) when
    that module exists; the sealed file digest is checked either way.
    """
    field = "onboarding_qualification.basis"
    match = RECEIPT_URI.fullmatch(uri) if isinstance(uri, str) else None
    if match is None:
        raise Refused(f"{where}: {field}: found {render(uri)}, expected receipt://<run-id>/<file>")
    archive = Path(archive_dir)
    resolver = _receipt_resolver(f"{where}: {field}: cannot verify {uri}")
    if resolver is not None:
        try:
            resolved = Path(resolver(uri, archive))
        except Refused as exc:
            raise Refused(f"{where}: {field}: {one_line(str(exc))}") from None
        except Exception as exc:
            raise Refused(
                f"{where}: {field}: cannot verify {uri} ({type(exc).__name__}: "
                f"{one_line(str(exc))[:120]})"
            ) from None
    else:
        resolved = archive / match["run_id"] / match["file"]
    try:
        real = resolved.resolve(strict=True)
        inside = real.is_relative_to(archive.resolve(strict=True))
        regular = real.is_file()
    except (OSError, RuntimeError):
        raise Refused(
            f"{where}: {field}: {uri} does not resolve (no file {resolved}); "
            f"expected an archived receipt"
        ) from None
    if not inside or not regular:
        raise Refused(f"{where}: {field}: {uri} resolves outside the receipt archive or not to a file")
    try:
        digest = sha256_file(real)
    except OSError as exc:
        raise Refused(f"{where}: {field}: cannot read {real} ({exc.strerror})") from None
    if digest != sealed_sha256:
        raise Refused(f"{where}: {field}: {uri}: sha256 found {digest}, sealed {sealed_sha256}")
    return real


def check_against_sealed(
    identity: Identity,
    document: Mapping[str, Any],
    sealed_identities: Mapping[str, SealedIdentity],
    archive_dir: Path,
    where: str,
) -> SealedIdentity:
    """Layer (d): the lane's sealed constants, field by field, then the basis receipt."""
    sealed = sealed_identities.get(identity.lane)
    if sealed is None:
        known = ", ".join(sealed_identities) or "none yet"
        raise Refused(f"{where}: lane: found {render(identity.lane)}, sealed lanes: {known}")
    try:
        check_speculative_draft(
            identity.lane, identity.producer_mode, identity.speculative_draft is not None
        )
    except Refused as exc:
        raise Refused(f"{where}: {exc}") from None
    rule = identity.onboarding_qualification.full_logits
    if isinstance(rule, BoundedDriftLogits):
        for bound in ("maximum_absolute", "maximum_mean_absolute"):
            value = getattr(rule, bound)
            if not math.isfinite(value) or value <= 0.0:
                raise Refused(
                    f"{where}: onboarding_qualification.full_logits.{bound}: found {value!r}, "
                    f"expected a finite positive number"
                )
    mismatch = _sealed_mismatch(dict(document), sealed.identity_document(), ())
    if mismatch is not None:
        raise Refused(f"{where}: {mismatch}")
    resolve_basis(
        identity.onboarding_qualification.basis,
        archive_dir,
        sealed.qualification.basis_sha256,
        where,
    )
    return sealed


# --- public entry points ------------------------------------------------------------------------


def validate_identity_document(
    document: Any,
    *,
    where: str,
    sealed_identities: Mapping[str, SealedIdentity] | None = None,
    archive_dir: str | os.PathLike[str] | None = None,
) -> Identity:
    """Layers (b)-(d) on an already parsed document; ``where`` starts every refusal."""
    table = sealed_module.SEALED_IDENTITIES if sealed_identities is None else sealed_identities
    archive = Path(DEFAULT_ARCHIVE_DIR if archive_dir is None else archive_dir)
    _walk_values(document, where)
    check_schema(document, IDENTITY_SCHEMA_PATH, where)
    try:
        identity = Identity.model_validate_json(json.dumps(document, allow_nan=False), strict=True)
    except ValidationError as exc:
        raise Refused(f"{where}: {_describe_pydantic_error(exc)}") from None
    check_against_sealed(identity, document, table, archive, where)
    if canonical_json_bytes(identity.document()) != canonical_json_bytes(document):
        raise Refused(f"{where}: the typed model does not round-trip the document exactly")
    return identity


def load_identity(
    path: str | os.PathLike[str],
    *,
    sealed_identities: Mapping[str, SealedIdentity] | None = None,
    archive_dir: str | os.PathLike[str] | None = None,
) -> Identity:
    """Read and validate an identity file (layers a-d); any refusal is one-line ``Refused``.

    ``sealed_identities`` defaults to the shipped ``qualify.contract.sealed.SEALED_IDENTITIES`` and
    ``archive_dir`` to ``receipts/`` in the checkout.
    """
    where = f"identity {os.fspath(path)}"
    document = read_strict_json(path, "identity")
    return validate_identity_document(
        document, where=where, sealed_identities=sealed_identities, archive_dir=archive_dir
    )


def logit_units_label(units: RawLogitUnits | SoftcapLogitUnits) -> str:
    """The engine-side spelling of logit units: ``raw`` or ``tanh-softcap:<cap>``."""
    if isinstance(units, SoftcapLogitUnits):
        return f"tanh-softcap:{units.cap!r}"
    return "raw"


def _parse_engine_units(engine_units: str) -> tuple[str, float | None] | None:
    if engine_units == "raw":
        return ("raw", None)
    prefix = "tanh-softcap:"
    if engine_units.startswith(prefix):
        try:
            cap = float(engine_units[len(prefix):])
        except ValueError:
            return None
        if math.isfinite(cap) and cap > 0:
            return ("tanh-softcap", cap)
    return None


def check_engine_units(identity: Identity, engine_units: str) -> None:
    """Refuse an engine whose logits are not in the identity's contract units (seed §32.6).

    Both sides are compared in those units; a bound in other units would be meaningless.
    """
    expected = logit_units_label(identity.logit_units)
    parsed = _parse_engine_units(engine_units) if isinstance(engine_units, str) else None
    wanted: tuple[str, float | None] = (
        ("tanh-softcap", identity.logit_units.cap)
        if isinstance(identity.logit_units, SoftcapLogitUnits)
        else ("raw", None)
    )
    if parsed != wanted:
        raise Refused(
            f"logit units: engine reports {render(engine_units)}, identity {identity.lane} "
            f"compares in {expected!r}; both sides must be compared in the contract's units"
        )


__all__ = [
    "BoundedDriftLogits",
    "Checkpoint",
    "ContextPolicy",
    "DraftGeometry",
    "EngineRef",
    "ExactLogits",
    "Identity",
    "NamedDigest",
    "OnboardingQualification",
    "PromptRef",
    "RawLogitUnits",
    "Rope",
    "SoftcapLogitUnits",
    "SpeculativeDraft",
    "check_engine_units",
    "identity_sha256",
    "load_identity",
    "logit_units_label",
    "read_strict_json",
    "validate_identity_document",
]
