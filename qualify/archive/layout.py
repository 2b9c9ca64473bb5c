"""Receipts: every run, passing or failing, leaves one directory, created once, never rewritten.

This module holds what the writer (:mod:`qualify.archive.writer`), the verifier
(:mod:`qualify.archive.verify`) and the reader (:mod:`qualify.archive.reader`) share: the layout,
its names, the JSON file form, run ids and the archive's location.

Layout of ``<archive>/<run-id>/``::

    command.log               command line, then one timestamped line per log entry
    identity.json             the identity document, byte for byte (absent, like identity.sha256,
                              in a receipt of a run refused before its identity loaded)
    identity.sha256           its digest (``qualify.core.digests.document_sha256``: RFC 8785 for
                              current schemas, the legacy form for older ones)
    versions.json             engine and library versions
    host.json                 what each process ran on (below); absent in receipts older than it
    samples/sample-<n>.json   one sample record per handoff (n from 1)
    series/sample-<n>.safetensors  the per-position, per-layer series of that sample
                              (:mod:`qualify.evidence.series`); absent for a sample that failed
                              before its comparison
    series/envelope-<n>.safetensors  the four series a fixture envelope holds that handoff to
                              (a producer declared non-deterministic: its calibration's fixture
                              handoffs and every sample of its qualifications); absent where the
                              comparer computed none, which the envelope judges as failed
    validation-summary.json   the verdict over the run, with its status
    manifest.json             SHA-256 and size of every other file but the envelope (RFC 8785 bytes)
    attestation.dsse.json     the signed in-toto statement over every other file (written last;
                              :mod:`qualify.archive.attestation`)

The format, its threat model and an offline verifier: docs/receipts.md. Receipts from before
signing (manifest ``trust-ladder.receipt-manifest.v1``, no envelope) stay readable and are
reported as unsigned, never as verified.

``host.json`` is ``{"schema": "trust-ladder.receipt-host.v1", "consumer": F, "producers": [P, ...]}``
with one P per producer start, in order (a calibration restarts its producer for every handoff;
an empty list: no producer reached readiness), each P ``{"facts": F or null, "note": null or why
the facts are missing}``, each F a :func:`qualify.core.hostenv.host_facts` document: CPU model and
SIMD flags, BLAS library, kernel and threads, the kernel-selecting environment variables, numpy's
SIMD dispatch, torch threads and GPU, the harness's git commit. The consumer's are taken when the
receipt is finalized (in the writing process), the producer's are what it reported when ready.
Recorded, never judged: they explain why a lane calibrated on one host behaves otherwise on another.

Atomicity: the run id is claimed by an exclusive ``mkdir`` of the final directory; everything is
written into ``<archive>/.partial-<run-id>/`` and renamed over the (still empty) claimed directory
only after the manifest is complete. A crash therefore leaves an empty claimed directory and a
``.partial-`` one, which verification reports as incomplete, never a receipt that looks complete.
Finalized files are made read-only.

Archive location: ``--receipts DIR``, else ``$QUALIFY_RECEIPTS``, else
``$XDG_DATA_HOME/trust-ladder/receipts``, else ``~/.local/share/trust-ladder/receipts``: outside
the checkout, so demo runs never dirty it. The repository's ``receipts/`` holds committed basis
receipts. A receipt is addressed as ``receipt://<run-id>/<file>``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qualify.core.assets import require_asset

MANIFEST_SCHEMA = "trust-ladder.receipt-manifest.v2"
MANIFEST_SCHEMA_PATH = require_asset("contracts/receipt-manifest.v2.schema.json")
LEGACY_MANIFEST_SCHEMA = "trust-ladder.receipt-manifest.v1"
LEGACY_MANIFEST_SCHEMA_PATH = require_asset("contracts/receipt-manifest.v1.schema.json")
MANIFEST = "manifest.json"
SUMMARY = "validation-summary.json"
HOST = "host.json"
HOST_SCHEMA = "trust-ladder.receipt-host.v1"
IDENTITY_FILES: tuple[str, ...] = ("identity.json", "identity.sha256")
"""The identity a run was under: in every receipt but one of a run refused before its identity
loaded (its summary's ``identity_sha256`` is null, its status refused), which holds neither."""
REQUIRED_FILES: tuple[str, ...] = (
    "command.log",
    "versions.json",
    SUMMARY,
)
"""Files every receipt holds besides the manifest (samples may be none, for an early failure);
:data:`IDENTITY_FILES` too, unless it records a run refused before its identity loaded."""

PARTIAL_PREFIX = ".partial-"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SAMPLE_PATH = re.compile(r"^samples/sample-[1-9][0-9]*\.json$")
URI_PREFIX = "receipt://"
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


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


def receipt_uri(run_id: str, file: str = SUMMARY) -> str:
    """``receipt://<run-id>/<file>``."""
    return f"{URI_PREFIX}{run_id}/{file}"


def is_safe_relative(path: object) -> bool:
    """A plain relative path inside a receipt: segments of letters, digits, '.', '_', '-', none
    starting with '.' (so no '..', no hidden files)."""
    return isinstance(path, str) and all(_SEGMENT.fullmatch(part) for part in path.split("/"))


# --------------------------------------------------------------------------- the JSON file form


def json_safe(value: Any) -> Any:
    """Non-finite floats become the strings NaN/Infinity/-Infinity so they reach the judge."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_bytes(document: Any) -> bytes:
    """The receipt's JSON file form: sorted keys, 2-space indent, trailing newline, no NaN."""
    text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")
