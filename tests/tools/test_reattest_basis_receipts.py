"""tools/reattest_basis_receipts.py: a signed receipt gets the same statement under a new key whose
public half goes into the trust file it writes, a legacy one a pin of its manifest digest; the
manifests identities pin never change; a receipt that does not match its manifest stops it with
nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qualify.archive.attestation import ENVELOPE
from qualify.archive.keys import load_trust
from qualify.archive.layout import MANIFEST
from qualify.archive.verify import authenticate_receipt
from tests.support.receipt_forgery import make_writable, rehash_manifest
from tests.support.scripts import load_script
from tests.unit.archive.test_basis_trust import LEGACY, SIGNED

ROOT = Path(__file__).resolve().parents[2]
reattest = load_script(ROOT / "tools" / "reattest_basis_receipts.py")


def _archive(tmp_path: Path) -> Path:
    archive = tmp_path / "receipts"
    for receipt in (SIGNED[0], LEGACY[0]):
        shutil.copytree(receipt, archive / receipt.name)
        make_writable(archive / receipt.name)
    return archive


def _payload(receipt: Path) -> str:
    payload: str = json.loads((receipt / ENVELOPE).read_bytes())["payload"]
    return payload


def test_signed_receipts_keep_their_statement_under_the_published_key_and_legacy_ones_are_pinned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive, trust_path = _archive(tmp_path), tmp_path / "trust.json"
    signed, legacy = archive / SIGNED[0].name, archive / LEGACY[0].name
    before = {path.name: (path / MANIFEST).read_bytes() for path in (signed, legacy)}
    assert reattest.main(["--receipts", str(archive), "--trust-file", str(trust_path)]) == 0
    trust = load_trust(trust_path)
    (key,) = trust.keys
    assert key.role == "basis-receipts" and json.loads((signed / ENVELOPE).read_bytes())["signatures"][0]["keyid"] == key.key_id
    assert _payload(signed) == _payload(SIGNED[0])  # the same statement, byte for byte
    assert {path.name: (path / MANIFEST).read_bytes() for path in (signed, legacy)} == before
    assert [(authenticate_receipt(path, trust).state) for path in (signed, legacy)] == ["verified", "legacy"]
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"wrote {trust_path}: key {key.key_id} (basis-receipts, ")


def test_a_receipt_that_does_not_match_its_manifest_stops_it_with_nothing_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive, trust_path = _archive(tmp_path), tmp_path / "trust.json"
    (archive / LEGACY[0].name / "command.log").write_text("edited\n", encoding="utf-8")
    assert reattest.main(["--receipts", str(archive), "--trust-file", str(trust_path)]) == 1
    assert capsys.readouterr().err.startswith(f"reattest_basis_receipts: {LEGACY[0].name}: altered file command.log")
    assert not trust_path.exists() and _payload(archive / SIGNED[0].name) == _payload(SIGNED[0])


def test_a_signed_receipt_whose_statement_no_longer_names_its_files_is_put_back_and_nothing_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Edited and re-hashed: its own manifest holds, its statement does not; the new signature is
    checked before anything is kept, and the old envelope comes back."""
    archive, trust_path = _archive(tmp_path), tmp_path / "trust.json"
    signed = archive / SIGNED[0].name
    (signed / "command.log").write_text("edited\n", encoding="utf-8")
    rehash_manifest(signed)
    envelope = (signed / ENVELOPE).read_bytes()
    assert reattest.main(["--receipts", str(archive), "--trust-file", str(trust_path)]) == 1
    assert capsys.readouterr().err.startswith(f"reattest_basis_receipts: {signed.name}: tampered under the new trust file: ")
    assert not trust_path.exists() and (signed / ENVELOPE).read_bytes() == envelope
