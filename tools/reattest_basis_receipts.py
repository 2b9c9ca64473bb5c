#!/usr/bin/env python3
"""Make the committed basis receipts verifiable by anyone: write the project's trust file for them.

The basis receipts under ``receipts/`` are of two kinds (docs/receipts.md, "Basis receipts"):

* **signed** (v2 manifest, DSSE envelope): signed by operators' keys whose public halves were
  never published, so nobody could check them. This tool signs each one's statement again,
  byte for byte the same statement (the same subjects and predicate), with a key made here in
  memory and never written anywhere: once the tool ends, that key can sign nothing more. Its public
  half goes into the trust file with role ``basis-receipts`` and a window of run starts covering
  exactly these receipts. Only the envelope changes; the manifest, which identities pin by digest,
  does not.
* **legacy** (v1 manifest, no envelope, written before signing): they cannot be signed without a
  v2 manifest, which would change the digest identities pin; the trust file pins each by its
  manifest's SHA-256 instead.

A receipt whose files do not match its manifest, or whose statement's subjects and predicate do
not match its files and summary, is refused and nothing is written (every new envelope is checked
by ``authenticate_receipt`` under the new trust file before any file is kept).

    python tools/reattest_basis_receipts.py [--receipts receipts] [--trust-file contracts/basis-trust.json]

Exit 0 done (prints one line per receipt and the new key id), 1 refused (one line: why).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from qualify.archive.attestation import ENVELOPE, sign_statement
from qualify.archive.keys import TRUST_SCHEMA_V2, LegacyReceipt, SigningKey, TrustedKey, TrustFile, signing_key_id
from qualify.archive.layout import LEGACY_MANIFEST_SCHEMA, MANIFEST, SUMMARY, json_bytes
from qualify.archive.verify import authenticate_receipt, check_receipt

ROOT = Path(__file__).resolve().parents[1]
ROLE = "basis-receipts"


class NotReattested(Exception):
    """Why the receipts cannot be re-attested (one line)."""


def _utc(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _statement(receipt: Path) -> tuple[dict[str, Any], str]:
    """The receipt's signed statement (decoded, not verified: its signer's key is unknown) and its signer's key id."""
    envelope = json.loads((receipt / ENVELOPE).read_bytes())
    (signature,) = envelope["signatures"]
    return json.loads(base64.b64decode(envelope["payload"], validate=True)), signature["keyid"]


def _legacy_note(receipt: Path) -> str:
    summary = json.loads((receipt / SUMMARY).read_text(encoding="utf-8"))
    status = summary.get("status") or ("passed" if summary.get("passed") else "not passed")
    what = ", ".join(f"{name} {summary[name]}" for name in ("recipe", "lane") if summary.get(name))
    return (f"written before receipts were signed ({LEGACY_MANIFEST_SCHEMA} manifest, no envelope); "
            f"records {status}" + (f"; {what}" if what else ""))


def reattest(receipts: Path, trust_path: Path) -> tuple[TrustFile, list[str]]:
    """Re-sign the signed receipts under ``receipts`` with a fresh key, pin the legacy ones, check
    every receipt under the resulting trust file, then write it; returns it and one line per receipt."""
    private = Ed25519PrivateKey.generate()
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    key = SigningKey(private, public, signing_key_id(public), Path("(in memory only; never written)"))
    originals: dict[Path, bytes] = {}
    legacy: list[LegacyReceipt] = []
    signers: set[str] = set()
    starts: list[dt.datetime] = []
    lines: list[str] = []
    for receipt in sorted(path for path in receipts.iterdir() if path.is_dir() and not path.name.startswith(".")):
        problems, _files = check_receipt(receipt)
        if problems:
            raise NotReattested(f"{problems[0]} (its files do not match its manifest; nothing was written)")
        manifest = (receipt / MANIFEST).read_bytes()
        if not (receipt / ENVELOPE).exists():
            if json.loads(manifest).get("schema") != LEGACY_MANIFEST_SCHEMA:
                raise NotReattested(f"{receipt.name}: no {ENVELOPE} beside a signed receipt's manifest")
            legacy.append(LegacyReceipt(receipt.name, hashlib.sha256(manifest).hexdigest(), _legacy_note(receipt)))
            lines.append(f"legacy  {receipt.name}: pinned by manifest sha256 {legacy[-1].manifest_sha256}")
            continue
        statement, signer = _statement(receipt)
        subjects = [(subject["name"], subject["digest"]["sha256"]) for subject in statement["subject"]]
        predicate = dict(statement["predicate"])
        envelope = sign_statement(subjects, predicate, key)
        old_payload = json.loads((receipt / ENVELOPE).read_bytes())["payload"]
        if json.loads(envelope)["payload"] != old_payload:
            raise NotReattested(f"{receipt.name}: its statement does not come back byte for byte; nothing was written")
        originals[receipt] = (receipt / ENVELOPE).read_bytes()
        signers.add(signer)
        starts.append(dt.datetime.fromisoformat(str(predicate["started_utc"])))
        lines.append(f"signed  {receipt.name}: re-signed (was key {signer[:16]}…)")
        (receipt / ENVELOPE).chmod(0o644)
        (receipt / ENVELOPE).write_bytes(envelope)
    try:
        if not starts:
            raise NotReattested(f"{receipts}: no signed receipt to re-attest")
        first, last = min(starts).replace(microsecond=0), max(starts).replace(microsecond=0) + dt.timedelta(seconds=1)
        comment = (f"re-attests the {len(originals)} signed basis receipts under receipts/ (runs started {_utc(first)} to "
                   f"{_utc(last)}): their statements, byte for byte, first signed by operator keys "
                   f"{', '.join(sorted(signer[:16] + '…' for signer in signers))} whose public halves were never "
                   f"published; made and used by tools/reattest_basis_receipts.py on {_utc(dt.datetime.now(dt.UTC))}, "
                   f"its private half never written, so it signs nothing more")
        entry = TrustedKey(key.key_id, public, comment, _utc(dt.datetime.now(dt.UTC)), None, ROLE, _utc(first), _utc(last))
        trust = TrustFile((entry,), f"trust file {trust_path}", tuple(legacy), TRUST_SCHEMA_V2)
        for receipt in sorted(path for path in receipts.iterdir() if path.is_dir() and not path.name.startswith(".")):
            check = authenticate_receipt(receipt, trust)
            if check.state not in ("verified", "legacy"):
                raise NotReattested(f"{receipt.name}: {check.state} under the new trust file: "
                                    f"{check.problems[0] if check.problems else 'no problem named'}; nothing was written")
    except BaseException:
        for receipt, data in originals.items():
            (receipt / ENVELOPE).write_bytes(data)
        raise
    trust_path.write_bytes(json_bytes(trust.document()))
    return trust, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--receipts", type=Path, default=ROOT / "receipts")
    parser.add_argument("--trust-file", type=Path, default=ROOT / "contracts" / "basis-trust.json")
    options = parser.parse_args(argv)
    try:
        trust, lines = reattest(options.receipts, options.trust_file)
    except (NotReattested, OSError, ValueError, KeyError) as exc:
        print(f"reattest_basis_receipts: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    print(f"wrote {options.trust_file}: key {trust.keys[0].key_id} ({ROLE}, {trust.keys[0].window()}), "
          f"{len(trust.legacy)} legacy receipts pinned")
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
