"""Verifying receipts: re-hash every file against the manifest, check the digest files agree, and
report incomplete (``.partial-``) receipts; what ``qualify receipts verify``
(:mod:`qualify.interfaces.verify_command`) reports.

A receipt is untrusted input: every JSON file is read bounded in size and nesting, every file is
opened without following links or blocking, and anything unexpected while checking one receipt
becomes a problem line for that receipt, so one hostile receipt never hides the others.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from qualify.archive.attestation import ENVELOPE, AttestationProblem, read_attestation
from qualify.archive.keys import TrustFile
from qualify.archive.layout import (
    HOST,
    HOST_SCHEMA,
    IDENTITY_FILES,
    LEGACY_MANIFEST_SCHEMA,
    LEGACY_MANIFEST_SCHEMA_PATH,
    MANIFEST,
    MANIFEST_SCHEMA,
    MANIFEST_SCHEMA_PATH,
    PARTIAL_PREFIX,
    REQUIRED_FILES,
    RUN_ID,
    SAMPLE_PATH,
    SUMMARY,
    is_safe_relative,
    json_bytes,
)
from qualify.core.arguments import say_refusal
from qualify.core.digests import document_sha256, is_sha256_hex, jcs_bytes
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import (
    check_schema,
    open_regular_file,
    parse_untrusted_json,
    read_bounded,
    render,
)

_MANIFEST_FORMS: dict[str, tuple[Path, Callable[[Any], bytes]]] = {
    MANIFEST_SCHEMA: (MANIFEST_SCHEMA_PATH, jcs_bytes),
    LEGACY_MANIFEST_SCHEMA: (LEGACY_MANIFEST_SCHEMA_PATH, json_bytes),
}
"""A manifest's schema and its one byte form: v2 RFC 8785 (signed receipts), v1 the legacy
indented form (unsigned receipts from before signing)."""



def _manifest_form(manifest: object) -> tuple[Path, Callable[[Any], bytes]]:
    """A manifest document's schema and byte form: its own version's (v2 when it names none it
    knows, a hostile ``schema`` of any JSON type included, so it fails as a v2 manifest)."""
    schema = manifest.get("schema") if isinstance(manifest, dict) else None
    return _MANIFEST_FORMS[schema] if isinstance(schema, str) and schema in _MANIFEST_FORMS \
        else _MANIFEST_FORMS[MANIFEST_SCHEMA]


def manifest_schema_path(manifest: object) -> Path:
    """The schema a manifest document is checked against (:func:`_manifest_form`)."""
    return _manifest_form(manifest)[0]


RECEIPT_JSON_MAX_BYTES = 16 << 20
"""Largest receipt JSON file parsed (manifest, identity, summary, host, sample); real ones are
kilobytes, a calibration's host.json with a producer start per handoff some hundreds."""

_DIGEST_FILE_MAX_BYTES = 1 << 10
"""identity.sha256 holds 64 hex digits and a newline."""

_DETAIL_LIMIT = 160


# --------------------------------------------------------------------------- bounded reading


def shown(text: str) -> str:
    """``text`` as printed on one line: as is when printable, else escaped, so a file name with a
    newline or undecodable bytes neither splits a report line nor fails to print."""
    return text if text.isprintable() else ascii(text)


def load_receipt_json(path: Path, where: str, max_bytes: int = RECEIPT_JSON_MAX_BYTES) -> Any:
    """A receipt's JSON file, bounded and parsed strictly (:func:`parse_untrusted_json`), or
    :class:`Refused` with one line starting ``where:``."""
    return parse_untrusted_json(read_bounded(path, max_bytes, where), where, max_bytes=max_bytes)


def _sha256_of(path: Path, expected_bytes: int, where: str) -> tuple[int, str | None]:
    """The file's size and SHA-256 hex digest; the digest is None when the size is not
    ``expected_bytes`` (checked on the open descriptor, so a wrong size is never hashed)."""
    descriptor, size = open_regular_file(path, where)
    with os.fdopen(descriptor, "rb") as handle:
        if size != expected_bytes:
            return size, None
        return size, hashlib.file_digest(handle, hashlib.sha256).hexdigest()


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
        data = read_bounded(manifest_path, RECEIPT_JSON_MAX_BYTES, where)
        manifest = parse_untrusted_json(data, where, max_bytes=RECEIPT_JSON_MAX_BYTES)
        schema_path, render_bytes = _manifest_form(manifest)
        check_schema(manifest, schema_path, where)
    except Refused as exc:
        problems.append(str(exc))
        return None
    if render_bytes(manifest) != data:
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
                if relative not in (MANIFEST, ENVELOPE):
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
        if path in (MANIFEST, ENVELOPE) or not is_safe_relative(path):
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


def _receipt_problems(root: Path, problems: list[str], hashed: dict[str, str]) -> int:
    """Append every problem of the receipt at ``root``; returns the number of files its manifest
    covers (itself included), 0 when there is no usable manifest. Each file's SHA-256 goes into
    ``hashed`` as it is computed (the signed statement's check reuses it)."""
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
            continue
        hashed[path] = digest
        if digest != entry["sha256"]:
            problems.append(f"altered file {path}: sha256 {digest} differs from the manifest")
    for path in sorted(actual - set(listed)):
        problems.append(f"extra file {shown(path)}")
    needed_dirs = {"samples"} | {Path(p).parent.as_posix() for p in listed if "/" in p}
    signed = manifest["schema"] == MANIFEST_SCHEMA
    if signed != os.path.lexists(root / ENVELOPE):
        problems.append(f"missing file {ENVELOPE} (a {MANIFEST_SCHEMA} receipt is signed)" if signed
                        else f"extra file {ENVELOPE} beside a {LEGACY_MANIFEST_SCHEMA} manifest")
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


def check_receipt(directory: str | os.PathLike[str],
                  hashed: dict[str, str] | None = None) -> tuple[list[str], int]:
    """Problems of one receipt (each ``<run id>: <problem>``; none when intact) and the number of
    files its manifest covers; the SHA-256 of each file hashed goes into ``hashed`` when given.
    Never raises: anything unexpected while checking becomes the problem ``<run id>: cannot
    check: <what>``, kept with those found before it."""
    root = Path(directory)
    label = shown(root.name)
    problems: list[str] = []
    count = 0
    try:
        if not stat.S_ISDIR(root.lstat().st_mode):
            return [f"{shown(str(root))}: not a receipt directory"], 0
        count = _receipt_problems(root, problems, {} if hashed is None else hashed)
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
    summary names this run, this identity and as many samples as the manifest lists. A summary
    naming no identity (null ``identity_sha256``) is a run refused before its identity loaded:
    its status must be refused and the receipt must hold neither identity file."""
    problems: list[str] = []
    try:
        summary = load_receipt_json(root / SUMMARY, SUMMARY)
    except Refused as exc:
        summary = None
        problems.append(str(exc))
    if summary is not None and not isinstance(summary, dict):
        problems.append(f"{SUMMARY} is not a JSON object")  # checked no further: each use below needs a dict
    held = [name for name in IDENTITY_FILES if name in listed]
    if isinstance(summary, dict) and "identity_sha256" in summary and summary["identity_sha256"] is None:
        if summary.get("status") != "refused":
            problems.append(f"{SUMMARY} names no identity, status {render(summary.get('status'))}; only a run "
                            f"refused before its identity loaded has none")
        problems.extend(f"{SUMMARY} names no identity, the receipt holds {name}" for name in held)
    else:
        problems.extend(f"missing file {name} (required: {SUMMARY} names an identity)"
                        for name in IDENTITY_FILES if name not in held)
        if held == list(IDENTITY_FILES):
            identity_digest = _identity_digest_problems(root, problems)
            if isinstance(summary, dict) and summary.get("identity_sha256") != identity_digest:
                problems.append(f"{SUMMARY} names another identity digest")
    if not isinstance(summary, dict):
        return problems
    if summary.get("run_id") != root.name:
        problems.append(f"{SUMMARY} names run {render(summary.get('run_id'))}")
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


def _identity_digest_problems(root: Path, problems: list[str]) -> str:
    """identity.sha256's digest (empty when unreadable), appending a problem when it is no SHA-256
    hex digest or not identity.json's canonical digest."""
    try:
        raw_digest = read_bounded(root / "identity.sha256", _DIGEST_FILE_MAX_BYTES, "identity.sha256")
        identity_digest = raw_digest.decode(errors="replace").strip()
    except Refused as exc:
        problems.append(str(exc))
        identity_digest = ""
    if not is_sha256_hex(identity_digest):
        problems.append("identity.sha256 does not hold a SHA-256 hex digest")
    try:
        if document_sha256(load_receipt_json(root / "identity.json", "identity.json")) != identity_digest:
            problems.append("identity.sha256 is not the canonical digest of identity.json")
    except Refused as exc:
        problems.append(str(exc))
    except ValueError as exc:  # no hashed document's schema, or one its canonical form refuses
        problems.append(f"identity.json: {one_line(str(exc))}")
    return identity_digest


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


# --------------------------------------------------------------------------- authentication

State = Literal["verified", "legacy", "unsigned", "untrusted", "tampered", "partial"]
"""How ``receipts verify`` judges a receipt. ``verified``: signed by a key the trust file trusts for
that run. ``legacy``: from before signing, intact, and its manifest pinned by digest in the trust
file (not signed, so not ``verified``, but as authentic as that file). Both pass, as ``partial``
(a leftover) does; ``unsigned``, ``untrusted`` and ``tampered`` fail."""


@dataclass
class ReceiptCheck:
    """One receipt as ``receipts verify`` judges it: ``state`` (``verified``, ``legacy`` and
    ``partial`` pass), the run ``status`` it records (authenticated only when verified), the signer,
    the problems found (each one line), once verified the signed predicate (what a reader of the
    receipt may quote as the signer's), and for a legacy one the trust file pinning it."""

    name: str
    state: State
    status: str | None = None
    key_id: str | None = None
    files: int = 0
    problems: list[str] = field(default_factory=list)
    predicate: Mapping[str, Any] | None = None
    pinned_by: str | None = None


def _recorded_status(root: Path) -> str | None:
    """The status a receipt's summary records (v1 summaries: from ``passed`` and ``error``)."""
    try:
        summary = load_receipt_json(root / SUMMARY, SUMMARY)
    except Refused:
        return None
    if not isinstance(summary, dict):
        return None
    if isinstance(summary.get("status"), str):
        return str(summary["status"])
    if summary.get("passed") is True:
        return "passed"
    error = summary.get("error")
    if isinstance(error, str):
        return "refused" if error.startswith("refused: ") else "incomplete"
    return "failed" if summary.get("passed") is False else None


def _subject_problems(root: Path, subjects: dict[str, str], hashed: dict[str, str]) -> list[str]:
    """The statement must name exactly the receipt's files (the manifest included, the envelope
    aside), each with its SHA-256 (from ``hashed`` when the manifest check already computed it)."""
    problems: list[str] = []
    actual, _directories = _walk(root, problems)
    actual.add(MANIFEST)
    for name in sorted(set(subjects) - actual):
        problems.append(f"statement subject {shown(name)}: no such file")
    for name in sorted(actual - set(subjects)):
        problems.append(f"file {shown(name)} is not a subject of the signed statement")
    for name in sorted(actual & set(subjects)):
        digest = hashed.get(name)
        if digest is None:
            try:
                descriptor, _size = open_regular_file(root / name, f"file {name}")
            except Refused as exc:
                problems.append(str(exc))
                continue
            with os.fdopen(descriptor, "rb") as handle:
                digest = hashlib.file_digest(handle, hashlib.sha256).hexdigest()
        if digest != subjects[name]:
            problems.append(f"file {name}: sha256 differs from the signed statement's subject")
    return problems


_SUMMARY_FIELDS_SIGNED = ("lane", "recipe", "rung", "identity_sha256", "verdict")
"""What the signed predicate repeats from the summary, beside run id and status: enroll and an
auditor read the predicate, so it may not say anything the receipt's own files do not."""


def _predicate_problems(root: Path, predicate: dict[str, Any], status: str | None) -> list[str]:
    """The signed conclusion must be the receipt's own: its run id, the status its summary
    records, and the lane, recipe, rung, identity digest and verdict the summary names."""
    problems = []
    if predicate.get("run_id") != root.name:
        problems.append(f"signed statement names run {render(predicate.get('run_id'))}, not {shown(root.name)}")
    if predicate.get("status") != status:
        problems.append(f"signed statement says {render(predicate.get('status'))}, {SUMMARY} says {render(status)}")
    try:
        summary = load_receipt_json(root / SUMMARY, SUMMARY)
    except Refused as exc:
        return [*problems, str(exc)]
    for name in _SUMMARY_FIELDS_SIGNED:
        found = summary.get(name) if isinstance(summary, dict) else None
        if predicate.get(name) != found:
            problems.append(f"signed statement's {name} {render(predicate.get(name))} is not {SUMMARY}'s "
                            f"{render(found)}")
    return problems


def authenticate_receipt(directory: str | os.PathLike[str], trust: TrustFile | None) -> ReceiptCheck:
    """Verify one receipt end to end: every file against its manifest, then the signed statement
    (signature by a key ``trust`` holds, subjects equal to the files, the conclusion the
    summary's). A receipt with no statement and a v1 manifest is ``unsigned`` (legacy), never
    verified. Never raises."""
    root = Path(directory)
    check = ReceiptCheck(shown(root.name), "tampered")
    hashed: dict[str, str] = {}
    problems, check.files = check_receipt(root, hashed)
    prefix = f"{check.name}: "
    check.problems = [problem.removeprefix(prefix) for problem in problems]
    check.status = _recorded_status(root)
    if not os.path.lexists(root / ENVELOPE):
        if not check.problems and _manifest_schema(root) == LEGACY_MANIFEST_SCHEMA:
            check.state = "unsigned"
            _pinned_legacy(root, check, trust)
        elif not check.problems:
            check.problems.append(f"missing file {ENVELOPE}")
        return check
    try:
        attestation = read_attestation(root, trust)
    except AttestationProblem as problem:
        check.problems.append(str(problem))
        if problem.kind == "untrusted" and len(check.problems) == 1:
            check.state = "untrusted"
        return check
    except Exception as exc:  # a hostile envelope's surprise stays this receipt's problem
        check.problems.append(f"cannot check {ENVELOPE}: {_describe(exc)}")
        return check
    check.key_id = attestation.key_id
    check.problems.extend(_subject_problems(root, attestation.subjects, hashed))
    check.problems.extend(_predicate_problems(root, attestation.predicate, check.status))
    if not check.problems:
        signer = trust.get(attestation.key_id) if trust is not None else None
        started = attestation.predicate.get("started_utc")
        if trust is not None and signer is not None and not signer.vouches_for(str(started)):
            check.state = "untrusted"  # a genuine signature, by a key not trusted for this run
            check.problems.append(f"signed by key {attestation.key_id[:16]}…, which {trust.source} trusts "
                                  f"for {signer.window()}; this run started {render(started)}")
            return check
        check.state = "verified"
        check.predicate = attestation.predicate
    return check


def _pinned_legacy(root: Path, check: ReceiptCheck, trust: TrustFile | None) -> None:
    """An intact unsigned receipt the trust file pins: ``legacy`` when its manifest's SHA-256 is the
    pinned one, ``tampered`` when another (its files were edited and the manifest re-hashed)."""
    pin = trust.legacy_receipt(root.name) if trust is not None else None
    if pin is None or trust is None:
        return
    try:
        descriptor, _size = open_regular_file(root / MANIFEST, MANIFEST)
    except Refused as exc:
        check.state = "tampered"
        check.problems.append(str(exc))
        return
    with os.fdopen(descriptor, "rb") as handle:
        digest = hashlib.file_digest(handle, hashlib.sha256).hexdigest()
    if digest != pin.manifest_sha256:
        check.state = "tampered"
        check.problems.append(f"{MANIFEST}: sha256 {digest[:16]}… is not the {pin.manifest_sha256[:16]}… that "
                              f"{trust.source} pins for this legacy receipt")
        return
    check.state = "legacy"
    check.pinned_by = trust.source


def _manifest_schema(root: Path) -> object:
    try:
        manifest = load_receipt_json(root / MANIFEST, MANIFEST)
    except Refused:
        return None
    return manifest.get("schema") if isinstance(manifest, dict) else None


# --------------------------------------------------------------------------- the command


def _archive_contents(target: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """The receipts to check under ``target`` (itself when it holds any file a receipt holds, so
    a receipt missing its manifest is checked as one receipt), the ``.partial-`` leftovers of
    runs killed before they finalized (their claimed, still empty run directory is part of the
    leftover, not a receipt), and the strays: symbolic links and other hidden entries, which no
    run writes and which are never followed or skipped unsaid. Raises ``OSError`` when ``target``
    cannot be listed."""
    own_files = (MANIFEST, ENVELOPE, *REQUIRED_FILES)
    if target.name.startswith(PARTIAL_PREFIX) or any(os.path.lexists(target / name) for name in own_files):
        return [target], [], []
    entries = sorted((p, p.lstat().st_mode) for p in target.iterdir())
    children = [p for p, mode in entries if stat.S_ISDIR(mode)]
    partial = [p for p in children if p.name.startswith(PARTIAL_PREFIX)]
    claimed = {p.name.removeprefix(PARTIAL_PREFIX) for p in partial}
    receipts = [p for p in children if not p.name.startswith(".") and not (p.name in claimed and _is_empty(p))]
    strays = [p for p, mode in entries if stat.S_ISLNK(mode) or (p.name.startswith(".") and p not in partial)]
    return receipts, partial, strays


STRAY_LINK = "a symbolic link: not followed; verify the receipt at its own path"
"""The problem of a link given or found in an archive: its target would read as the link's run."""
STRAY_HIDDEN = "a hidden entry in the archive: no run writes one; not verified"
"""The problem of a hidden entry (a dot-named one other than a ``.partial-`` leftover)."""


def _stray_check(path: Path) -> ReceiptCheck:
    """A path ``receipts verify`` reports and never verifies: a symbolic link or a hidden entry."""
    return ReceiptCheck(shown(path.name), "tampered", problems=[STRAY_LINK if path.is_symlink() else STRAY_HIDDEN])


def _is_empty(directory: Path) -> bool:
    """An empty directory (one that cannot be listed is not: it is checked as a receipt)."""
    try:
        return not any(directory.iterdir())
    except OSError:
        return False


_LABELS: dict[State, str] = {"verified": "ok       ", "legacy": "legacy   ", "partial": "partial  ",
                             "unsigned": "UNSIGNED ", "untrusted": "UNTRUSTED", "tampered": "TAMPERED "}


def _report(check: ReceiptCheck, stream: TextIO) -> None:
    label = _LABELS[check.state]
    if check.state == "verified":
        print(f"{label} {check.name}: {check.status}; signed by {check.key_id and check.key_id[:16]}…, "
              f"{check.files} files match the signed statement", file=stream)
    elif check.state == "legacy":
        print(f"{label} {check.name}: {check.status}; a legacy receipt with no signed statement, pinned by its "
              f"manifest's sha256 in {check.pinned_by}; {check.files} files match that manifest", file=stream)
    elif check.state == "unsigned":
        print(f"{label} {check.name}: legacy receipt with no signed statement; its files match its own "
              f"manifest, which anyone can recompute; records {check.status} (not authenticated)", file=stream)
    elif check.state == "partial":
        print(f"{label} {check.name}: a run stopped before it finalized its receipt; nothing in it is "
              f"attested", file=stream)
    else:
        for problem in check.problems:
            print(f"{label} {check.name}: {problem}", file=stream)


def _checks(paths: Sequence[str | os.PathLike[str]], trust: TrustFile | None) -> Iterator[tuple[Path, ReceiptCheck]]:
    """Each receipt under ``paths`` (each one receipt or an archive) with its check, in order;
    :class:`Refused` (one line) when a path cannot be listed."""
    for path in paths:
        if Path(path).is_symlink():
            yield Path(path), _stray_check(Path(path))
            continue
        try:
            receipts, partial, strays = _archive_contents(Path(path))
        except OSError as exc:
            raise Refused(f"receipts verify: {shown(os.fspath(path))}: cannot list "
                          f"({exc.strerror or type(exc).__name__})") from None
        for receipt in receipts:
            yield receipt, authenticate_receipt(receipt, trust)
        for leftover in partial:
            yield leftover, ReceiptCheck(shown(leftover.name), "partial", status="incomplete")
        for stray in strays:
            yield stray, _stray_check(stray)


_RECORDED = ("passed", "failed", "refused", "incomplete")


def _tally(checks: Sequence[ReceiptCheck]) -> dict[str, Any]:
    """How many receipts are in each state, and how many verified ones record each status."""
    tally: dict[str, Any] = {"receipts": len(checks)}
    tally.update({state: sum(check.state == state for check in checks) for state in _LABELS})
    tally["recorded"] = {status: sum(check.state in ("verified", "legacy") and check.status == status for check in checks)
                         for status in _RECORDED}
    return tally


def _tally_line(tally: dict[str, Any]) -> str:
    recorded = ", ".join(f"{count} {status}" for status, count in tally["recorded"].items() if count)
    return (f"{tally['receipts']} receipts: {tally['verified']} verified"
            + (f", {tally['legacy']} legacy" if tally["legacy"] else "") + (f" ({recorded})" if recorded else "")
            + "".join(f", {tally[state]} {state}" for state in ("partial", "unsigned", "untrusted", "tampered")
                      if tally[state]))


def _exit_code(tally: dict[str, Any]) -> int:
    """0 when nothing is unsigned, untrusted or tampered (and something was found), else 1."""
    return 0 if tally["receipts"] and tally["unsigned"] + tally["untrusted"] + tally["tampered"] == 0 else 1


def _none_found(paths: Sequence[str | os.PathLike[str]]) -> str:
    return f"receipts verify: no receipts under {', '.join(shown(os.fspath(p)) for p in paths)}"


def verify_paths(paths: Sequence[str | os.PathLike[str]], trust: TrustFile | None, out: TextIO) -> int:
    """Verify every receipt under ``paths`` (each one receipt or an archive); print one line per
    receipt as it is checked, and a tally. 0 when every receipt is verified (whatever status it
    records) or a partial leftover; 1 when any is unsigned, untrusted or tampered, or none is
    found; 2 when a path cannot be listed (one line on stderr)."""
    checks: list[ReceiptCheck] = []
    try:
        for _path, check in _checks(paths, trust):
            checks.append(check)
            _report(check, out)
    except Refused as refusal:
        say_refusal(str(refusal))
        return 2
    if not checks:
        print(_none_found(paths), file=out)
        return 1
    tally = _tally(checks)
    print(_tally_line(tally), file=out)
    return _exit_code(tally)


VERIFY_JSON_SCHEMA = "trust-ladder.cli-receipts-verify.v2"
"""The ``schema`` of ``receipts verify --json``'s document (contracts/cli-receipts-verify.v2.schema.json:
v1 plus the ``legacy`` state and its count)."""


def verify_document(paths: Sequence[str | os.PathLike[str]], trust: TrustFile | None,
                    trust_path: Path | None) -> dict[str, Any]:
    """``receipts verify --json``'s document: every receipt's check and the tally (exit code and
    status as the text report's); :class:`Refused` when a path cannot be listed."""
    from qualify import __version__

    found = list(_checks(paths, trust))
    tally = _tally([check for _path, check in found])
    code = _exit_code(tally)
    return {
        "schema": VERIFY_JSON_SCHEMA, "status": "passed" if code == 0 else "failed", "exit_code": code,
        "message": None if found else _none_found(paths), "harness_version": __version__,
        "trust": None if trust is None or trust_path is None else str(trust_path),
        "receipts": [{"name": check.name, "path": str(path), "state": check.state, "status": check.status,
                      "key_id": check.key_id, "files": check.files, "problems": list(check.problems)}
                     for path, check in found],
        "tally": tally,
    }
