"""Hostile receipts: ``receipts verify`` names every problem in one line, exits 1 (never 2, never
a traceback), and one bad receipt in an archive never stops the healthy ones being checked. A
forger who re-hashes the manifest (in its RFC 8785 form) is caught by the cross-checks between
files and by the signed statement; one who also re-signs is untrusted."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qualify.archive import verify as verify_module
from qualify.archive.keys import load_signing_key
from qualify.archive.layout import MANIFEST
from qualify.archive.reader import read_receipt_json, receipt_files
from qualify.archive.verify import RECEIPT_JSON_MAX_BYTES, verify_receipt
from qualify.core.digests import jcs_bytes
from qualify.core.errors import Refused
from qualify.interfaces.cli import main
from qualify.interfaces.verify_command import verify_cli
from tests.support.receipt_forgery import (
    check,
    fail_scandir,
    forger_key,
    make_writable,
    rehash_manifest,
    resign,
    writable_receipt,
    write_receipt,
)

DEEP = 100_000
"""Nesting far past both the parser's recursion limit and the strict reader's 32 levels."""


@pytest.fixture
def receipt(tmp_path: Path) -> Path:
    return writable_receipt(tmp_path / "archive")


def manifest_text(receipt: Path) -> str:
    return (receipt / MANIFEST).read_text(encoding="utf-8")


def ok_line(receipt: Path) -> str:
    """The line ``receipts verify`` prints for an intact passing receipt of this session's key."""
    return (f"ok        {receipt.name}: passed; signed by {load_signing_key().key_id[:16]}…, "
            "10 files match the signed statement")


def run_cli(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    """``qualify receipts verify PATH`` in-process: exit code, stdout lines, stderr."""
    code = main(["receipts", "verify", str(path)])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def verify_within(receipt: Path, seconds: float = 60.0) -> list[str]:
    """verify_receipt on a thread, asserting it ends within a generous bound (a FIFO opened for
    reading would block forever)."""
    result: list[list[str]] = []
    worker = threading.Thread(target=lambda: result.append(verify_receipt(receipt)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, f"verify_receipt did not end within {seconds} s"
    return result[0]


def assert_one_line_problems(problems: list[str], receipt: Path) -> None:
    assert problems, "a hostile receipt verified intact"
    for problem in problems:
        assert "\n" not in problem and "\r" not in problem, problem
        assert problem.startswith(f"{receipt.name}: "), problem
        assert "Traceback" not in problem


# --------------------------------------------------------------------------- the manifest


def test_a_deeply_nested_manifest_is_a_named_problem_and_exits_1_not_2(receipt, capsys):
    (receipt / MANIFEST).write_text("[" * DEEP + "]" * DEEP)
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert any("altered file manifest.json: nesting deeper than 32 levels" in p for p in problems), problems
    code, out, err = run_cli(receipt, capsys)
    assert code == 1
    assert any(line.startswith(f"TAMPERED  {receipt.name}: altered file manifest.json: nesting") for line in out), out
    assert "internal error" not in err and "RecursionError" not in err + "".join(out)


def test_an_archive_with_one_deeply_nested_receipt_still_lists_the_healthy_ones(tmp_path, capsys):
    archive = tmp_path / "archive"
    healthy = [write_receipt(archive) for _ in range(3)]
    bad = write_receipt(archive)
    make_writable(bad)
    (bad / MANIFEST).write_text('{"files": ' + "[" * DEEP + "]" * DEEP + "}")
    code, out, err = run_cli(archive, capsys)
    assert code == 1, (out, err)
    for receipt in healthy:
        assert ok_line(receipt) in out, out
    assert any(line.startswith(f"TAMPERED  {bad.name}: altered file manifest.json: nesting") for line in out), out
    assert out[-1] == "4 receipts: 3 verified (3 passed), 1 tampered"
    assert err == ""


@pytest.mark.parametrize(("literal", "found"), [("4.0", "4.0"), ("true", "true"), ('"4"', '"4"')])
def test_a_manifest_integer_written_as_a_float_a_boolean_or_a_string_is_refused(receipt, literal, found):
    manifest = json.loads(manifest_text(receipt))
    manifest["files"][0]["bytes"] = "PLACEHOLDER"
    text = jcs_bytes(manifest).decode().replace('"PLACEHOLDER"', literal)
    (receipt / MANIFEST).write_text(text)
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert f"{receipt.name}: altered file manifest.json: files[0].bytes: found {found}, expected type integer" \
        in problems, problems


@pytest.mark.parametrize("schema", [[], {}, 2, None, True, "trust-ladder.receipt-manifest.v9"])
def test_a_manifest_schema_of_any_json_type_is_a_named_problem_never_cannot_check(receipt, schema):
    # The slow manifest fuzz once found a list here raising TypeError (unhashable) in the lookup of
    # the manifest's form: "cannot check", a caught surprise instead of a named problem.
    manifest = json.loads(manifest_text(receipt))
    manifest["schema"] = schema
    (receipt / MANIFEST).write_bytes(jcs_bytes(manifest))
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert not any("cannot check" in problem for problem in problems), problems
    assert any("altered file manifest.json: schema" in problem for problem in problems), problems


@pytest.mark.parametrize("literal", ["1e400", "-1e400"])
def test_a_manifest_number_overflowing_to_infinity_is_refused(receipt, literal):
    text = manifest_text(receipt)
    first_size = json.loads(text)["files"][0]["bytes"]
    assert f'"bytes":{first_size},' in text  # RFC 8785: no whitespace
    (receipt / MANIFEST).write_text(text.replace(f'"bytes":{first_size},', f'"bytes":{literal},', 1))
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert any("files[0].bytes: found a number that overflows to infinity" in p for p in problems), problems


def test_a_manifest_that_is_not_utf8_is_refused(receipt, capsys):
    data = (receipt / MANIFEST).read_bytes().replace(b'"command.log"', b'"command\xff.log"', 1)
    (receipt / MANIFEST).write_bytes(data)
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert any("altered file manifest.json: not UTF-8 (byte 0xff" in p for p in problems), problems
    assert run_cli(receipt, capsys)[0] == 1


def test_a_manifest_with_a_duplicate_key_is_refused(receipt):
    text = manifest_text(receipt).replace('"schema":', '"run_id": "x",\n  "schema":', 1)
    (receipt / MANIFEST).write_text(text)
    assert any("duplicate key 'run_id'" in p for p in verify_receipt(receipt))


def test_a_huge_manifest_is_refused_by_its_size(receipt):
    with open(receipt / MANIFEST, "r+b") as handle:  # sparse: costs no disk
        handle.truncate(RECEIPT_JSON_MAX_BYTES + 1)
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert any(f"{RECEIPT_JSON_MAX_BYTES + 1} bytes, expected at most {RECEIPT_JSON_MAX_BYTES}" in p
               for p in problems), problems


def test_a_huge_listed_file_is_reported_by_its_size(receipt):
    with open(receipt / "samples" / "sample-2.json", "r+b") as handle:
        handle.truncate(1 << 40)  # a terabyte, sparse: reported by size, never hashed
    problems = verify_within(receipt)
    assert f"{receipt.name}: altered file samples/sample-2.json: {1 << 40} bytes, manifest says" \
        in " ".join(problems), problems


def test_a_manifest_that_is_a_fifo_is_reported_without_blocking(receipt, capsys):
    (receipt / MANIFEST).unlink()
    os.mkfifo(receipt / MANIFEST)
    problems = verify_within(receipt)
    assert f"{receipt.name}: manifest.json is not a regular file" in problems
    assert run_cli(receipt, capsys)[0] == 1


# --------------------------------------------------------------------------- listed files


def _replace_with_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _replace_with_symlink(path: Path) -> None:
    copy = path.parent.parent.parent / f"copy-of-{path.name}"
    copy.write_bytes(path.read_bytes())  # identical bytes: only the link itself is wrong
    path.unlink()
    path.symlink_to(copy)


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(("replace", "expected"), [
    (_replace_with_directory, "extra directory samples/sample-1.json"),
    (_replace_with_symlink, "extra file samples/sample-1.json: symbolic link"),
    (_replace_with_fifo, "extra file samples/sample-1.json: not a regular file"),
], ids=["directory", "symlink", "fifo"])
def test_a_sample_file_that_is_a_directory_a_symlink_or_a_fifo_is_reported(
        receipt, capsys, replace: Callable[[Path], None], expected):
    replace(receipt / "samples" / "sample-1.json")
    problems = verify_within(receipt)
    assert_one_line_problems(problems, receipt)
    assert f"{receipt.name}: {expected}" in problems, problems
    assert f"{receipt.name}: missing file samples/sample-1.json" in problems, problems
    assert run_cli(receipt, capsys)[0] == 1


def test_a_samples_directory_that_is_a_symlink_is_reported(receipt):
    elsewhere = receipt.parent.parent / "elsewhere"
    (receipt / "samples").rename(elsewhere)
    (receipt / "samples").symlink_to(elsewhere, target_is_directory=True)
    problems = verify_receipt(receipt)
    assert f"{receipt.name}: extra file samples: symbolic link" in problems, problems
    assert f"{receipt.name}: missing file samples/sample-1.json" in problems, problems


def test_a_receipt_tree_deeper_than_the_recursion_limit_is_reported_not_crashed(receipt):
    levels = [os.path.join(receipt, *["d"] * depth) for depth in range(1, 1101)]
    for level in levels:  # one level at a time: os.makedirs itself recurses
        os.mkdir(level)
    try:
        problems = verify_receipt(receipt)
        assert f"{receipt.name}: extra directory d" in problems, problems
        assert not any("cannot check" in p for p in problems), problems
    finally:
        for level in reversed(levels):  # shutil.rmtree recurses too
            os.rmdir(level)


# --------------------------------------------------------------------------- consistent forgeries


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("identity.json", "[" * DEEP + "]" * DEEP, "identity.json: nesting deeper than 32 levels"),
    ("identity.json", '{"bound": 1e400}', "identity.json: bound: found a number that overflows"),
    ("validation-summary.json", '{"a":' * 40 + "1" + "}" * 40, "validation-summary.json: nesting deeper"),
    ("host.json", "[" * DEEP + "]" * DEEP, "host.json: nesting deeper than 32 levels"),
    ("host.json", b'{"schema": "\xc0"}', "host.json: not UTF-8 (byte 0xc0"),
    ("identity.sha256", "0" * 4096, "identity.sha256: 4096 bytes, expected at most 1024"),
], ids=["identity-deep", "identity-1e400", "summary-deep", "host-deep", "host-not-utf8", "digest-huge"])
def test_a_consistently_rehashed_hostile_document_is_a_named_problem(receipt, name, content, expected):
    (receipt / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    rehash_manifest(receipt)
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert any(p.startswith(f"{receipt.name}: {expected}") for p in problems), problems
    checked = check(receipt)
    assert checked.state == "tampered"
    assert f"file {name}: sha256 differs from the signed statement's subject" in checked.problems, checked


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("identity.sha256", "0" * 64 + "\n", "identity.sha256 is not the canonical digest of identity.json"),
    ("validation-summary.json", "{}", "validation-summary.json names run null"),
], ids=["identity-digest", "summary-empty"])
def test_a_rehashed_and_re_signed_forgery_is_untrusted_and_still_fails_its_cross_checks(
        receipt, capsys, name, content, expected):
    """The forger re-signs the edited receipt with a key of their own: the signature verifies
    under that key, which the operator's trust file does not list; the cross-checks still fail."""
    (receipt / name).write_text(content)
    rehash_manifest(receipt)
    resign(receipt, forger_key())
    assert f"{receipt.name}: {expected}" in verify_receipt(receipt)
    checked = check(receipt)
    assert checked.state == "tampered" and any("does not list" in p for p in checked.problems), checked
    code, out, err = run_cli(receipt, capsys)
    assert code == 1 and err == "" and out[-1] == "1 receipts: 0 verified, 1 tampered", out


@pytest.mark.parametrize("count", ["true", "3.0", '"3"', "1e400", "null"])
def test_a_summary_sample_count_that_is_not_the_integer_is_refused(receipt, count):
    path = receipt / "validation-summary.json"
    summary = json.loads(path.read_text())
    assert summary["samples"] == 3
    summary["samples"] = "PLACEHOLDER"
    path.write_text(jcs_bytes(summary).decode().replace('"PLACEHOLDER"', count))
    rehash_manifest(receipt)
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert any("samples" in p for p in problems), problems
    assert check(receipt).state == "tampered"


# --------------------------------------------------------------------------- the walk goes on


def test_an_unexpected_error_in_one_receipt_becomes_cannot_check_and_the_walk_goes_on(
        tmp_path, monkeypatch, capsys):
    archive = tmp_path / "archive"
    first, broken, last = (write_receipt(archive) for _ in range(3))
    # the environment fails once while one receipt is walked (out of memory, say): no OSError the walk expects
    fail_scandir(monkeypatch, broken, MemoryError("no memory\nfor this one"), times=1)
    assert verify_receipt(broken) == [f"{broken.name}: cannot check: MemoryError: no memory for this one"]
    fail_scandir(monkeypatch, broken, MemoryError("no memory\nfor this one"), times=1)
    code, out, err = run_cli(archive, capsys)
    assert code == 1 and err == ""
    assert ok_line(first) in out and ok_line(last) in out, out
    assert f"TAMPERED  {broken.name}: cannot check: MemoryError: no memory for this one" in out
    assert out[-1] == "3 receipts: 2 verified (2 passed), 1 tampered"


def test_file_names_with_newlines_or_undecodable_bytes_print_as_one_escaped_line(receipt, capsys):
    (receipt / "bad\nname").write_text("x")
    (receipt / os.fsdecode(b"latin-\xe9")).write_text("x")
    problems = verify_receipt(receipt)
    assert_one_line_problems(problems, receipt)
    assert f"{receipt.name}: extra file 'bad\\nname'" in problems, problems
    assert f"{receipt.name}: extra file 'latin-\\udce9'" in problems, problems
    code, out, err = run_cli(receipt, capsys)  # capsys encodes strictly: a raw surrogate would raise
    assert code == 1 and err == ""


def test_an_archive_that_cannot_be_listed_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "archive").mkdir()

    def refuse(path: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(verify_module.os, "listdir", refuse)  # as root, a mode 000 directory still lists
    assert verify_cli([str(tmp_path / "archive")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "cannot list (Permission denied)" in captured.err


# --------------------------------------------------------------------------- the reader


def test_the_reader_refuses_hostile_json_in_one_line(receipt):
    (receipt / "versions.json").write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(Refused, match=r"versions.json: nesting deeper than 32 levels") as refusal:
        read_receipt_json(receipt, "versions.json")
    assert "\n" not in str(refusal.value)
    with pytest.raises(Refused, match="not a plain path inside the receipt"):
        read_receipt_json(receipt, "../archive/x.json")
    with pytest.raises(Refused, match="no such file"):
        read_receipt_json(receipt, "samples/sample-9.json")


def test_the_reader_refuses_a_manifest_that_breaks_its_schema(receipt):
    manifest = json.loads(manifest_text(receipt))
    del manifest["files"][0]["path"]
    (receipt / MANIFEST).write_bytes(jcs_bytes(manifest))
    with pytest.raises(Refused, match=r"manifest.json: files\[0\].path: missing, expected this field"):
        receipt_files(receipt)
