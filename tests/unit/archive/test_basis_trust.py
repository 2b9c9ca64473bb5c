"""The committed basis receipts verify for anyone holding the committed trust file
(``contracts/basis-trust.json``): the signed ones by the published ``basis-receipts`` key, inside
its window of run starts; the legacy ones (from before signing) by their manifest digest pinned in
that file. A pin never excuses an edit, a key never vouches outside its window, and a trust file
whose window or pins contradict themselves is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from qualify.archive.attestation import ENVELOPE
from qualify.archive.keys import BASIS_TRUST_FILE, TRUST_SCHEMA_V2, load_trust, parse_trust
from qualify.archive.layout import LEGACY_MANIFEST_SCHEMA, MANIFEST, json_bytes
from qualify.archive.verify import authenticate_receipt, check_receipt, verify_document
from qualify.core.assets import RECEIPTS_DIR
from qualify.core.errors import Refused
from qualify.interfaces import cli
from tests.support.receipt_forgery import make_writable, sha256_of

BASIS_RECEIPTS = sorted(path for path in RECEIPTS_DIR.iterdir() if path.is_dir() and not path.name.startswith("."))


def _manifest(receipt: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((receipt / MANIFEST).read_bytes())
    return document


LEGACY = [path for path in BASIS_RECEIPTS if _manifest(path)["schema"] == LEGACY_MANIFEST_SCHEMA]
SIGNED = [path for path in BASIS_RECEIPTS if (path / ENVELOPE).exists()]


def _copy(receipt: Path, archive: Path) -> Path:
    copy = archive / receipt.name
    shutil.copytree(receipt, copy)
    make_writable(copy)
    return copy


def _trust_document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(BASIS_TRUST_FILE.read_bytes())
    return document


def test_every_shipped_basis_receipt_verifies_under_the_committed_trust_file(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["receipts", "verify", "--trust", str(BASIS_TRUST_FILE), str(RECEIPTS_DIR)])
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out[-1]
    assert len(BASIS_RECEIPTS) == len(LEGACY) + len(SIGNED) and LEGACY and SIGNED
    assert [line.split()[0] for line in out[:-1]] == ["legacy" if path in LEGACY else "ok" for path in BASIS_RECEIPTS]
    assert out[-1].startswith(f"{len(BASIS_RECEIPTS)} receipts: {len(SIGNED)} verified, {len(LEGACY)} legacy (")


def test_the_trust_file_pins_exactly_the_legacy_receipts_and_publishes_a_basis_key() -> None:
    trust = load_trust(BASIS_TRUST_FILE)
    assert trust.schema == TRUST_SCHEMA_V2
    assert {pin.run_id: pin.manifest_sha256 for pin in trust.legacy} == {
        path.name: sha256_of(path / MANIFEST) for path in LEGACY}
    signers = {json.loads((path / ENVELOPE).read_bytes())["signatures"][0]["keyid"] for path in SIGNED}
    assert {key.key_id for key in trust.keys if key.role == "basis-receipts" and key.revoked is None} >= signers


def test_without_the_trust_file_nothing_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    """What an auditor without it sees: the legacy receipts unsigned, the signed ones untrusted."""
    assert authenticate_receipt(LEGACY[0], None).state == "unsigned"
    assert authenticate_receipt(SIGNED[0], None).state == "untrusted"


def test_a_pinned_legacy_receipt_edited_and_rehashed_is_tampered(tmp_path: Path) -> None:
    receipt = _copy(LEGACY[0], tmp_path)
    with open(receipt / "command.log", "a", encoding="utf-8") as log:
        log.write("2026-11-29T09:31:00Z an entry written afterwards\n")
    manifest = _manifest(receipt)
    for entry in manifest["files"]:  # a consistent v1 forgery: the manifest re-hashed in its own form
        if entry["path"] == "command.log":
            entry.update(sha256=sha256_of(receipt / "command.log"), bytes=(receipt / "command.log").stat().st_size)
    (receipt / MANIFEST).write_bytes(json_bytes(manifest))
    assert check_receipt(receipt)[0] == []  # intact as far as its own manifest goes
    found = authenticate_receipt(receipt, load_trust(BASIS_TRUST_FILE))
    assert found.state == "tampered"
    assert found.problems == [f"{MANIFEST}: sha256 {sha256_of(receipt / MANIFEST)[:16]}… is not the "
                              f"{sha256_of(LEGACY[0] / MANIFEST)[:16]}… that trust file {BASIS_TRUST_FILE} pins "
                              f"for this legacy receipt"]


def test_a_pinned_legacy_receipt_with_an_edited_file_is_tampered_not_legacy(tmp_path: Path) -> None:
    receipt = _copy(LEGACY[0], tmp_path)
    (receipt / "command.log").write_text("edited\n", encoding="utf-8")
    assert authenticate_receipt(receipt, load_trust(BASIS_TRUST_FILE)).state == "tampered"


def test_a_legacy_receipt_the_trust_file_does_not_pin_stays_unsigned(tmp_path: Path) -> None:
    document = _trust_document()
    document["legacy_receipts"] = [pin for pin in document["legacy_receipts"] if pin["run_id"] != LEGACY[0].name]
    trust = parse_trust(json_bytes(document), "trust file without the pin")
    assert authenticate_receipt(LEGACY[0], trust).state == "unsigned"


def test_a_basis_key_does_not_vouch_for_a_run_outside_its_window() -> None:
    document = _trust_document()
    for key in document["keys"]:
        key["valid_until"] = key["valid_from"]  # a window that closes before the last receipt's run started
    trust = parse_trust(json_bytes(document), "trust file with a closed window")
    found = authenticate_receipt(SIGNED[-1], trust)
    assert found.state == "untrusted" and len(found.problems) == 1
    assert found.problems[0].startswith(f"signed by key {document['keys'][0]['keyid'][:16]}…, which trust file with a "
                                        f"closed window trusts for runs started from {document['keys'][0]['valid_from']} "
                                        f"to {document['keys'][0]['valid_from']}; this run started "), found.problems


@pytest.mark.parametrize(("edit", "expected"), [
    pytest.param(lambda d: d["keys"][0].update(valid_until="2000-01-01T00:00:00Z"),
                 "keys[0]: valid_until 2000-01-01T00:00:00Z is before valid_from", id="window-ends-before-it-starts"),
    pytest.param(lambda d: d["legacy_receipts"].append(dict(d["legacy_receipts"][0])),
                 "is listed twice", id="one-run-pinned-twice"),
    pytest.param(lambda d: d["keys"][0].pop("role"), "keys[0].role: missing", id="a-v2-key-without-a-role"),
    pytest.param(lambda d: d["legacy_receipts"][0].update(manifest_sha256="ab" * 31), "manifest_sha256",
                 id="a-pin-that-is-no-digest"),
])
def test_a_contradictory_trust_file_is_refused_naming_the_field(edit: Any, expected: str) -> None:
    document = _trust_document()
    edit(document)
    with pytest.raises(Refused, match=r"^trust file bad\.json: ") as refused:
        parse_trust(json_bytes(document), "trust file bad.json")
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_a_pinned_legacy_receipt_counts_as_recorded_and_names_what_pinned_it() -> None:
    """Verified and legacy receipts both count toward what the tally says they record; a legacy
    one names the trust file that pinned it."""
    trust = load_trust(BASIS_TRUST_FILE)
    check = authenticate_receipt(LEGACY[0], trust)
    assert (check.state, check.pinned_by) == ("legacy", trust.source)
    tally = verify_document([LEGACY[0]], trust, BASIS_TRUST_FILE)["tally"]
    assert tally["legacy"] == 1 and sum(tally["recorded"].values()) == 1
    assert tally["recorded"][check.status] == 1
