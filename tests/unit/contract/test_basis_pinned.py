"""The basis receipt is pinned whole: its ``manifest.json`` digest is sealed, and every file must
match that manifest, so editing any file of it (a fixture anchor sample, which sets the run's KV
envelope) is refused at ``qualify identity check`` and at run start, even when the forger re-hashes the manifest.

Each test copies a shipped lane's committed basis receipt into a temporary archive (the committed
receipts under ``receipts/`` are never touched) and checks the shipped identity against the copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from qualify.archive.layout import MANIFEST_SCHEMA
from qualify.archive.reader import resolve_receipt_uri
from qualify.archive.verify import check_receipt
from qualify.contract import identity as identity_module
from qualify.contract.identity import Identity, check_basis_receipt, load_identity
from qualify.contract.sealed_data import SEALED_BASIS_MANIFESTS
from qualify.core.assets import CONTRACTS_DIR, REPO_ROOT
from qualify.core.digests import jcs_bytes
from qualify.core.errors import Refused
from qualify.interfaces import cli
from qualify.judge.calibration import ANCHOR_PART
from tests.conftest import isolate_cli_environment

LANE = "nvfp4-native-splitk"
IDENTITY_PATH = CONTRACTS_DIR / f"{LANE}-identity-v1.json"
FIELD = "onboarding_qualification.basis"


def _run_id(identity: Identity) -> str:
    return identity.onboarding_qualification.basis.removeprefix("receipt://").partition("/")[0]


@pytest.fixture
def shipped() -> Identity:
    return load_identity(IDENTITY_PATH)


@pytest.fixture
def archive(tmp_path: Path, shipped: Identity) -> Path:
    """A temporary archive holding a writable copy of the lane's committed basis receipt (a signed
    receipt since the lanes' re-calibration: its manifest is v2, in RFC 8785 bytes)."""
    run_id = _run_id(shipped)
    copy = tmp_path / "archive" / run_id
    shutil.copytree(REPO_ROOT / "receipts" / run_id, copy)
    for current, _dirs, files in os.walk(copy):
        os.chmod(current, 0o755)
        for name in files:
            os.chmod(Path(current) / name, 0o644)
    assert json.loads((copy / "manifest.json").read_bytes())["schema"] == MANIFEST_SCHEMA
    return copy.parent


def _receipt(archive: Path, identity: Identity) -> Path:
    return archive / _run_id(identity)


def _check(identity: Identity, archive: Path) -> Path:
    return check_basis_receipt(identity, resolve_receipt_uri, check_receipt, where=f"identity {IDENTITY_PATH}",
                               archive_dir=archive)


def _rehash_manifest(receipt: Path) -> None:
    """What a forger does after editing a file: every manifest entry's size and SHA-256 made to
    match, written in the receipt's own manifest form, v2's RFC 8785 bytes (the archive layer then
    finds nothing wrong)."""
    manifest_path = receipt / "manifest.json"
    manifest = json.loads(manifest_path.read_bytes())
    for entry in manifest["files"]:
        data = (receipt / entry["path"]).read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    manifest_path.write_bytes(jcs_bytes(manifest))


def _anchor_samples(receipt: Path) -> list[Path]:
    """The basis's fixture anchor samples, as its calibration evidence names them: the run's KV
    envelope (localisation) and the digests a run must reproduce come from these alone."""
    evidence = json.loads((receipt / "evidence" / "calibration.json").read_bytes())
    anchors = [receipt / "samples" / f"sample-{handoff['repetition']}.json"
               for handoff in evidence["handoffs"] if handoff["part"] == ANCHOR_PART]
    assert len(anchors) >= 2 and all(anchor.is_file() for anchor in anchors), anchors
    return anchors


def _widen_one_kv_envelope_entry(sample: Path) -> None:
    """Raise one per-layer K delta of an anchor sample: the run's KV envelope comes from these."""
    record = json.loads(sample.read_bytes())
    entry = record["localisation"]["kv_layer_max_abs"][0]
    entry["k"] = entry["k"] * 4 + 1.0
    sample.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def test_an_untouched_copy_of_the_basis_receipt_passes(shipped: Identity, archive: Path) -> None:
    basis = _check(shipped, archive)
    assert basis == (_receipt(archive, shipped) / "command.log").resolve()
    assert hashlib.sha256((basis.parent / "manifest.json").read_bytes()).hexdigest() == SEALED_BASIS_MANIFESTS[LANE]


def test_an_edited_sample_with_its_manifest_rehashed_is_refused_naming_the_basis(
    shipped: Identity, archive: Path
) -> None:
    receipt = _receipt(archive, shipped)
    _widen_one_kv_envelope_entry(_anchor_samples(receipt)[0])
    _rehash_manifest(receipt)
    assert check_receipt(receipt)[0] == []  # the forgery is consistent: the per-file check alone passes
    with pytest.raises(Refused) as caught:
        _check(shipped, archive)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"identity {IDENTITY_PATH}: {FIELD}: {shipped.onboarding_qualification.basis}: "
                              f"receipt {receipt.name} file manifest.json sha256 found "), message
    assert f"sealed {SEALED_BASIS_MANIFESTS[LANE]} (lane {LANE})" in message


def test_an_edited_sample_left_unhashed_is_refused_naming_the_file(shipped: Identity, archive: Path) -> None:
    receipt = _receipt(archive, shipped)
    anchor = _anchor_samples(receipt)[0]
    _widen_one_kv_envelope_entry(anchor)
    with pytest.raises(Refused) as caught:
        _check(shipped, archive)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"identity {IDENTITY_PATH}: {FIELD}: ")
    assert f"altered file {anchor.relative_to(receipt).as_posix()}" in message, message


def test_an_extra_file_is_refused_naming_it(shipped: Identity, archive: Path) -> None:
    receipt = _receipt(archive, shipped)
    extra = f"samples/sample-{len(list((receipt / 'samples').glob('sample-*.json'))) + 1}.json"  # one past the last
    (receipt / extra).write_text("{}\n", encoding="utf-8")
    with pytest.raises(Refused) as caught:
        _check(shipped, archive)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"identity {IDENTITY_PATH}: {FIELD}: ")
    assert f"extra file {extra}" in message, message


def test_an_extra_file_listed_in_a_rehashed_manifest_is_refused_by_the_seal(shipped: Identity, archive: Path) -> None:
    receipt = _receipt(archive, shipped)
    (receipt / "notes.txt").write_text("a forger's note\n", encoding="utf-8")
    manifest = json.loads((receipt / "manifest.json").read_bytes())
    manifest["files"].append({"path": "notes.txt", "bytes": 0, "sha256": "0" * 64})
    manifest["files"].sort(key=lambda entry: entry["path"])
    (receipt / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _rehash_manifest(receipt)
    assert check_receipt(receipt)[0] == []  # listed and hashed: the per-file check alone passes
    with pytest.raises(Refused, match=f"^identity .*: {FIELD}: .* file manifest.json sha256 found "):
        _check(shipped, archive)


def test_a_missing_file_is_refused_naming_it(shipped: Identity, archive: Path) -> None:
    (_receipt(archive, shipped) / "samples" / "sample-3.json").unlink()
    with pytest.raises(Refused, match=f"^identity .*: {FIELD}: .*missing file samples/sample-3.json"):
        _check(shipped, archive)


def _listed(receipt: Path) -> list[str]:
    return [entry["path"] for entry in json.loads((receipt / "manifest.json").read_bytes())["files"]]


@pytest.mark.parametrize("rehash", [False, True], ids=["manifest-kept", "manifest-rehashed"])
def test_a_one_byte_change_to_any_file_of_the_basis_receipt_is_refused(
    shipped: Identity, archive: Path, rehash: bool
) -> None:
    receipt = _receipt(archive, shipped)
    pristine = {path: (receipt / path).read_bytes() for path in [*_listed(receipt), "manifest.json"]}
    assert len(pristine) >= 10  # command.log, identity, host, versions, summary, samples, manifest
    for path, data in pristine.items():
        changed = bytearray(data)
        changed[len(changed) // 2] ^= 0x01
        (receipt / path).write_bytes(bytes(changed))
        if rehash and path != "manifest.json":
            _rehash_manifest(receipt)
        with pytest.raises(Refused) as caught:
            _check(shipped, archive)
        assert str(caught.value).startswith(f"identity {IDENTITY_PATH}: {FIELD}: "), (path, str(caught.value))
        assert "\n" not in str(caught.value)
        for original, content in pristine.items():  # restore the whole receipt for the next file
            (receipt / original).write_bytes(content)
    _check(shipped, archive)  # restored: passes again


# --- the callers: `qualify identity check` and a run's start refuse the forged basis (exit 2) ----


@pytest.fixture
def forged_archive(shipped: Identity, archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The CLI isolated in tmp_path, resolving shipped identities' bases in ``archive``, where the
    lane's basis holds an edited sample and a re-hashed manifest."""
    receipt = _receipt(archive, shipped)
    _widen_one_kv_envelope_entry(_anchor_samples(receipt)[-1])
    _rehash_manifest(receipt)
    places = {name: tmp_path / name for name in ("cwd", "runs", "data")}
    for directory in places.values():
        directory.mkdir()
    isolate_cli_environment(monkeypatch, cwd=places["cwd"], archive=places["runs"], data=places["data"])
    monkeypatch.setattr(identity_module, "DEFAULT_ARCHIVE_DIR", archive)
    return archive


def _refusal(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    refusals = [line for line in err.splitlines() if FIELD in line]
    assert len(refusals) == 1, err
    return refusals[0]


def test_identity_check_refuses_a_forged_basis_with_exit_2(
    forged_archive: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["identity", "check", str(IDENTITY_PATH)])
    captured = capsys.readouterr()
    line = _refusal(code, captured.err)
    assert "file manifest.json sha256 found" in line and f"identity {IDENTITY_PATH}: {FIELD}: " in line
    assert "valid" not in captured.out


def test_a_run_refuses_a_forged_basis_at_its_start_with_exit_2(
    forged_archive: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["--recipe", "native-text", "--identity", str(IDENTITY_PATH)])
    captured = capsys.readouterr()
    line = _refusal(code, captured.err)
    assert "file manifest.json sha256 found" in line and f"identity {IDENTITY_PATH}: {FIELD}: " in line
    assert "sample 1 recorded" not in captured.out + captured.err  # refused before any handoff
