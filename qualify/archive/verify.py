"""Verifying receipts: re-hash every file against the manifest, check the digest files agree, and
report incomplete (``.partial-``) receipts; ``qualify receipts verify`` (:func:`verify_cli`).

A receipt is untrusted input: every JSON file is read bounded in size and nesting, every file is
opened without following links or blocking, and anything unexpected while checking one receipt
becomes a problem line for that receipt, so one hostile receipt never hides the others.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path
from typing import Any, TextIO

from qualify.archive.layout import (
    HOST,
    HOST_SCHEMA,
    MANIFEST,
    MANIFEST_SCHEMA_PATH,
    PARTIAL_PREFIX,
    REQUIRED_FILES,
    RUN_ID,
    SAMPLE_PATH,
    SUMMARY,
    default_archive_dir,
    is_safe_relative,
    json_bytes,
)
from qualify.core.digests import canonical_sha256, is_sha256_hex
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import check_schema, parse_untrusted_json, render, schema_validator

RECEIPT_JSON_MAX_BYTES = 16 << 20
"""Largest receipt JSON file parsed (manifest, identity, summary, host, sample); real ones are
kilobytes, a calibration's host.json with a producer start per handoff some hundreds."""

_DIGEST_FILE_MAX_BYTES = 1 << 10
"""identity.sha256 holds 64 hex digits and a newline."""

_DETAIL_LIMIT = 160
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
"""Never follow a link planted in a receipt; never block opening a FIFO put where a file was."""


# --------------------------------------------------------------------------- bounded reading


def shown(text: str) -> str:
    """``text`` as printed on one line: as is when printable, else escaped, so a file name with a
    newline or undecodable bytes neither splits a report line nor fails to print."""
    return text if text.isprintable() else ascii(text)


def _open_regular(path: Path, where: str) -> tuple[int, int]:
    """A read-only descriptor of a regular file and its size, or :class:`Refused` naming why."""
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise Refused(f"{where}: no such file") from None
    except OSError as exc:
        raise Refused(f"{where}: cannot open ({exc.strerror or type(exc).__name__}), "
                      f"expected a regular file") from None
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise Refused(f"{where}: not a regular file, expected one")
    return descriptor, info.st_size


def read_bounded(path: Path, limit: int, where: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, or :class:`Refused` (one line
    starting ``where:``); the size is checked before reading and the read is capped."""
    descriptor, size = _open_regular(path, where)
    with os.fdopen(descriptor, "rb") as handle:
        if size > limit:
            raise Refused(f"{where}: {size} bytes, expected at most {limit}")
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise Refused(f"{where}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > limit:
        raise Refused(f"{where}: grew past {limit} bytes while reading")
    return data


def load_receipt_json(path: Path, where: str, max_bytes: int = RECEIPT_JSON_MAX_BYTES) -> Any:
    """A receipt's JSON file, bounded and parsed strictly (:func:`parse_untrusted_json`), or
    :class:`Refused` with one line starting ``where:``."""
    return parse_untrusted_json(read_bounded(path, max_bytes, where), where, max_bytes=max_bytes)


def _sha256_of(path: Path, expected_bytes: int, where: str) -> tuple[int, str | None]:
    """The file's size and SHA-256 hex digest; the digest is None when the size is not
    ``expected_bytes`` (checked on the open descriptor, so a wrong size is never hashed)."""
    descriptor, size = _open_regular(path, where)
    with os.fdopen(descriptor, "rb") as handle:
        if size != expected_bytes:
            return size, None
        return size, hashlib.file_digest(handle, "sha256").hexdigest()


# --------------------------------------------------------------------------- one receipt


def _read_listed_manifest(directory: Path, problems: list[str]) -> dict[str, Any] | None:
    """The receipt's manifest when it is a regular file, valid against its schema and in its
    canonical byte form; else None, with the problem appended."""
    manifest_path = directory / MANIFEST
    try:
        info = manifest_path.lstat()
    except FileNotFoundError:
        problems.append(f"missing file {MANIFEST} (incomplete receipt: a run in progress or interrupted)")
        return None
    if not stat.S_ISREG(info.st_mode):
        problems.append(f"{MANIFEST} is not a regular file")
        return None
    where = f"altered file {MANIFEST}"
    try:
        schema_validator(MANIFEST_SCHEMA_PATH)
    except Refused as exc:  # the harness's own schema file, not the receipt, is at fault
        problems.append(f"cannot check {MANIFEST}: {exc}")
        return None
    try:
        data = read_bounded(manifest_path, RECEIPT_JSON_MAX_BYTES, where)
        manifest = parse_untrusted_json(data, where, max_bytes=RECEIPT_JSON_MAX_BYTES)
        check_schema(manifest, MANIFEST_SCHEMA_PATH, where)
    except Refused as exc:
        problems.append(str(exc))
        return None
    if json_bytes(manifest) != data:
        problems.append(f"{where}: bytes differ from its canonical rendering")
        return None
    document: dict[str, Any] = manifest
    return document


def _walk(root: Path, problems: list[str]) -> tuple[set[str], set[str]]:
    """Regular files (the manifest aside) and directories under ``root``, as relative POSIX paths.
    Links, special files and unreadable directories become problems. Iterative: a deep tree
    cannot exhaust the stack."""
    files: set[str] = set()
    directories: set[str] = set()
    pending = [root]
    while pending:
        current = pending.pop()
        where = shown(current.relative_to(root).as_posix())
        try:
            with os.scandir(current) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError as exc:
            problems.append(f"cannot read directory {where} ({exc.strerror or type(exc).__name__})")
            continue
        for entry in entries:
            found = Path(entry.path)
            relative = found.relative_to(root).as_posix()
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError as exc:
                problems.append(f"cannot read {shown(relative)} ({exc.strerror or type(exc).__name__})")
                continue
            if stat.S_ISLNK(mode):
                problems.append(f"extra file {shown(relative)}: symbolic link")
            elif stat.S_ISDIR(mode):
                directories.add(relative)
                pending.append(found)
            elif stat.S_ISREG(mode):
                if relative != MANIFEST:
                    files.add(relative)
            else:
                problems.append(f"extra file {shown(relative)}: not a regular file")
    return files, directories


def _listed_files(manifest: dict[str, Any], root: Path, problems: list[str]) -> dict[str, dict[str, Any]]:
    """The manifest's entries by path; invalid, duplicate, unsorted or missing required entries
    and a run id other than the directory's become problems."""
    if manifest["run_id"] != root.name:
        problems.append(f"manifest run_id {manifest['run_id']!r} does not match the directory name")
    listed: dict[str, dict[str, Any]] = {}
    for entry in manifest["files"]:
        path = entry["path"]
        if path == MANIFEST or not is_safe_relative(path):
            problems.append(f"manifest lists an invalid path {path!r}")
        elif path in listed:
            problems.append(f"manifest lists {path} twice")
        else:
            listed[path] = entry
    paths = list(listed)
    if paths != sorted(paths):
        problems.append("manifest files are not sorted by path")
    for name in REQUIRED_FILES:
        if name not in listed:
            problems.append(f"manifest omits required file {name}")
    return listed


def _receipt_problems(root: Path, problems: list[str]) -> int:
    """Append every problem of the receipt at ``root``; returns the number of files its manifest
    covers (itself included), 0 when there is no usable manifest."""
    if not RUN_ID.fullmatch(root.name):
        problems.append(f"directory name {root.name!r} is not a run id")
    manifest = _read_listed_manifest(root, problems)
    actual, directories = _walk(root, problems)
    if manifest is None:
        for name in REQUIRED_FILES:
            if name not in actual:
                problems.append(f"missing file {name}")
        return 0

    listed = _listed_files(manifest, root, problems)
    for path in sorted(listed):
        if path not in actual:
            problems.append(f"missing file {path}")
            continue
        entry = listed[path]
        try:
            size, digest = _sha256_of(root / path, entry["bytes"], f"altered file {path}")
        except Refused as exc:
            problems.append(str(exc))
            continue
        if digest is None:
            problems.append(f"altered file {path}: {size} bytes, manifest says {entry['bytes']}")
        elif digest != entry["sha256"]:
            problems.append(f"altered file {path}: sha256 {digest} differs from the manifest")
    for path in sorted(actual - set(listed)):
        problems.append(f"extra file {shown(path)}")
    needed_dirs = {"samples"} | {Path(p).parent.as_posix() for p in listed if "/" in p}
    for path in sorted(directories - needed_dirs):
        problems.append(f"extra directory {shown(path)}")

    if not problems:
        problems.extend(_consistency_problems(root, sorted(listed)))
    return len(listed) + 1


def _describe(exc: BaseException) -> str:
    """An unexpected exception as one bounded line (its text, if any, may itself be hostile)."""
    try:
        text = one_line(str(exc))
    except Exception:  # a str() that raises still gets its exception named
        text = ""
    text = shown(text)[:_DETAIL_LIMIT]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_receipt(directory: str | os.PathLike[str]) -> tuple[list[str], int]:
    """Problems of one receipt (each ``<run id>: <problem>``; none when intact) and the number of
    files its manifest covers. Never raises: anything unexpected while checking becomes the
    problem ``<run id>: cannot check: <what>``, kept with those found before it."""
    root = Path(directory)
    label = shown(root.name)
    problems: list[str] = []
    count = 0
    try:
        if not stat.S_ISDIR(root.lstat().st_mode):
            return [f"{shown(str(root))}: not a receipt directory"], 0
        count = _receipt_problems(root, problems)
    except FileNotFoundError:
        return [f"{shown(str(root))}: not a receipt directory"], 0
    except Exception as exc:  # one receipt's surprise must not stop the archive walk
        problems.append(f"cannot check: {_describe(exc)}")
    return [f"{label}: {problem}" for problem in problems], count


def verify_receipt(directory: str | os.PathLike[str]) -> list[str]:
    """Re-hash a receipt against its manifest; every altered, missing or extra file (and any
    inconsistency between digest files) is one problem line. An empty list means intact."""
    problems, _count = check_receipt(directory)
    return problems


def _consistency_problems(root: Path, listed: list[str]) -> list[str]:
    """Digest files must agree: identity.sha256 is identity.json's canonical digest, and the
    summary names this run, this identity and as many samples as the manifest lists."""
    problems = []
    try:
        raw_digest = read_bounded(root / "identity.sha256", _DIGEST_FILE_MAX_BYTES, "identity.sha256")
        identity_digest = raw_digest.decode("utf-8", errors="replace").strip()
    except Refused as exc:
        problems.append(str(exc))
        identity_digest = ""
    if not is_sha256_hex(identity_digest):
        problems.append("identity.sha256 does not hold a SHA-256 hex digest")
    try:
        if canonical_sha256(load_receipt_json(root / "identity.json", "identity.json")) != identity_digest:
            problems.append("identity.sha256 is not the canonical digest of identity.json")
    except Refused as exc:
        problems.append(str(exc))
    try:
        summary = load_receipt_json(root / SUMMARY, SUMMARY)
    except Refused as exc:
        return [*problems, str(exc)]
    if not isinstance(summary, dict):
        return [*problems, f"{SUMMARY} is not a JSON object"]
    if summary.get("run_id") != root.name:
        problems.append(f"{SUMMARY} names run {render(summary.get('run_id'))}")
    if summary.get("identity_sha256") != identity_digest:
        problems.append(f"{SUMMARY} names another identity digest")
    if not isinstance(summary.get("passed"), bool):
        problems.append(f"{SUMMARY} has no passed flag")
    if HOST in listed:  # receipts from before host.json have none
        problems.extend(_host_problems(root))
    samples = [path for path in listed if path.startswith("samples/")]
    counted = summary.get("samples")
    if any(not SAMPLE_PATH.fullmatch(p) for p in samples):
        problems.append("samples/ holds a file not named sample-<n>.json")
    elif type(counted) is not int or counted != len(samples):  # true and 3.0 are no count
        problems.append(f"{SUMMARY} counts {render(counted)} samples, the receipt holds {len(samples)}")
    return problems


def _host_problems(root: Path) -> list[str]:
    """host.json, when present, names both sides: a consumer's facts, and per producer start its
    facts or why they are missing."""
    try:
        host = load_receipt_json(root / HOST, HOST)
    except Refused as exc:
        return [str(exc)]
    if not isinstance(host, dict) or host.get("schema") != HOST_SCHEMA \
            or set(host) != {"schema", "consumer", "producers"}:
        return [f"{HOST} is not a {HOST_SCHEMA} document"]
    if not isinstance(host["consumer"], dict):
        return [f"{HOST} has no consumer facts"]
    if not isinstance(host["producers"], list):
        return [f"{HOST} producers is not a list"]
    for index, start in enumerate(host["producers"]):
        if not isinstance(start, dict) or set(start) != {"facts", "note"} \
                or not isinstance(start["facts"], dict | None) \
                or (start["facts"] is None) != isinstance(start["note"], str):
            return [f"{HOST} producers[{index}] must hold facts, or a note saying why they are missing"]
    return []


# --------------------------------------------------------------------------- the command


def _archive_contents(target: Path) -> tuple[list[Path], list[Path]]:
    """The receipts to check under ``target`` (itself when it is one) and the ``.partial-``
    leftovers of interrupted runs."""
    if os.path.lexists(target / MANIFEST) or target.name.startswith(PARTIAL_PREFIX):
        return [target], []
    children = sorted(p for p in target.iterdir() if stat.S_ISDIR(p.lstat().st_mode))
    partial = [p for p in children if p.name.startswith(PARTIAL_PREFIX)]
    receipts = [p for p in children if not p.name.startswith(".")]
    return receipts, partial


def verify_cli(path: str | os.PathLike[str] | None = None, out: TextIO | None = None) -> int:
    """``qualify receipts verify [PATH]``: PATH is one receipt or an archive of many (default:
    the archive location). Prints one line per receipt; exit 0 when every receipt is intact,
    1 when any is not (or none is found), 2 when PATH does not exist or cannot be listed."""
    stream = out or sys.stdout
    errors = sys.stderr if out is None else stream
    target = Path(path).expanduser() if path else default_archive_dir()
    try:
        if not target.is_dir():
            print(f"receipts verify: {shown(str(target))}: no such directory", file=errors)
            return 2
        receipts, partial = _archive_contents(target)
    except OSError as exc:
        print(f"receipts verify: {shown(str(target))}: cannot list ({exc.strerror or type(exc).__name__})",
              file=errors)
        return 2
    failing = 0
    for receipt in receipts:
        problems, file_count = check_receipt(receipt)
        if problems:
            failing += 1
            for problem in problems:
                print(f"FAIL {problem}", file=stream)
        else:
            print(f"ok   {receipt.name}: {file_count} files match the manifest", file=stream)
    for leftover in partial:
        failing += 1
        print(f"FAIL {shown(leftover.name)}: partial receipt left by an interrupted run", file=stream)
    if not receipts and not partial:
        print(f"receipts verify: no receipts under {shown(str(target))}", file=stream)
        return 1
    total = len(receipts) + len(partial)
    if failing:
        print(f"{failing} of {total} receipts failed verification", file=stream)
        return 1
    print(f"{total} receipts verified: every file matches its manifest", file=stream)
    return 0
