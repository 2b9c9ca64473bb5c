"""SHA-256 helpers and the canonical JSON byte forms every document digest and MAC is taken over.

Two canonical forms exist, and a hashed document's declared ``schema`` picks one
(:func:`document_bytes`, :func:`document_sha256`; an undeclared or unknown schema is refused):

* RFC 8785, the JSON Canonicalization Scheme (:func:`jcs_bytes`), for every current schema
  (:data:`JCS_SCHEMAS`): a verifier in any language reproduces the digest with a stock JCS
  library. Integers beyond IEEE 754 doubles' exact range (2**53 - 1) and NaN/infinities are refused.
* Legacy (:func:`canonical_json_bytes`), for the schemas written before it
  (:data:`LEGACY_SCHEMAS`), kept so archived receipts and old identities still verify: UTF-8 bytes
  of ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
  allow_nan=False)``. It differs from RFC 8785 on numbers (``1e-06`` vs ``0.000001``, ``10000.0``
  vs ``10000``), so only this harness reproduces it.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import rfc8785

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 22


def is_sha256_hex(value: object) -> bool:
    """True for exactly 64 lowercase hex characters."""
    return isinstance(value, str) and SHA256_HEX.fullmatch(value) is not None


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def canonical_json_bytes(obj: Any) -> bytes:
    """The legacy canonical byte form of a JSON document (see module docstring); new documents
    are digested by their schema (:func:`document_sha256`)."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def canonical_sha256(obj: Any) -> str:
    return sha256_bytes(canonical_json_bytes(obj))


def jcs_bytes(obj: Any) -> bytes:
    """RFC 8785 (JSON Canonicalization Scheme) bytes of a JSON document: what a verifier in any
    language reproduces with a stock JCS library. NaN, infinities and integers beyond IEEE 754
    doubles' exact range are refused (``ValueError``)."""
    try:
        return rfc8785.dumps(obj)
    except rfc8785.CanonicalizationError as exc:
        raise ValueError(f"not RFC 8785 canonicalizable: {exc}") from None


def jcs_sha256(obj: Any) -> str:
    return sha256_bytes(jcs_bytes(obj))


LEGACY_SCHEMAS: frozenset[str] = frozenset({
    "trust-ladder.onboarding-identity.v1",
    "trust-ladder.handoff-manifest.v3",
    "trust-ladder.calibration.v1",
    "trust-ladder.gpu-scale-contract.v1",
    "trust-ladder.draft-acceptance.v1",
})
"""Schemas digested in the legacy canonical form (:func:`canonical_json_bytes`): what archived
receipts (``identity.json``/``identity.sha256``) and v1 identities were sealed with."""

JCS_SCHEMAS: frozenset[str] = frozenset({
    "trust-ladder.onboarding-identity.v2",
    "trust-ladder.onboarding-identity.v3",
    "trust-ladder.onboarding-identity.v4",
    "trust-ladder.onboarding-identity.v5",
    "trust-ladder.onboarding-identity.v6",
    "trust-ladder.onboarding-identity.v7",
    "trust-ladder.onboarding-identity.v8",
    "trust-ladder.handoff-manifest.v4",
    "trust-ladder.calibration.v2",
    "trust-ladder.calibration.v3",
    "trust-ladder.served-pair-identity.v1",
    "trust-ladder.served-pair-checked.v1",
})
"""Schemas digested (or MAC'd) over their RFC 8785 bytes (:func:`jcs_bytes`)."""


def document_bytes(document: Any) -> bytes:
    """The canonical bytes of a hashed document, in the form its declared ``schema`` version
    uses: RFC 8785 for :data:`JCS_SCHEMAS`, legacy for :data:`LEGACY_SCHEMAS`. ``ValueError``
    (one line, naming the schema) for a document that declares neither, or that its form refuses."""
    schema = document.get("schema") if isinstance(document, dict) else None
    if isinstance(schema, str) and schema in JCS_SCHEMAS:
        try:
            return jcs_bytes(document)
        except ValueError as exc:
            raise ValueError(f"document digest: schema {schema}: {exc}") from None
    if isinstance(schema, str) and schema in LEGACY_SCHEMAS:
        try:
            return canonical_json_bytes(document)
        except (TypeError, ValueError) as exc:  # NaN, a non-JSON type, a lone surrogate
            raise ValueError(f"document digest: schema {schema}: not canonical JSON ({type(exc).__name__})") from None
    found = "no schema" if schema is None else f"schema {ascii(schema)[:120]}"
    raise ValueError(f"document digest: found {found}, expected a hashed document's schema, one of "
                     f"{', '.join(sorted(JCS_SCHEMAS | LEGACY_SCHEMAS))}")


def document_sha256(document: Any) -> str:
    """SHA-256 of :func:`document_bytes`: the digest of a hashed document (identity, calibration)
    by its declared schema version."""
    return sha256_bytes(document_bytes(document))


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json_loads(data: bytes | str) -> Any:
    """Parse standard JSON only: duplicate keys and NaN/Infinity raise ``ValueError`` (bytes must
    be UTF-8), so a document can never mean two things to two readers."""
    text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    return json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant)
