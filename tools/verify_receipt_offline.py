#!/usr/bin/env python3
"""Verify a signed trust-ladder receipt with Python's standard library and `cryptography` alone.

Usage: python verify_receipt_offline.py --trust TRUST.json RECEIPT_DIR      (docs/receipts.md)
Exit 0 verified (prints what the receipt concluded), 1 not verified (one line: why), 2 bad usage."""
import base64
import hashlib
import json
import sys
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

ENVELOPE = "attestation.dsse.json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
TYPES = ("https://in-toto.io/Statement/v1", "urn:trust-ladder:receipt-predicate:v1")  # _type, predicateType


class NotVerified(Exception): ...  # why the receipt does not verify


def trusted_key(trust: dict, keyid: str) -> Ed25519PublicKey:
    """The key listed under ``keyid``: not revoked, and ``keyid`` is the SHA-256 of its raw bytes."""
    listed = [entry for entry in trust["keys"] if entry["keyid"] == keyid]
    if not listed or listed[0]["revoked"] is not None:
        why = f"revoked ({listed[0]['revoked']['reason']})" if listed else "does not list"
        raise NotVerified(f"signed by key {keyid[:16]}, which the trust file {why}")
    raw = bytes.fromhex(listed[0]["public_key"])
    if hashlib.sha256(raw).hexdigest() != keyid:
        raise NotVerified(f"trust file: key id {keyid[:16]} is not the SHA-256 of its public key")
    return Ed25519PublicKey.from_public_bytes(raw)


def verify(trust: dict, receipt: Path) -> str:
    """Check envelope, signature, statement and files; returns what the receipt concluded."""
    if not (receipt / ENVELOPE).is_file():
        raise NotVerified(f"no {ENVELOPE}: not a receipt, or an unsigned (legacy) one")
    envelope = json.loads((receipt / ENVELOPE).read_bytes())
    if envelope["payloadType"] != PAYLOAD_TYPE or len(envelope["signatures"]) != 1:
        raise NotVerified(f"{ENVELOPE}: expected payloadType {PAYLOAD_TYPE} and one signature")
    (signature,) = envelope["signatures"]
    texts = (envelope["payload"], signature["sig"])
    payload, sig = (base64.b64decode(text, validate=True) for text in texts)
    if (base64.b64encode(payload).decode(), base64.b64encode(sig).decode()) != texts:
        raise NotVerified(f"{ENVELOPE}: payload or signature is not in canonical base64")
    signed = b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload), payload)
    try:
        trusted_key(trust, signature["keyid"]).verify(sig, signed)
    except InvalidSignature:
        raise NotVerified(f"{ENVELOPE}: the signature does not verify (statement or envelope altered)") from None
    statement = json.loads(payload)
    if (statement["_type"], statement["predicateType"]) != TYPES:
        raise NotVerified(f"signed statement: expected _type and predicateType {TYPES}")
    subjects = {subject["name"]: subject["digest"]["sha256"] for subject in statement["subject"]}
    files, predicate = {}, statement["predicate"]  # files: SHA-256 of each but the envelope, by relative path
    for path in [receipt, *sorted(receipt.rglob("*"))]:  # the receipt itself too: a link is never followed
        name = path.relative_to(receipt).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise NotVerified(f"{name}: not a regular file or directory")
        if path.is_file() and name != ENVELOPE:
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    for name in sorted(subjects.keys() | files.keys()):
        if name not in files:
            raise NotVerified(f"{name}: a subject of the signed statement, missing from the receipt")
        if subjects.get(name) != files[name]:
            raise NotVerified(f"{name}: altered or added after signing (SHA-256 not in the signed statement)")
    if len(subjects) != len(statement["subject"]) or predicate["run_id"] != receipt.name:
        raise NotVerified(f"signed statement: repeats a subject, or names run {predicate['run_id']}")
    return (f"verified {receipt.name}: status {predicate['status']}, lane {predicate['lane']}, verdict "
            f"{predicate['verdict']}; signed by key {signature['keyid'][:16]}; {len(files)} files")


def main(argv: list) -> int:
    if len(argv) != 3 or argv[0] != "--trust":
        print("usage: verify_receipt_offline.py --trust TRUST.json RECEIPT_DIR", file=sys.stderr)
        return 2
    receipt = Path(argv[2]).absolute()  # not resolved: a link is refused below, never followed
    try:
        line, code = verify(json.loads(Path(argv[1]).read_bytes()), receipt), 0
    except (NotVerified, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as exc:
        why = str(exc) if isinstance(exc, NotVerified) else f"unreadable or malformed input ({type(exc).__name__}: {exc})"
        line, code = f"NOT VERIFIED {receipt.name}: {why}", 1
    print(" ".join(line.split())[:1000])  # one line, whatever the names in it hold
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
