"""Calibrating a served pair (issue 36 item 3): ``qualify calibrate --recipe native-text
--prefill-url U --decode-url V [--model M] --identity PATH``.

1. **Checks**, each refused in one line (exit 2, with a refused receipt): both URLs; ``--identity``
   a new file in a writable directory (an identity is never overwritten); both servers as a
   qualification checks them (:func:`qualify.run.served_pair.check_pair`).
2. **The evidence**: the strongest logprobs the decode server grants
   (:func:`~qualify.run.served_pair.probe_evidence`: full, else top-k for the largest k).
3. **The cells**: every document of the calibration set (kept apart from the fixture) at every
   prompt length of the set, each served three ways, in this order: a cold recompute on the decode
   server, a second cold recompute, and one handoff (prefill on the prefill server with the
   disaggregated-prefill ``kv_transfer_params``, decode from the transferred KV), each around the
   servers' ``/metrics`` so a branch that was not cold, or a handoff that was not one, fails the
   calibration.
4. **The judge** (:mod:`qualify.judge.served_calibration`): cold-vs-cold and handoff-vs-cold, per
   position the maximum and mean |Δ logprob| (top-k: with the rank and membership moves), the
   bounds by :data:`~qualify.contract.rules.SERVED_BOUND_RULE`, the lanes' policy.
5. **The receipt** (signed, like every run's: ``identity.json`` the pair as checked,
   ``evidence/served-calibration.json`` every cell's comparisons and series), and, when the
   calibration passed, **the identity** at ``--identity``: it pins the pair, the evidence, the
   bounds and rules, the fixture prompt's digest, and the receipt with its signed statement's digest.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qualify.archive.attestation import ENVELOPE
from qualify.archive.layout import receipt_uri
from qualify.archive.writer import ReceiptWriter
from qualify.contract.controls import load_calibration_set, load_document
from qualify.contract.rules import SERVED_BOUND_RULE, SERVED_RULES, SERVED_TOP_K_RULE
from qualify.contract.served_identity import SERVED_IDENTITY_SCHEMA, served_identity_document
from qualify.core import assets
from qualify.core.digests import sha256_file
from qualify.core.errors import Refused
from qualify.judge import Verdict, judge_refused
from qualify.judge.served import FULL, Evidence, ServedHandoff
from qualify.judge.served_calibration import (
    SERVED_CALIBRATION_EVIDENCE,
    ServedCalibrationJudgement,
    ServedCell,
    judge_served_calibration,
)
from qualify.run.served_pair import (
    LANE,
    OUTPUT_TOKENS,
    REPETITIONS,
    Pair,
    ServedOptions,
    check_pair,
    check_urls,
    decode_branch,
    handoff,
    handoff_line,
    probe_evidence,
)


@dataclass
class ServedCalibration:
    """A served calibration's outcome: its verdict, receipt, the identity written (None unless it
    passed), the command to run next and the lines it showed."""

    verdict: Verdict | None = None
    receipt_path: Path | None = None
    identity_path: Path | None = None
    judgement: ServedCalibrationJudgement | None = None
    next_command: str | None = None
    log: list[str] = field(default_factory=list)


def check_identity_path(path: Path | None) -> Path:
    """``--identity``: given, not there yet, in a directory this process can write."""
    if path is None:
        raise Refused("--identity: missing; the calibration writes the pair's identity there (a new JSON file)")
    if os.path.lexists(path):
        raise Refused(f"--identity {path}: exists; an identity is never overwritten (name a new file)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise Refused(f"--identity {path}: {parent} is not a writable directory")
    return path


def _write_identity(path: Path, document: dict[str, Any]) -> None:
    data = (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise Refused(f"--identity {path}: appeared during the calibration; an identity is never overwritten") from None
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def identity_document(pair: Pair, evidence: Evidence, judgement: ServedCalibrationJudgement,
                      calibration_set: dict[str, Any], basis: str, statement_sha256: str) -> dict[str, Any]:
    """The identity a passing calibration writes (schema ``trust-ladder.served-pair-identity.v1``)."""
    bounds = judgement.bounds
    if bounds is None:  # pragma: no cover - only a passing calibration, which derived its bounds, writes one
        raise Refused("served calibration: no bounds derived, no identity written")
    decode, prefill = pair.decode, pair.prefill
    return {
        "schema": SERVED_IDENTITY_SCHEMA, "recipe": "native-text", "lane": LANE,
        "prefill": {"vllm_version": prefill.version, "max_model_len": prefill.max_model_len},
        "decode": {"vllm_version": decode.version, "max_model_len": decode.max_model_len},
        "model": {"name": pair.model.name, "served_model_id": decode.model_id, "config_sha256": decode.config_sha256,
                  "model_check": decode.checked_by},
        "evidence": {"mode": evidence.mode, "top_k": evidence.k, "vocab": evidence.vocab},
        "rule": {"maximum_absolute": bounds.maximum_absolute, "maximum_mean_absolute": bounds.maximum_mean_absolute,
                 "bound_rule": {"name": SERVED_BOUND_RULE, "statement": SERVED_RULES[SERVED_BOUND_RULE]},
                 "top_k_rule": None if evidence.mode == FULL else
                 {"name": SERVED_TOP_K_RULE, "statement": SERVED_RULES[SERVED_TOP_K_RULE]}},
        "fixture": {"name": assets.MAIN_PROMPT, "prompt_tokens": len(pair.model.prompt),
                    "prompt_sha256": pair.prompt_sha256, "output_tokens": OUTPUT_TOKENS, "repetitions": REPETITIONS},
        "calibration": {"set": calibration_set, "cells": len(judgement.cells)},
        "basis": {"receipt": basis, "statement_sha256": statement_sha256},
    }


def qualify_command(options: ServedOptions, identity: Path) -> str:
    """The qualification to run next, under the identity just written."""
    quote = shlex.quote
    model = f" --model {quote(options.model)}" if options.model else ""
    return (f"qualify --recipe {options.recipe} --prefill-url {quote(str(options.prefill_url))} --decode-url "
            f"{quote(str(options.decode_url))}{model} --served-identity {quote(str(identity))} "
            f"--receipts {quote(str(options.receipts))}")


def run_served_calibration(options: ServedOptions, identity_path: Path | None,
                           show: Callable[[str], None]) -> ServedCalibration:
    """Check, measure, judge and archive; write the identity when the calibration passed. Every
    refusal leaves a refused receipt (``result.verdict.refused``)."""
    result = ServedCalibration()

    def note(line: str) -> None:
        result.log.append(line)
        show(line)

    try:
        return _calibrate(options, identity_path, result, note)
    except Refused as exc:
        reason = str(exc)
        result.verdict = judge_refused(reason)
        with ReceiptWriter(options.receipts, command_line=options.command_line, identity=None,
                           recipe=options.recipe, lane=LANE) as writer:
            for line in result.log:
                writer.log(line)
            result.receipt_path = writer.finalize(result.verdict)
        return result


def _calibrate(options: ServedOptions, identity_path: Path | None, result: ServedCalibration,
               note: Callable[[str], None]) -> ServedCalibration:
    check_urls(options)
    target = check_identity_path(identity_path)
    pair = check_pair(options, note)
    calibration_set, set_digest = load_calibration_set()
    set_ref = {"name": calibration_set.name, "sha256": set_digest}
    plan = [(entry.name, length) for entry in calibration_set.documents for length in calibration_set.prompt_lengths]
    longest = max(length for _name, length in plan) + OUTPUT_TOKENS
    for server in (pair.prefill, pair.decode):
        if server.max_model_len is not None and server.max_model_len < longest:
            raise Refused(f"{server.endpoint.option} {server.endpoint.base}: max_model_len {server.max_model_len} is "
                          f"shorter than the calibration set's {longest} tokens")
    evidence = probe_evidence(pair.decode, pair.model)
    note(f"evidence: the decode server grants {evidence.words()}; calibrating {len(plan)} cells of {calibration_set.name} "
         f"(each: cold recompute, second cold recompute, handoff)")
    cells: list[ServedCell] = []
    with ReceiptWriter(options.receipts, command_line=options.command_line, identity=pair.document(),
                       recipe=options.recipe, lane=LANE,
                       rule={"kind": "served-pair-calibration", "evidence": evidence.mode, "top_k": evidence.k,
                             "vocab": evidence.vocab, "bound_rule": SERVED_BOUND_RULE}) as writer:
        for line in result.log:
            writer.log(line)
        try:
            for index, (name, length) in enumerate(plan, start=1):
                started = time.monotonic()
                prompt = [int(t) for t in load_document(name)[:length]]
                label = f"cell {index}/{len(plan)} {name}@{length}"
                cold = decode_branch(pair.decode, prompt, evidence, None, f"{label} cold recompute")
                again = decode_branch(pair.decode, prompt, evidence, None, f"{label} second cold recompute")
                done: ServedHandoff = handoff(pair, prompt, evidence, index, f"{label} handoff")
                cells.append(ServedCell(name, length, cold, again, done))
                line = (f"{label}: cold connector {cold.external_hits}/prefix cache {cold.local_hits}, second cold "
                        f"{again.external_hits}/{again.local_hits}; " + handoff_line("handoff", done, started))
                writer.log(line)
                note(line)
        except Refused as exc:  # a server failed mid-run: the receipt says so, refused
            result.verdict = judge_refused(str(exc))
            result.receipt_path = writer.finalize(result.verdict)
            return result
        judgement = judge_served_calibration(cells, evidence, output_tokens=OUTPUT_TOKENS)
        result.judgement = judgement
        writer.add_evidence(SERVED_CALIBRATION_EVIDENCE, judgement.evidence(evidence, set_ref, OUTPUT_TOKENS))
        result.verdict = judgement.verdict
        result.receipt_path = writer.finalize(judgement.verdict)
        run_id = writer.run_id
    if not judgement.verdict.passed:
        return result
    basis = receipt_uri(run_id, "").rstrip("/")
    document = identity_document(pair, evidence, judgement, set_ref, basis,
                                 sha256_file(result.receipt_path / ENVELOPE))
    _write_identity(target, served_identity_document(document, f"--identity {target}"))
    result.identity_path = target
    result.next_command = qualify_command(options, target)
    return result
