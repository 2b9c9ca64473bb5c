"""Reading receipts: the files a verified receipt lists, its JSON files parsed strictly, its
sample records (the one reader of them: :func:`read_samples`, and :func:`sample_records` for a
verified receipt), its summary checked against its own version's schema, and
``receipt://<run-id>/<file>`` URIs resolved to files of verified receipts."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.archive.layout import MANIFEST, RUN_ID, SAMPLE_PATH, SUMMARY, URI_PREFIX, is_safe_relative
from qualify.archive.verify import load_receipt_json, manifest_schema_path, shown, verify_receipt
from qualify.archive.writer import SCOPED_SUMMARY_SCHEMA
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import check_schema
from qualify.evidence.records import LEGACY_SUMMARY_SCHEMA, SUMMARY_SCHEMA

SUMMARY_SCHEMAS: dict[str, Path] = {
    version: CONTRACTS_DIR / f"{version.removeprefix('trust-ladder.')}.schema.json"
    for version in (SCOPED_SUMMARY_SCHEMA, SUMMARY_SCHEMA, LEGACY_SUMMARY_SCHEMA)
}
"""Every summary version a reader accepts, newest first, and its schema file: v3 (the verdict's
``scope``), v2 (``status``, no scope) and v1 (legacy: neither)."""


def receipt_files(directory: str | os.PathLike[str]) -> list[str]:
    """Paths listed in a receipt's manifest (call after :func:`verify_receipt` found no problems).
    The manifest is read bounded and checked against its schema again: a receipt may change
    between verification and reading, and a refusal here is one line, never a ``KeyError``."""
    root = Path(directory)
    where = f"receipt {shown(root.name)}: {MANIFEST}"
    manifest = load_receipt_json(root / MANIFEST, where)
    check_schema(manifest, manifest_schema_path(manifest), where)
    return [entry["path"] for entry in manifest["files"]]


def read_receipt_json(directory: str | os.PathLike[str], relative: str) -> Any:
    """A JSON file of a receipt, read bounded and parsed strictly (no NaN constants, no duplicate
    keys, no deep nesting); :class:`Refused` (one line) for a path outside the receipt or a file
    that is missing, not regular, too large or not strict JSON."""
    root = Path(directory)
    where = f"receipt {shown(root.name)}: {shown(str(relative))}"
    if not is_safe_relative(relative):
        raise Refused(f"{where}: not a plain path inside the receipt")
    return load_receipt_json(root / relative, where)


SAMPLE_FILE = re.compile(r"^sample-([1-9][0-9]{0,5})\.json$")
"""A sample record's file name in ``samples/``; its number is the repetition."""


@dataclass(frozen=True)
class SampleRead:
    """One sample record file of a receipt: its repetition, and its record (any JSON value; None
    when it could not be read) or the one line saying why it could not."""

    repetition: int
    record: Any
    problem: str | None = None


@dataclass(frozen=True)
class ReceiptSamples:
    """A receipt's sample record files: how many it holds, and the first ones read."""

    found: int
    samples: list[SampleRead]


def read_samples(directory: str | os.PathLike[str], limit: int | None = None) -> ReceiptSamples:
    """Every ``samples/sample-<n>.json`` of a receipt, in repetition order (the first ``limit``
    read), each read bounded and parsed strictly (:func:`read_receipt_json`); a file that cannot
    be is its own problem, never the others'. Listed from the receipt's ``samples/`` directory,
    which may be absent (no samples); :class:`Refused` (one line) when it is a symbolic link
    (nothing is read through one) or cannot be listed."""
    root = Path(directory)
    if os.path.islink(root / "samples"):
        raise Refused("samples/ is a symbolic link: its records are not read")
    try:
        with os.scandir(root / "samples") as listing:
            found = sorted(int(m.group(1)) for entry in listing if (m := SAMPLE_FILE.fullmatch(entry.name)))
    except FileNotFoundError:
        found = []
    except OSError as exc:
        raise Refused(f"samples/: cannot list ({exc.strerror or type(exc).__name__})") from None
    samples: list[SampleRead] = []
    for repetition in found[:limit]:
        try:
            samples.append(SampleRead(repetition, read_receipt_json(root, f"samples/sample-{repetition}.json")))
        except Refused as exc:
            samples.append(SampleRead(repetition, None, one_line(str(exc))))
    return ReceiptSamples(len(found), samples)


def sample_records(directory: str | os.PathLike[str]) -> dict[int, Any]:
    """A verified receipt's sample records by repetition, in order (:func:`read_samples`);
    :class:`Refused` (one line) at the first that cannot be read, or when ``samples/`` holds other
    files than the manifest lists (the receipt changed since it was verified)."""
    root = Path(directory)
    where = f"receipt {shown(root.name)}"
    try:
        read = read_samples(root)
    except Refused as exc:
        raise Refused(f"{where}: {exc}") from None
    listed = sorted(name for name in receipt_files(root) if SAMPLE_PATH.fullmatch(name))
    held = sorted(f"samples/sample-{sample.repetition}.json" for sample in read.samples)
    if held != listed:
        raise Refused(f"{where}: samples/ holds {', '.join(held) or 'no record'}, its manifest lists "
                      f"{', '.join(listed) or 'none'}")
    for sample in read.samples:
        if sample.problem is not None:
            raise Refused(sample.problem)
    return {sample.repetition: sample.record for sample in read.samples}


def read_summary(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A receipt's ``validation-summary.json``, valid against its own version's schema
    (:data:`SUMMARY_SCHEMAS`); :class:`Refused` (one line) for an unknown version or a summary
    that breaks its schema. A v1 or v2 summary has no ``scope``: read it as null."""
    root = Path(directory)
    document = read_receipt_json(root, SUMMARY)
    where = f"receipt {shown(root.name)}: {SUMMARY}"
    schema = document.get("schema") if isinstance(document, dict) else None
    if not isinstance(schema, str) or schema not in SUMMARY_SCHEMAS:
        found = "no schema" if schema is None else f"schema {ascii(schema)[:120]}"
        raise Refused(f"{where}: found {found}, expected one of {', '.join(SUMMARY_SCHEMAS)}")
    check_schema(document, SUMMARY_SCHEMAS[schema], where)
    summary: dict[str, Any] = document
    return summary


def resolve_receipt_uri(uri: str, archive_dir: str | os.PathLike[str]) -> Path:
    """``receipt://<run-id>/<file>`` to the file's path in a verified receipt of ``archive_dir``.

    Refuses (one line) a malformed URI, path traversal, a missing receipt or file, and a receipt
    that fails :func:`verify_receipt`.
    """
    if not isinstance(uri, str) or not uri.startswith(URI_PREFIX):
        raise Refused(f"receipt uri: found {uri!r}, expected receipt://<run-id>/<file>")
    run_id, _, relative = uri[len(URI_PREFIX):].partition("/")
    if not RUN_ID.fullmatch(run_id) or not relative:
        raise Refused(f"receipt uri: found {uri!r}, expected receipt://<run-id>/<file>")
    if not is_safe_relative(relative):
        raise Refused(f"receipt uri {uri}: file {relative!r} is not a plain path inside the receipt")
    archive = Path(archive_dir)
    receipt = archive / run_id
    if not receipt.is_dir():
        raise Refused(f"receipt uri {uri}: no receipt {run_id} under {archive}")
    problems = verify_receipt(receipt)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise Refused(f"receipt uri {uri}: receipt fails verification: {problems[0]}{more}")
    if relative != MANIFEST and relative not in receipt_files(receipt):
        raise Refused(f"receipt uri {uri}: receipt {run_id} has no file {relative}")
    resolved = (receipt / relative).resolve(strict=True)
    if not resolved.is_relative_to(receipt.resolve(strict=True)) or not resolved.is_file():
        raise Refused(f"receipt uri {uri}: resolves outside the receipt")
    return resolved
