"""What ``--json`` prints: one JSON document per command, each validating against its committed
schema ``contracts/cli-<command>.v<n>.schema.json`` (:data:`SCHEMA_VERSIONS`) and naming it in its
``schema`` field.

Every document carries ``status`` (``passed`` exit 0, ``failed`` exit 1, ``refused`` exit 2;
a recipe run interrupted by a signal exits 128 + its number with its receipt's status, normally
``incomplete``), ``exit_code`` (the process's), ``message`` (one line saying why the command did
not do its work: its refusal or interruption, the line it also wrote to stderr, or that there was
nothing to check; else null) and ``harness_version``. A command refused before it ran anything (a
bad argument, an unusable path) prints the short form: its schema and those four fields, nothing
else; its refusal line still goes to stderr. Numbers are JSON numbers; a non-finite measurement
is the string ``NaN``, ``Infinity`` or ``-Infinity``, as the receipt's sample records hold it.

The recipe run's document is read back from the receipt it sealed (summary, samples, host), so
what ``--json`` reports is what the receipt says, its ``scope`` (what the verdict covers: fixture
and controls) included.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qualify import __version__
from qualify.archive.layout import HOST
from qualify.archive.predicate import host_summary, scope
from qualify.archive.reader import read_receipt_json, read_summary, sample_records
from qualify.judge.scope import controls_words

if TYPE_CHECKING:  # the run modules import torch-free but heavy engine code; only their types here
    from qualify.contract.identity import Identity
    from qualify.run.calibrate import Calibration
    from qualify.run.onboarding import StepLine
    from qualify.run.selftest import FaultResult

STATUS_BY_EXIT = {0: "passed", 1: "failed", 2: "refused"}

PHASES = ("producer_compute", "serialize", "transport", "verify", "install", "decode", "recompute")
"""A sample's timed phases; the record's field is ``<phase>_s``."""


SCHEMA_VERSIONS: dict[str, int] = {"recipe": 2, "calibrate": 2, "receipts-verify": 2}
"""Each command's document version where it is past 1 (a closed schema gains a field only in a
new version): the recipe document's v2 adds ``scope``, receipts verify's the ``legacy`` state.
Older versions' schemas stay committed."""


def schema_id(command: str) -> str:
    """The ``schema`` field of ``command``'s document (also its schema file's ``$id``)."""
    return f"trust-ladder.cli-{command}.v{SCHEMA_VERSIONS.get(command, 1)}"


def schema_file(command: str) -> str:
    """The committed schema's file name under ``contracts/``."""
    return f"cli-{command}.v{SCHEMA_VERSIONS.get(command, 1)}.schema.json"


def json_number(value: object) -> object:
    """A measurement as strict JSON holds it: finite floats as numbers, non-finite ones as the
    strings the sample records use; anything else (None, an int, such a string) as it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    return value


def document_text(document: Mapping[str, Any]) -> str:
    """The document as printed: indented, ASCII only (a path with undecodable bytes prints on any
    terminal or pipe), never a NaN constant."""
    return json.dumps(document, indent=2, ensure_ascii=True, allow_nan=False) + "\n"


def emit(document: Mapping[str, Any]) -> None:
    """Write ``document`` to stdout, the only thing a ``--json`` command writes there."""
    sys.stdout.write(document_text(document))
    sys.stdout.flush()


def head(command: str, exit_code: int, message: str | None, status: str | None = None) -> dict[str, Any]:
    """The fields every document starts with."""
    return {"schema": schema_id(command), "status": status or STATUS_BY_EXIT.get(exit_code, "refused"),
            "exit_code": exit_code, "message": message, "harness_version": __version__}


def refusal_document(command: str, message: str, exit_code: int = 2) -> dict[str, Any]:
    """The short form: a command refused before it ran anything."""
    return head(command, exit_code, message, "refused")


def _int_or_none(value: object) -> int | None:
    return value if type(value) is int else None


def tokens_agreed(record: Mapping[str, Any]) -> int | None:
    """How many of the sample's output tokens agreed (its rate times its tokens), or None when
    the record lacks either."""
    rate, tokens = record.get("token_agreement_rate"), record.get("output_tokens")
    if type(tokens) is not int or not isinstance(rate, int | float) or not math.isfinite(rate):
        return None
    return round(rate * tokens)


def sample_document(record: Mapping[str, Any]) -> dict[str, Any]:
    """One sample's headline evidence from its record: tokens agreed, drift, payload, phase
    times and where it first diverged (the full record is the receipt's sample file)."""
    localisation = record.get("localisation")
    divergence = localisation.get("first_divergence_position") if isinstance(localisation, Mapping) else None
    return {
        "repetition": record.get("repetition"),
        "output_tokens": _int_or_none(record.get("output_tokens")),
        "tokens_agreed": tokens_agreed(record),
        "token_agreement_rate": json_number(record.get("token_agreement_rate")),
        "max_abs": json_number(record.get("max_abs")),
        "mean_abs": json_number(record.get("mean_abs")),
        "payload_bytes": _int_or_none(record.get("payload_bytes")),
        "payload_gbit_per_s": json_number(record.get("payload_gbit_per_s")),
        "phase_seconds": {phase: json_number(record.get(f"{phase}_s")) for phase in PHASES},
        "first_divergence_position": _int_or_none(divergence),
        "error": record.get("error"),
    }


def receipt_ref(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else {"path": str(path), "run_id": path.name}


def recipe_document(*, exit_code: int, message: str | None, recipe: str, identity_path: Path | None,
                    receipt: Path | None, status: str) -> dict[str, Any]:
    """A recipe run's document, read from the receipt it sealed (``receipt``: its status, verdict,
    scope and samples; the summary checked against its version's schema); with no receipt
    (interrupted before its identity loaded) only what the run knew: ``status``, no lane, verdict,
    scope or samples. ``scope`` is the summary's (null when the verdict has none, or the summary
    predates it)."""
    document = head("recipe", exit_code, message, status)
    document.update({"recipe": recipe, "lane": None, "rung": None,
                     "identity": {"path": None if identity_path is None else str(identity_path), "sha256": None},
                     "verdict": None, "scope": None, "samples": [], "receipt": receipt_ref(receipt)})
    if receipt is None:
        return document
    summary = read_summary(receipt)
    host = read_receipt_json(receipt, HOST)
    consumer = host.get("consumer") if isinstance(host, Mapping) else None
    document.update({
        "status": summary["status"], "recipe": summary.get("recipe") or recipe,
        "lane": summary.get("lane"), "rung": summary.get("rung"), "scope": summary.get("scope"),
        "samples": [sample_document(record) for record in sample_records(receipt).values()],
        "verdict": {"passed": summary["passed"], "headline": summary["verdict"], "reasons": list(summary["reasons"]),
                    "scope": scope(summary, host_summary(consumer if isinstance(consumer, Mapping) else None))},
    })
    document["identity"]["sha256"] = summary.get("identity_sha256")
    return document


def calibration_document(result: Calibration, *, exit_code: int, recipe: str, anchors: int,
                         steps: Sequence[StepLine]) -> dict[str, Any]:
    """A calibration's document: its cells, the bounds and floor its rules derive (or null), its
    controls, the operator's next steps as the console prints them, and its receipt."""
    proposed = None
    if result.proposed_maximum_absolute is not None:
        proposed = {"maximum_absolute": json_number(result.proposed_maximum_absolute),
                    "maximum_mean_absolute": json_number(result.proposed_maximum_mean_absolute)}
    if result.teacher_forced is not None:  # the fixture parted: the teacher-forced rule's numbers
        forced = result.teacher_forced
        proposed = {"maximum_absolute": json_number(forced.maximum_absolute),
                    "maximum_mean_absolute": json_number(forced.maximum_mean_absolute),
                    "near_tie_margin": forced.near_tie_margin,
                    "maximum_changed_row_share": forced.maximum_changed_row_share}
    document = head("calibrate", exit_code, None)
    document.update({
        "lane": result.lane, "recipe": recipe, "anchors": anchors, "headline": result.headline,
        "observed": {"max_abs": json_number(result.observed_max_abs),
                     "mean_abs": json_number(result.observed_mean_abs)},
        "cells": [{"document": cell.document, "prompt_tokens": cell.prompt_tokens, "max_abs": json_number(cell.max_abs),
                   "mean_abs": json_number(cell.mean_abs), "tokens_exact": cell.tokens_exact} for cell in result.cells],
        "tokens_exact": result.tokens_exact, "deterministic": result.deterministic,
        "proposed_rule": proposed, "acceptance_floor": result.acceptance_floor, "failures": list(result.failures),
        "controls": None if not result.controls_judgement else {
            "words": controls_words(result.controls) if result.controls is not None
            else "controls not established: " + "; ".join(result.controls_judgement.get("problems", [])),
            "judgement": result.controls_judgement},
        "samples": [sample_document(record) for record in result.records],
        "next_steps": [{"text": step.text, "style": step.style} for step in steps],
        "receipt": receipt_ref(result.receipt_path),
    })
    if result.non_deterministic:  # only then: a deterministic calibration's document is as it was
        envelope = result.envelope
        document["fixture_envelope"] = None if envelope is None else {
            "rule": envelope.rule, "handoffs": envelope.handoffs, "producer_starts": envelope.starts,
            "multipliers": list(envelope.multipliers)}
    return document


def selftest_document(results: Sequence[tuple[int, FaultResult]], *, exit_code: int,
                      receipts_kept: bool) -> dict[str, Any]:
    """The self-test's document: each fault lane run, whether it was caught and localised, and
    its receipt (null when the receipts went to a temporary directory, removed at the end)."""
    document = head("selftest", exit_code, None)
    document["faults"] = [
        {"fault": result.fault, "recipe": result.recipe, "rung": rung, "caught": result.caught,
         "localised": result.localised, "passed": result.passed, "finding": result.finding,
         "receipt": receipt_ref(result.receipt) if receipts_kept else None}
        for rung, result in results
    ]
    return document


def identity_check_document(path: Path, identity: Identity, digest: str, basis: Path) -> dict[str, Any]:
    """A valid identity's document: what it pins the run to, its digest and its basis receipt."""
    document = head("identity-check", 0, None)
    document.update({
        "path": str(path), "lane": identity.lane, "lane_kind": identity.lane_kind.value,
        "recipe": identity.recipe.value, "rung": identity.rung, "producer_mode": identity.producer_mode.value,
        "identity_sha256": digest,
        "basis": {"uri": identity.onboarding_qualification.basis, "path": str(basis)},
    })
    return document
