"""The run's contract: what one qualification checks against, derived from a sealed identity (or,
for a calibration, from the lane and its artifacts, with no rule), and the checks that refuse a
host or an identity before any handoff (exit 2)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qualify.contract.identity import Identity
from qualify.contract.lanes import (
    LaneSpec,
    ProducerMode,
    Recipe,
    engine_named,
    lane_for_engines,
    lane_spec,
    recipe_named,
)
from qualify.core import assets
from qualify.core.digests import document_sha256
from qualify.core.errors import Refused, one_line
from qualify.engines.base import Engine
from qualify.evidence.records import BitExactRule, BoundedDriftRule
from qualify.handoff.protocol import (
    CALIBRATED_FACTOR,
    DEFAULT_DEADLINES,
    HANDOFF_FLOOR_S,
    READY_FLOOR_S,
    SILENCE_S,
    VERIFY_FLOOR_S,
    PhaseDeadlines,
    ProducerExpectation,
    seconds_or_none,
)

ORDERED_HANDOFFS = 3
"""Every recipe runs three ordered handoffs (an identity declaring another count is refused)."""


def chosen_lane(recipe: str, producer: str, consumer: str) -> LaneSpec:
    """The lane an operator's ``--recipe``/``--producer``/``--consumer`` choice names; refuses an
    unknown recipe or engine, or a pair no lane runs."""
    return lane_for_engines(recipe_named(recipe), engine_named("--producer", producer),
                            engine_named("--consumer", consumer))


def default_identity_path(recipe: str, producer: str = "reference", consumer: str = "reference") -> Path:
    """The shipped identity a recipe qualifies when ``--identity`` is not given (for a vLLM
    producer or consumer, that pair's lane: ``--producer vllm`` alone is ``vllm-to-reference``)."""
    return identity_path_for_lane(chosen_lane(recipe, producer, consumer).name)


def identity_path_for_lane(lane: str) -> Path:
    """Where a lane's frozen identity lives in ``contracts/``."""
    return assets.CONTRACTS_DIR / f"{lane}-identity-v1.json"


@dataclass
class Contract:
    """Everything the run checks against, taken from a loaded identity (or, for calibration,
    derived from the lane and its artifacts, with no rule)."""

    lane: str
    recipe: Recipe
    rung: int
    producer_mode: ProducerMode
    # The frozen identity file the run is under, or, for a calibration, the document describing it.
    identity_document: Path | dict[str, Any]
    identity_sha256: str
    target_cache_identity: str
    logit_units: str
    prompt_name: str
    prompt: np.ndarray
    prompt_sha256: str
    handoff_positions: int
    output_tokens: int
    repetitions: int
    rule: BoundedDriftRule | BitExactRule | None
    expectation: ProducerExpectation
    # Per layer (K, V): the largest handed-off KV delta the lane's basis receipt measured; a
    # sample's layers above it are where a fault sits. Rung 3's envelope is zero everywhere.
    kv_envelope: list[tuple[float, float]] | None = None
    # The basis receipt's sample records (the calibration the rule came from): the run's
    # deterministic digests are rechecked against them. None for a calibration.
    basis_records: list[dict[str, Any]] | None = None
    # The identity declares the producer's output deterministic (require_deterministic_remote_output).
    deterministic_producer: bool = True
    # How long the consumer waits for the producer per phase (phase_deadlines of the basis receipt).
    deadlines: PhaseDeadlines = DEFAULT_DEADLINES


def phase_deadlines(basis_records: list[dict[str, Any]]) -> PhaseDeadlines:
    """The consumer's deadlines for a lane, from its basis receipt: CALIBRATED_FACTOR times the
    slowest calibrated handoff (producer compute + serialize + transport) for a handoff, and times
    the slowest compute for start-up (engine build and a short warm-up prefill), each never under
    its floor; the handshake and the silence limit are fixed (neither grows with the model)."""
    handoff_s, compute_s = 0.0, 0.0
    for record in basis_records:
        phases = [seconds_or_none(record.get(name)) for name in ("producer_compute_s", "serialize_s", "transport_s")]
        known = [value for value in phases if value is not None]
        if len(known) == len(phases):
            handoff_s = max(handoff_s, sum(known))
            compute_s = max(compute_s, known[0])
    return PhaseDeadlines(
        ready_s=max(READY_FLOOR_S, CALIBRATED_FACTOR * compute_s),
        verify_s=VERIFY_FLOOR_S,
        handoff_s=max(HANDOFF_FLOOR_S, CALIBRATED_FACTOR * handoff_s),
        silence_s=SILENCE_S,
    )


def receipt_sample_records(receipt_dir: Path) -> list[dict[str, Any]]:
    """A receipt's sample records, in repetition order (refused when unreadable or absent)."""
    import json

    try:
        paths = sorted((receipt_dir / "samples").glob("sample-*.json"),
                       key=lambda path: int(path.stem.removeprefix("sample-")))
        if not paths:
            raise Refused(f"basis receipt {receipt_dir.name}: no samples/sample-*.json to recheck against")
        return [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    except (OSError, ValueError) as exc:
        raise Refused(f"basis receipt {receipt_dir.name}: unreadable sample ({one_line(str(exc))})") from None


def kv_envelope_from_records(records: list[dict[str, Any]], layers: int) -> list[tuple[float, float]] | None:
    """Per-layer max K and V deltas over a calibration receipt's samples (None if it has none)."""
    envelope = [(0.0, 0.0)] * layers
    found = False
    for record in records:
        localisation = record.get("localisation") or {}
        for item in localisation.get("kv_layer_max_abs") or []:
            layer = item["layer"]
            if layer < layers:
                k, v = envelope[layer]
                envelope[layer] = (max(k, item["k"]), max(v, item["v"]))
                found = True
    return envelope if found else None


def check_engine_pins(identity: Identity, consumer: Engine, producer_abi: str) -> None:
    """Refuse (exit 2, before any handoff) a host whose built engines differ from the engines the
    identity pins: their ABI names the numeric environment (numpy and BLAS, CPU ISA class, torch,
    CUDA, GPU), so a host the lane was not calibrated on is refused here, never judged as drift."""
    calibrate_hint = f"qualify calibrate --recipe {identity.recipe.value} --lane {identity.lane}"
    found_and_pinned = {
        "producer_engine.abi": (producer_abi, identity.producer_engine.abi),
        "consumer_engine.name": (consumer.name, identity.consumer_engine.name),
        "consumer_engine.version": (consumer.version, identity.consumer_engine.version),
        "consumer_engine.abi": (consumer.abi, identity.consumer_engine.abi),
    }
    for field_name, (found, expected) in found_and_pinned.items():
        if found == expected:
            continue
        found_parts, expected_parts = set(str(found).split("+")), set(str(expected).split("+"))
        difference = "; ".join(part for part in (
            f"only here: {', '.join(sorted(found_parts - expected_parts))}" if found_parts - expected_parts else "",
            f"only pinned: {', '.join(sorted(expected_parts - found_parts))}" if expected_parts - found_parts else "",
        ) if part) or "the same parts in another order"
        raise Refused(
            f"identity {identity.lane}: {field_name}: found {found!r} on this host, expected "
            f"{expected!r} ({difference}); the lane is calibrated for another numeric environment; "
            f"to calibrate it for this host: {calibrate_hint}")


def contract_from_identity(identity_path: Path, recipe: str, drift_graded: bool, consumer: Engine) -> Contract:
    """Load and seal the identity (schema, strict model, sealed digest, basis receipt), check the built
    engines against its pins and derive the run's contract; refuses an identity of another
    recipe or whose artifacts or numeric environment no longer match."""
    from qualify.contract.identity import identity_sha256, load_identity
    from qualify.contract.units import logit_units_label
    from qualify.engines.factory import check_adapter, lane_producer_abi
    from qualify.evidence.records import rule_from_identity
    from qualify.handoff.protocol import expectation_from_identity

    identity = load_identity(identity_path)
    check_adapter(identity.lane_kind, identity.adapter.name, identity.adapter.sha256)
    if identity.recipe != recipe:
        raise Refused(f"identity {identity_path}: recipe: found {identity.recipe.value}, the run is --recipe {recipe}")
    check_engine_pins(identity, consumer, lane_producer_abi(identity.lane))
    consumer_geometry = consumer.geometry
    prompt = assets.load_prompt(identity.prompt.name)
    if assets.prompt_sha256(prompt) != identity.onboarding_qualification.prompt_sha256:
        raise Refused(f"prompt {identity.prompt.name}: sha256 {assets.prompt_sha256(prompt)} differs from "
                      f"the identity's prompt_sha256 {identity.onboarding_qualification.prompt_sha256}")
    qualification = identity.onboarding_qualification
    # Rung 2's rule is a bounded drift: it can only be judged by grading the deltas.
    graded = drift_graded or identity.rung == 2
    from qualify.archive.reader import resolve_receipt_uri
    from qualify.archive.verify import check_receipt
    from qualify.contract.identity import check_basis_receipt

    basis = check_basis_receipt(identity, resolve_receipt_uri, check_receipt, where=f"identity {identity_path}")
    basis_records = receipt_sample_records(basis.parent)
    kv_envelope: list[tuple[float, float]] | None
    if identity.rung == 3:
        kv_envelope = [(0.0, 0.0)] * consumer_geometry.layers
    else:
        kv_envelope = kv_envelope_from_records(basis_records, consumer_geometry.layers)
    return Contract(
        lane=identity.lane,
        recipe=identity.recipe,
        rung=identity.rung,
        producer_mode=identity.producer_mode,
        identity_document=identity_path,
        identity_sha256=identity_sha256(identity),
        target_cache_identity=identity.target_cache_identity_sha256,
        logit_units=logit_units_label(identity.logit_units),
        prompt_name=identity.prompt.name,
        prompt=prompt,
        prompt_sha256=qualification.prompt_sha256,
        handoff_positions=identity.context_policy.handoff_positions,
        output_tokens=qualification.output_tokens,
        repetitions=qualification.repetitions,
        rule=rule_from_identity(identity, drift_graded=graded),
        expectation=expectation_from_identity(identity, consumer_geometry),
        kv_envelope=kv_envelope,
        basis_records=basis_records,
        deterministic_producer=qualification.require_deterministic_remote_output,
        deadlines=phase_deadlines(basis_records),
    )


def comparison_bounds(rule: BoundedDriftRule | BitExactRule | None) -> tuple[float, float]:
    """The bounds a comparison localises against: rung 2's declared bounds, 0 for rung 3 (any
    difference breaks it), and no bound at all for a calibration, which only measures."""
    if isinstance(rule, BoundedDriftRule):
        return rule.maximum_absolute, rule.maximum_mean_absolute
    if isinstance(rule, BitExactRule):
        return 0.0, 0.0
    return sys.float_info.max, sys.float_info.max


def check_lane_engines(lane: str, producer: str, consumer: str) -> None:
    """An identity whose lane runs other engines than ``--producer``/``--consumer`` is refused."""
    engines = lane_spec(lane).engines
    chosen = (engine_named("--producer", producer), engine_named("--consumer", consumer))
    if engines != chosen:
        raise Refused(f"identity lane {lane} runs producer {engines[0].value} and consumer {engines[1].value}, "
                      f"the run asked for --producer {producer} --consumer {consumer}")


CALIBRATION_SCHEMA = "trust-ladder.calibration.v2"
"""The document a calibration runs under in place of an identity; v2's digest is over its RFC 8785
bytes (``qualify.core.digests.document_sha256``; v1 receipts keep the legacy form)."""


def calibration_contract(lane: str, recipe: str, prompt_name: str = assets.MAIN_PROMPT,
                         output_tokens: int = 256) -> Contract:
    """A contract for measuring a lane before its identity exists: the lane's real artifacts and
    cache identity, a calibration document in place of the identity, and no rule."""
    from qualify.contract.lanes import lane_spec
    from qualify.engines.factory import build_cache_identity, checkpoint_digests, lane_kv_dtype, producer_facts

    spec = lane_spec(lane)
    if spec.recipe.value != recipe:
        raise Refused(f"lane {lane}: recipe: found {spec.recipe.value}, the run is --recipe {recipe}")
    producer = producer_facts(lane)
    prompt = assets.load_prompt(prompt_name)
    handoff_positions = len(prompt) - 1
    cache_identity = build_cache_identity(spec)
    prompt_sha256 = assets.prompt_sha256(prompt)
    document: dict[str, Any] = {
        "schema": CALIBRATION_SCHEMA,
        "lane": lane,
        "recipe": recipe,
        "producer_mode": spec.mode.value,
        "producer_engine": {"name": producer.name, "version": producer.version, "abi": producer.abi},
        "checkpoint": checkpoint_digests(spec.kind),
        "prompt": {"name": prompt_name, "sha256": prompt_sha256},
        "handoff_positions": handoff_positions,
        "output_tokens": output_tokens,
        "target_cache_identity_sha256": cache_identity,
    }
    digest = document_sha256(document)
    return Contract(
        lane=lane, recipe=spec.recipe, rung=spec.recipe.rung, producer_mode=spec.mode,
        identity_document=document, identity_sha256=digest,
        target_cache_identity=cache_identity, logit_units="raw",
        prompt_name=prompt_name, prompt=prompt, prompt_sha256=prompt_sha256,
        handoff_positions=handoff_positions, output_tokens=output_tokens,
        repetitions=ORDERED_HANDOFFS, rule=None,
        expectation=ProducerExpectation(
            engine_version=producer.version, geometry=producer.geometry, identity_sha256=digest,
            engine_name=producer.name, engine_abi=producer.abi, digests=producer.digests,
            kv_dtype=lane_kv_dtype(spec)),
    )

