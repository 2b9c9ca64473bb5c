"""Receipts: every run, passing or failing, leaves one directory, created once, never rewritten.

Layout of ``<archive>/<run-id>/``::

    command.log               command line, then one timestamped line per log entry
    identity.json             the identity document, byte for byte
    identity.sha256           its canonical digest (``qualify.core.digests.canonical_sha256``)
    versions.json             engine and library versions
    host.json                 what each process ran on (below); absent in receipts older than it
    samples/sample-<n>.json   one sample record per handoff (n from 1)
    validation-summary.json   the verdict over the run
    manifest.json             SHA-256 and size of every other file (written last)

``host.json`` is ``{"schema": "trust-ladder.receipt-host.v1", "consumer": F, "producers": [P, ...]}``
with one P per producer start, in order (a calibration restarts its producer for every handoff;
an empty list: no producer reached readiness), each P ``{"facts": F or null, "note": null or why
the facts are missing}``, each F a
:func:`qualify.core.hostenv.host_facts` document: CPU model and SIMD flags, BLAS library, kernel and
threads, the kernel-selecting environment variables, numpy's SIMD dispatch, torch threads and GPU,
the harness's git commit. The consumer's are taken when the receipt is finalized (in the writing
process), the producer's are what it reported when ready (:meth:`ReceiptWriter.set_producer_host`).
Recorded, never judged: they explain why a lane calibrated on one host behaves otherwise on another.

Atomicity: the run id is claimed by an exclusive ``mkdir`` of the final directory; everything is
written into ``<archive>/.partial-<run-id>/`` and renamed over the (still empty) claimed directory
only after the manifest is complete. A crash therefore leaves an empty claimed directory and a
``.partial-`` one, which :func:`verify_receipt` / :func:`verify_cli` report as incomplete, never
a receipt that looks complete. Finalized files are made read-only.

Archive location: ``--receipts DIR``, else ``$QUALIFY_RECEIPTS``, else
``$XDG_DATA_HOME/trust-ladder/receipts``, else ``~/.local/share/trust-ladder/receipts``: outside
the checkout, so demo runs never dirty it. The repository's ``receipts/`` holds committed basis
receipts. A receipt is addressed as ``receipt://<run-id>/<file>`` (:func:`resolve_receipt_uri`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import secrets
import stat
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import jsonschema
from pydantic import BaseModel

from qualify.core.assets import CONTRACTS_DIR
from qualify.core.digests import canonical_sha256, is_sha256_hex, strict_json_loads
from qualify.core.errors import Refused, one_line
from qualify.core.hostenv import host_facts, host_facts_problem
from qualify.evidence.records import CheckRecord, SampleRecord, ValidationSummary, record_json

if TYPE_CHECKING:
    from qualify.judge import Verdict

MANIFEST_SCHEMA = "trust-ladder.receipt-manifest.v1"
MANIFEST_SCHEMA_PATH = CONTRACTS_DIR / "receipt-manifest.v1.schema.json"
MANIFEST = "manifest.json"
HOST = "host.json"
HOST_SCHEMA = "trust-ladder.receipt-host.v1"
REQUIRED_FILES: tuple[str, ...] = (
    "command.log",
    "identity.json",
    "identity.sha256",
    "versions.json",
    "validation-summary.json",
)
"""Files every receipt holds besides the manifest (samples may be none, for an early failure)."""

PARTIAL_PREFIX = ".partial-"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_SAMPLE = re.compile(r"^samples/sample-[1-9][0-9]*\.json$")
URI_PREFIX = "receipt://"
_READ_LIMIT = 64 << 20


# --------------------------------------------------------------------------- locations and ids


def default_archive_dir() -> Path:
    """``$QUALIFY_RECEIPTS``, else ``$XDG_DATA_HOME/trust-ladder/receipts``, else
    ``~/.local/share/trust-ladder/receipts`` (outside the git tree)."""
    configured = os.environ.get("QUALIFY_RECEIPTS")
    if configured:
        return Path(configured).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME")
    base = Path(data_home) if data_home and os.path.isabs(data_home) else Path.home() / ".local" / "share"
    return base / "trust-ladder" / "receipts"


def archive_dir(option: str | os.PathLike[str] | None = None) -> Path:
    """The archive a run writes to: the ``--receipts`` option if given, else the default."""
    return Path(option).expanduser() if option else default_archive_dir()


def new_run_id(now: _dt.datetime | None = None) -> str:
    """UTC timestamp plus a random suffix, e.g. ``20261129T084512Z-3f9a0c1d2e4b5a69``."""
    moment = (now or _dt.datetime.now(_dt.UTC)).astimezone(_dt.UTC)
    return f"{moment:%Y%m%dT%H%M%SZ}-{secrets.token_hex(8)}"


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def receipt_uri(run_id: str, file: str = "validation-summary.json") -> str:
    """``receipt://<run-id>/<file>``."""
    return f"{URI_PREFIX}{run_id}/{file}"


# --------------------------------------------------------------------------- JSON helpers


def _json_safe(value: Any) -> Any:
    """Non-finite floats become the strings NaN/Infinity/-Infinity so they reach the judge."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _json_bytes(document: Any) -> bytes:
    """The receipt's JSON file form: sorted keys, 2-space indent, trailing newline, no NaN."""
    return (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def _parse_json(data: bytes) -> Any:
    return strict_json_loads(data)


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` exclusively and write ``data`` durably."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _identity_document(identity: Any) -> tuple[bytes, Any]:
    """(bytes to store as identity.json, parsed document) from a path, a mapping or an Identity."""
    if isinstance(identity, (str, os.PathLike)):
        path = Path(identity)
        try:
            data = path.read_bytes()
            return data, _parse_json(data)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise Refused(f"receipt: identity {path}: cannot read a JSON document ({type(exc).__name__})") from None
    if hasattr(identity, "document"):
        document = identity.document()
    elif isinstance(identity, Mapping):
        document = dict(identity)
    else:
        raise Refused(f"receipt: identity: found {type(identity).__name__}, expected a path, mapping or Identity")
    return _json_bytes(document), document


def library_versions() -> dict[str, str]:
    """Python, platform and the versions of the libraries the harness's numbers depend on."""
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("trust-ladder", "numpy", "pydantic", "jsonschema", "safetensors", "tokenizers", "gguf", "torch", "transformers", "vllm"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


# --------------------------------------------------------------------------- writer


class ReceiptWriter:
    """Writes one run's receipt: claim the run id, stream samples and log lines, then
    :meth:`finalize` once (call it in a ``finally`` path, or use the writer as a context manager,
    which finalizes a failing receipt if the run raised or ended without a verdict).

    ``identity`` is the identity file path (copied byte for byte), its document, or an Identity;
    ``identity_sha256``, when given, must equal the document's canonical digest. ``rule`` is the
    judging rule (stored in the summary so the receipt can be re-judged). ``consumer_host`` is the
    consumer's host facts for host.json; by default this process's, taken at :meth:`finalize`.
    """

    def __init__(
        self,
        archive: str | os.PathLike[str],
        *,
        command_line: Sequence[str],
        identity: Any,
        recipe: str,
        lane: str,
        rule: BaseModel | Mapping[str, Any] | None = None,
        identity_sha256: str | None = None,
        versions: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        consumer_host: Mapping[str, Any] | None = None,
    ) -> None:
        self.archive = Path(archive)
        self.run_id = new_run_id() if run_id is None else run_id
        if not RUN_ID.fullmatch(self.run_id):
            raise Refused(f"receipt: run id {self.run_id!r} is malformed; expected letters, digits, '.', '_' or '-'")
        identity_bytes, document = _identity_document(identity)
        try:
            digest = canonical_sha256(document)
        except (TypeError, ValueError):
            raise Refused("receipt: identity document is not canonical JSON") from None
        if identity_sha256 is not None and identity_sha256 != digest:
            raise Refused(f"receipt: identity_sha256 {identity_sha256} does not match the document's digest {digest}")
        self.identity_sha256 = digest
        self.recipe = recipe
        self.lane = lane
        self.rule = rule.model_dump(mode="json") if isinstance(rule, BaseModel) else (dict(rule) if rule else None)
        self.started_utc = _utc_now()
        self.samples = 0
        self.finalized = False
        self.consumer_host = dict(consumer_host) if consumer_host is not None else None
        if consumer_host is None:
            host_facts()  # its static part (git, CPU, numpy) now, so finalize only re-reads threads and env
        self.producer_hosts: list[dict[str, Any]] = []  # one {"facts", "note"} per producer start

        self.archive.mkdir(parents=True, exist_ok=True)
        self.path = self.archive / self.run_id
        try:
            os.mkdir(self.path)
        except FileExistsError:
            raise Refused(f"receipt {self.run_id}: {self.path} already exists; a receipt is never rewritten") from None
        self.staging = self.archive / f"{PARTIAL_PREFIX}{self.run_id}"
        try:
            os.mkdir(self.staging)
        except FileExistsError:
            raise Refused(f"receipt {self.run_id}: {self.staging} already exists; a receipt is never rewritten") from None
        os.mkdir(self.staging / "samples")
        _write_new(self.staging / "identity.json", identity_bytes)
        _write_new(self.staging / "identity.sha256", f"{digest}\n".encode("ascii"))
        merged = {"libraries": library_versions(), **({"engines": dict(versions)} if versions else {})}
        _write_new(self.staging / "versions.json", _json_bytes(_json_safe(merged)))
        descriptor = os.open(self.staging / "command.log", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._log: TextIO = os.fdopen(descriptor, "w", encoding="utf-8")
        self._log.write("command: " + " ".join(one_line(part) for part in command_line) + "\n")
        self.log(f"receipt {self.run_id} started; identity sha256 {digest}")

    # -- during the run

    def log(self, line: str) -> None:
        """Append one timestamped line to command.log (flushed at once)."""
        self._require_open()
        self._write_log(line)

    def _write_log(self, line: str) -> None:
        self._log.write(f"{_utc_now()} {one_line(line)}\n")
        self._log.flush()

    def add_sample(self, record: SampleRecord | Mapping[str, Any]) -> Path:
        """Write the next ``samples/sample-<n>.json`` (n from 1); returns its final path."""
        self._require_open()
        document = record_json(record) if isinstance(record, SampleRecord) else _json_safe(dict(record))
        self.samples += 1
        name = f"sample-{self.samples}.json"
        _write_new(self.staging / "samples" / name, _json_bytes(document))
        self.log(f"sample {self.samples} recorded")
        return self.path / "samples" / name

    def set_producer_host(self, facts: Mapping[str, Any] | None, *, problem: str | None = None) -> None:
        """Record one producer start's host facts (as it reported them when ready) for host.json,
        after any earlier start's. A document that is not well-formed host facts is recorded as
        missing, with the reason; command.log keeps a line for each start."""
        self._require_open()
        found = None if facts is None else host_facts_problem(dict(facts) if isinstance(facts, Mapping) else facts)
        if facts is not None and found is None:
            recorded = _json_safe(dict(facts))
            self.producer_hosts.append({"facts": recorded, "note": None})
            cpu, blas = recorded["cpu"], recorded["blas"]
            self.log(f"producer host: pid {recorded['pid']}, cpu {cpu.get('model')!r} "
                     f"({cpu.get('isa_class')}), blas {blas.get('library')} kernel {blas.get('kernel')} "
                     f"threads {blas.get('num_threads')}")
        else:
            reason = one_line(problem or (f"malformed host facts: {found}" if found
                                          else "the producer reported no host facts"))
            self.producer_hosts.append({"facts": None, "note": reason})
            self.log(f"producer host: unknown ({reason})")

    def _host_document(self) -> dict[str, Any]:
        consumer = self.consumer_host if self.consumer_host is not None else host_facts()
        return {"schema": HOST_SCHEMA, "consumer": _json_safe(consumer), "producers": self.producer_hosts}

    # -- the end

    def finalize(self, verdict: Verdict | None, *, error: str | None = None) -> Path:
        """Write the validation summary and manifest, then publish the receipt atomically.

        ``verdict`` is a :class:`qualify.judge.Verdict` (None when the run ended before one); the
        receipt passes only with a passing verdict and no ``error``. Returns the receipt path.
        """
        self._require_open()
        self.finalized = True
        error_line = one_line(error) if error else None
        passed = bool(verdict is not None and verdict.passed and error_line is None)
        if verdict is None:
            headline = f"failed: run ended before a verdict: {error_line or 'no verdict given'}"
            reasons: tuple[str, ...] = (headline.removeprefix("failed: "),)
            checks: tuple[CheckRecord, ...] = ()
        else:
            headline = verdict.headline if error_line is None else f"failed: {error_line}"
            reasons = tuple(verdict.reasons) + ((error_line,) if error_line else ())
            checks = tuple(CheckRecord(name=c.name, passed=c.passed, detail=c.detail) for c in verdict.checks)
        rung = self.rule.get("rung") if self.rule else None
        summary = ValidationSummary(
            run_id=self.run_id,
            recipe=self.recipe,
            lane=self.lane,
            rung=rung if rung in (1, 2, 3) else None,
            identity_sha256=self.identity_sha256,
            passed=passed,
            verdict=one_line(headline),
            reasons=tuple(one_line(r) for r in reasons),
            checks=checks,
            rule=self.rule,
            samples=self.samples,
            started_utc=self.started_utc,
            finished_utc=_utc_now(),
            error=error_line,
        )
        self._write_log(f"verdict: {summary.verdict}")
        self._log.flush()
        os.fsync(self._log.fileno())
        self._log.close()
        _write_new(self.staging / "validation-summary.json", _json_bytes(json.loads(summary.model_dump_json(by_alias=True))))
        _write_new(self.staging / HOST, _json_bytes(self._host_document()))
        entries = []
        for path in sorted(p for p in self.staging.rglob("*") if p.is_file()):
            relative = path.relative_to(self.staging).as_posix()
            data = path.read_bytes()
            entries.append({"path": relative, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
        manifest = {"schema": MANIFEST_SCHEMA, "run_id": self.run_id, "files": entries}
        _write_new(self.staging / MANIFEST, _json_bytes(manifest))
        for path in self.staging.rglob("*"):
            if path.is_file():
                os.chmod(path, 0o444)
        for directory in (self.staging / "samples", self.staging):
            _fsync_dir(directory)
            os.chmod(directory, 0o555)
        try:
            os.rename(self.staging, self.path)  # replaces only our own claimed, empty directory
        except OSError as exc:
            raise Refused(
                f"receipt {self.run_id}: cannot publish ({exc.strerror}); {self.path} changed during the run, "
                f"the receipt stays in {self.staging}"
            ) from None
        _fsync_dir(self.archive)
        return self.path

    def _require_open(self) -> None:
        if self.finalized:
            raise Refused(f"receipt {self.run_id}: already finalized; a receipt is never rewritten")

    def __enter__(self) -> ReceiptWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.finalized:
            return
        if exc is not None:
            self.finalize(None, error=f"{kind.__name__ if kind else 'error'}: {one_line(str(exc))}")
        else:
            self.finalize(None, error="run ended without a verdict")


# --------------------------------------------------------------------------- verification


@lru_cache(maxsize=1)
def _manifest_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(MANIFEST_SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _safe_relative(path: object) -> bool:
    return isinstance(path, str) and all(_SEGMENT.fullmatch(part) for part in path.split("/"))


def _read_listed_manifest(directory: Path, problems: list[str]) -> dict[str, Any] | None:
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
        manifest = _parse_json(data)
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
    if _json_bytes(manifest) != data:
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
            path = base / name
            relative = path.relative_to(root).as_posix()
            mode = path.lstat().st_mode
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
        if path == MANIFEST or not _safe_relative(path):
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
        document = _parse_json((root / "identity.json").read_bytes())
        if canonical_sha256(document) != identity_digest:
            problems.append("identity.sha256 is not the canonical digest of identity.json")
    except (ValueError, UnicodeDecodeError, TypeError):
        problems.append("identity.json is not a JSON document")
    try:
        summary = _parse_json((root / "validation-summary.json").read_bytes())
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
    samples = sorted(p.relative_to(root).as_posix() for p in (root / "samples").glob("*")) if (root / "samples").is_dir() else []
    if any(not _SAMPLE.fullmatch(p) for p in samples):
        problems.append("samples/ holds a file not named sample-<n>.json")
    elif summary.get("samples") != len(samples):
        problems.append(f"validation-summary.json counts {summary.get('samples')!r} samples, the receipt holds {len(samples)}")
    return problems


def _host_problems(root: Path) -> list[str]:
    """host.json, when present, names both sides: a consumer's facts, and per producer start its
    facts or why they are missing."""
    try:
        host = _parse_json((root / HOST).read_bytes())
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


def receipt_files(directory: str | os.PathLike[str]) -> list[str]:
    """Paths listed in a receipt's manifest (call after :func:`verify_receipt` found no problems)."""
    manifest = _parse_json((Path(directory) / MANIFEST).read_bytes())
    return [entry["path"] for entry in manifest["files"]]


def read_receipt_json(directory: str | os.PathLike[str], relative: str) -> Any:
    """A JSON file of a receipt, parsed strictly (no NaN constants, no duplicate keys)."""
    return _parse_json((Path(directory) / relative).read_bytes())


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
    if not _safe_relative(relative):
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
            print(f"ok   {receipt.name}: {len(receipt_files(receipt)) + 1} files match the manifest", file=stream)
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
