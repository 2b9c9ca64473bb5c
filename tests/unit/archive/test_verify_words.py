"""``receipts verify`` in words: the help, usage errors and refusals it prints, the report lines and
tally it writes to the stream it is given, the ``--json`` document, the status a legacy summary
records, and which directories of an archive are checked as receipts."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from qualify.archive import verify as verify_module
from qualify.archive.attestation import ENVELOPE
from qualify.archive.keys import default_trust_path, load_signing_key
from qualify.archive.layout import (
    LEGACY_MANIFEST_SCHEMA,
    LEGACY_MANIFEST_SCHEMA_PATH,
    MANIFEST,
    MANIFEST_SCHEMA,
    MANIFEST_SCHEMA_PATH,
    PARTIAL_PREFIX,
    SUMMARY,
)
from qualify.archive.verify import (
    VERIFY_JSON_SCHEMA,
    manifest_schema_path,
    verify_document,
    verify_paths,
    verify_receipt,
)
from qualify.core.digests import document_sha256
from qualify.interfaces.verify_command import verify_cli
from tests.support.receipt_forgery import (
    IDENTITY,
    check,
    make_writable,
    operator_key,
    operator_trust,
    rehash_manifest,
    resign,
    statement_of,
    writable_receipt,
    write_receipt,
)
from tests.unit.archive.test_receipts import committed_receipts
from tests.unit.archive.test_signed_receipts import edit_json

RUN_A = "20260101T000000Z-aaaaaaaaaaaaaaaa"
RUN_B = "20260101T000000Z-bbbbbbbbbbbbbbbb"
RUN_C = "20260101T000000Z-cccccccccccccccc"

MISSING_WITHOUT_MANIFEST = [
    "missing file manifest.json (incomplete receipt: a run in progress or interrupted)",
    "missing file command.log", "missing file versions.json", "missing file validation-summary.json",
]
"""The problems of a directory holding no receipt file at all (REQUIRED_FILES, in their order)."""


@pytest.fixture
def receipt(tmp_path: Path) -> Path:
    """A signed receipt of this test's own, writable: to tamper with."""
    return writable_receipt(tmp_path / "archive")


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A signed receipt no test changes (shared: writing one takes a good part of a test's budget)."""
    return write_receipt(tmp_path_factory.mktemp("intact"))


@pytest.fixture(scope="module")
def rewritable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A signed receipt whose summary each test using it rewrites whole."""
    path = write_receipt(tmp_path_factory.mktemp("rewritable"))
    make_writable(path)
    return path


def key16() -> str:
    return load_signing_key().key_id[:16]


def legacy_receipt() -> Path:
    """The first committed legacy receipt (v1 manifest, no signed statement; its run passed)."""
    legacy, _signed = committed_receipts()
    return legacy[0]


def unsigned_line(path: Path) -> str:
    return (f"UNSIGNED  {path.name}: legacy receipt with no signed statement; its files match its own manifest, "
            "which anyone can recompute; records passed (not authenticated)")


def untrusted_line(path: Path) -> str:
    return f"UNTRUSTED {path.name}: signed by key {key16()}…, and no trust file was given"


# --------------------------------------------------------------------------- the command line


def test_help_names_the_command_its_arguments_and_what_each_is_for(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")  # one help entry per line, whatever the trust path's length
    assert verify_cli(["--help"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = [" ".join(line.split()) for line in captured.out.splitlines() if line.strip()]
    assert lines == [
        "usage: qualify receipts verify [-h] [--trust TRUST] [--json] [PATH ...]",
        "Verify receipts: signature, signed statement, every file.",
        "positional arguments:",
        "PATH receipts or archives",
        "options:",
        "-h, --help show this help message and exit",
        f"--trust TRUST trust file of public keys (default {default_trust_path()} when it exists)",
        "--json print one JSON document on stdout (contracts/cli-receipts-verify.v1.schema.json)",
    ]


@pytest.mark.parametrize(("argv", "error"), [
    ([""], "argument PATH: found an empty path '', expected a path"),
    (["--trust", "", "archive"], "argument --trust: found an empty path '', expected a path"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_usage_error_exits_2_with_one_line_naming_the_command_and_the_argument(argv, error, capsys):
    assert verify_cli(argv) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"qualify receipts verify: error: {error}\n")


def test_an_archive_that_cannot_be_listed_is_refused_before_any_report(tmp_path, monkeypatch, capsys):
    archive = tmp_path / "archive"
    archive.mkdir()
    real_listdir = os.listdir

    def refuse_the_archive(path: Any = ".") -> list[str]:
        if path is not None and Path(path) == archive:
            raise PermissionError()  # no strerror: the refusal falls back to the exception's name
        return real_listdir(path)

    # as root a mode 000 directory still lists: the refusal is simulated for this one directory only
    monkeypatch.setattr(verify_module.os, "listdir", refuse_the_archive)
    assert verify_cli([str(archive)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"receipts verify: {archive}: cannot list (PermissionError)\n")


# --------------------------------------------------------------------------- the report and its stream


def test_a_path_that_cannot_be_listed_mid_walk_exits_2_naming_it_and_why(tmp_path, capsys):
    out = io.StringIO()
    missing = tmp_path / "gone"
    assert verify_paths([missing], None, out) == 2
    captured = capsys.readouterr()
    assert out.getvalue() == captured.out == ""
    assert captured.err == f"receipts verify: {missing}: cannot list (No such file or directory)\n"


def test_a_listing_error_without_an_os_reason_is_named_by_its_exception(tmp_path, monkeypatch, capsys):
    archive = tmp_path / "archive"
    archive.mkdir()
    real_iterdir = Path.iterdir

    def refuse_the_archive(self: Path) -> Any:
        if self == archive:
            raise PermissionError()
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", refuse_the_archive)
    assert verify_paths([archive], None, io.StringIO()) == 2
    assert capsys.readouterr().err == f"receipts verify: {archive}: cannot list (PermissionError)\n"


def test_no_receipts_under_several_paths_is_one_line_on_the_given_stream_naming_each(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    out = io.StringIO()
    assert verify_paths([first, second], None, out) == 1
    assert out.getvalue() == f"receipts verify: no receipts under {first}, {second}\n"
    assert capsys.readouterr() == ("", "")


def test_an_unsigned_receipt_beside_an_untrusted_one_fails_and_both_lines_go_to_the_stream(intact, capsys):
    legacy = legacy_receipt()
    out = io.StringIO()
    assert verify_paths([legacy, intact], None, out) == 1
    assert out.getvalue().splitlines() == [
        unsigned_line(legacy), untrusted_line(intact), "2 receipts: 0 verified, 1 unsigned, 1 untrusted"]
    assert capsys.readouterr() == ("", "")


def test_an_untrusted_receipt_beside_a_tampered_one_fails_and_every_problem_goes_to_the_stream(tmp_path, capsys):
    trusted_elsewhere = write_receipt(tmp_path / "one")
    tampered = write_receipt(tmp_path / "two")
    make_writable(tampered)
    size = (tampered / "command.log").stat().st_size
    (tampered / "command.log").write_text("edited")
    out = io.StringIO()
    assert verify_paths([trusted_elsewhere, tampered], None, out) == 1
    assert out.getvalue().splitlines() == [
        untrusted_line(trusted_elsewhere),
        f"TAMPERED  {tampered.name}: altered file command.log: 6 bytes, manifest says {size}",
        f"TAMPERED  {tampered.name}: signed by key {key16()}…, and no trust file was given",
        "2 receipts: 0 verified, 1 untrusted, 1 tampered",
    ]
    assert capsys.readouterr() == ("", "")


def test_a_legacy_receipt_with_an_altered_file_is_tampered_not_unsigned(tmp_path):
    legacy = legacy_receipt()
    copy = tmp_path / "archive" / legacy.name
    shutil.copytree(legacy, copy)
    make_writable(copy)
    with open(copy / "command.log", "a", encoding="utf-8") as log:
        log.write("appended\n")
    checked = check(copy)
    assert checked.state == "tampered"
    assert len(checked.problems) == 1 and checked.problems[0].startswith("altered file command.log: "), checked.problems


# --------------------------------------------------------------------------- unexpected errors


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


@pytest.mark.parametrize(("error", "shown_as"), [
    (Unprintable("hidden"), "Unprintable"),
    (ValueError(), "ValueError"),
    (ValueError("no digest\tin\nthree lines"), "ValueError: no digest in three lines"),
])
def test_an_unexpected_error_is_named_by_its_type_and_its_text_only_when_it_has_one(
        intact, monkeypatch, error, shown_as):
    def explode(root: Path, listed: list[str]) -> list[str]:
        raise error

    monkeypatch.setattr(verify_module, "_consistency_problems", explode)
    assert verify_receipt(intact) == [f"{intact.name}: cannot check: {shown_as}"]


# --------------------------------------------------------------------------- the status a summary records


@pytest.mark.parametrize(("summary", "status"), [
    ({"passed": True}, "passed"),
    ({"passed": True, "error": "refused: no CUDA device"}, "passed"),
    ({"passed": False}, "failed"),
    ({"passed": False, "error": None}, "failed"),
    ({"passed": False, "error": "refused: no CUDA device"}, "refused"),
    ({"passed": False, "error": "interrupted by SIGINT during handoff 2/3"}, "incomplete"),
    ({"passed": 1}, None),  # 1 is no passed flag
    ({}, None),
    ({"status": "failed", "passed": True}, "failed"),  # a v2+ summary's own status wins
    ([], None),
])
def test_a_summary_records_its_status_from_status_or_from_passed_and_error(rewritable, summary, status):
    (rewritable / SUMMARY).write_text(json.dumps(summary))
    assert check(rewritable).status == status


# --------------------------------------------------------------------------- the signed statement's checks


def test_a_verified_receipt_carries_its_signed_predicate(intact):
    checked = check(intact)
    assert checked.state == "verified"
    assert checked.predicate == statement_of(intact)["predicate"]
    assert checked.predicate["run_id"] == intact.name


def _replace_summary_and_resign(receipt: Path, text: str) -> None:
    """The operator's own signer over a receipt whose summary is ``text``: every file matches the
    manifest and the statement, so only the conclusion's cross-checks can object."""
    (receipt / SUMMARY).write_text(text)
    rehash_manifest(receipt)
    resign(receipt, operator_key())


def test_a_summary_that_is_no_object_is_named_against_each_field_the_statement_signs(receipt):
    _replace_summary_and_resign(receipt, "[]")
    checked = check(receipt)
    assert checked.state == "tampered"
    assert checked.problems[:-1] == [
        f"{SUMMARY} is not a JSON object",
        f"signed statement says \"passed\", {SUMMARY} says null",
        f"signed statement's lane \"nvfp4-native-splitk\" is not {SUMMARY}'s null",
        f"signed statement's recipe \"native-text\" is not {SUMMARY}'s null",
        f"signed statement's rung 2 is not {SUMMARY}'s null",
        f"signed statement's identity_sha256 \"{document_sha256(IDENTITY)}\" is not {SUMMARY}'s null",
    ]
    verdict = checked.problems[-1]  # the signed verdict is a long line, shown cut short
    assert verdict.startswith("signed statement's verdict \"passed: 3/3 handoffs with exact tokens")
    assert verdict.endswith(f"… is not {SUMMARY}'s null")


def test_an_unreadable_summary_is_named_by_the_statement_check_too(receipt):
    _replace_summary_and_resign(receipt, "{")
    checked = check(receipt)
    assert checked.state == "tampered"
    [refusal] = {problem for problem in checked.problems if problem.startswith(f"{SUMMARY}: ")}
    assert checked.problems == [refusal, f"signed statement says \"passed\", {SUMMARY} says null", refusal]


def _consistent_forgery(receipt: Path) -> tuple[bytes, bytes]:
    """Edit sample 2 and re-hash the manifest (the statement still names the originals); returns
    the original manifest's and sample's bytes."""
    manifest, sample = (receipt / MANIFEST).read_bytes(), (receipt / "samples" / "sample-2.json").read_bytes()
    edit_json(receipt / "samples" / "sample-2.json", lambda document: document.update(max_abs=0.25))
    rehash_manifest(receipt)
    return manifest, sample


def _between_the_manifest_and_the_statement_checks(monkeypatch, action: Any) -> None:
    """Run ``action`` after the manifest check and before the statement check: a forger racing the
    verifier (the summary's status is read in between)."""
    real = verify_module._recorded_status

    def race(root: Path) -> str | None:
        action()
        return real(root)

    monkeypatch.setattr(verify_module, "_recorded_status", race)


def test_a_file_swapped_back_mid_check_is_judged_on_the_one_reading_the_manifest_saw(receipt, monkeypatch):
    manifest, sample = _consistent_forgery(receipt)

    def restore_the_originals() -> None:
        (receipt / MANIFEST).write_bytes(manifest)
        (receipt / "samples" / "sample-2.json").write_bytes(sample)

    _between_the_manifest_and_the_statement_checks(monkeypatch, restore_the_originals)
    checked = check(receipt)
    assert checked.state == "tampered"
    assert checked.problems == ["file samples/sample-2.json: sha256 differs from the signed statement's subject"]


def test_a_subject_that_cannot_be_opened_is_named_and_the_later_subjects_are_still_checked(receipt, monkeypatch):
    _consistent_forgery(receipt)

    def manifest_becomes_a_fifo() -> None:
        (receipt / MANIFEST).unlink()
        os.mkfifo(receipt / MANIFEST)

    _between_the_manifest_and_the_statement_checks(monkeypatch, manifest_becomes_a_fifo)
    checked = check(receipt)
    assert checked.state == "tampered"
    # the walk's own line about the FIFO comes first (it calls the manifest an "extra file": see the report)
    assert checked.problems[-2:] == [
        "file manifest.json: not a regular file, expected a regular file",
        "file samples/sample-2.json: sha256 differs from the signed statement's subject",
    ]
    assert len(checked.problems) == 3


def test_a_legacy_manifest_swapped_for_a_non_object_mid_check_is_tampered_never_a_crash(tmp_path, monkeypatch):
    legacy = legacy_receipt()
    copy = tmp_path / "archive" / legacy.name
    shutil.copytree(legacy, copy)
    make_writable(copy)
    _between_the_manifest_and_the_statement_checks(monkeypatch, lambda: (copy / MANIFEST).write_text("[]"))
    checked = check(copy)
    # what is read now names no legacy schema, so the receipt is held to a signed one's rules
    assert (checked.state, checked.problems) == ("tampered", [f"missing file {ENVELOPE}"])


def test_a_manifest_is_checked_against_its_own_versions_schema():
    assert manifest_schema_path({"schema": LEGACY_MANIFEST_SCHEMA}) == LEGACY_MANIFEST_SCHEMA_PATH
    assert manifest_schema_path({"schema": MANIFEST_SCHEMA}) == MANIFEST_SCHEMA_PATH
    assert manifest_schema_path({"schema": 1}) == MANIFEST_SCHEMA_PATH
    assert manifest_schema_path([LEGACY_MANIFEST_SCHEMA]) == MANIFEST_SCHEMA_PATH


# --------------------------------------------------------------------------- what an archive holds


def _archive_with_leftovers(archive: Path) -> None:
    """Two runs killed before they finalized, A's claimed directory still empty, B's not; and C,
    an empty directory nobody claimed."""
    for run in (RUN_A, RUN_B):
        (archive / f"{PARTIAL_PREFIX}{run}").mkdir(parents=True)
        (archive / f"{PARTIAL_PREFIX}{run}" / "command.log").write_text("started\n")
    (archive / RUN_A).mkdir()
    (archive / RUN_B).mkdir()
    (archive / RUN_B / "stray.txt").write_text("x")
    (archive / RUN_C).mkdir()


def _partial_line(run: str) -> str:
    return (f"partial   {PARTIAL_PREFIX}{run}: a run stopped before it finalized its receipt; "
            "nothing in it is attested")


def test_only_a_leftovers_claimed_empty_directory_is_passed_over(tmp_path):
    archive = tmp_path / "archive"
    _archive_with_leftovers(archive)
    out = io.StringIO()
    assert verify_paths([archive], None, out) == 1
    assert out.getvalue().splitlines() == [
        # with no manifest nothing can be called extra: B's stray file goes unnamed, its missing ones do not
        *(f"TAMPERED  {RUN_B}: {problem}" for problem in MISSING_WITHOUT_MANIFEST),
        *(f"TAMPERED  {RUN_C}: {problem}" for problem in MISSING_WITHOUT_MANIFEST),
        _partial_line(RUN_A), _partial_line(RUN_B),
        "4 receipts: 0 verified, 2 partial, 2 tampered",
    ]


def test_a_claimed_directory_that_cannot_be_listed_is_checked_as_a_receipt(tmp_path, monkeypatch):
    archive = tmp_path / "archive"
    _archive_with_leftovers(archive)
    real_iterdir = Path.iterdir

    def refuse_run_a(self: Path) -> Any:
        if self == archive / RUN_A:
            raise PermissionError(13, "Permission denied")
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", refuse_run_a)
    out = io.StringIO()
    assert verify_paths([archive], None, out) == 1
    lines = out.getvalue().splitlines()
    assert [line for line in lines if line.startswith(f"TAMPERED  {RUN_A}: ")] == [
        f"TAMPERED  {RUN_A}: {problem}" for problem in MISSING_WITHOUT_MANIFEST]
    assert lines[-1] == "5 receipts: 0 verified, 2 partial, 3 tampered"


# --------------------------------------------------------------------------- the JSON document


def test_the_document_lists_a_leftover_as_partial_and_incomplete(tmp_path):
    archive = tmp_path / "archive"
    (archive / f"{PARTIAL_PREFIX}{RUN_A}").mkdir(parents=True)
    (archive / RUN_A).mkdir()
    document = verify_document([archive], None, None)
    assert document["receipts"] == [{
        "name": f"{PARTIAL_PREFIX}{RUN_A}", "path": str(archive / f"{PARTIAL_PREFIX}{RUN_A}"), "state": "partial",
        "status": "incomplete", "key_id": None, "files": 0, "problems": []}]
    assert (document["status"], document["exit_code"], document["message"]) == ("passed", 0, None)


def test_the_document_of_a_verified_archive_passes_and_names_its_trust_file(intact):
    trust_path = default_trust_path()
    document = verify_document([intact.parent], operator_trust(), trust_path)
    assert (document["schema"], document["status"], document["exit_code"]) == (VERIFY_JSON_SCHEMA, "passed", 0)
    assert document["message"] is None
    assert document["trust"] == str(trust_path)
    assert [(entry["name"], entry["state"], entry["status"]) for entry in document["receipts"]] == [
        (intact.name, "verified", "passed")]


@pytest.mark.parametrize("trust_given", [False, True])
def test_the_document_names_a_trust_file_only_when_one_was_read_and_its_path_is_known(intact, trust_given):
    trust = operator_trust() if trust_given else None
    trust_path = None if trust_given else default_trust_path()
    assert verify_document([intact], trust, trust_path)["trust"] is None


def test_the_document_of_nothing_found_fails_with_the_none_found_message(tmp_path):
    (tmp_path / "empty").mkdir()
    document = verify_document([tmp_path / "empty"], None, None)
    assert (document["status"], document["exit_code"], document["receipts"]) == ("failed", 1, [])
    assert document["message"] == f"receipts verify: no receipts under {tmp_path / 'empty'}"


def test_json_output_is_ascii_indented_by_two_and_names_the_trust_file_given(tmp_path, capsys):
    archive = tmp_path / "archivé"
    receipt = write_receipt(archive)
    trust_path = default_trust_path()
    assert verify_cli(["--json", "--trust", str(trust_path), str(archive)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith('{\n  "schema": "trust-ladder.cli-receipts-verify.v1",\n  "status": "passed",\n')
    assert "é" not in captured.out and '"path": "' + str(receipt).replace("é", "\\u00e9") + '"' in captured.out
    document = json.loads(captured.out)
    assert document["trust"] == str(trust_path)
    assert document["receipts"][0]["path"] == str(receipt)
