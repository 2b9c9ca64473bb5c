"""Signed receipts, against a forger with write access to the archive: a receipt edited and its
manifest re-hashed, a passing run's evidence transplanted into a failing run's receipt, a receipt
re-signed by the forger's own key, a statement whose subjects are not the files, and a receipt
signed by a revoked key all fail ``qualify receipts verify`` (exit 1) and are refused by
``qualify enroll``; refused and incomplete receipts verify (exit 0) and the tally lists their
status. The receipts are written by the real writer with the lane's real identity and rule; one
end-to-end case forges the receipt of a real ``qualify --recipe native-text`` run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from qualify.archive import verify as verify_module
from qualify.archive.attestation import ENVELOPE, STATEMENT_TYPE, AttestationProblem, read_attestation, sign_statement
from qualify.archive.keys import TrustedKey, TrustFile, ensure_signing_key, init_key, load_signing_key, rotate_key
from qualify.archive.layout import MANIFEST, PARTIAL_PREFIX, SUMMARY, json_bytes
from qualify.archive.verify import verify_receipt
from qualify.archive.writer import ReceiptWriter
from qualify.contract.identity import Identity, load_identity
from qualify.core.assets import REPO_ROOT
from qualify.core.errors import Refused
from qualify.evidence.records import rule_from_identity
from qualify.interfaces.cli import main
from qualify.interfaces.verify_command import verify_cli
from qualify.judge import judge_incomplete, judge_refused
from qualify.run.enroll import enroll
from qualify.run.run_contract import identity_path_for_lane
from tests.support.receipt_forgery import (
    check,
    envelope_of,
    forger_key,
    make_writable,
    operator_key,
    operator_trust,
    rehash_manifest,
    resign,
    signed_envelope,
    statement_of,
    statement_over,
    write_envelope,
    write_receipt,
)
from tests.unit.archive.test_receipts import committed_receipts
from tests.unit.judge.test_judge import rung2_record

LANE = "nvfp4-native-w4a4"
"""The lane ``qualify --recipe native-text`` qualifies (enrollable; its real identity and rule)."""

PASSING = {"max_abs": 0.5, "mean_abs": 0.05}
FAILING = {"max_abs": 5.0, "mean_abs": 0.05}
"""Sample numbers within and beyond the lane's bounds (max |Δlogit| 1.28, mean 0.079)."""


@pytest.fixture(scope="module")
def identity() -> Identity:
    return load_identity(identity_path_for_lane(LANE))


def lane_receipt(archive: Path, identity: Identity, numbers: dict[str, float]) -> Path:
    """A receipt of three handoffs of the lane with ``numbers``, judged under its identity's rule."""
    records = [rung2_record(repetition, **numbers) for repetition in (1, 2, 3)]
    path = write_receipt(archive, records, identity=identity, rule=rule_from_identity(identity, drift_graded=True),
                         lane=identity.lane)
    make_writable(path)
    return path


@pytest.fixture
def places(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(archive=tmp_path / "archive", registry=tmp_path / "state" / "registry.json",
                           keys=tmp_path / "state" / "keys")


def verify(capsys: pytest.CaptureFixture[str], *paths: Path, trust: Path | None = None) -> tuple[int, list[str]]:
    """``qualify receipts verify [--trust T] PATHS`` in-process: exit code and stdout lines."""
    code = main(["receipts", "verify", *(["--trust", str(trust)] if trust else []), *map(str, paths)])
    captured = capsys.readouterr()
    assert captured.err == "", captured.err
    return code, captured.out.splitlines()


def enroll_refusal(identity: Identity, receipt: Path, places: SimpleNamespace, trust: TrustFile | None = None) -> str:
    """The one-line refusal of enrolling ``receipt``; nothing was minted or registered."""
    with pytest.raises(Refused) as refusal:
        enroll(identity, receipt, places.registry, places.keys, trust=operator_trust() if trust is None else trust)
    assert not places.registry.exists() and not places.keys.exists()
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(f"enroll: receipt {receipt.name} "), message
    return message


def edit_json(path: Path, change: Any) -> None:
    """Rewrite a receipt's JSON file after ``change(document)``, in the receipt's own file form."""
    document = json.loads(path.read_bytes())
    change(document)
    path.write_bytes(json_bytes(document))


def subject_line(receipt: Path, name: str) -> str:
    return f"TAMPERED  {receipt.name}: file {name}: sha256 differs from the signed statement's subject"


# --------------------------------------------------------------------------- the control


def test_an_untouched_receipt_verifies_and_enrolls(identity, places, capsys):
    """The control every forgery below is measured against: the genuine receipt passes both."""
    receipt = lane_receipt(places.archive, identity, PASSING)
    code, out = verify(capsys, receipt)
    assert code == 0
    assert out == [f"ok        {receipt.name}: passed; signed by {load_signing_key().key_id[:16]}…, "
                   "10 files match the signed statement", "1 receipts: 1 verified (1 passed)"]
    entry = enroll(identity, receipt, places.registry, places.keys, trust=operator_trust())
    assert entry.lane == LANE and entry.receipt == f"receipt://{receipt.name}/{SUMMARY}"
    assert (places.keys / f"{entry.key_id}.key").is_file()


# --------------------------------------------------------------------------- edited and re-hashed


def _edit_max_abs_and_rehash(receipt: Path, value: float) -> None:
    """The forger's edit: one sample's max |Δlogit|, the manifest recomputed in its RFC 8785 form."""
    edit_json(receipt / "samples" / "sample-2.json", lambda sample: sample.update(max_abs=value))
    rehash_manifest(receipt)


def test_an_edited_and_rehashed_receipt_fails_verify_naming_the_signed_statement(identity, places, capsys):
    receipt = lane_receipt(places.archive, identity, PASSING)
    _edit_max_abs_and_rehash(receipt, 0.25)
    assert verify_receipt(receipt) == []  # the forgery is consistent: the manifest alone is fooled
    code, out = verify(capsys, receipt)
    assert code == 1
    assert out == [subject_line(receipt, MANIFEST), subject_line(receipt, "samples/sample-2.json"),
                   "1 receipts: 0 verified, 1 tampered"]


def test_an_edited_and_rehashed_receipt_is_not_enrolled(identity, places):
    """An edit that keeps the receipt passing, so only the signature can refuse it."""
    receipt = lane_receipt(places.archive, identity, PASSING)
    _edit_max_abs_and_rehash(receipt, 0.25)
    message = enroll_refusal(identity, receipt, places)
    assert "is tampered: file manifest.json: sha256 differs from the signed statement's subject" in message


def test_a_failing_receipt_edited_to_pass_is_not_enrolled(identity, places, capsys):
    """The forger lowers every sample's max |Δlogit| under the bound and flips the summary to
    passed: the manifest is consistent, the signed statement still says failed."""
    receipt = lane_receipt(places.archive, identity, FAILING)
    for repetition in (1, 2, 3):
        edit_json(receipt / "samples" / f"sample-{repetition}.json", lambda sample: sample.update(PASSING))
    edit_json(receipt / SUMMARY, lambda summary: summary.update(passed=True, status="passed"))
    rehash_manifest(receipt)
    assert verify_receipt(receipt) == []
    code, out = verify(capsys, receipt)
    assert code == 1 and out[-1] == "1 receipts: 0 verified, 1 tampered"
    assert f'TAMPERED  {receipt.name}: signed statement says "failed", {SUMMARY} says "passed"' in out, out
    assert "is tampered: " in enroll_refusal(identity, receipt, places)


# --------------------------------------------------------------------------- transplanted


def _transplant(failing: Path, passing: Path, *, fit_run_id: bool) -> None:
    """Copy the passing run's samples and summary into the failing run's receipt and recompute its
    manifest; with ``fit_run_id`` the summary is also made to name the failing run (so every
    cross-check between the files holds)."""
    shutil.rmtree(failing / "samples")
    shutil.copytree(passing / "samples", failing / "samples")
    shutil.copyfile(passing / SUMMARY, failing / SUMMARY)
    if fit_run_id:
        edit_json(failing / SUMMARY, lambda summary: summary.update(run_id=failing.name))
    rehash_manifest(failing)


@pytest.mark.parametrize("fit_run_id", [False, True], ids=["as-copied", "run-id-fitted"])
def test_a_transplanted_receipt_fails_verify_and_is_not_enrolled(identity, places, capsys, fit_run_id):
    failing = lane_receipt(places.archive, identity, FAILING)
    passing = lane_receipt(places.archive, identity, PASSING)
    assert check(failing).status == "failed" and check(passing).status == "passed"
    _transplant(failing, passing, fit_run_id=fit_run_id)
    assert (verify_receipt(failing) == []) is fit_run_id  # fitted: the manifest's cross-checks all hold
    code, out = verify(capsys, failing, passing)
    assert code == 1
    assert out[-1] == "2 receipts: 1 verified (1 passed), 1 tampered"
    for name in (MANIFEST, "samples/sample-1.json", "samples/sample-2.json", "samples/sample-3.json", SUMMARY):
        assert subject_line(failing, name) in out, out
    assert f'TAMPERED  {failing.name}: signed statement says "failed", {SUMMARY} says "passed"' in out, out
    assert enroll_refusal(identity, failing, places).startswith(f"enroll: receipt {failing.name} is tampered: ")


def test_a_transplanted_receipt_with_the_passing_runs_signed_statement_too_fails(identity, places, capsys):
    """Copying the passing run's envelope along: its statement names the other run and other bytes."""
    failing = lane_receipt(places.archive, identity, FAILING)
    passing = lane_receipt(places.archive, identity, PASSING)
    _transplant(failing, passing, fit_run_id=True)
    shutil.copyfile(passing / ENVELOPE, failing / ENVELOPE)
    code, out = verify(capsys, failing)
    assert code == 1
    assert f"TAMPERED  {failing.name}: signed statement names run \"{passing.name}\", not {failing.name}" in out, out
    assert "is tampered: " in enroll_refusal(identity, failing, places)


# --------------------------------------------------------------------------- re-signed


def test_a_receipt_re_signed_by_an_untrusted_key_is_untrusted(identity, places, capsys):
    """The forger re-signs the receipt's own, correct statement with a key of their own."""
    receipt = lane_receipt(places.archive, identity, PASSING)
    statement = statement_of(receipt)
    forger = forger_key()
    write_envelope(receipt, signed_envelope(statement, forger))
    assert statement_of(receipt) == statement
    code, out = verify(capsys, receipt)
    assert code == 1
    assert out == [f"UNTRUSTED {receipt.name}: signed by key {forger.key_id[:16]}…, which trust file "
                   f"{os.environ['XDG_CONFIG_HOME']}/trust-ladder/trust.json does not list",
                   "1 receipts: 0 verified, 1 untrusted"]
    assert "is untrusted: signed by key" in enroll_refusal(identity, receipt, places)


def test_an_edited_receipt_re_signed_by_the_forger_is_untrusted(identity, places, capsys):
    """A complete forgery: edit, re-hash, a new statement over the edited files, the forger's signature."""
    receipt = lane_receipt(places.archive, identity, FAILING)
    for repetition in (1, 2, 3):
        edit_json(receipt / "samples" / f"sample-{repetition}.json", lambda sample: sample.update(PASSING))
    edit_json(receipt / SUMMARY, lambda summary: summary.update(passed=True, status="passed"))
    rehash_manifest(receipt)
    predicate = statement_of(receipt)["predicate"] | {"status": "passed"}
    resign(receipt, forger_key(), predicate)
    assert verify_receipt(receipt) == []
    code, out = verify(capsys, receipt)
    assert code == 1 and out[-1] == "1 receipts: 0 verified, 1 untrusted"
    assert "is untrusted: " in enroll_refusal(identity, receipt, places)


def test_a_key_id_claimed_by_the_forger_does_not_verify(identity, places, capsys):
    """The forger signs with their key but names the operator's key id: the signature fails."""
    receipt = lane_receipt(places.archive, identity, PASSING)
    edit_json(receipt / SUMMARY, lambda summary: summary.update(verdict="passed: edited"))
    rehash_manifest(receipt)
    statement = statement_over(receipt, statement_of(receipt)["predicate"])
    write_envelope(receipt, signed_envelope(statement, forger_key(), keyid=load_signing_key().key_id))
    code, out = verify(capsys, receipt)
    assert code == 1
    assert out[0].startswith(f"TAMPERED  {receipt.name}: {ENVELOPE}: the signature does not verify under key "), out
    assert "is tampered: " in enroll_refusal(identity, receipt, places)


def test_a_trust_file_from_the_forger_trusts_the_forger(identity, places, tmp_path, capsys):
    """The limit of the scheme (docs/receipts.md): whoever picks the trust file picks the signers.
    The same forgery verifies under a trust file listing the forger's key, and only under it."""
    receipt = lane_receipt(places.archive, identity, PASSING)
    _edit_max_abs_and_rehash(receipt, 0.25)
    forger = forger_key()
    resign(receipt, forger)
    forged_trust = TrustFile((TrustedKey(forger.key_id, forger.public, "the forger", "2026-01-01T00:00:00Z"),), "x")
    (tmp_path / "forged-trust.json").write_bytes(json_bytes(forged_trust.document()))
    assert verify(capsys, receipt, trust=tmp_path / "forged-trust.json")[0] == 0
    assert verify(capsys, receipt)[0] == 1


# --------------------------------------------------------------------------- statements that lie


def _operator_signs(receipt: Path, statement: dict[str, Any]) -> None:
    """A statement signed by the operator's own key (a signer fault, or a stolen signing step)."""
    write_envelope(receipt, signed_envelope(statement, operator_key()))


@pytest.mark.parametrize(("lie", "expected"), [
    ("wrong-digest", "file command.log: sha256 differs from the signed statement's subject"),
    ("missing-subject", "file command.log is not a subject of the signed statement"),
    ("extra-subject", "statement subject notes.txt: no such file"),
    ("renamed-subject", "statement subject command.txt: no such file"),
])
def test_a_statement_whose_subjects_are_not_the_files_is_tampered(identity, places, capsys, lie, expected):
    receipt = lane_receipt(places.archive, identity, PASSING)
    statement = statement_of(receipt)
    subjects = statement["subject"]
    command = next(subject for subject in subjects if subject["name"] == "command.log")
    if lie == "wrong-digest":
        command["digest"]["sha256"] = "0" * 64
    elif lie == "missing-subject":
        subjects.remove(command)
    elif lie == "extra-subject":
        subjects.append({"name": "notes.txt", "digest": {"sha256": "0" * 64}})
    else:
        command["name"] = "command.txt"
    subjects.sort(key=lambda subject: subject["name"])
    _operator_signs(receipt, statement)
    checked = check(receipt)
    assert (checked.state, checked.key_id) == ("tampered", load_signing_key().key_id)
    assert expected in checked.problems, checked
    code, out = verify(capsys, receipt)
    assert code == 1 and f"TAMPERED  {receipt.name}: {expected}" in out, out
    assert expected in enroll_refusal(identity, receipt, places)


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("status", "passed", 'signed statement says "passed", validation-summary.json says "failed"'),
    ("run_id", "20260101T000000Z-0000000000000000",
     'signed statement names run "20260101T000000Z-0000000000000000", not RUN'),
    ("lane", "nvfp4-native-f16", "signed statement's lane \"nvfp4-native-f16\" is not validation-summary.json's \"LANE\""),
    ("identity_sha256", "ab" * 32, f"signed statement's identity_sha256 \"{'ab' * 32}\" is not validation-summary.json's"),
    ("rung", 3, "signed statement's rung 3 is not validation-summary.json's 2"),
    ("verdict", "passed: all good", "signed statement's verdict \"passed: all good\" is not validation-summary.json's"),
])
def test_a_statement_whose_conclusion_is_not_the_receipts_is_tampered(identity, places, field, value, expected):
    receipt = lane_receipt(places.archive, identity, FAILING)
    statement = statement_of(receipt)
    statement["predicate"][field] = value
    _operator_signs(receipt, statement)
    checked = check(receipt)
    assert checked.state == "tampered"
    (problem,) = checked.problems
    assert problem.startswith(expected.replace("RUN", receipt.name).replace("LANE", identity.lane)), checked


# --------------------------------------------------------------------------- revoked


def test_a_receipt_signed_by_a_revoked_key_is_untrusted_naming_the_revocation(
        identity, places, tmp_path, monkeypatch, capsys):
    """After ``keys rotate`` every receipt the old key signed is untrusted; the new key's verify."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # the session's key stays unrotated
    old = init_key()
    before = lane_receipt(places.archive, identity, PASSING)
    assert check(before).state == "verified"
    new, revoked_id = rotate_key("laptop stolen")
    assert revoked_id == old.key_id != new.key_id
    after = lane_receipt(places.archive, identity, PASSING)
    checked = check(before)
    assert checked.state == "untrusted" and len(checked.problems) == 1
    assert checked.problems[0].startswith(f"signed by key {old.key_id[:16]}…, revoked ")
    assert checked.problems[0].endswith(f"(laptop stolen) in trust file {tmp_path}/config/trust-ladder/trust.json")
    code, out = verify(capsys, places.archive)
    assert code == 1
    assert f"UNTRUSTED {before.name}: {checked.problems[0]}" in out
    assert f"ok        {after.name}: passed; signed by {new.key_id[:16]}…, 10 files match the signed statement" in out
    assert out[-1] == "2 receipts: 1 verified (1 passed), 1 untrusted"
    assert "is untrusted: signed by key" in enroll_refusal(identity, before, places)
    assert enroll(identity, after, places.registry, places.keys, trust=operator_trust()).lane == LANE


# --------------------------------------------------------------------------- every status


def test_refused_incomplete_and_failed_receipts_verify_and_the_tally_lists_their_status(identity, tmp_path, capsys):
    archive = tmp_path / "archive"
    lane_receipt(archive, identity, PASSING)
    lane_receipt(archive, identity, FAILING)
    rule = rule_from_identity(identity, drift_graded=True)
    refused = ReceiptWriter(archive, command_line=["qualify", "--recipe", "native-text"], identity=identity,
                            recipe="native-text", lane=LANE, rule=rule)
    refused.finalize(judge_refused("identity sealed: transformers engine device: no CUDA device"))
    interrupted = ReceiptWriter(archive, command_line=["qualify", "--recipe", "native-text"], identity=identity,
                                recipe="native-text", lane=LANE, rule=rule)
    interrupted.add_sample(rung2_record(1, **PASSING))
    interrupted.finalize(judge_incomplete("interrupted by SIGINT during handoff 2/3"))
    leftover = ReceiptWriter(archive, command_line=["qualify"], identity=identity, recipe="native-text", lane=LANE,
                             rule=rule)  # killed before it finalized: a .partial- leftover
    code, out = verify(capsys, archive)
    assert code == 0, out
    key = load_signing_key().key_id[:16]
    for writer, status in ((refused, "refused"), (interrupted, "incomplete")):
        assert f"ok        {writer.run_id}: {status}; signed by {key}…, " in "\n".join(out), out
    assert (f"partial   {PARTIAL_PREFIX}{leftover.run_id}: a run stopped before it finalized its receipt; "
            "nothing in it is attested") in out
    assert out[-1] == "5 receipts: 4 verified (1 passed, 1 failed, 1 refused, 1 incomplete), 1 partial"
    assert check(refused.path).status == "refused" and check(interrupted.path).status == "incomplete"


def test_a_refused_run_with_no_identity_leaves_a_receipt_that_verifies(tmp_path, capsys):
    """A contract refused before its identity loaded: no identity files, still signed."""
    ensure_signing_key(announce=lambda line: None)  # made quietly: stderr stays the verifier's (run alone, too)
    writer = ReceiptWriter(tmp_path, command_line=["qualify", "--identity", "x.json"], identity=None,
                           recipe="native-text", lane=None)
    receipt = writer.finalize(judge_refused("identity sealed: identity x.json: no such file"))
    assert not (receipt / "identity.json").exists()
    code, out = verify(capsys, receipt)
    assert (code, out[-1]) == (0, "1 receipts: 1 verified (1 refused)"), out


def test_failed_and_legacy_receipts_in_one_call_exit_1_for_the_legacy_only(identity, tmp_path, capsys):
    """A failed run's receipt is evidence (exit 0); a legacy one beside it is unsigned (exit 1)."""
    failing = lane_receipt(tmp_path / "archive", identity, FAILING)
    legacy = sorted(p for p in (REPO_ROOT / "receipts").iterdir() if p.is_dir() and not p.name.startswith("."))[0]
    ok_line = (f"ok        {failing.name}: failed; signed by {load_signing_key().key_id[:16]}…, "
               "10 files match the signed statement")
    assert verify(capsys, failing) == (0, [ok_line, "1 receipts: 1 verified (1 failed)"])
    code, out = verify(capsys, failing, legacy)
    assert code == 1 and out[0] == ok_line and out[1].startswith(f"UNSIGNED  {legacy.name}: legacy receipt")
    assert out[-1] == "2 receipts: 1 verified (1 failed), 1 unsigned"


# --------------------------------------------------------------------------- end to end


CLI = "import sys; from qualify.interfaces.cli import main; sys.exit(main(sys.argv[1:]))"
"""``qualify`` in a child process (what the console script runs)."""


@pytest.fixture(scope="module")
def real_receipt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The receipt of a real ``qualify --recipe native-text`` run (producer process, consumer,
    signed with the session's key), made once for the module."""
    archive = tmp_path_factory.mktemp("real-archive")
    done = subprocess.run([sys.executable, "-c", CLI, "--recipe", "native-text", "--reference-once",
                           "--receipts", str(archive)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [receipt] = [path for path in archive.iterdir() if not path.name.startswith(".")]
    return receipt


@pytest.mark.slow
def test_a_real_runs_receipt_edited_and_rehashed_fails_verify_and_enroll(real_receipt, tmp_path, capsys):
    identity_path = identity_path_for_lane(LANE)
    enroll_argv = ["enroll", "--identity", str(identity_path), "--registry", str(tmp_path / "registry.json"),
                   "--keys", str(tmp_path / "keys"), "--receipt"]
    assert verify(capsys, real_receipt) == (0, [
        f"ok        {real_receipt.name}: passed; signed by {load_signing_key().key_id[:16]}…, "
        f"{check(real_receipt).files} files match the signed statement", "1 receipts: 1 verified (1 passed)"])
    forged = tmp_path / "forged" / real_receipt.name
    shutil.copytree(real_receipt, forged)
    make_writable(forged)
    sample = json.loads((forged / "samples" / "sample-1.json").read_bytes())
    _edit_max_abs_and_rehash(forged, sample["max_abs"] / 2)
    assert verify_receipt(forged) == []
    code, out = verify(capsys, forged)
    assert code == 1 and subject_line(forged, "samples/sample-2.json") in out, out
    assert main([*enroll_argv, str(forged)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"enroll: receipt {forged.name} is tampered: " in err, err
    assert not (tmp_path / "registry.json").exists()
    assert main([*enroll_argv, str(real_receipt)]) == 0  # the genuine receipt enrolls
    assert f"enrolled {LANE}" in capsys.readouterr().out
    assert verify_cli([str(real_receipt)]) == 0  # and was left as it was


def test_a_receipt_given_directly_without_its_manifest_is_checked_as_one_receipt(identity, places, capsys):
    receipt = lane_receipt(places.archive, identity, {})
    (receipt / MANIFEST).unlink()
    code, lines = verify(capsys, receipt)
    assert code == 1
    assert all(line.startswith(f"TAMPERED  {receipt.name}: ") for line in lines[:-1]), lines
    assert any("missing file manifest.json" in line for line in lines) and lines[-1] == "1 receipts: 0 verified, 1 tampered"


# --------------------------------------------------------------------------- the signed statement read, and raced
# (the words of each refusal are held in tests/golden/archive.attestation.txt and archive.verify.txt)


def test_a_verified_receipt_carries_its_signed_predicate(tmp_path):
    receipt = write_receipt(tmp_path / "archive")
    checked = check(receipt)
    assert checked.state == "verified"
    assert checked.predicate == statement_of(receipt)["predicate"] and checked.predicate["run_id"] == receipt.name


def test_the_genuine_envelope_is_read_naming_its_signer_and_subjects(tmp_path):
    receipt = write_receipt(tmp_path / "archive")
    attestation = read_attestation(receipt, operator_trust())
    assert attestation.key_id == operator_key().key_id and SUMMARY in attestation.subjects


def _forge_envelope(receipt: Path, how: str) -> None:
    if how == "not-json":
        (receipt / ENVELOPE).write_bytes(b"{not json")
    elif how.startswith("payload "):
        write_envelope(receipt, {**envelope_of(receipt), "payload": how.removeprefix("payload ")})
    elif how == "claimed-key":
        write_envelope(receipt, signed_envelope(statement_of(receipt), forger_key(), keyid=operator_key().key_id))
    elif how == "malformed-statement":
        write_envelope(receipt, signed_envelope({"_type": STATEMENT_TYPE}, operator_key()))
    else:  # a file named twice
        statement = statement_of(receipt)
        statement["subject"] = [*statement["subject"], statement["subject"][0]]
        write_envelope(receipt, signed_envelope(statement, operator_key()))


@pytest.mark.parametrize("how", ["not-json", "payload AB==", "payload AA\nAA", "payload AA-_", "payload AAA",
                                 "payload AAAA=", "claimed-key", "malformed-statement", "a-file-twice"])
def test_an_envelope_forged_or_misspelled_is_tampered_never_untrusted(tmp_path, how):
    receipt = write_receipt(tmp_path / "archive")
    make_writable(receipt)
    _forge_envelope(receipt, how)
    with pytest.raises(AttestationProblem) as problem:
        read_attestation(receipt, operator_trust())
    assert problem.value.kind == "tampered" and "\n" not in str(problem.value)
    assert check(receipt).state == "tampered"


def test_signing_a_statement_its_schema_refuses_is_refused_before_any_receipt_carries_it():
    with pytest.raises(Refused):
        sign_statement([(SUMMARY, "0" * 64)], {}, operator_key())  # a predicate without its schema


@pytest.mark.parametrize("summary", ["[]", "{"], ids=["no-object", "not-json"])
def test_a_re_signed_summary_that_is_no_object_is_tampered(tmp_path, summary):
    receipt = write_receipt(tmp_path / "archive")
    make_writable(receipt)
    (receipt / SUMMARY).write_text(summary)
    rehash_manifest(receipt)
    resign(receipt, operator_key())
    checked = check(receipt)
    assert checked.state == "tampered" and checked.status is None


def consistent_forgery(receipt: Path) -> tuple[bytes, bytes]:
    """Edit sample 2 and re-hash the manifest (the statement still names the originals); returns
    the original manifest's and sample's bytes."""
    manifest, sample = (receipt / MANIFEST).read_bytes(), (receipt / "samples" / "sample-2.json").read_bytes()
    edit_json(receipt / "samples" / "sample-2.json", lambda document: document.update(max_abs=0.25))
    rehash_manifest(receipt)
    return manifest, sample


def _after_the_manifest_check(monkeypatch: pytest.MonkeyPatch, action: Any) -> None:
    """Run ``action`` once the files have been checked against the manifest and before the signed
    statement is: a forger racing the verifier."""
    real = verify_module.check_receipt

    def race(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        action()
        return found

    monkeypatch.setattr(verify_module, "check_receipt", race)


def test_a_file_swapped_back_mid_check_is_judged_on_the_one_reading_the_manifest_saw(tmp_path, monkeypatch):
    receipt = write_receipt(tmp_path / "archive")
    make_writable(receipt)
    manifest, sample = consistent_forgery(receipt)

    def restore_the_originals() -> None:
        (receipt / MANIFEST).write_bytes(manifest)
        (receipt / "samples" / "sample-2.json").write_bytes(sample)

    _after_the_manifest_check(monkeypatch, restore_the_originals)
    checked = check(receipt)
    assert checked.state == "tampered" and len(checked.problems) == 1


def test_a_subject_that_cannot_be_opened_mid_check_is_named_and_the_later_subjects_are_still_checked(
        tmp_path, monkeypatch):
    receipt = write_receipt(tmp_path / "archive")
    make_writable(receipt)
    consistent_forgery(receipt)

    def manifest_becomes_a_fifo() -> None:
        (receipt / MANIFEST).unlink()
        os.mkfifo(receipt / MANIFEST)

    _after_the_manifest_check(monkeypatch, manifest_becomes_a_fifo)
    checked = check(receipt)
    # the walk names the FIFO, the subject check names it, and the later subject (sample 2) is still checked
    assert checked.state == "tampered" and len(checked.problems) == 3
    assert [MANIFEST in checked.problems[1], "sample-2.json" in checked.problems[2]] == [True, True]


def test_a_legacy_manifest_swapped_for_a_non_object_mid_check_is_tampered_never_a_crash(tmp_path, monkeypatch):
    legacy = committed_receipts()[0][0]
    copy = tmp_path / "archive" / legacy.name
    shutil.copytree(legacy, copy)
    make_writable(copy)
    _after_the_manifest_check(monkeypatch, lambda: (copy / MANIFEST).write_text("[]"))
    checked = check(copy)
    # what is read now names no legacy schema, so the receipt is held to a signed one's rules
    assert (checked.state, len(checked.problems)) == ("tampered", 1)
