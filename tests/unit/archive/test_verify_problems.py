"""What ``verify_receipt`` / ``check_receipt`` say about one broken receipt, problem by problem: the
exact lines, that the walk goes on past each problem (every missing, resized or unreadable file is
named, not only the first), and that a receipt's files are counted only when its manifest is usable.
Each case breaks one thing in a copy of a freshly written receipt."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qualify.archive import verify as verify_module
from qualify.archive.attestation import ENVELOPE
from qualify.archive.keys import default_trust_path
from qualify.archive.layout import (
    HOST,
    HOST_SCHEMA,
    LEGACY_MANIFEST_SCHEMA,
    LEGACY_MANIFEST_SCHEMA_PATH,
    MANIFEST,
    MANIFEST_SCHEMA,
    MANIFEST_SCHEMA_PATH,
    PARTIAL_PREFIX,
    SUMMARY,
    json_bytes,
)
from qualify.archive.verify import (
    VERIFY_JSON_SCHEMA,
    check_receipt,
    manifest_schema_path,
    verify_document,
    verify_paths,
    verify_receipt,
)
from qualify.core.digests import document_sha256, jcs_bytes
from qualify.core.errors import Refused
from qualify.interfaces.verify_command import verify_cli
from tests.support.receipt_forgery import (
    check,
    fail_scandir,
    make_writable,
    operator_trust,
    regular_files,
    rehash_manifest,
    sha256_of,
    write_receipt,
)
from tests.unit.archive.test_receipts import committed_receipts
from tests.unit.archive.test_signed_receipts import edit_json

OTHER_RUN = "20260101T000000Z-bbbbbbbbbbbbbbbb"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One signed receipt, written once for the module; each test breaks its own copy."""
    return write_receipt(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def receipt(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / pristine.name
    shutil.copytree(pristine, copy)
    make_writable(copy)
    return copy


def problems_of(receipt: Path) -> list[str]:
    """verify_receipt's problems without the ``<run id>: `` each carries."""
    prefix = f"{receipt.name}: "
    problems = verify_receipt(receipt)
    assert all(problem.startswith(prefix) for problem in problems), problems
    return [problem.removeprefix(prefix) for problem in problems]


def listed(receipt: Path) -> list[str]:
    return [entry["path"] for entry in json.loads((receipt / MANIFEST).read_bytes())["files"]]


def write_manifest(receipt: Path, paths: list[str]) -> None:
    """A v2 manifest listing ``paths`` in the order given, each with its true digest and size."""
    entries = [{"path": name, "sha256": sha256_of(receipt / name), "bytes": (receipt / name).stat().st_size}
               for name in paths]
    (receipt / MANIFEST).write_bytes(jcs_bytes({"schema": MANIFEST_SCHEMA, "run_id": receipt.name, "files": entries}))


# --------------------------------------------------------------------------- the manifest


def test_a_receipt_under_another_run_id_names_the_manifests_run_id(receipt):
    moved = receipt.rename(receipt.parent / OTHER_RUN)
    assert problems_of(moved) == [f"manifest run_id {receipt.name!r} does not match the directory name"]


@pytest.mark.parametrize("own_file", [MANIFEST, ENVELOPE])
def test_a_manifest_listing_its_own_file_or_the_envelope_lists_an_invalid_path(receipt, own_file):
    write_manifest(receipt, sorted([*regular_files(receipt), own_file]))
    assert problems_of(receipt) == [f"manifest lists an invalid path {own_file!r}"]


def test_a_manifest_out_of_path_order_is_named_so(receipt):
    paths = regular_files(receipt)
    write_manifest(receipt, [paths[-1], *paths[:-1]])
    assert problems_of(receipt) == ["manifest files are not sorted by path"]


def test_every_missing_file_is_named_not_only_the_first(receipt):
    for name in ("samples/sample-1.json", "samples/sample-3.json"):
        (receipt / name).unlink()
    assert problems_of(receipt) == ["missing file samples/sample-1.json", "missing file samples/sample-3.json"]


def test_every_resized_file_is_named_with_both_sizes(receipt):
    sizes = {}
    for name in ("command.log", "versions.json"):
        sizes[name] = (receipt / name).stat().st_size
        with open(receipt / name, "ab") as handle:
            handle.write(b"\n")
    assert problems_of(receipt) == [f"altered file {name}: {size + 1} bytes, manifest says {size}"
                                    for name, size in sizes.items()]


def test_a_listed_file_that_cannot_be_opened_is_named_and_the_rest_still_checked(receipt, monkeypatch):
    size = (receipt / "versions.json").stat().st_size
    with open(receipt / "versions.json", "ab") as handle:
        handle.write(b" ")
    real_open = verify_module.open_regular_file

    def swapped_away(path: Any, where: str) -> tuple[int, int]:
        if Path(path).name == "command.log":
            raise Refused(f"{where}: cannot open (Permission denied), expected a regular file")
        return real_open(path, where)

    monkeypatch.setattr(verify_module, "open_regular_file", swapped_away)
    assert problems_of(receipt) == [
        "altered file command.log: cannot open (Permission denied), expected a regular file",
        f"altered file versions.json: {size + 1} bytes, manifest says {size}",
    ]


def test_a_legacy_manifest_beside_an_envelope_names_the_envelope_extra(tmp_path):
    legacy = committed_receipts()[0][0]
    copy = tmp_path / legacy.name
    shutil.copytree(legacy, copy)
    make_writable(copy)
    (copy / ENVELOPE).write_bytes(b"{}")
    assert problems_of(copy) == [f"extra file {ENVELOPE} beside a {LEGACY_MANIFEST_SCHEMA} manifest"]


# --------------------------------------------------------------------------- what check_receipt returns


def test_files_are_counted_only_through_a_usable_manifest(receipt):
    assert check_receipt(receipt) == ([], len(listed(receipt)) + 1)
    (receipt / MANIFEST).unlink()
    problems, count = check_receipt(receipt)
    assert count == 0 and problems[0] == (f"{receipt.name}: missing file {MANIFEST} "
                                          "(incomplete receipt: a run in progress or interrupted)")


def test_a_file_or_a_missing_path_is_not_a_receipt_directory_and_counts_nothing(tmp_path):
    file = tmp_path / OTHER_RUN
    file.write_text("x")
    missing = tmp_path / "gone"
    assert check_receipt(file) == ([f"{file}: not a receipt directory"], 0)
    assert check_receipt(missing) == ([f"{missing}: not a receipt directory"], 0)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails")


@pytest.mark.parametrize("error", [RuntimeError("walk failed"), MemoryError(), Unprintable("hidden"),
                                   ValueError("no digest\tin\nthree lines")], ids=["runtime", "memory", "unprintable",
                                                                                  "three-lines"])
def test_a_surprise_while_checking_is_the_receipts_one_problem_in_one_line_and_counts_nothing(receipt, monkeypatch,
                                                                                            error):
    # the environment fails in a way the walk does not expect (no OSError): an out-of-memory, say
    fail_scandir(monkeypatch, receipt, error)
    problems, count = check_receipt(receipt)
    assert count == 0 and len(problems) == 1
    assert problems[0].startswith(f"{receipt.name}: cannot check: {type(error).__name__}") and "\n" not in problems[0]


# --------------------------------------------------------------------------- the walk


@pytest.mark.parametrize(("error", "why"), [(PermissionError(13, "Permission denied"), "Permission denied"),
                                            (PermissionError(), "PermissionError")])
def test_an_unreadable_directory_is_named_and_the_walk_goes_on(receipt, monkeypatch, error, why):
    # "aaa" is pushed before "samples" and so walked after it: its file is still found
    (receipt / "aaa").mkdir()
    (receipt / "aaa" / "x").write_text("x")
    samples = [name for name in listed(receipt) if name.startswith("samples/")]
    fail_scandir(monkeypatch, receipt / "samples", error)
    assert problems_of(receipt) == [f"cannot read directory samples ({why})",
                                    *(f"missing file {name}" for name in samples),
                                    "extra file aaa/x", "extra directory aaa"]


def test_an_unreadable_receipt_directory_is_named_as_dot(receipt, monkeypatch):
    fail_scandir(monkeypatch, receipt, PermissionError(13, "Permission denied"))
    problems = problems_of(receipt)
    assert problems[0] == "cannot read directory . (Permission denied)"
    assert problems[1:] == [f"missing file {name}" for name in sorted(listed(receipt))]


class _Entry:
    """A directory entry whose ``stat`` fails when ``fails``."""

    def __init__(self, entry: os.DirEntry[str], error: OSError | None) -> None:
        self.name, self.path, self._entry, self._error = entry.name, entry.path, entry, error

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        if self._error is not None:
            raise self._error
        return self._entry.stat(follow_symlinks=follow_symlinks)


@pytest.mark.parametrize(("error", "why"), [(PermissionError(13, "Permission denied"), "Permission denied"),
                                            (PermissionError(), "PermissionError")])
def test_an_entry_that_cannot_be_statted_is_named_and_its_siblings_still_walked(receipt, monkeypatch, error, why):
    real_scandir = os.scandir

    @contextlib.contextmanager
    def scandir(path: Any) -> Iterator[list[_Entry]]:
        with real_scandir(path) as listing:
            yield [_Entry(entry, error if entry.name == HOST else None) for entry in listing]

    monkeypatch.setattr(os, "scandir", scandir)
    assert problems_of(receipt) == [f"cannot read {HOST} ({why})", f"missing file {HOST}"]


# --------------------------------------------------------------------------- the files' agreement


def test_an_unparsable_summary_is_its_one_problem(receipt):
    (receipt / SUMMARY).write_bytes(b"not json")
    rehash_manifest(receipt)
    problems = problems_of(receipt)
    assert len(problems) == 1 and problems[0].startswith(f"{SUMMARY}: "), problems


def test_a_summary_naming_no_identity_names_its_status_and_each_identity_file(receipt):
    edit_json(receipt / SUMMARY, lambda summary: summary.update(identity_sha256=None, status="passed"))
    rehash_manifest(receipt)
    assert problems_of(receipt) == [
        f'{SUMMARY} names no identity, status "passed"; only a run refused before its identity loaded has none',
        f"{SUMMARY} names no identity, the receipt holds identity.json",
        f"{SUMMARY} names no identity, the receipt holds identity.sha256",
    ]


def test_a_summary_naming_another_run_names_it(receipt):
    edit_json(receipt / SUMMARY, lambda summary: summary.update(run_id=OTHER_RUN))
    rehash_manifest(receipt)
    assert problems_of(receipt) == [f'{SUMMARY} names run "{OTHER_RUN}"']


def test_a_sample_file_not_named_as_a_sample_is_named_so(receipt):
    shutil.copy(receipt / "samples" / "sample-1.json", receipt / "samples" / "extra.json")
    rehash_manifest(receipt)
    assert problems_of(receipt) == ["samples/ holds a file not named sample-<n>.json"]


def test_a_summary_counting_other_than_the_samples_held_names_both_counts(receipt):
    edit_json(receipt / SUMMARY, lambda summary: summary.update(samples=2))
    rehash_manifest(receipt)
    assert problems_of(receipt) == [f"{SUMMARY} counts 2 samples, the receipt holds 3"]


def test_an_identity_digest_file_of_undecodable_bytes_is_no_digest_never_a_crash(receipt):
    (receipt / "identity.sha256").write_bytes(b"\xff" * 64 + b"\n")
    rehash_manifest(receipt)
    assert problems_of(receipt) == [
        "identity.sha256 does not hold a SHA-256 hex digest",
        "identity.sha256 is not the canonical digest of identity.json",
        f"{SUMMARY} names another identity digest",
    ]


def test_an_identity_of_no_hashed_schema_is_named_with_what_its_digest_refused(receipt):
    (receipt / "identity.json").write_bytes(json_bytes({"schema": "unknown"}))
    rehash_manifest(receipt)
    with pytest.raises(ValueError) as refused:
        document_sha256({"schema": "unknown"})
    assert str(refused.value).startswith("document digest: found schema 'unknown'")
    assert problems_of(receipt) == [f"identity.json: {refused.value}"]


GOOD_START = {"facts": {}, "note": None}


@pytest.mark.parametrize(("host", "problem"), [
    ([], f"{HOST} is not a {HOST_SCHEMA} document"),
    ({"schema": HOST_SCHEMA, "consumer": {}, "producers": [], "extra": 1}, f"{HOST} is not a {HOST_SCHEMA} document"),
    ({"schema": "other", "consumer": {}, "producers": []}, f"{HOST} is not a {HOST_SCHEMA} document"),
    ({"schema": HOST_SCHEMA, "consumer": None, "producers": []}, f"{HOST} has no consumer facts"),
    ({"schema": HOST_SCHEMA, "consumer": {}, "producers": {}}, f"{HOST} producers is not a list"),
    *(({"schema": HOST_SCHEMA, "consumer": {}, "producers": [GOOD_START, start]},
       f"{HOST} producers[1] must hold facts, or a note saying why they are missing")
      for start in (["facts", "note"], {"facts": {}}, {**GOOD_START, "extra": 1}, {"facts": 1, "note": 5},
                    {"facts": None, "note": None}, {"facts": {}, "note": "both"})),
])
def test_a_host_document_out_of_its_form_is_named(receipt, host, problem):
    (receipt / HOST).write_bytes(json_bytes(host))
    rehash_manifest(receipt)
    assert problems_of(receipt) == [problem]


def test_a_host_document_with_facts_or_a_note_per_start_passes(receipt):
    host = {"schema": HOST_SCHEMA, "consumer": {}, "producers": [GOOD_START, {"facts": None, "note": "no reply"}]}
    (receipt / HOST).write_bytes(json_bytes(host))
    rehash_manifest(receipt)
    assert problems_of(receipt) == []


# --------------------------------------------------------------------------- the command's paths


def test_every_path_is_checked_listable_before_any_receipt_is_reported(pristine, tmp_path, monkeypatch, capsys):
    unlistable = tmp_path / "unlistable"
    unlistable.mkdir()
    real_listdir = os.listdir

    def listdir(path: Any = ".") -> list[str]:
        if path is not None and Path(path) == unlistable:
            raise PermissionError(13, "Permission denied")
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    assert verify_cli([str(pristine.parent), str(unlistable)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"receipts verify: {unlistable}: cannot list (Permission denied)\n")


def test_a_path_too_long_to_look_up_is_refused_naming_it(tmp_path, capsys):
    too_long = tmp_path / ("a" * 300)  # one name over NAME_MAX: the lookup itself fails
    assert verify_cli([str(too_long)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"receipts verify: {too_long}: cannot list (File name too long)\n")



# --------------------------------------------------------------------------- receipts verify: exit codes, streams, counts
# (the lines themselves are held in tests/golden/archive.verify.txt)

RUN_A = "20260101T000000Z-aaaaaaaaaaaaaaaa"
RUN_B = "20260101T000000Z-bbbbbbbbbbbbbbbb"
RUN_C = "20260101T000000Z-cccccccccccccccc"


def walk(paths: list[Path], capsys: pytest.CaptureFixture[str], trust: Any = None) -> tuple[int, list[str], str, str]:
    """``verify_paths`` with a stream of its own: exit code, the stream's lines, stdout and stderr."""
    stream = io.StringIO()
    code = verify_paths(paths, trust, stream)
    captured = capsys.readouterr()
    return code, stream.getvalue().splitlines(), captured.out, captured.err


def test_help_exits_0_on_stdout_alone(capsys):
    assert verify_cli(["--help"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("usage: qualify receipts verify")


@pytest.mark.parametrize("argv", [[""], ["--trust", "", "archive"], ["--bogus"]], ids=["empty-path", "empty-trust",
                                                                                       "unknown-option"])
def test_a_usage_error_exits_2_with_one_line_on_stderr_and_nothing_on_stdout(argv, capsys):
    assert verify_cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("qualify receipts verify: error: ")


def test_a_path_that_cannot_be_listed_mid_walk_exits_2_writing_nothing_to_the_stream(tmp_path, monkeypatch, capsys):
    assert walk([tmp_path / "gone"], capsys)[:3] == (2, [], "")
    archive = tmp_path / "archive"
    archive.mkdir()
    real_iterdir = Path.iterdir

    def refuse_the_archive(self: Path) -> Any:
        if self == archive:
            raise PermissionError()
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", refuse_the_archive)
    code, lines, out, err = walk([archive], capsys)
    assert (code, lines, out) == (2, [], "") and err.count("\n") == 1


def test_no_receipts_under_any_path_exits_1_with_one_line_on_the_given_stream(tmp_path, capsys):
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    code, lines, out, err = walk([tmp_path / "first", tmp_path / "second"], capsys)
    assert (code, len(lines), out, err) == (1, 1, "", "")


def test_an_unsigned_or_an_untrusted_receipt_fails_the_walk_and_only_the_stream_is_written(pristine, capsys):
    legacy = committed_receipts()[0][0]
    code, lines, out, err = walk([legacy, pristine], capsys)
    assert (code, len(lines), out, err) == (1, 3, "", "")  # one line each, and the tally


def test_a_legacy_receipt_with_an_altered_file_is_tampered_not_unsigned(tmp_path):
    legacy = committed_receipts()[0][0]
    copy = tmp_path / "archive" / legacy.name
    shutil.copytree(legacy, copy)
    make_writable(copy)
    with open(copy / "command.log", "a", encoding="utf-8") as log:
        log.write("appended\n")
    checked = check(copy)
    assert checked.state == "tampered" and len(checked.problems) == 1


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
def test_a_summary_records_its_status_from_status_or_from_passed_and_error(receipt, summary, status):
    (receipt / SUMMARY).write_text(json.dumps(summary))
    assert check(receipt).status == status


def test_a_manifest_is_checked_against_its_own_versions_schema():
    assert manifest_schema_path({"schema": LEGACY_MANIFEST_SCHEMA}) == LEGACY_MANIFEST_SCHEMA_PATH
    assert manifest_schema_path({"schema": MANIFEST_SCHEMA}) == MANIFEST_SCHEMA_PATH
    assert manifest_schema_path({"schema": 1}) == MANIFEST_SCHEMA_PATH
    assert manifest_schema_path([LEGACY_MANIFEST_SCHEMA]) == MANIFEST_SCHEMA_PATH


def archive_with_leftovers(archive: Path) -> None:
    """Two runs killed before they finalized, A's claimed directory still empty, B's not; and C,
    an empty directory nobody claimed."""
    for run in (RUN_A, RUN_B):
        (archive / f"{PARTIAL_PREFIX}{run}").mkdir(parents=True)
        (archive / f"{PARTIAL_PREFIX}{run}" / "command.log").write_text("started\n")
    (archive / RUN_A).mkdir()
    (archive / RUN_B).mkdir()
    (archive / RUN_B / "stray.txt").write_text("x")
    (archive / RUN_C).mkdir()


def tally_of(document: dict[str, Any]) -> tuple[int, ...]:
    tally = document["tally"]
    return tally["receipts"], tally["verified"], tally["partial"], tally["tampered"]


def test_only_a_leftovers_claimed_empty_directory_is_passed_over(tmp_path, capsys):
    archive = tmp_path / "archive"
    archive_with_leftovers(archive)
    document = verify_document([archive], None, None)
    assert tally_of(document) == (4, 0, 2, 2) and document["exit_code"] == 1
    assert [(entry["name"], entry["state"]) for entry in document["receipts"]] == [
        (RUN_B, "tampered"), (RUN_C, "tampered"), (f"{PARTIAL_PREFIX}{RUN_A}", "partial"),
        (f"{PARTIAL_PREFIX}{RUN_B}", "partial")]
    assert walk([archive], capsys)[0] == 1


def test_a_claimed_directory_that_cannot_be_listed_is_checked_as_a_receipt(tmp_path, monkeypatch):
    archive = tmp_path / "archive"
    archive_with_leftovers(archive)
    real_iterdir = Path.iterdir

    def refuse_run_a(self: Path) -> Any:
        if self == archive / RUN_A:
            raise PermissionError(13, "Permission denied")
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", refuse_run_a)
    document = verify_document([archive], None, None)
    assert tally_of(document) == (5, 0, 2, 3)
    assert (RUN_A, "tampered") in [(entry["name"], entry["state"]) for entry in document["receipts"]]


def test_links_and_hidden_entries_of_an_archive_are_reported_and_fail_it(pristine, tmp_path, capsys):
    """A tampered copy hidden beside a genuine receipt, and links to receipts (the genuine one
    under a failing run's name, one elsewhere, a dangling one), are never skipped unsaid nor
    followed: each is listed, not verified, and the archive fails, as does a link given as the path."""
    archive = tmp_path / "archive"
    archive.mkdir()
    genuine = archive / pristine.name
    shutil.copytree(pristine, genuine)
    hidden = archive / f".{pristine.name}"
    shutil.copytree(pristine, hidden)
    make_writable(hidden)
    (hidden / "command.log").write_text("edited")
    (archive / OTHER_RUN).symlink_to(genuine, target_is_directory=True)
    (archive / "20260101T000000Z-cccccccccccccccc").symlink_to(tmp_path / "gone")
    (archive / ".notes").write_text("a hidden file")
    document = verify_document([archive], None, None)
    found = {entry["name"]: (entry["state"], entry["problems"]) for entry in document["receipts"]}
    assert found.pop(pristine.name)[0] in {"verified", "untrusted"}
    link, hidden = ("tampered", [verify_module.STRAY_LINK]), ("tampered", [verify_module.STRAY_HIDDEN])
    assert found == {f".{pristine.name}": hidden, ".notes": hidden, OTHER_RUN: link,
                     "20260101T000000Z-cccccccccccccccc": link}
    assert document["exit_code"] == 1 and walk([archive], capsys)[0] == 1
    linked = verify_document([archive / OTHER_RUN, genuine], None, None)  # the paths after a link still checked
    assert [entry["name"] for entry in linked["receipts"]] == [OTHER_RUN, pristine.name]
    assert linked["receipts"][0]["state"] == "tampered" and linked["exit_code"] == 1


def test_the_document_lists_a_leftover_as_partial_and_incomplete_and_passes(tmp_path):
    archive = tmp_path / "archive"
    (archive / f"{PARTIAL_PREFIX}{RUN_A}").mkdir(parents=True)
    (archive / RUN_A).mkdir()
    document = verify_document([archive], None, None)
    assert [(entry["state"], entry["status"], entry["files"], entry["problems"]) for entry in document["receipts"]] == [
        ("partial", "incomplete", 0, [])]
    assert (document["status"], document["exit_code"], document["message"]) == ("passed", 0, None)


def test_the_document_of_a_verified_archive_passes_and_names_its_trust_file(pristine):
    trust_path = default_trust_path()
    document = verify_document([pristine.parent], operator_trust(), trust_path)
    assert (document["schema"], document["status"], document["exit_code"], document["message"]) == (
        VERIFY_JSON_SCHEMA, "passed", 0, None)
    assert document["trust"] == str(trust_path)
    assert [(entry["name"], entry["state"], entry["status"]) for entry in document["receipts"]] == [
        (pristine.name, "verified", "passed")]


@pytest.mark.parametrize("trust_given", [False, True])
def test_the_document_names_a_trust_file_only_when_one_was_read_and_its_path_is_known(pristine, trust_given):
    trust = operator_trust() if trust_given else None
    trust_path = None if trust_given else default_trust_path()
    assert verify_document([pristine], trust, trust_path)["trust"] is None


def test_the_document_of_nothing_found_fails_with_a_message(tmp_path):
    (tmp_path / "empty").mkdir()
    document = verify_document([tmp_path / "empty"], None, None)
    assert (document["status"], document["exit_code"], document["receipts"]) == ("failed", 1, [])
    assert document["message"] is not None


def test_json_output_is_ascii_and_names_the_trust_file_given(tmp_path, capsys):
    archive = tmp_path / "archivé"
    receipt = write_receipt(archive)
    trust_path = default_trust_path()
    assert verify_cli(["--json", "--trust", str(trust_path), str(archive)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.isascii()
    document = json.loads(captured.out)
    assert document["trust"] == str(trust_path) and document["receipts"][0]["path"] == str(receipt)
