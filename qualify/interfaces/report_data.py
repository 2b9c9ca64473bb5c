"""What ``qualify report`` shows of one receipt, read from its files as untrusted input.

:func:`load_receipt` authenticates the receipt (:func:`qualify.archive.verify.authenticate_receipt`)
and gathers the verdict (from the signed predicate when verified, else from the summary, marked
unauthenticated), what it covers (the summary's ``scope``: fixture and controls), the identity's
bounds, the host facts, every sample record with its series and the calibrated KV envelope of the
identity's basis receipt. Only a directory that is no receipt, or whose summary cannot be read, is
refused (one line); anything else that cannot be read becomes a note the page shows, so a damaged
receipt is still shown, never silently.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qualify.archive.keys import TrustFile
from qualify.archive.layout import (
    HOST,
    LEGACY_MANIFEST_SCHEMA,
    MANIFEST,
    MANIFEST_SCHEMA,
    PARTIAL_PREFIX,
    SUMMARY,
)
from qualify.archive.predicate import host_summary, scope
from qualify.archive.reader import read_receipt_json, read_samples, read_summary, resolve_receipt_uri, sample_records
from qualify.archive.verify import authenticate_receipt, shown
from qualify.contract.identity import DEFAULT_ARCHIVE_DIR
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.errors import Refused, one_line
from qualify.core.strict_json import check_schema
from qualify.evidence.series import read_series
from qualify.run.run_contract import kv_envelope_from_records

MAX_SAMPLES = 256
"""The most sample records one page shows (a qualification has 3, a calibration some tens)."""



@dataclass(frozen=True)
class Bounds:
    """The full-logit bounds a sample's drift is judged against (None: no rule to draw)."""

    maximum_absolute: float | None
    maximum_mean_absolute: float | None
    source: str


@dataclass(frozen=True)
class Envelope:
    """Per layer (K, V), the largest KV delta the basis receipt measured, or why there is none."""

    layers: list[tuple[float, float]] | None
    note: str


@dataclass(frozen=True)
class SampleView:
    """One handoff sample: its record and series (either may be missing, ``notes`` say why)."""

    repetition: int
    record: Mapping[str, Any] | None
    series: dict[str, np.ndarray] | None
    notes: tuple[str, ...] = ()

    def kv_layers(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-layer max |K| and |V| deltas: the series', else the record's localisation."""
        if self.series is not None:
            return self.series["kv_k_max_abs_delta"], self.series["kv_v_max_abs_delta"]
        return _record_kv_layers(self.record)

    def first_divergence(self) -> int | None:
        """The first position whose handoff and cold tokens differ (series, else record)."""
        if self.series is not None:
            differs = np.flatnonzero(self.series["handoff_tokens"] != self.series["cold_tokens"])
            return int(differs[0]) if differs.size else None
        localisation = self.record.get("localisation") if self.record is not None else None
        found = localisation.get("first_divergence_position") if isinstance(localisation, Mapping) else None
        return found if type(found) is int else None


@dataclass
class ReceiptView:
    """Everything the page shows of one receipt."""

    path: Path
    run_id: str
    state: str
    signer: str | None
    trust_source: str
    problems: list[str]
    status: str
    verdict: str
    reasons: list[str]
    scope: str
    # The summary's scope (qualify.archive.writer.ScopeRecord's form: the scope line, the fixture,
    # the controls); None when the verdict has none or the summary predates it (v1, v2).
    verdict_scope: Mapping[str, Any] | None
    lane: str | None
    recipe: str | None
    rung: int | None
    identity_sha256: str | None
    started_utc: str | None
    finished_utc: str | None
    legacy: bool
    bounds: Bounds
    envelope: Envelope
    identity: Mapping[str, Any] | None
    host: Mapping[str, Any] | None
    samples: list[SampleView] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # A soak's receipt (evidence/soak.json, listed in its signed manifest): it qualifies no fixture.
    soak: bool = False

    @property
    def verified(self) -> bool:
        return self.state == "verified"


# --------------------------------------------------------------------------- small readers


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _finite(value: object) -> float | None:
    """A JSON number as a finite float (booleans and non-finite strings are no number)."""
    if type(value) in (int, float) and math.isfinite(float(value)):  # type: ignore[arg-type]
        return float(value)  # type: ignore[arg-type]
    return None


def _record_kv_layers(record: Mapping[str, Any] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-layer K and V deltas from a sample record's ``localisation.kv_layer_max_abs``."""
    items = _kv_items(record)
    if not items:
        return None
    layers = max(layer for layer, _k, _v in items) + 1
    k = np.full(layers, np.nan)
    v = np.full(layers, np.nan)
    for layer, k_delta, v_delta in items:
        k[layer], v[layer] = k_delta, v_delta
    return k, v


_MAX_LAYERS = 4096


def _kv_items(record: Mapping[str, Any] | None) -> list[tuple[int, float, float]]:
    """The well-formed ``(layer, k, v)`` entries of a record's per-layer KV deltas."""
    localisation = record.get("localisation") if isinstance(record, Mapping) else None
    found = localisation.get("kv_layer_max_abs") if isinstance(localisation, Mapping) else None
    items: list[tuple[int, float, float]] = []
    for item in found if isinstance(found, list) else []:
        if not isinstance(item, Mapping):
            continue
        layer, k, v = item.get("layer"), _finite(item.get("k")), _finite(item.get("v"))
        if type(layer) is int and 0 <= layer < _MAX_LAYERS and k is not None and v is not None:
            items.append((layer, k, v))
    return items


# --------------------------------------------------------------------------- the receipt


def is_receipt_directory(path: Path) -> bool:
    """A directory holding a receipt's summary or manifest (a ``.partial-`` one included)."""
    return path.is_dir() and (os.path.lexists(path / SUMMARY) or os.path.lexists(path / MANIFEST))


def _manifest_schema(root: Path) -> object:
    try:
        manifest = read_receipt_json(root, MANIFEST)
    except Refused:
        return None
    return manifest.get("schema") if isinstance(manifest, dict) else None


def _bounds(identity: Mapping[str, Any] | None, summary: Mapping[str, Any], rung: int | None) -> Bounds:
    """The identity's full-logit bounds (rung 3: bit-exact, bound 0); the summary's rule when the
    identity names none (a run refused before its identity loaded has neither)."""
    qualification = identity.get("onboarding_qualification") if identity is not None else None
    full = qualification.get("full_logits") if isinstance(qualification, Mapping) else None
    if isinstance(full, Mapping) and full.get("mode") == "exact":
        return Bounds(0.0, 0.0, "identity full_logits: exact (rung 3: every logit bit-identical, bound 0)")
    if isinstance(full, Mapping) and full.get("mode") == "bounded-drift":
        maximum, mean = _finite(full.get("maximum_absolute")), _finite(full.get("maximum_mean_absolute"))
        if maximum is not None and mean is not None:
            return Bounds(maximum, mean, "identity full_logits: bounded-drift")
    rule = summary.get("rule")
    if isinstance(rule, Mapping) and rule.get("rung") == 3:
        return Bounds(0.0, 0.0, f"{SUMMARY} rule: rung 3 bit-exact, bound 0")
    if isinstance(rule, Mapping) and _finite(rule.get("maximum_absolute")) is not None:
        return Bounds(_finite(rule.get("maximum_absolute")), _finite(rule.get("maximum_mean_absolute")),
                      f"{SUMMARY} rule (the identity names no bounds)")
    if rung == 3:
        return Bounds(0.0, 0.0, "rung 3: bit-exact, bound 0")
    return Bounds(None, None, "no rule: nothing bounds this run's drift (a calibration only measures)")


def _samples(root: Path, legacy: bool) -> tuple[list[SampleView], list[str]]:
    """Every ``samples/sample-<n>.json`` record, in order, with its series (or why it has none)."""
    notes: list[str] = []
    linked = [name for name in ("samples", "series") if os.path.islink(root / name)]
    if linked:  # never read through a link out of the receipt (verification reports it too)
        return [], [f"{linked[0]}/ is a symbolic link: its records are not read"]
    try:
        read = read_samples(root, limit=MAX_SAMPLES)
    except Refused as exc:
        return [], [one_line(str(exc))]
    if not read.found:
        notes.append("the receipt holds no sample records (the run stopped before its first handoff)")
    if read.found > MAX_SAMPLES:
        notes.append(f"the receipt holds {read.found} sample records; the first {MAX_SAMPLES} are shown")
    views: list[SampleView] = []
    for sample in read.samples:
        repetition = sample.repetition
        sample_notes: list[str] = [] if sample.problem is None else [sample.problem]
        record: Mapping[str, Any] | None = sample.record if isinstance(sample.record, dict) else None
        if record is None and sample.problem is None:
            sample_notes.append(f"samples/sample-{repetition}.json is not a JSON object")
        series: dict[str, np.ndarray] | None = None
        series_path = root / "series" / f"sample-{repetition}.safetensors"
        # A legacy receipt predates series altogether: the page says so once, not per sample.
        if not legacy and not os.path.lexists(series_path):
            sample_notes.append("no series: the sample failed before its comparison")
        elif not legacy:
            try:
                series = read_series(series_path)
            except Refused as exc:
                sample_notes.append(f"series unreadable: {one_line(str(exc)).removeprefix(f'series {series_path}: ')}")
        views.append(SampleView(repetition, record, series, tuple(sample_notes)))
    return views, notes


def _layer_count(samples: Sequence[SampleView]) -> int | None:
    for sample in samples:
        layers = sample.kv_layers()
        if layers is not None:
            return int(layers[0].shape[0])
    return None


def _basis_records(basis_dir: Path) -> list[dict[str, Any]]:
    """The basis receipt's sample records, reduced to their well-formed per-layer KV deltas (the
    only part the envelope reads), so a malformed record cannot derail the envelope."""
    records: list[dict[str, Any]] = []
    samples = sample_records(basis_dir)
    repetitions = list(samples)
    anchors = _anchor_repetitions(basis_dir)
    if anchors is not None:  # a v3 basis: the envelope is its fixture anchors', as the run localises against
        repetitions = [repetition for repetition in repetitions if repetition in anchors]
    for repetition in repetitions[:MAX_SAMPLES]:
        record = samples[repetition]
        items = _kv_items(record if isinstance(record, dict) else None)
        records.append({"localisation": {"kv_layer_max_abs": [
            {"layer": layer, "k": k, "v": v} for layer, k, v in items]}})
    return records


def _anchor_repetitions(basis_dir: Path) -> set[int] | None:
    """The fixture anchors' repetitions of a basis with ``evidence/calibration.json``; None for an
    older basis (every sample was a fixture handoff)."""
    if not (basis_dir / "evidence" / "calibration.json").is_file():
        return None
    evidence = read_receipt_json(basis_dir, "evidence/calibration.json")
    handoffs = evidence.get("handoffs") if isinstance(evidence, dict) else None
    return {h["repetition"] for h in handoffs or [] if isinstance(h, dict) and h.get("part") == "anchor"
            and type(h.get("repetition")) is int}


def _envelope(root: Path, identity: Mapping[str, Any] | None, rung: int | None, layers: int | None) -> Envelope:
    """The calibrated KV envelope from the identity's basis receipt, looked up in the receipt's own
    archive and then the repository's ``receipts/``; rung 3's is zero (bit-exact)."""
    if layers is None:
        return Envelope(None, "envelope unavailable: no sample holds per-layer KV deltas")
    if rung == 3:
        return Envelope([(0.0, 0.0)] * layers, "rung 3 is bit-exact: the envelope is zero in every layer")
    qualification = identity.get("onboarding_qualification") if identity is not None else None
    uri = qualification.get("basis") if isinstance(qualification, Mapping) else None
    if not isinstance(uri, str):
        return Envelope(None, "envelope unavailable: the identity names no basis receipt")
    reasons: list[str] = []
    for archive in dict.fromkeys((root.absolute().parent, DEFAULT_ARCHIVE_DIR)):
        try:
            basis = resolve_receipt_uri(uri, archive)
            envelope = kv_envelope_from_records(_basis_records(basis.parent), layers)
        except Refused as exc:
            reasons.append(one_line(str(exc)))
            continue
        except OSError as exc:
            reasons.append(f"{uri}: cannot read its samples ({exc.strerror or type(exc).__name__})")
            continue
        if envelope is None:
            return Envelope(None, f"envelope unavailable: basis receipt {basis.parent.name} records no per-layer KV deltas")
        return Envelope(envelope, f"envelope: per-layer maxima over the fixture anchors of basis receipt {basis.parent.name}")
    # The last archive tried is the repository's, where shipped lanes keep their basis receipts.
    return Envelope(None, f"envelope unavailable: {reasons[-1]}" if reasons else "envelope unavailable")


def load_receipt(path: Path, trust: TrustFile | None) -> ReceiptView:
    """Read one receipt for the page; :class:`Refused` (one line) for a directory that is no
    receipt or a summary that cannot be read, every other problem kept as a note."""
    where = f"receipt {shown(str(path))}"
    if not path.is_dir():
        raise Refused(f"{where}: {'no such directory' if not os.path.lexists(path) else 'not a directory'}, "
                      f"expected a receipt directory")
    if not is_receipt_directory(path):
        raise Refused(f"{where}: not a receipt (no {SUMMARY} or {MANIFEST}); to report on an archive, "
                      f"name its receipts")
    summary = read_summary(path)  # valid against its own version's schema, else refused
    check = authenticate_receipt(path, trust)
    state = "partial" if path.name.startswith(PARTIAL_PREFIX) else check.state
    predicate = check.predicate if state == "verified" else None
    notes: list[str] = []

    identity: Mapping[str, Any] | None = None
    if summary.get("identity_sha256") is not None:
        try:
            loaded = read_receipt_json(path, "identity.json")
            identity = loaded if isinstance(loaded, dict) else None
            if identity is None:
                notes.append("identity.json is not a JSON object")
        except Refused as exc:
            notes.append(one_line(str(exc)))
    host: Mapping[str, Any] | None = None
    if os.path.lexists(path / HOST):
        try:
            loaded = read_receipt_json(path, HOST)
            check_schema(loaded, CONTRACTS_DIR / "receipt-host.v1.schema.json", f"receipt {shown(path.name)}: {HOST}")
            host = loaded
        except Refused as exc:
            notes.append(one_line(str(exc)))
    else:
        notes.append(f"no {HOST}: the receipt predates host facts")

    manifest_schema = _manifest_schema(path)
    # A v1 manifest predates series; a receipt whose manifest is unreadable is judged by its files.
    legacy = manifest_schema == LEGACY_MANIFEST_SCHEMA or (
        manifest_schema != MANIFEST_SCHEMA and not os.path.lexists(path / "series"))
    samples, sample_notes = _samples(path, legacy)
    notes.extend(sample_notes)
    rung = summary.get("rung") if type(summary.get("rung")) is int else None
    if predicate is not None:
        verdict, reasons, scope_text = predicate["verdict"], list(predicate["reasons"]), predicate["scope"]
        status = predicate["status"]
    else:
        # The status as verification reads it (v1 summaries: from ``passed`` and ``error``); a
        # summary valid against its schema always yields one, unless it changed since it was read.
        if check.status is None:
            raise Refused(f"{where}: {SUMMARY}: no status on a second read, expected the summary "
                          f"read a moment before (is the receipt being written?)")
        status, verdict, reasons = check.status, summary["verdict"], list(summary["reasons"])
        consumer = host.get("consumer") if host is not None else None
        try:
            scope_text = scope(summary, host_summary(consumer if isinstance(consumer, Mapping) else None))
        except (KeyError, TypeError, AttributeError) as exc:
            scope_text = f"scope unavailable ({type(exc).__name__})"
    return ReceiptView(
        path=path, run_id=shown(path.name), state=state, signer=check.key_id,
        trust_source=trust.source if trust is not None else "no trust file",
        problems=list(check.problems), status=status, verdict=verdict, reasons=reasons, scope=scope_text,
        verdict_scope=summary.get("scope"),
        lane=_text(summary.get("lane")), recipe=_text(summary.get("recipe")), rung=rung,
        identity_sha256=_text(summary.get("identity_sha256")),
        started_utc=_text(summary.get("started_utc")), finished_utc=_text(summary.get("finished_utc")),
        legacy=legacy, bounds=_bounds(identity, summary, rung),
        envelope=_envelope(path, identity, rung, _layer_count(samples)),
        identity=identity, host=host, samples=samples, notes=notes,
        soak=os.path.lexists(path / "evidence" / "soak.json"),
    )
