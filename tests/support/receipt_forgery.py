"""Receipts to attack, and what a forger with write access to an archive does to them: re-hash the
manifest in its RFC 8785 form, decode and edit the signed statement, re-sign it with a key of
their own. The DSSE envelope is built here by hand from the format's text (docs/receipts.md:
PAE, Ed25519 over it, RFC 8785 bytes), not with the harness's signing code, so a forgery that
the verifier refuses is refused for what it is, and a genuine re-signing checks the format too."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.archive.attestation import ENVELOPE, PAYLOAD_TYPE, PREDICATE_TYPE, STATEMENT_TYPE
from qualify.archive.keys import (
    SigningKey,
    TrustFile,
    default_trust_path,
    ensure_signing_key,
    load_signing_key,
    load_trust,
    signing_key_id,
)
from qualify.archive.layout import MANIFEST, MANIFEST_SCHEMA
from qualify.archive.verify import ReceiptCheck, authenticate_receipt
from qualify.archive.writer import ReceiptWriter
from qualify.core.digests import jcs_bytes
from qualify.evidence.records import BoundedDriftRule
from qualify.judge import Verdict, judge_summary
from tests.unit.judge.test_judge import rung2_record

RULE = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25)
IDENTITY = {"schema": "trust-ladder.calibration.v2", "lane": "nvfp4-native-splitk", "bound": 11.0}
"""A small identity document of a hashed schema (its digest is RFC 8785), enough for a receipt."""


# --------------------------------------------------------------------------- making receipts


def write_receipt(archive: Path, records: Sequence[Mapping[str, Any]] | None = None, *, run_id: str | None = None,
                  identity: Any = IDENTITY, rule: Any = RULE, lane: str = "nvfp4-native-splitk",
                  verdict: Verdict | None = None) -> Path:
    """A signed receipt as the qualifier writes one (three passing rung-2 samples by default),
    signed by the session's operator key (tests/conftest.py gives every session its own)."""
    records = [rung2_record(i) for i in (1, 2, 3)] if records is None else list(records)
    ensure_signing_key(announce=lambda line: None)  # made quietly: a test's captured stderr stays its own
    writer = ReceiptWriter(
        archive, command_line=["qualify", "--recipe", "native-text"], identity=identity,
        recipe="native-text", lane=lane, rule=rule, versions={"consumer": "reference 0.1"}, run_id=run_id,
    )
    try:
        writer.log("identity sealed")
        for record in records:
            writer.add_sample(record)
        verdict = verdict if verdict is not None else judge_summary(records, rule)
    finally:
        path = writer.finalize(verdict)
    return path


def writable_receipt(archive: Path) -> Path:
    """A receipt as :func:`write_receipt` writes one by default, made writable for tampering."""
    path = write_receipt(archive)
    make_writable(path)
    return path


def make_writable(path: Path) -> None:
    """Finalized receipts are read-only; tests that tamper with them lift that first."""
    for current, _dirs, files in os.walk(path):
        os.chmod(current, 0o755)
        for name in files:
            if not os.path.islink(Path(current) / name):
                os.chmod(Path(current) / name, 0o644)


def fail_scandir(monkeypatch: Any, directory: Path, error: BaseException, *, times: int | None = None) -> None:
    """``os.scandir`` fails on ``directory`` only, raising ``error`` (the first ``times`` calls, or
    every call): an unreadable directory (as root a mode-000 directory still lists) or the
    environment failing mid-walk (say, out of memory)."""
    real_scandir = os.scandir
    failures = [0]

    def scandir(path: Any) -> Any:
        if Path(path) == directory and (times is None or failures[0] < times):
            failures[0] += 1
            raise error
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)


# --------------------------------------------------------------------------- checking them


def operator_trust() -> TrustFile:
    """The operator's trust file (the session's, made with its key by the first writer)."""
    return load_trust(default_trust_path())


def check(receipt: Path, trust: TrustFile | None = None) -> ReceiptCheck:
    """``authenticate_receipt`` against the operator's trust file unless another is given (the
    session's key and trust file made quietly first, as a test run alone has none yet)."""
    if trust is None:
        ensure_signing_key(announce=lambda line: None)
        trust = operator_trust()
    return authenticate_receipt(receipt, trust)


# --------------------------------------------------------------------------- the manifest


def regular_files(receipt: Path) -> list[str]:
    """Every regular file under ``receipt`` (links not followed) but the manifest and the
    envelope, as sorted relative POSIX paths: what a forger's manifest lists."""
    found = []
    for current, _dirs, files in os.walk(receipt):
        for name in files:
            path = Path(current) / name
            relative = path.relative_to(receipt).as_posix()
            if stat.S_ISREG(path.lstat().st_mode) and relative not in (MANIFEST, ENVELOPE):
                found.append(relative)
    return sorted(found)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def rehash_manifest(receipt: Path, run_id: str | None = None) -> None:
    """Rewrite the manifest to list every file now present with its digest and size, in the one
    byte form a v2 manifest has (RFC 8785): a consistent forgery only the cross-checks between
    files and the signed statement can catch."""
    entries = [{"path": name, "sha256": sha256_of(receipt / name), "bytes": (receipt / name).stat().st_size}
               for name in regular_files(receipt)]
    manifest = {"schema": MANIFEST_SCHEMA, "run_id": run_id or receipt.name, "files": entries}
    (receipt / MANIFEST).write_bytes(jcs_bytes(manifest))


# --------------------------------------------------------------------------- the signed statement


def envelope_of(receipt: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((receipt / ENVELOPE).read_bytes())
    return document


def statement_of(receipt: Path) -> dict[str, Any]:
    """The statement the envelope carries, decoded."""
    statement: dict[str, Any] = json.loads(base64.b64decode(envelope_of(receipt)["payload"]))
    return statement


def forger_key() -> SigningKey:
    """An Ed25519 key of the forger's own: valid, and in no trust file the operator keeps."""
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return SigningKey(private, public, signing_key_id(public), Path("forger-key.pem"))


def operator_key() -> SigningKey:
    """The session's operator key: for a statement the operator's own signer got wrong."""
    return load_signing_key()


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: what the signature covers."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def signed_envelope(statement: Mapping[str, Any] | bytes, key: SigningKey, *, keyid: str | None = None,
                    payload_type: str = PAYLOAD_TYPE) -> dict[str, Any]:
    """A DSSE envelope of ``statement`` (its RFC 8785 bytes, or the bytes given) signed by ``key``,
    claiming ``keyid`` (the key's own by default)."""
    payload = statement if isinstance(statement, bytes) else jcs_bytes(statement)
    signature = key.sign(pae(payload_type, payload))
    return {"payload": base64.b64encode(payload).decode("ascii"), "payloadType": payload_type,
            "signatures": [{"keyid": key.key_id if keyid is None else keyid,
                            "sig": base64.b64encode(signature).decode("ascii")}]}


def write_envelope(receipt: Path, envelope: Mapping[str, Any]) -> None:
    """Write ``envelope`` in its one byte form (RFC 8785)."""
    (receipt / ENVELOPE).write_bytes(jcs_bytes(envelope))


def statement_over(receipt: Path, predicate: Mapping[str, Any],
                   names: Iterable[str] | None = None) -> dict[str, Any]:
    """An in-toto statement naming every file of ``receipt`` now present (the manifest included)
    by its SHA-256, or only ``names``, with ``predicate``."""
    chosen = sorted([*regular_files(receipt), MANIFEST] if names is None else names)
    return {"_type": STATEMENT_TYPE,
            "subject": [{"name": name, "digest": {"sha256": sha256_of(receipt / name)}} for name in chosen],
            "predicateType": PREDICATE_TYPE, "predicate": dict(predicate)}


def resign(receipt: Path, key: SigningKey, predicate: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The full forgery: a fresh statement over the files as they are now (the receipt's own
    predicate unless another is given), signed by ``key``. Returns the statement."""
    statement = statement_over(receipt, statement_of(receipt)["predicate"] if predicate is None else predicate)
    write_envelope(receipt, signed_envelope(statement, key))
    return statement
