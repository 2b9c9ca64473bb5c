"""Receipts: created once, complete even on failure, signed, and any altered, missing or extra file
is found (by the manifest, and by the signed statement that names every file)."""

from __future__ import annotations

import dataclasses
import io
import json
import stat
from pathlib import Path

import pytest

from qualify.archive.attestation import ENVELOPE
from qualify.archive.keys import ensure_signing_key, load_signing_key
from qualify.archive.layout import (
    LEGACY_MANIFEST_SCHEMA,
    MANIFEST,
    MANIFEST_SCHEMA,
    PARTIAL_PREFIX,
    REQUIRED_FILES,
    RUN_ID,
    SUMMARY,
    archive_dir,
    default_archive_dir,
    json_bytes,
    new_run_id,
)
from qualify.archive.reader import read_receipt_json, read_summary, receipt_files, resolve_receipt_uri
from qualify.archive.verify import verify_paths, verify_receipt
from qualify.archive.writer import SCOPED_SUMMARY_SCHEMA, ReceiptWriter
from qualify.core.assets import REPO_ROOT
from qualify.core.digests import document_sha256, sha256_file
from qualify.core.errors import Refused
from qualify.evidence.records import LEGACY_SUMMARY_SCHEMA, SAMPLE_SCHEMA, SUMMARY_SCHEMA
from qualify.interfaces.verify_command import verify_cli
from qualify.judge import judge_incomplete, judge_refused, judge_summary
from qualify.judge.scope import scope_document, scope_line
from tests.support.receipt_forgery import (
    IDENTITY,
    RULE,
    check,
    envelope_of,
    make_writable,
    operator_key,
    operator_trust,
    rehash_manifest,
    resign,
    statement_of,
    write_receipt,
)
from tests.unit.judge.test_judge import rung2_record
from tests.unit.judge.test_scope import SCOPE, scoped

__all__ = ["IDENTITY", "RULE", "as_v2_receipt", "committed_receipts", "make_writable",  # imported from here by
           "write_receipt"]  # other tests


def committed_receipts() -> tuple[list[Path], list[Path]]:
    """The receipts committed under receipts/, sorted, as (legacy, signed): a legacy receipt has a
    v1 manifest and no signed statement, a signed one a v2 manifest and its envelope. A receipt
    that is neither (a v2 manifest without its envelope, say) fails here: it is tampered, not legacy."""
    legacy: list[Path] = []
    signed: list[Path] = []
    for path in sorted(p for p in (REPO_ROOT / "receipts").iterdir() if p.is_dir() and not p.name.startswith(".")):
        manifest = json.loads((path / MANIFEST).read_bytes())["schema"]
        enveloped = (path / ENVELOPE).is_file()
        if (manifest, enveloped) == (LEGACY_MANIFEST_SCHEMA, False):
            legacy.append(path)
        elif (manifest, enveloped) == (MANIFEST_SCHEMA, True):
            signed.append(path)
        else:
            raise AssertionError(f"{path.name}: manifest {manifest} with{'' if enveloped else 'out'} {ENVELOPE}: "
                                 f"neither a legacy nor a signed receipt")
    return legacy, signed


@pytest.fixture
def receipt(tmp_path) -> Path:
    return write_receipt(tmp_path / "archive")


def test_a_fresh_receipt_verifies_and_holds_every_file(receipt):
    assert verify_receipt(receipt) == []
    checked = check(receipt)
    assert (checked.state, checked.status, checked.problems) == ("verified", "passed", [])
    assert checked.key_id == load_signing_key().key_id
    files = receipt_files(receipt)
    assert checked.files == len(files) + 1 == 10  # the manifest counts: the statement names it
    statement = statement_of(receipt)  # the signed statement names every file, the manifest too
    assert [subject["name"] for subject in statement["subject"]] == sorted([*files, MANIFEST])
    assert statement["predicate"]["run_id"] == receipt.name and statement["predicate"]["status"] == "passed"
    assert (receipt / ENVELOPE).is_file() and ENVELOPE not in files
    assert set(REQUIRED_FILES) <= set(files)
    assert [f for f in files if f.startswith("samples/")] == [f"samples/sample-{n}.json" for n in (1, 2, 3)]
    assert (receipt / "identity.sha256").read_text() == document_sha256(IDENTITY) + "\n"
    summary = read_receipt_json(receipt, "validation-summary.json")
    assert summary["passed"] is True and summary["run_id"] == receipt.name and summary["samples"] == 3
    assert summary["rule"]["maximum_absolute"] == 11.0
    assert summary["identity_sha256"] == document_sha256(IDENTITY)
    log = (receipt / "command.log").read_text()
    assert log.startswith("command: qualify --recipe native-text\n")
    assert "identity sealed" in log and "verdict: passed:" in log
    versions = read_receipt_json(receipt, "versions.json")
    assert versions["engines"] == {"consumer": "reference 0.1"} and "numpy" in versions["libraries"]
    assert read_receipt_json(receipt, "samples/sample-2.json")["repetition"] == 2


def test_finalized_files_are_read_only(receipt):
    for path in receipt.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert stat.S_IMODE(receipt.stat().st_mode) == 0o555


def test_identity_file_is_copied_byte_for_byte(tmp_path):
    identity_path = tmp_path / "identity.json"
    identity_path.write_bytes(b'{"schema": "trust-ladder.calibration.v2", "lane": "nvfp4-native-splitk",   "bound": 11.0}\n')
    path = write_receipt(tmp_path / "archive", identity=identity_path)
    assert (path / "identity.json").read_bytes() == identity_path.read_bytes()
    expected = document_sha256({"schema": "trust-ladder.calibration.v2", "lane": "nvfp4-native-splitk", "bound": 11.0})
    assert (path / "identity.sha256").read_text().strip() == expected
    assert verify_receipt(path) == [] and check(path).state == "verified"


def _all_receipt_files() -> list[str]:
    return [*REQUIRED_FILES, "samples/sample-1.json", "samples/sample-3.json", MANIFEST, ENVELOPE]


@pytest.mark.parametrize("name", _all_receipt_files())
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipping_any_byte_of_any_file_fails_verification(receipt, name, where):
    path = receipt / name
    data = bytearray(path.read_bytes())
    index = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[index] ^= 0x01
    make_writable(receipt)
    path.write_bytes(bytes(data))
    checked = check(receipt)
    # a flipped key id names a key nobody trusts: untrusted, never verified
    assert checked.state in (("tampered", "untrusted") if name == ENVELOPE else ("tampered",)), \
        f"flipping byte {index} of {name}: {checked}"
    if name == ENVELOPE:  # the manifest does not cover the envelope; the signature check does
        assert verify_receipt(receipt) == [] and checked.problems, checked
        return
    problems = verify_receipt(receipt)
    assert problems, f"flipping byte {index} of {name} went unnoticed by the manifest"
    if name != MANIFEST:  # an edited manifest may surface as the entry it now misdescribes
        assert any(name in problem for problem in problems), problems
    assert f"file {name}: sha256 differs from the signed statement's subject" in checked.problems, checked


@pytest.mark.parametrize("name", [*REQUIRED_FILES, "samples/sample-2.json", MANIFEST])
def test_a_missing_file_is_reported(receipt, name):
    make_writable(receipt)
    (receipt / name).unlink()
    problems = verify_receipt(receipt)
    assert any(f"missing file {name}" in problem for problem in problems), problems
    checked = check(receipt)
    assert checked.state == "tampered" and f"missing file {name}" in " ".join(checked.problems), checked


def test_a_missing_envelope_is_tampered_not_unsigned(receipt):
    """A v2 receipt without its signed statement is not a legacy receipt: removing the envelope
    does not downgrade it to 'unsigned'."""
    make_writable(receipt)
    (receipt / ENVELOPE).unlink()
    expected = f"missing file {ENVELOPE} (a trust-ladder.receipt-manifest.v2 receipt is signed)"
    assert verify_receipt(receipt) == [f"{receipt.name}: {expected}"]
    checked = check(receipt)
    assert (checked.state, checked.problems) == ("tampered", [expected])


@pytest.mark.parametrize("name", ["notes.txt", "samples/sample-4.json", ".hidden", "samples/extra/deep.json"])
def test_an_extra_file_is_reported(receipt, name):
    make_writable(receipt)
    (receipt / name).parent.mkdir(parents=True, exist_ok=True)
    (receipt / name).write_text("{}")
    problems = verify_receipt(receipt)
    assert any(f"extra file {name}" in problem for problem in problems), problems
    checked = check(receipt)
    assert checked.state == "tampered"
    assert f"file {name} is not a subject of the signed statement" in checked.problems, checked


def test_extra_directories_and_links_are_reported(receipt, tmp_path):
    make_writable(receipt)
    (receipt / "empty").mkdir()
    (receipt / "link.json").symlink_to(receipt / "versions.json")
    problems = verify_receipt(receipt)
    assert any("extra directory empty" in p for p in problems)
    assert any("extra file link.json: symbolic link" in p for p in problems)
    assert check(receipt).state == "tampered"


def test_a_consistently_rewritten_manifest_still_fails_the_digest_cross_checks(receipt):
    """Editing identity.sha256 and re-hashing the manifest (in its RFC 8785 form) is caught by the
    identity cross-check, and by the signed statement's subjects."""
    make_writable(receipt)
    (receipt / "identity.sha256").write_text("0" * 64 + "\n")
    rehash_manifest(receipt)
    problems = verify_receipt(receipt)
    assert any("identity.sha256 is not the canonical digest of identity.json" in p for p in problems)
    assert not any(MANIFEST in p for p in problems), problems  # the forged manifest itself is well formed
    checked = check(receipt)
    assert checked.state == "tampered"
    for name in ("identity.sha256", MANIFEST):
        assert f"file {name}: sha256 differs from the signed statement's subject" in checked.problems, checked


def test_a_receipt_directory_is_never_rewritten(tmp_path):
    archive = tmp_path / "archive"
    first = write_receipt(archive, run_id="20261129T000000Z-0123456789abcdef")
    before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
    with pytest.raises(Refused, match="already exists; a receipt is never rewritten"):
        write_receipt(archive, run_id="20261129T000000Z-0123456789abcdef")
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    assert verify_receipt(first) == [] and check(first).state == "verified"


def test_a_finalized_writer_refuses_further_writes(tmp_path):
    writer = ReceiptWriter(tmp_path, command_line=["x"], identity=IDENTITY, recipe="native-text", lane="l", rule=RULE)
    writer.finalize(judge_incomplete("stopped"))
    for action in (lambda: writer.log("x"), lambda: writer.add_sample(rung2_record()),
                   lambda: writer.finalize(judge_incomplete("again"))):
        with pytest.raises(Refused, match="already finalized"):
            action()


def test_a_run_that_raises_still_gets_a_complete_failing_receipt(tmp_path):
    archive = tmp_path / "archive"
    with pytest.raises(RuntimeError):
        with ReceiptWriter(archive, command_line=["qualify"], identity=IDENTITY, recipe="native-text",
                           lane="nvfp4-native-splitk", rule=RULE) as writer:
            writer.add_sample(rung2_record(1))
            raise RuntimeError("producer died\nwith a traceback")
    [path] = [p for p in archive.iterdir()]
    assert verify_receipt(path) == []
    checked = check(path)
    assert (checked.state, checked.status) == ("verified", "incomplete"), checked
    summary = read_receipt_json(path, "validation-summary.json")
    assert summary["passed"] is False
    assert summary["error"] == "RuntimeError: producer died with a traceback"
    assert summary["verdict"] == "not qualified: RuntimeError: producer died with a traceback"
    assert summary["reasons"] == ["RuntimeError: producer died with a traceback"]
    assert summary["samples"] == 1


def test_a_run_without_a_verdict_fails(tmp_path):
    with ReceiptWriter(tmp_path, command_line=["qualify"], identity=IDENTITY, recipe="native-text", lane="l",
                       rule=RULE) as writer:
        pass
    summary = read_receipt_json(writer.path, "validation-summary.json")
    assert summary["passed"] is False and summary["error"] == "run ended without a verdict"


def test_finalize_takes_only_the_judges_verdict(tmp_path):
    writer = ReceiptWriter(tmp_path, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l", rule=RULE)
    records = [rung2_record(i) for i in (1, 2, 3)]
    for record in records:
        writer.add_sample(record)
    with pytest.raises(TypeError, match="finalize needs a qualify.judge.Verdict"):
        writer.finalize(None)  # type: ignore[arg-type]  # the old "no verdict" call is the point
    path = writer.finalize(judge_summary(records, RULE))  # the writer stayed open
    summary = read_receipt_json(path, "validation-summary.json")
    assert summary["passed"] is True and summary["error"] is None
    assert summary["verdict"].startswith("passed: 3/3 handoffs")


def test_a_run_that_stopped_early_records_why_and_fails(tmp_path):
    writer = ReceiptWriter(tmp_path, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l", rule=RULE)
    writer.add_sample(rung2_record(1))
    path = writer.finalize(judge_incomplete("handoff 2/3: producer failed: killed by signal 9"))
    summary = read_receipt_json(path, "validation-summary.json")
    assert summary["passed"] is False
    assert summary["verdict"] == "not qualified: handoff 2/3: producer failed: killed by signal 9"
    assert summary["error"] == "handoff 2/3: producer failed: killed by signal 9"
    assert [entry["passed"] for entry in summary["checks"]] == [False]
    assert verify_receipt(path) == [] and check(path).state == "verified"


def test_a_crash_never_leaves_a_receipt_that_looks_complete(tmp_path):
    archive = tmp_path / "archive"
    writer = ReceiptWriter(archive, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l", rule=RULE)
    writer.add_sample(rung2_record(1))
    # the process dies here: no finalize
    claimed = archive / writer.run_id
    assert claimed.is_dir() and not any(claimed.iterdir())
    assert any("missing file manifest.json" in p for p in verify_receipt(claimed))
    assert (archive / f"{PARTIAL_PREFIX}{writer.run_id}").is_dir()
    assert check(claimed).state == "tampered"  # checked as a receipt, the empty directory is none
    out = io.StringIO()  # the archive reports the leftover as partial, attested by nothing, and passes
    assert verify_paths([archive], operator_trust(), out) == 0
    assert out.getvalue().splitlines() == [
        f"partial   {PARTIAL_PREFIX}{writer.run_id}: a run stopped before it finalized its receipt; "
        "nothing in it is attested",
        "1 receipts: 0 verified, 1 partial"]


def test_non_finite_sample_values_are_kept_as_strings(tmp_path):
    record = rung2_record(1, max_abs=float("nan"), mean_abs=float("inf"))
    writer = ReceiptWriter(tmp_path, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l", rule=RULE)
    writer.add_sample(record)
    path = writer.finalize(judge_incomplete("stopped"))
    stored = read_receipt_json(path, "samples/sample-1.json")
    assert stored["max_abs"] == "NaN" and stored["mean_abs"] == "Infinity"
    assert stored["schema"] == SAMPLE_SCHEMA


def test_identity_digest_mismatch_is_refused(tmp_path):
    with pytest.raises(Refused, match="does not match the document's digest"):
        ReceiptWriter(tmp_path, command_line=["q"], identity=IDENTITY, identity_sha256="0" * 64,
                      recipe="native-text", lane="l", rule=RULE)


@pytest.mark.parametrize("run_id", ["../x", "", ".hidden", "a/b", "a b"])
def test_malformed_run_ids_are_refused(tmp_path, run_id):
    with pytest.raises(Refused, match="run id"):
        ReceiptWriter(tmp_path, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l", run_id=run_id)


def test_run_ids_are_utc_timestamp_plus_random_suffix():
    first, second = new_run_id(), new_run_id()
    assert first != second
    for run_id in (first, second):
        assert RUN_ID.fullmatch(run_id)
        stamp, suffix = run_id.split("-")
        assert len(stamp) == 16 and stamp.endswith("Z") and stamp[8] == "T"
        assert len(suffix) == 16 and int(suffix, 16) >= 0


# --------------------------------------------------------------------------- receipt:// URIs


def test_resolve_receipt_uri(receipt):
    archive = receipt.parent
    assert resolve_receipt_uri(f"receipt://{receipt.name}/command.log", archive) == (receipt / "command.log").resolve()
    assert resolve_receipt_uri(f"receipt://{receipt.name}/samples/sample-2.json", archive).name == "sample-2.json"
    assert resolve_receipt_uri(f"receipt://{receipt.name}/manifest.json", archive).name == MANIFEST


@pytest.mark.parametrize(
    "uri",
    [
        "command.log",
        "https://example.org/x/command.log",
        "receipt://",
        "receipt://RUN",
        "receipt://RUN/",
        "receipt://RUN/../other/command.log",
        "receipt://RUN/samples/../../command.log",
        "receipt://RUN//command.log",
        "receipt://RUN/./command.log",
        "receipt://RUN/samples\\sample-1.json",
        "receipt://../RUN/command.log",
        "receipt:///etc/passwd",
        "receipt://RUN/command.log?x=1",
        "receipt://RUN/command.log#top",
        "receipt://RUN/%2e%2e/command.log",
    ],
)
def test_malformed_and_traversing_uris_are_refused(receipt, uri):
    with pytest.raises(Refused) as refusal:
        resolve_receipt_uri(uri.replace("RUN", receipt.name), receipt.parent)
    assert "\n" not in str(refusal.value)


def test_uri_to_a_missing_receipt_or_file_is_refused(receipt):
    with pytest.raises(Refused, match="no receipt"):
        resolve_receipt_uri("receipt://20990101T000000Z-0000000000000000/command.log", receipt.parent)
    with pytest.raises(Refused, match="has no file"):
        resolve_receipt_uri(f"receipt://{receipt.name}/samples/sample-9.json", receipt.parent)


def test_uri_to_an_altered_receipt_is_refused(receipt):
    make_writable(receipt)
    (receipt / "samples" / "sample-1.json").write_text("{}")
    with pytest.raises(Refused, match="fails verification: .*altered file samples/sample-1.json"):
        resolve_receipt_uri(f"receipt://{receipt.name}/command.log", receipt.parent)


# --------------------------------------------------------------------------- CLI and locations


def _verify(capsys, *argv) -> tuple[int, list[str]]:
    """``qualify receipts verify ARGV`` in-process: exit code and stdout lines (stderr empty)."""
    code = verify_cli([str(arg) for arg in argv])
    captured = capsys.readouterr()
    assert captured.err == "", captured.err
    return code, captured.out.splitlines()


def test_verify_cli_archive_and_single_receipt(tmp_path, capsys):
    archive = tmp_path / "archive"
    first, second = sorted([write_receipt(archive), write_receipt(archive)])
    key = load_signing_key().key_id[:16]
    code, out = _verify(capsys, archive)
    assert code == 0
    assert out == [f"ok        {path.name}: passed; signed by {key}…, 10 files match the signed statement"
                   for path in (first, second)] + ["2 receipts: 2 verified (2 passed)"]
    assert _verify(capsys, first) == (0, [out[0], "1 receipts: 1 verified (1 passed)"])
    assert _verify(capsys, first, second)[1] == out  # several paths: one report
    make_writable(second)
    (second / "command.log").write_text("edited")
    code, out = _verify(capsys, archive)
    assert code == 1
    assert f"TAMPERED  {second.name}: altered file command.log: 6 bytes, manifest says " in "\n".join(out)
    assert f"TAMPERED  {second.name}: file command.log: sha256 differs from the signed statement's subject" in out
    assert out[-1] == "2 receipts: 1 verified (1 passed), 1 tampered"


def test_verify_cli_missing_path_and_empty_archive(tmp_path, capsys):
    assert verify_cli([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"receipts verify: {tmp_path / 'nowhere'}: no such directory")
    (tmp_path / "empty").mkdir()
    assert _verify(capsys, tmp_path / "empty") == (1, [f"receipts verify: no receipts under {tmp_path / 'empty'}"])
    receipt = write_receipt(tmp_path / "archive")
    assert verify_cli([str(receipt), str(tmp_path / "nowhere")]) == 2  # every path is checked before any report
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1


def test_verify_cli_refuses_an_unusable_trust_file(tmp_path, capsys):
    receipt = write_receipt(tmp_path / "archive")
    (tmp_path / "trust.json").write_text('{"schema": "trust-ladder.trust.v1"}')
    assert verify_cli(["--trust", str(tmp_path / "trust.json"), str(receipt)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "trust.json" in captured.err
    assert verify_cli(["--trust", str(tmp_path / "missing.json"), str(receipt)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_committed_legacy_receipts_are_reported_unsigned_and_the_signed_ones_untrusted_here(capsys):
    """The legacy receipts under receipts/ predate signing: intact against their own manifests, yet
    never 'ok' (anyone can recompute such a manifest): UNSIGNED. The signed ones (the v3 identities'
    bases and the runs under them) were signed by the machines that ran them (the operator's key,
    a GPU device's key), keys no trust file in the repository lists: under this session's trust
    file each is UNTRUSTED, naming its key, never 'ok' and never unsigned. Exit 1."""
    legacy, signed = committed_receipts()
    assert legacy and signed
    ensure_signing_key(announce=lambda line: None)  # the session's trust file exists, listing its own key only
    trust = operator_trust()
    code, out = _verify(capsys, REPO_ROOT / "receipts")
    assert code == 1
    expected = {path.name: f"UNSIGNED  {path.name}: legacy receipt with no signed statement; its files match its "
                           f"own manifest, which anyone can recompute; records {check(path).status} (not authenticated)"
                for path in legacy}
    for path in signed:
        [signature] = envelope_of(path)["signatures"]
        assert trust.get(signature["keyid"]) is None, path.name
        expected[path.name] = (f"UNTRUSTED {path.name}: signed by key {signature['keyid'][:16]}…, which "
                               f"{trust.source} does not list")
    assert out[:-1] == [expected[name] for name in sorted(expected)]
    assert out[-1] == f"{len(legacy) + len(signed)} receipts: 0 verified, {len(legacy)} unsigned, {len(signed)} untrusted"
    for path in [*legacy, *signed]:
        assert verify_receipt(path) == [], path.name


def test_a_committed_signed_receipt_s_statement_names_its_files_and_its_summary_s_conclusion():
    """What a signed committed receipt shows without its signer's public key: the statement its
    envelope carries (decoded, not authenticated) names exactly its files, the manifest included,
    each with the SHA-256 the file has, and concludes what its summary records."""
    _legacy, signed = committed_receipts()
    for path in signed:
        statement = statement_of(path)
        subjects = {subject["name"]: subject["digest"]["sha256"] for subject in statement["subject"]}
        assert subjects == {name: sha256_file(path / name) for name in [*receipt_files(path), MANIFEST]}, path.name
        summary = read_summary(path)
        predicate = statement["predicate"]
        assert (predicate["run_id"], predicate["status"]) == (path.name, summary["status"]), path.name
        for name in ("lane", "recipe", "rung", "identity_sha256", "verdict"):
            assert predicate[name] == summary[name], (path.name, name)


def test_default_archive_is_outside_the_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("QUALIFY_RECEIPTS", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_archive_dir() == tmp_path / "home" / ".local" / "share" / "trust-ladder" / "receipts"
    assert not default_archive_dir().is_relative_to(REPO_ROOT)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_archive_dir() == tmp_path / "xdg" / "trust-ladder" / "receipts"
    monkeypatch.setenv("QUALIFY_RECEIPTS", str(tmp_path / "env"))
    assert default_archive_dir() == tmp_path / "env"
    assert archive_dir(str(tmp_path / "option")) == tmp_path / "option"
    assert archive_dir(None) == tmp_path / "env"


@pytest.mark.slow
def test_every_single_byte_flip_of_the_manifest_is_caught(receipt):
    """Exhaustive over the manifest (the one file the manifest cannot cover): any edit is found, by
    its own checks and by the signed statement."""
    path = receipt / MANIFEST
    original = path.read_bytes()
    make_writable(receipt)
    for index in range(len(original)):
        for mask in (0x01,):
            data = bytearray(original)
            data[index] ^= mask
            path.write_bytes(bytes(data))
            assert verify_receipt(receipt), f"byte {index} ^ {mask:#x} of the manifest went unnoticed"
            assert check(receipt).state == "tampered", f"byte {index} ^ {mask:#x} of the manifest"
    path.write_bytes(original)
    assert verify_receipt(receipt) == [] and check(receipt).state == "verified"


# --------------------------------------------------------------------------- the summary's scope (v3) and older summaries


def as_v2_receipt(receipt: Path) -> Path:
    """``receipt`` as the harness wrote it before summaries held a scope: a v2 summary (no
    ``scope``), the manifest re-hashed and the statement re-signed with the operator's own key,
    so it is a genuine signed v2 receipt, not a forgery."""
    make_writable(receipt)
    path = receipt / SUMMARY
    summary = json.loads(path.read_bytes())
    del summary["scope"]
    summary["schema"] = SUMMARY_SCHEMA
    path.write_bytes(json_bytes(summary))
    rehash_manifest(receipt)
    resign(receipt, operator_key())
    return receipt


def test_a_scoped_verdict_is_written_whole_into_a_v3_summary_and_verifies(tmp_path):
    records = [rung2_record(i) for i in (1, 2, 3)]
    for verdict in (scoped(judge_summary(records, RULE)), scoped(judge_summary(records[:1], RULE))):
        receipt = write_receipt(tmp_path / f"archive-{verdict.status}", records, verdict=verdict)
        assert verify_receipt(receipt) == [] and check(receipt).state == "verified"
        summary = read_summary(receipt)  # valid against the v3 schema
        assert summary["schema"] == SCOPED_SUMMARY_SCHEMA and summary["status"] == verdict.status
        assert summary["scope"] == scope_document(SCOPE, verdict.passed)
        assert summary["verdict"] == verdict.headline and summary["verdict"].startswith(
            scope_line(verdict.passed, SCOPE, None if verdict.passed else verdict.reasons[0]))
        assert f"verdict: {verdict.headline}" in (receipt / "command.log").read_text()


def test_a_verdict_without_a_scope_writes_a_null_scope(tmp_path):
    receipt = write_receipt(tmp_path / "archive")
    summary = read_summary(receipt)
    assert (summary["schema"], summary["scope"]) == (SCOPED_SUMMARY_SCHEMA, None)
    stopped = ReceiptWriter(tmp_path / "archive", command_line=["q"], identity=IDENTITY, recipe="native-text",
                            lane="l", rule=RULE).finalize(judge_incomplete("interrupted by SIGINT during handoff 1/3"))
    assert read_summary(stopped)["scope"] is None


@pytest.mark.parametrize("verdict", [
    dataclasses.replace(judge_incomplete("interrupted by SIGINT"), scope=SCOPE),
    dataclasses.replace(judge_refused("no GPU"), scope=SCOPE),
], ids=["incomplete", "refused"])
def test_a_scope_on_a_verdict_that_judged_nothing_is_refused_and_the_run_sealed_incomplete(tmp_path, verdict):
    archive = tmp_path / "archive"
    with pytest.raises(Refused, match=f"^receipt: scope: a {verdict.status} verdict judged nothing"):
        with ReceiptWriter(archive, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l",
                           rule=RULE) as writer:
            writer.finalize(verdict)
    summary = read_summary(writer.path)  # the writer stayed open, and its context sealed the run
    assert (summary["status"], summary["scope"]) == ("incomplete", None)
    assert summary["error"].startswith(f"Refused: receipt: scope: a {verdict.status} verdict")
    assert verify_receipt(writer.path) == []


def test_a_scope_the_file_form_refuses_never_reaches_a_receipt(tmp_path, monkeypatch):
    """Should the judge's words ever break the form (here: a line split in two), the receipt
    refuses them in one line rather than store a scope it cannot state."""
    import qualify.archive.writer as writer_module

    def broken(scope, passed):
        return {**scope_document(scope, passed), "line": "QUALIFIED\non two lines"}

    monkeypatch.setattr(writer_module, "scope_document", broken)
    writer = ReceiptWriter(tmp_path, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l", rule=RULE)
    records = [rung2_record(1)]
    with pytest.raises(Refused) as refused:
        writer.finalize(scoped(judge_summary(records, RULE)))
    assert str(refused.value).startswith("receipt: scope: ") and "line" in str(refused.value)
    assert "\n" not in str(refused.value) and not writer.finalized


def test_a_v2_receipt_still_verifies_and_reads_with_no_scope(tmp_path):
    receipt = as_v2_receipt(write_receipt(tmp_path / "archive", verdict=scoped(judge_summary(
        [rung2_record(i) for i in (1, 2, 3)], RULE))))
    assert verify_receipt(receipt) == [] and check(receipt).state == "verified"
    summary = read_summary(receipt)
    assert summary["schema"] == SUMMARY_SCHEMA and "scope" not in summary and summary.get("scope") is None
    code_and_lines = io.StringIO()
    assert verify_paths([receipt], operator_trust(), code_and_lines) == 0
    assert code_and_lines.getvalue().startswith(f"ok        {receipt.name}: passed; signed by ")


def test_every_committed_summary_reads_as_its_own_version():
    """Legacy receipts hold v1 summaries; signed ones v3: a calibration's scope is null (it judged
    no fixture), a qualification's states its scope, worded the same in its verdict."""
    legacy, signed = committed_receipts()
    assert {read_summary(path)["schema"] for path in legacy} == {LEGACY_SUMMARY_SCHEMA}
    for path in signed:
        summary = read_summary(path)
        assert summary["schema"] == SCOPED_SUMMARY_SCHEMA, path.name
        kind = json.loads((path / "identity.json").read_bytes())["schema"]
        if kind == "trust-ladder.calibration.v3":
            assert summary["scope"] is None, path.name
        else:
            assert kind == "trust-ladder.onboarding-identity.v3", path.name
            scope, verdict = summary["scope"], summary["verdict"]
            words = "QUALIFIED" if summary["passed"] else "NOT QUALIFIED"
            assert scope["line"] == f"{words} on {scope['fixture_words']}; {scope['controls_words']}", path.name
            # A failed verdict names its first reason between the line's halves.
            because = "" if summary["passed"] else f": {summary['reasons'][0]}"
            assert verdict.startswith(f"{words} on {scope['fixture_words']}{because}; {scope['controls_words']}"), \
                path.name


@pytest.mark.parametrize(("change", "expected"), [
    (lambda s: s.update(schema="trust-ladder.validation-summary.v9"),
     "found schema 'trust-ladder.validation-summary.v9', expected one of trust-ladder.validation-summary.v3, "
     "trust-ladder.validation-summary.v2, trust-ladder.validation-summary.v1"),
    (lambda s: s.pop("schema"), "found no schema, expected one of"),
    (lambda s: s.pop("scope"), "scope: missing, expected this field"),
    (lambda s: s["scope"].update(line=7), "scope.line: found 7, expected type string"),
    (lambda s: s.update(scope={"line": "QUALIFIED"}), "scope: {'line': 'QUALIFIED'} is not valid"),
    (lambda s: s.update(status="refused", passed=False, error="refused: no GPU"), "expected type null"),  # judged nothing
])
def test_a_summary_off_its_versions_form_is_refused_in_one_line(tmp_path, change, expected):
    receipt = write_receipt(tmp_path / "archive", verdict=scoped(judge_summary([rung2_record(i) for i in (1, 2, 3)],
                                                                               RULE)))
    make_writable(receipt)
    summary = json.loads((receipt / SUMMARY).read_bytes())
    change(summary)
    (receipt / SUMMARY).write_bytes(json_bytes(summary))
    with pytest.raises(Refused) as refused:
        read_summary(receipt)
    message = str(refused.value)
    assert message.startswith(f"receipt {receipt.name}: {SUMMARY}: ") and expected in message and "\n" not in message
