"""The signed statement in every receipt: an in-toto Statement v1 in a DSSE envelope, Ed25519.

``attestation.dsse.json`` is a DSSE envelope (payload type ``application/vnd.in-toto+json``) whose
payload is the RFC 8785 form of an in-toto Statement v1: its subjects are every other file of the
receipt by SHA-256 (the manifest included), its predicate (``PREDICATE_TYPE``, defined inline in
``contracts/receipt-statement.v1.schema.json``) repeats what the receipt concluded: status and
verdict, lane, identity digest, rule, per-sample numbers, scope, host facts. One signature, by the
operator's key (:mod:`qualify.archive.keys`). The envelope file itself is RFC 8785 bytes, so a
receipt has one byte form and an auditor's script reproduces every check with ``cryptography``,
``hashlib`` and ``json`` alone (docs/receipts.md).

Signing and verifying use ``securesystemslib`` (DSSE envelope, pre-authentication encoding,
Ed25519 through ``cryptography``); nothing here is hand-rolled crypto. The statement is a plain
document checked by its JSON Schema, not built with ``in-toto-attestation``: that package holds a
predicate in a protobuf ``Struct``, which turns every integer into a double (2048 comes back as
2048.0, 2**53 + 1 as 2**53), and the predicate's counts and positions must stay exact integers.
Keyless signing (sigstore) is not used: it needs an OIDC identity and the public Rekor/Fulcio
services at signing time, which air-gapped GPU hosts and CI runners without egress do not have.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError
from securesystemslib.signer import CryptoSigner, SSlibKey

from qualify.archive.keys import SigningKey, TrustFile
from qualify.core.assets import require_asset
from qualify.core.digests import jcs_bytes
from qualify.core.errors import Refused
from qualify.core.strict_json import check_schema, parse_untrusted_json, read_bounded

ENVELOPE = "attestation.dsse.json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "urn:trust-ladder:receipt-predicate:v1"
PREDICATE_SCHEMA = "trust-ladder.receipt-predicate.v1"
STATEMENT_SCHEMA_PATH = require_asset("contracts/receipt-statement.v1.schema.json")
ENVELOPE_SCHEMA_PATH = require_asset("contracts/dsse-envelope.v1.schema.json")
ENVELOPE_MAX_BYTES = 16 << 20
"""Largest envelope read: the statement lists a few dozen files and a few samples' numbers."""

Trouble = Literal["tampered", "untrusted"]


class AttestationProblem(Refused):
    """Why a receipt's statement cannot be accepted: ``tampered`` (bytes, signature or statement
    wrong) or ``untrusted`` (a valid-looking signature by a key the trust file does not trust)."""

    def __init__(self, kind: Trouble, message: str) -> None:
        super().__init__(message)
        self.kind: Trouble = kind


@dataclass(frozen=True)
class Attestation:
    """A verified statement: who signed it, what files it names, what it concluded."""

    key_id: str
    subjects: dict[str, str]
    predicate: dict[str, Any]


def statement_for(files: Iterable[tuple[str, str]], predicate: dict[str, Any]) -> dict[str, Any]:
    """The in-toto Statement v1 over ``files`` ((relative path, sha256) pairs) with ``predicate``."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digest}} for name, digest in sorted(files)],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }


def sign_statement(files: Iterable[tuple[str, str]], predicate: dict[str, Any], key: SigningKey) -> bytes:
    """Sign a statement over ``files`` ((relative path, sha256) of every file of the receipt but
    the envelope); returns the envelope's bytes (the caller writes them as :data:`ENVELOPE`). The
    statement is checked against its schema first: a receipt never carries a statement its
    verifier would refuse."""
    statement = statement_for(files, predicate)
    check_schema(statement, STATEMENT_SCHEMA_PATH, "receipt statement")
    envelope = Envelope(jcs_bytes(statement), PAYLOAD_TYPE, {})
    envelope.sign(CryptoSigner(key.private, _sslib_key(key.key_id, key.public)))
    return jcs_bytes(envelope.to_dict())


def _sslib_key(key_id: str, public: bytes) -> SSlibKey:
    return SSlibKey(key_id, "ed25519", "ed25519", {"public": public.hex()})


def _strict_base64(text: str, what: str) -> bytes:
    """Standard padded base64 in its one canonical spelling (no whitespace, no other alphabet)."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise AttestationProblem("tampered", f"{ENVELOPE}: {what} is not standard base64") from None
    if base64.b64encode(data).decode("ascii") != text:
        raise AttestationProblem("tampered", f"{ENVELOPE}: {what} is not in canonical base64")
    return data


def _canonical(document: Any) -> bytes | None:
    """RFC 8785 bytes, or None for a document JCS cannot hold (an integer beyond 2**53): such a
    document has no canonical form, so it never equals the bytes it was read from."""
    try:
        return jcs_bytes(document)
    except ValueError:
        return None


def read_attestation(directory: Path, trust: TrustFile | None) -> Attestation:
    """Check ``directory``'s envelope: canonical bytes, one signature by a key ``trust`` holds and
    has not revoked, a signature that verifies, and a well-formed statement. Subjects are checked
    against the files by the caller (:mod:`qualify.archive.verify`). Raises
    :class:`AttestationProblem`; the signature is checked before the statement is parsed."""
    try:
        data = read_bounded(directory / ENVELOPE, ENVELOPE_MAX_BYTES, ENVELOPE)
        document = parse_untrusted_json(data, ENVELOPE, max_bytes=ENVELOPE_MAX_BYTES)
        check_schema(document, ENVELOPE_SCHEMA_PATH, ENVELOPE)
    except AttestationProblem:
        raise
    except Refused as exc:
        raise AttestationProblem("tampered", str(exc)) from None
    if _canonical(document) != data:
        raise AttestationProblem("tampered", f"{ENVELOPE}: bytes differ from its RFC 8785 form")
    if document["payloadType"] != PAYLOAD_TYPE:
        raise AttestationProblem("tampered", f"{ENVELOPE}: payloadType is not {PAYLOAD_TYPE}")
    payload = _strict_base64(document["payload"], "payload")
    (signature,) = document["signatures"]
    signed_by = signature["keyid"]
    if len(_strict_base64(signature["sig"], "signature")) != 64:
        raise AttestationProblem("tampered", f"{ENVELOPE}: signature is not 64 bytes (Ed25519)")
    if trust is None:
        raise AttestationProblem("untrusted", f"signed by key {signed_by[:16]}…, and no trust file was given")
    trusted = trust.get(signed_by)
    if trusted is None:
        raise AttestationProblem("untrusted", f"signed by key {signed_by[:16]}…, which {trust.source} does not list")
    if trusted.revoked is not None:
        raise AttestationProblem("untrusted", f"signed by key {signed_by[:16]}…, revoked {trusted.revoked.utc} "
                                              f"({trusted.revoked.reason}) in {trust.source}")
    envelope = Envelope.from_dict({"payload": document["payload"], "payloadType": document["payloadType"],
                                   "signatures": [dict(signature)]})
    try:
        envelope.verify([_sslib_key(trusted.key_id, trusted.public)], 1)
    except VerificationError:
        raise AttestationProblem("tampered", f"{ENVELOPE}: the signature does not verify under key "
                                             f"{signed_by[:16]}… (statement or envelope altered)") from None
    try:
        statement = parse_untrusted_json(payload, f"{ENVELOPE} statement", max_bytes=ENVELOPE_MAX_BYTES)
        check_schema(statement, STATEMENT_SCHEMA_PATH, f"{ENVELOPE} statement")
    except Refused as exc:  # signed by a trusted key yet malformed: a signer fault, still refused
        raise AttestationProblem("tampered", str(exc)) from None
    if _canonical(statement) != payload:
        raise AttestationProblem("tampered", f"{ENVELOPE}: statement bytes differ from their RFC 8785 form")
    subjects: dict[str, str] = {}
    for subject in statement["subject"]:
        if subject["name"] in subjects:
            raise AttestationProblem("tampered", f"{ENVELOPE}: statement names {subject['name']} twice")
        subjects[subject["name"]] = subject["digest"]["sha256"]
    return Attestation(signed_by, subjects, statement["predicate"])
