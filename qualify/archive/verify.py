"""Verifying receipts: re-hash every file against the manifest, check the digest files agree, and
report incomplete (``.partial-``) receipts; ``qualify receipts verify`` (:func:`verify_cli`)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, TextIO

import jsonschema

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
from qualify.core.digests import canonical_sha256, is_sha256_hex, strict_json_loads
from qualify.core.errors import one_line

_READ_LIMIT = 64 << 20


@lru_cache(maxsize=1)
def _manifest_validator() -> jsonschema.Draft202012Validator:
    """The manifest's JSON Schema, checked once per process."""
    schema = json.loads(MANIFEST_SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


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
    if info.st_size > _READ_LIMIT:
        problems.append(f"{MANIFEST} is {info.st_size} bytes, too large")
        return None
    data = manifest_path.read_bytes()
    try:
        manifest: dict[str, Any] = strict_json_loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        problems.append(f"altered file {MANIFEST}: not valid JSON ({one_line(str(exc))[:80]})")
        return None
    try:
        _manifest_validator().validate(manifest)
    except jsonschema.ValidationError as exc:
        location = "/".join(str(p) for p in exc.absolute_path) or "(document)"
        problems.append(f"altered file {MANIFEST}: {location}: {one_line(exc.message)[:120]}")
        return None
    except (OSError, ValueError, jsonschema.SchemaError):
        problems.append(f"cannot check {MANIFEST}: manifest schema {MANIFEST_SCHEMA_PATH} is unusable")
        return None
    if json_bytes(manifest) != data:
        problems.append(f"altered file {MANIFEST}: bytes differ from its canonical rendering")
        return None
    return manifest


def verify_receipt(directory: str | os.PathLike[str]) -> list[str]:
    """Re-hash a receipt against its manifest; every altered, missing or extra file (and any
    inconsistency between digest files) is one problem line. An empty list means intact."""
    root = Path(directory)
    if not root.is_dir() or root.is_symlink():
        return [f"{root}: not a receipt directory"]
    problems: list[str] = []
    if not RUN_ID.fullmatch(root.name):
        problems.append(f"directory name {root.name!r} is not a run id")
    manifest = _read_listed_manifest(root, problems)

    actual: set[str] = set()
    directories: set[str] = set()
    for current, subdirs, files in os.walk(root, followlinks=False):
        base = Path(current)
        for name in subdirs + files:
            found = base / name
            relative = found.relative_to(root).as_posix()
            mode = found.lstat().st_mode
            if stat.S_ISLNK(mode):
                problems.append(f"extra file {relative}: symbolic link")
            elif stat.S_ISDIR(mode):
                directories.add(relative)
            elif stat.S_ISREG(mode):
                if relative != MANIFEST:
                    actual.add(relative)
            else:
                problems.append(f"extra file {relative}: not a regular file")
    if manifest is None:
        for name in REQUIRED_FILES:
            if name not in actual:
                problems.append(f"missing file {name}")
        return [f"{root.name}: {p}" for p in problems]

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
    for path in sorted(listed):
        if path not in actual:
            problems.append(f"missing file {path}")
            continue
        entry = listed[path]
        file_path = root / path
        size = file_path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"altered file {path}: {size} bytes, manifest says {entry['bytes']}")
            continue
        with open(file_path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        if digest != entry["sha256"]:
            problems.append(f"altered file {path}: sha256 {digest} differs from the manifest")
    for path in sorted(actual - set(listed)):
        problems.append(f"extra file {path}")
    needed_dirs = {"samples"} | {Path(p).parent.as_posix() for p in listed if "/" in p}
    for path in sorted(directories - needed_dirs):
        problems.append(f"extra directory {path}")

    if not problems:
        problems.extend(_consistency_problems(root))
    return [f"{root.name}: {p}" for p in problems]


def _consistency_problems(root: Path) -> list[str]:
    """Digest files must agree: identity.sha256 is identity.json's canonical digest, and the
    summary names this run and this identity."""
    problems = []
    identity_digest = (root / "identity.sha256").read_text(encoding="utf-8", errors="replace").strip()
    if not is_sha256_hex(identity_digest):
        problems.append("identity.sha256 does not hold a SHA-256 hex digest")
    try:
        document = strict_json_loads((root / "identity.json").read_bytes())
        if canonical_sha256(document) != identity_digest:
            problems.append("identity.sha256 is not the canonical digest of identity.json")
    except (ValueError, UnicodeDecodeError, TypeError):
        problems.append("identity.json is not a JSON document")
    try:
        summary = strict_json_loads((root / "validation-summary.json").read_bytes())
    except (ValueError, UnicodeDecodeError):
        return problems + ["validation-summary.json is not a JSON document"]
    if not isinstance(summary, dict):
        return problems + ["validation-summary.json is not a JSON object"]
    if summary.get("run_id") != root.name:
        problems.append(f"validation-summary.json names run {summary.get('run_id')!r}")
    if summary.get("identity_sha256") != identity_digest:
        problems.append("validation-summary.json names another identity digest")
    if not isinstance(summary.get("passed"), bool):
        problems.append("validation-summary.json has no passed flag")
    if (root / HOST).is_file():  # receipts from before host.json have none
        problems.extend(_host_problems(root))
    sample_dir = root / "samples"
    samples = sorted(p.relative_to(root).as_posix() for p in sample_dir.glob("*")) if sample_dir.is_dir() else []
    if any(not SAMPLE_PATH.fullmatch(p) for p in samples):
        problems.append("samples/ holds a file not named sample-<n>.json")
    elif summary.get("samples") != len(samples):
        problems.append(f"{SUMMARY} counts {summary.get('samples')!r} samples, the receipt holds {len(samples)}")
    return problems


def _host_problems(root: Path) -> list[str]:
    """host.json, when present, names both sides: a consumer's facts, and per producer start its
    facts or why they are missing."""
    try:
        host = strict_json_loads((root / HOST).read_bytes())
    except (ValueError, UnicodeDecodeError):
        return [f"{HOST} is not a JSON document"]
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


def _file_count(receipt: Path) -> int:
    """Files of a verified receipt: those its manifest lists, and the manifest."""
    manifest = strict_json_loads((receipt / MANIFEST).read_bytes())
    return len(manifest["files"]) + 1


def verify_cli(path: str | os.PathLike[str] | None = None, out: TextIO | None = None) -> int:
    """``qualify receipts verify [PATH]``: PATH is one receipt or an archive of many (default:
    the archive location). Prints one line per receipt; exit 0 when every receipt is intact,
    1 when any is not (or none is found), 2 when PATH does not exist."""
    stream = out or sys.stdout
    target = Path(path).expanduser() if path else default_archive_dir()
    if not target.is_dir():
        print(f"receipts verify: {target}: no such directory", file=sys.stderr if out is None else stream)
        return 2
    if (target / MANIFEST).exists() or target.name.startswith(PARTIAL_PREFIX):
        receipts = [target]
        partial: list[Path] = []
    else:
        children = sorted(p for p in target.iterdir() if p.is_dir() and not p.is_symlink())
        partial = [p for p in children if p.name.startswith(PARTIAL_PREFIX)]
        receipts = [p for p in children if not p.name.startswith(".")]
    failing = 0
    for receipt in receipts:
        problems = verify_receipt(receipt)
        if problems:
            failing += 1
            for problem in problems:
                print(f"FAIL {problem}", file=stream)
        else:
            print(f"ok   {receipt.name}: {_file_count(receipt)} files match the manifest", file=stream)
    for leftover in partial:
        failing += 1
        print(f"FAIL {leftover.name}: partial receipt left by an interrupted run", file=stream)
    if not receipts and not partial:
        print(f"receipts verify: no receipts under {target}", file=stream)
        return 1
    total = len(receipts) + len(partial)
    if failing:
        print(f"{failing} of {total} receipts failed verification", file=stream)
        return 1
    print(f"{total} receipts verified: every file matches its manifest", file=stream)
    return 0
