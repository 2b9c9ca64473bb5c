"""Writing a receipt: :class:`ReceiptWriter` claims a run id, streams samples and log lines, and
finalizes once with the judge's verdict (layout and atomicity: :mod:`qualify.archive.layout`)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, Final, Protocol, TextIO

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from qualify.archive.attestation import ENVELOPE, sign_statement
from qualify.archive.keys import SigningKey, ensure_signing_key
from qualify.archive.layout import (
    HOST,
    HOST_SCHEMA,
    MANIFEST,
    MANIFEST_SCHEMA,
    PARTIAL_PREFIX,
    RUN_ID,
    SUMMARY,
    json_bytes,
    json_safe,
    new_run_id,
)
from qualify.archive.predicate import receipt_predicate
from qualify.core.digests import document_sha256, jcs_bytes, strict_json_loads
from qualify.core.errors import Refused, one_line
from qualify.core.hostenv import host_facts, host_facts_problem
from qualify.evidence.records import (
    BitExactRule,
    BoundedDriftRule,
    CheckRecord,
    SampleRecord,
    ValidationSummary,
    record_json,
)
from qualify.judge import Verdict, judge_incomplete, judge_refused
from qualify.judge.scope import NAME, scope_document

SCOPED_SUMMARY_SCHEMA: Final = "trust-ladder.validation-summary.v3"
"""The summary the writer writes: v2's fields and the verdict's ``scope``
(:class:`ScopeRecord`, or null). v2 and v1 summaries stay readable."""


class DocumentedIdentity(Protocol):
    """An identity that can give back its JSON document (``qualify.contract.identity.Identity``)."""

    def document(self) -> dict[str, Any]: ...


IdentitySource = str | os.PathLike[str] | Mapping[str, Any] | DocumentedIdentity
"""Where a receipt's identity.json comes from: a file (copied byte for byte), a document, or an Identity."""


# --------------------------------------------------------------------------- the scope's file form


_Name = Annotated[str, StringConstraints(pattern=f"^{NAME.pattern}$")]
_Positive = Annotated[int, Field(ge=1)]
_Line = Annotated[str, StringConstraints(min_length=1, pattern=r"^[^\n\r]+$")]


class _ScopeForm(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class ScopeFixture(_ScopeForm):
    """The fixture a verdict ran on: its name, handoffs, and prompt and output tokens per handoff."""

    name: _Name
    repetitions: _Positive
    prompt_tokens: _Positive
    output_tokens: _Positive


class ScopeControlDocument(_ScopeForm):
    """One control document: within its E1 gates, or the grid lengths at which it exceeds them."""

    document: _Name
    within: bool
    exceeding_lengths: list[_Positive]

    @model_validator(mode="after")
    def _within_means_no_exceedance(self) -> ScopeControlDocument:
        if self.within == bool(self.exceeding_lengths):
            raise ValueError(f"{self.document}: within is {self.within} with exceeding lengths {self.exceeding_lengths}")
        return self


class ScopeControls(_ScopeForm):
    """The lane's E2 controls against their E1 gates: the criteria, the receipt that measured
    them, the length grid, and each document's outcome with the counts the line states."""

    criteria: _Name
    source: _Line
    lengths: list[_Positive] = Field(min_length=1)
    documents_within: Annotated[int, Field(ge=0)]
    documents_total: _Positive
    documents: list[ScopeControlDocument] = Field(min_length=1)

    @model_validator(mode="after")
    def _counts_are_the_documents(self) -> ScopeControls:
        within = sum(document.within for document in self.documents)
        if (self.documents_within, self.documents_total) != (within, len(self.documents)):
            raise ValueError(f"{self.criteria}: counts {self.documents_within} of {self.documents_total}, the documents "
                             f"say {within} of {len(self.documents)}")
        outside = sorted({n for d in self.documents for n in d.exceeding_lengths} - set(self.lengths))
        if outside:
            raise ValueError(f"{self.criteria}: exceeding lengths {outside} are not on the grid {self.lengths}")
        return self


class ScopeJudgedBy(_ScopeForm):
    """The rule that judged the handoffs when it is not the exact-token one, and the partings it
    allowed as near-ties out of all it saw (null when a sample's rows could not be read)."""

    rule: _Name
    near_tie_partings: Annotated[int, Field(ge=0)] | None
    partings: Annotated[int, Field(ge=0)] | None


class ScopeEnvelope(_ScopeForm):
    """The fixture envelope a producer declared non-deterministic was held to instead of an anchor
    recheck: its rule, and the honest handoffs and producer starts it was stated from."""

    rule: _Name
    handoffs: _Positive
    producer_starts: _Positive


class ScopeRecord(_ScopeForm):
    """What a verdict covers, as a summary holds it (:func:`qualify.judge.scope.scope_document`):
    the scope line, its fixture and controls halves word for word, and the facts they state."""

    line: _Line
    fixture_words: _Line
    controls_words: _Line
    fixture: ScopeFixture
    controls: ScopeControls | None
    judged_by: ScopeJudgedBy | None = None
    envelope: ScopeEnvelope | None = None


def scope_record(verdict: Verdict) -> ScopeRecord | None:
    """The verdict's scope in its file form; None when it has none (a calibration, a refused or
    incomplete run). :class:`Refused` (one line) for a scope on a verdict that judged nothing, or
    one the form refuses: the receipt never holds a scope it cannot state."""
    if verdict.scope is None:
        return None
    if verdict.status not in ("passed", "failed"):
        raise Refused(f"receipt: scope: a {verdict.status} verdict judged nothing, so it states no scope")
    try:
        return ScopeRecord.model_validate_json(json.dumps(scope_document(verdict.scope, verdict.passed)))
    except (ValidationError, ValueError) as exc:
        raise Refused(f"receipt: scope: {one_line(str(exc))[:300]}") from None


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` exclusively and write ``data`` durably."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries durable where the filesystem allows; where it cannot open or
    sync a directory the rename is still atomic, only its durability on power loss is weaker."""
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


def _identity_document(identity: IdentitySource) -> tuple[bytes, Any]:
    """(bytes to store as identity.json, parsed document) from a path, a mapping or an Identity."""
    if isinstance(identity, (str, os.PathLike)):
        path = Path(identity)
        try:
            data = path.read_bytes()
            return data, strict_json_loads(data)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise Refused(f"receipt: identity {path}: cannot read a JSON document ({type(exc).__name__})") from None
    document: Any
    if isinstance(identity, Mapping):
        document = dict(identity)
    elif callable(getattr(identity, "document", None)):
        document = identity.document()
    else:
        raise Refused(f"receipt: identity: found {type(identity).__name__}, expected a path, mapping or Identity")
    return json_bytes(document), document


def _identity_and_digest(identity: IdentitySource | None, identity_sha256: str | None) -> tuple[bytes | None, str | None]:
    """(identity.json bytes, canonical digest), both None for a run with no identity; a given
    ``identity_sha256`` must be the document's digest (and None when there is no identity)."""
    if identity is None:
        if identity_sha256 is not None:
            raise Refused(f"receipt: identity_sha256 {identity_sha256} given without an identity")
        return None, None
    identity_bytes, document = _identity_document(identity)
    try:
        digest = document_sha256(document)
    except (TypeError, ValueError) as exc:
        raise Refused(f"receipt: identity document: {one_line(str(exc))}") from None
    if identity_sha256 is not None and identity_sha256 != digest:
        raise Refused(f"receipt: identity_sha256 {identity_sha256} does not match the document's digest {digest}")
    return identity_bytes, digest


def library_versions() -> dict[str, str]:
    """Python, platform and the versions of the libraries the harness's numbers depend on."""
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("trust-ladder", "numpy", "pydantic", "jsonschema", "safetensors", "tokenizers", "gguf", "torch",
                    "transformers", "vllm"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions




class ReceiptWriter:
    """Writes one run's receipt: claim the run id, stream samples and log lines, then
    :meth:`finalize` once (call it in a ``finally`` path, or use the writer as a context manager,
    which finalizes a failing receipt if the run raised or ended without a verdict).

    ``identity`` is the identity file path (copied byte for byte), its document, or an Identity;
    ``identity_sha256``, when given, must equal the document's canonical digest. ``identity`` None
    is a run refused before its identity loaded: the receipt holds no identity files, its summary's
    ``identity_sha256`` is null, and only a refused verdict can finalize it (``lane`` may then be
    None too, when the operator's choice names none). ``rule`` is the
    judging rule (stored in the summary so the receipt can be re-judged). ``consumer_host`` is the
    consumer's host facts for host.json; by default this process's, taken at :meth:`finalize`.
    ``signing_key`` signs the receipt's statement; by default the operator's
    (:func:`qualify.archive.keys.ensure_signing_key`, made on first use), loaded before the run id
    is claimed so a key that cannot sign stops the run before anything is written.
    """

    def __init__(
        self,
        archive: str | os.PathLike[str],
        *,
        command_line: Sequence[str],
        identity: IdentitySource | None,
        recipe: str,
        lane: str | None,
        rule: BoundedDriftRule | BitExactRule | Mapping[str, Any] | None = None,
        identity_sha256: str | None = None,
        versions: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        consumer_host: Mapping[str, Any] | None = None,
        signing_key: SigningKey | None = None,
    ) -> None:
        self.signing_key = signing_key if signing_key is not None else ensure_signing_key()
        self.archive = Path(archive)
        self.run_id = new_run_id() if run_id is None else run_id
        if not RUN_ID.fullmatch(self.run_id):
            raise Refused(f"receipt: run id {self.run_id!r} is malformed; expected letters, digits, '.', '_' or '-'")
        identity_bytes, digest = _identity_and_digest(identity, identity_sha256)
        if lane is None and digest is not None:
            raise Refused("receipt: lane: found None, expected the lane of the identity the run is under")
        self.identity_sha256 = digest
        self.recipe = recipe
        self.lane = lane
        self.rule = (rule.model_dump(mode="json") if isinstance(rule, (BoundedDriftRule, BitExactRule))
                     else dict(rule) if rule else None)
        self.started_utc = _utc_now()
        self.samples = 0
        self._sample_documents: list[dict[str, Any]] = []
        self.finalized = False
        self.consumer_host = dict(consumer_host) if consumer_host is not None else None
        if consumer_host is None:
            host_facts()  # its static part (git, CPU, numpy) now, so finalize only re-reads threads and env
        self.producer_hosts: list[dict[str, Any]] = []  # one {"facts", "note"} per producer start

        self.path = self.archive / self.run_id
        try:
            self.archive.mkdir(parents=True, exist_ok=True)
            os.mkdir(self.path)
        except FileExistsError:
            raise Refused(f"receipt {self.run_id}: {self.path} already exists; a receipt is never rewritten") from None
        except OSError as exc:
            raise Refused(f"receipt archive {self.archive}: cannot create a receipt there "
                          f"({exc.strerror or type(exc).__name__}); no receipt was written") from None
        self.staging = self.archive / f"{PARTIAL_PREFIX}{self.run_id}"
        try:
            os.mkdir(self.staging)
        except FileExistsError:
            raise Refused(
                f"receipt {self.run_id}: {self.staging} already exists; a receipt is never rewritten") from None
        os.mkdir(self.staging / "samples")
        if identity_bytes is not None and digest is not None:
            _write_new(self.staging / "identity.json", identity_bytes)
            _write_new(self.staging / "identity.sha256", f"{digest}\n".encode("ascii"))
        merged = {"libraries": library_versions(), **({"engines": dict(versions)} if versions else {})}
        _write_new(self.staging / "versions.json", json_bytes(json_safe(merged)))
        descriptor = os.open(self.staging / "command.log", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._log: TextIO = os.fdopen(descriptor, "w", encoding="utf-8")
        self._log.write("command: " + " ".join(one_line(part) for part in command_line) + "\n")
        self.log(f"receipt {self.run_id} started; " + (f"identity sha256 {digest}" if digest is not None else
                 "no identity: the run was refused before its identity loaded"))

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
        document = record_json(record) if isinstance(record, SampleRecord) else json_safe(dict(record))
        self.samples += 1
        self._sample_documents.append(document)
        name = f"sample-{self.samples}.json"
        _write_new(self.staging / "samples" / name, json_bytes(document))
        self.log(f"sample {self.samples} recorded")
        return self.path / "samples" / name

    def add_series(self, repetition: int, tensors: Mapping[str, Any]) -> Path:
        """Write ``series/sample-<repetition>.safetensors``: the per-position, per-repetition and
        per-layer series an auditor plots (names and shapes: :mod:`qualify.evidence.series`).
        Each tensor is a numpy array; the file is listed in the manifest and the signed statement
        like every other. Returns its final path."""
        return self._write_series(repetition, f"sample-{repetition}.safetensors", tensors, "series")

    def add_envelope_series(self, repetition: int, tensors: Mapping[str, Any]) -> Path:
        """Write ``series/envelope-<repetition>.safetensors``: the four series a fixture envelope
        holds one handoff to (names and shapes: :mod:`qualify.evidence.series`), for a producer
        declared non-deterministic. Returns its final path."""
        from qualify.evidence.series import envelope_file_name

        return self._write_series(repetition, envelope_file_name(repetition), tensors, "envelope series")

    def _write_series(self, repetition: int, name: str, tensors: Mapping[str, Any], what: str) -> Path:
        self._require_open()
        from safetensors.numpy import save

        if type(repetition) is not int or repetition < 1:
            raise Refused(f"receipt {self.run_id}: {what} repetition {repetition!r}, expected an integer >= 1")
        series_dir = self.staging / "series"
        series_dir.mkdir(exist_ok=True)
        # Sorted names: the same tensors give the same bytes, so the file's digest is reproducible.
        _write_new(series_dir / name, save({key: tensors[key] for key in sorted(tensors)},
                                           metadata={"run_id": self.run_id, "repetition": str(repetition)}))
        self.log(f"{what} {repetition} recorded ({len(tensors)} tensors)")
        return self.path / "series" / name

    def add_evidence(self, name: str, document: Mapping[str, Any]) -> Path:
        """Write ``evidence/<name>.json`` once: a measurement beside the samples (a calibration's
        cells, a lane's E2 controls), listed in the manifest and the signed statement."""
        self._require_open()
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,63}", name):
            raise Refused(f"receipt {self.run_id}: evidence name {name!r}, expected lower-case letters, digits, '-'")
        evidence_dir = self.staging / "evidence"
        evidence_dir.mkdir(exist_ok=True)
        _write_new(evidence_dir / f"{name}.json", json_bytes(json_safe(dict(document))))
        self.log(f"evidence {name} recorded")
        return self.path / "evidence" / f"{name}.json"

    def set_producer_host(self, facts: Mapping[str, Any] | None, *, problem: str | None = None) -> None:
        """Record one producer start's host facts (as it reported them when ready) for host.json,
        after any earlier start's. A document that is not well-formed host facts is recorded as
        missing, with the reason; command.log keeps a line for each start."""
        self._require_open()
        found = None if facts is None else host_facts_problem(dict(facts) if isinstance(facts, Mapping) else facts)
        if facts is not None and found is None:
            recorded = json_safe(dict(facts))
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
        return {"schema": HOST_SCHEMA, "consumer": json_safe(consumer), "producers": self.producer_hosts}

    # -- the end

    def finalize(self, verdict: Verdict) -> Path:
        """Write the validation summary, manifest and signed statement, then publish the receipt
        atomically.

        ``verdict`` is the judge's (:mod:`qualify.judge`; a run that stopped early passes
        :func:`qualify.judge.judge_incomplete`); the receipt passes only when it does. Returns the
        receipt path.
        """
        self._require_open()
        if not isinstance(verdict, Verdict):
            raise TypeError(f"finalize needs a qualify.judge.Verdict, found {type(verdict).__name__}")
        if self.identity_sha256 is None and verdict.status != "refused":
            raise Refused(f"receipt {self.run_id}: status {verdict.status} without an identity; a receipt with no "
                          f"identity records a refused run")
        scope = scope_record(verdict)  # before finalized: a refused scope leaves the receipt to seal
        self.finalized = True
        rung = self.rule.get("rung") if self.rule else None
        summary = ValidationSummary(
            run_id=self.run_id,
            recipe=self.recipe,
            lane=self.lane,
            rung=rung if rung in (1, 2, 3) else None,
            identity_sha256=self.identity_sha256,
            passed=verdict.status == "passed",
            status=verdict.status,
            verdict=one_line(verdict.headline),
            reasons=tuple(one_line(reason) for reason in verdict.reasons),
            checks=tuple(CheckRecord(name=c.name, passed=c.passed, detail=c.detail) for c in verdict.checks),
            rule=self.rule,
            samples=self.samples,
            started_utc=self.started_utc,
            finished_utc=_utc_now(),
            error=one_line(verdict.error) if verdict.error is not None else None,
        )
        self._write_log(f"verdict: {summary.verdict}")
        self._log.flush()
        os.fsync(self._log.fileno())
        self._log.close()
        summary_document = json.loads(summary.model_dump_json(by_alias=True))
        summary_document.update(schema=SCOPED_SUMMARY_SCHEMA,
                                scope=None if scope is None else scope.model_dump(mode="json"))
        host_document = self._host_document()
        _write_new(self.staging / SUMMARY, json_bytes(summary_document))
        _write_new(self.staging / HOST, json_bytes(host_document))
        entries: list[dict[str, str | int]] = []
        subjects: list[tuple[str, str]] = []  # the signed statement's: these files, then the manifest
        for path in sorted(p for p in self.staging.rglob("*") if p.is_file()):
            relative = path.relative_to(self.staging).as_posix()
            data = path.read_bytes()
            subjects.append((relative, hashlib.sha256(data).hexdigest()))
            entries.append({"path": relative, "sha256": subjects[-1][1], "bytes": len(data)})
        manifest = jcs_bytes({"schema": MANIFEST_SCHEMA, "run_id": self.run_id, "files": entries})
        _write_new(self.staging / MANIFEST, manifest)
        subjects.append((MANIFEST, hashlib.sha256(manifest).hexdigest()))
        predicate = receipt_predicate(summary_document, self._sample_documents, host_document)
        _write_new(self.staging / ENVELOPE, sign_statement(subjects, predicate, self.signing_key))
        for path in self.staging.rglob("*"):
            if path.is_file():
                os.chmod(path, 0o444)
        subdirectories = [path for path in self.staging.iterdir() if path.is_dir()]
        for directory in (*subdirectories, self.staging):
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
        reason = f"{kind.__name__ if kind else 'error'}: {one_line(str(exc))}" if exc is not None \
            else "run ended without a verdict"
        # A receipt with no identity can only say the run was refused.
        self.finalize(judge_refused(reason) if self.identity_sha256 is None else judge_incomplete(reason))
