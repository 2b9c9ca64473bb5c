"""The run's contract: what one qualification checks against, derived from a sealed identity (or,
for a calibration, from the lane and its artifacts, with no rule), and the checks that refuse a
host or an identity before any handoff (exit 2)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qualify.contract.controls import model_contracts_dir
from qualify.contract.identity import Identity
from qualify.contract.lanes import (
    KQUANT_EXACT_LANE,
    VLLM_VIA_CONNECTOR_LANE,
    LaneSpec,
    ProducerMode,
    Recipe,
    engine_named,
    lane_for_engines,
    recipe_named,
)
from qualify.core import assets, model_choice
from qualify.core.digests import document_sha256
from qualify.core.errors import Refused
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
from qualify.judge.envelope import FixtureEnvelope
from qualify.judge.scope import ControlsOutcome, EnvelopeScope

ORDERED_HANDOFFS = 3
"""Every recipe runs three ordered handoffs (an identity declaring another count is refused)."""


def chosen_lane(recipe: str, producer: str, consumer: str) -> LaneSpec:
    """The lane an operator's ``--recipe``/``--producer``/``--consumer`` choice names; refuses an
    unknown recipe or engine, or a pair no lane runs."""
    return lane_for_engines(recipe_named(recipe), engine_named("--producer", producer),
                            engine_named("--consumer", consumer))


def default_identity_path(recipe: str, producer: str = "reference", consumer: str = "reference") -> Path:
    """The shipped identity a recipe qualifies when ``--identity`` is not given (for a vLLM
    producer or consumer, that pair's lane: ``--producer vllm`` alone is ``vllm-to-reference``).
    A chosen ``--model`` has no speculative draft: its k-quant recipe qualifies the draftless lane."""
    spec = chosen_lane(recipe, producer, consumer)
    choice = model_choice.chosen()
    if choice is None:
        return identity_path_for_lane(spec.name)
    path = identity_path_for_lane(KQUANT_EXACT_LANE if spec.speculative_draft else spec.name)
    if not path.is_file():
        frozen = [_frozen_lane_hint(other) for other in sorted(path.parent.glob("*-identity-v1.json"))]
        raise Refused(f"identity {path}: no such file: lane {path.name.removesuffix('-identity-v1.json')} has no "
                      f"frozen identity for --model {choice.name} (docs/models.md); frozen for it: "
                      f"{'; '.join(frozen) or 'none'}")
    return path


def _frozen_lane_hint(path: Path) -> str:
    """``lane (qualify --recipe R --identity PATH)`` for an identity file, or its name when unreadable
    (the hint only points; loading it is what checks it)."""
    try:
        from qualify.core.strict_json import read_strict_json

        document = read_strict_json(path, "identity")
        return f"{document['lane']} (qualify --recipe {document['recipe']} --identity {path})"
    except (Refused, KeyError, TypeError, ValueError):
        return path.name


def check_connector_pin(identity: Identity, pin: tuple[str, str] | None, where: str) -> None:
    """A connector lane's identity pins its connector (name, digest of the resolved connector); the
    run's connector (``--connector`` and its config) must be that one."""
    if identity.connector is None or pin is None:
        raise Refused(f"{where}: lane {identity.lane}: a connector lane needs --connector and its identity "
                      f"needs lane {VLLM_VIA_CONNECTOR_LANE}")
    name, sha256 = pin
    if (identity.connector.name, identity.connector.sha256) != (name, sha256):
        raise Refused(f"{where}: connector: the identity pins {identity.connector.name} sha256 "
                      f"{identity.connector.sha256}, the run's connector is {name} sha256 {sha256} (its module, "
                      f"class, package version or config differ); calibrate and freeze this connector's own identity")


def connector_identity_path(connector: str) -> Path:
    """Where a connector lane's frozen identity lives: ``contracts/connectors/<name>-identity-v1.json``
    (under ``contracts/models/<model>/`` for a chosen ``--model``)."""
    return model_contracts_dir() / "connectors" / f"{connector}-identity-v1.json"


def identity_path_for_lane(lane: str) -> Path:
    """Where a lane's frozen identity lives in ``contracts/``."""
    return model_contracts_dir() / f"{lane}-identity-v1.json"


@dataclass
class Contract:
    """Everything the run checks against, taken from a loaded identity (or, for calibration,
    derived from the lane and its artifacts, with no rule)."""

    spec: LaneSpec
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
    # The basis receipt's sample records (the calibration the rule came from). None for a calibration.
    basis_records: list[dict[str, Any]] | None = None
    # Its fixture anchor's records: the run's deterministic digests are rechecked against them
    # bit for bit (seed 000 §32.7, G3). None for a calibration.
    anchor_records: list[Mapping[str, Any]] | None = None
    # The lane's E2 controls as judged from the basis receipt (None: the identity declares none).
    controls: ControlsOutcome | None = None
    # The identity declares the producer's output deterministic (require_deterministic_remote_output).
    deterministic_producer: bool = True
    # How long the consumer waits for the producer per phase (phase_deadlines of the basis receipt).
    deadlines: PhaseDeadlines = DEFAULT_DEADLINES
    # The identity's link-rate floor in Gbit/s (None: it declares none): every handoff's payload
    # rate must reach it, so the producer must be reached over a network link.
    link_floor_gbit_per_s: float | None = None
    # A producer declared non-deterministic: the fixture envelope its basis receipt states, re-derived
    # and held to the identity's seal at load; every sample is held to it instead of an anchor.
    fixture_envelope: FixtureEnvelope | None = None

    @property
    def lane(self) -> str:
        """The lane's name, as receipts, logs and the producer's ``--lane`` carry it."""
        return self.spec.name

    @property
    def envelope_scope(self) -> EnvelopeScope | None:
        """What the verdict's scope says of the fixture envelope (None: no envelope judges the run)."""
        envelope = self.fixture_envelope
        return None if envelope is None else EnvelopeScope(envelope.rule, envelope.handoffs, envelope.starts)


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
    """A verified basis receipt's sample records, in repetition order
    (:func:`qualify.archive.reader.sample_records`); refused when unreadable or absent."""
    from qualify.archive.reader import sample_records

    try:
        records = list(sample_records(receipt_dir).values())
    except Refused as exc:
        raise Refused(f"basis receipt {receipt_dir.name}: unreadable sample ({exc})") from None
    if not records:
        raise Refused(f"basis receipt {receipt_dir.name}: no samples/sample-*.json to recheck against")
    return records


EVIDENCE_MAX_BYTES = 16 << 20
"""Largest evidence document read from a basis receipt (a controls record is some tens of kB)."""


def receipt_evidence(receipt_dir: Path, name: str) -> dict[str, Any]:
    """A receipt's ``evidence/<name>.json`` (strict JSON, bounded), refused when absent or unreadable:
    absent evidence is failed evidence."""
    from qualify.core.strict_json import read_strict_json

    path = receipt_dir / "evidence" / f"{name}.json"
    if not path.is_file() or path.is_symlink():
        raise Refused(f"basis receipt {receipt_dir.name}: evidence/{name}.json missing; it predates calibration "
                      f"sets (re-calibrate the lane: docs/calibration.md)")
    if path.stat().st_size > EVIDENCE_MAX_BYTES:
        raise Refused(f"basis receipt {receipt_dir.name}: evidence/{name}.json larger than {EVIDENCE_MAX_BYTES} bytes")
    document = read_strict_json(path, f"basis evidence {name}")
    if not isinstance(document, dict):
        raise Refused(f"basis receipt {receipt_dir.name}: evidence/{name}.json: found {type(document).__name__}, "
                      f"expected a JSON object")
    return document


def basis_rule_problems(identity: Identity, evidence: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """Why the identity's sealed numbers do not follow from its basis by its stated rules: the
    calibration set and rule the basis measured must be the identity's, and its bounds and draft
    floor must be what the rules derive from the basis (:mod:`qualify.judge.calibration`)."""
    from qualify.contract.identity import TeacherForcedLogits
    from qualify.judge.calibration import TeacherForcedBounds, bound_problems

    basis = identity.calibration
    problems = []
    stated_set = {"name": basis.set.name, "sha256": basis.set.sha256}
    if evidence.get("set") != stated_set:
        problems.append(f"calibration.set: the basis measured {evidence.get('set')!r}, the identity names {stated_set!r}")
    bounds = identity.onboarding_qualification.full_logits
    draft = identity.speculative_draft
    teacher_forced = None
    if isinstance(bounds, TeacherForcedLogits):
        teacher_forced = TeacherForcedBounds(bounds.maximum_absolute, bounds.maximum_mean_absolute,
                                             bounds.near_tie_margin, bounds.maximum_changed_row_share)
    problems += bound_problems(
        evidence, records,
        maximum_absolute=getattr(bounds, "maximum_absolute", None),
        maximum_mean_absolute=getattr(bounds, "maximum_mean_absolute", None),
        acceptance_floor=None if draft is None else draft.acceptance_floor,
        teacher_forced=teacher_forced)
    return problems


def basis_controls(identity: Identity, basis_dir: Path) -> ControlsOutcome | None:
    """The lane's E2 controls judged from its basis receipt against the committed criteria the
    identity pins; None when the identity declares none (refused if the criteria list the lane)."""
    from qualify.contract.controls import load_controls_criteria
    from qualify.judge.controls import judge_controls

    criteria, digest = load_controls_criteria()
    where = f"identity {identity.lane}: controls"
    if identity.controls is None:
        if identity.lane in criteria.lanes:
            raise Refused(f"{where}: found null, expected {criteria.name} (its criteria preregister lane {identity.lane})")
        return None
    if (identity.controls.name, identity.controls.sha256) != (criteria.name, digest):
        raise Refused(f"{where}: found {identity.controls.name} {identity.controls.sha256}, the committed criteria are "
                      f"{criteria.name} {digest}")
    source = f"receipt://{basis_dir.name}/evidence/controls.json"
    judged = judge_controls(receipt_evidence(basis_dir, "controls"), criteria.document(), source=source,
                            lane=identity.lane)
    if judged.outcome is None:
        raise Refused(f"{where}: the basis receipt's controls do not judge: {'; '.join(judged.problems)[:300]}")
    return judged.outcome


@dataclass(frozen=True)
class CheckedBasis:
    """An identity's basis receipt once every check passed: its file, samples, fixture anchors (none
    for a producer declared non-deterministic), judged controls, the fixture's handoffs (anchors or
    envelope handoffs) and, for a non-deterministic producer, its re-derived fixture envelope."""

    path: Path
    records: list[dict[str, Any]]
    anchors: list[Mapping[str, Any]]
    controls: ControlsOutcome | None
    fixture: list[Mapping[str, Any]]
    envelope: FixtureEnvelope | None = None


def checked_basis(identity: Identity, *, where: str) -> CheckedBasis:
    """Everything loading an identity checks of its basis (``qualify --recipe``, ``qualify identity
    check`` and enrollment alike): the receipt whole against its sealed manifest digest, the
    committed calibration set it names, every sealed number re-derived by the stated rules, at
    least two fixture anchors (for a producer declared non-deterministic: its fixture envelope,
    re-derived from the basis's series and held to the identity's seal), and its controls judged.
    Any failure is a one-line refusal (exit 2)."""
    from qualify.archive.reader import resolve_receipt_uri
    from qualify.archive.verify import check_receipt
    from qualify.contract.controls import load_calibration_set
    from qualify.contract.identity import check_basis_receipt
    from qualify.judge.calibration import anchor_records, fixture_records
    from qualify.run.fixture_envelope import basis_envelope

    uri = identity.onboarding_qualification.basis
    path = check_basis_receipt(identity, resolve_receipt_uri, check_receipt, where=where)
    records = receipt_sample_records(path.parent)
    calibration_set, set_digest = load_calibration_set()
    if (identity.calibration.set.name, identity.calibration.set.sha256) != (calibration_set.name, set_digest):
        raise Refused(f"{where}: calibration.set: found {identity.calibration.set.name} "
                      f"{identity.calibration.set.sha256}, the committed set is {calibration_set.name} {set_digest}")
    evidence = receipt_evidence(path.parent, "calibration")
    problems = basis_rule_problems(identity, evidence, records)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise Refused(f"{where}: a sealed number does not follow from its basis {uri}: {problems[0]}{more}")
    if not identity.deterministic_producer:  # no anchor: the fixture envelope instead
        envelope = basis_envelope(identity, path.parent, evidence, where=where)
        return CheckedBasis(path, records, [], basis_controls(identity, path.parent),
                            fixture_records(evidence, records), envelope)
    anchors = anchor_records(evidence, records)
    if len(anchors) < 2:
        raise Refused(f"{where}: basis {uri}: {len(anchors)} fixture anchor samples, expected at least 2 "
                      f"to recheck a run against")
    return CheckedBasis(path, records, anchors, basis_controls(identity, path.parent), anchors)


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
    identity pins: their ABI names the arithmetic and, for engines not exact by construction, the
    numeric environment (CPU ISA class, torch, CUDA, GPU), so a host the lane was not calibrated
    on is refused here, never judged as drift."""
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


def check_rope_cache(identity: Identity, head_dim: int, where: str) -> None:
    """Refuse (exit 2, before any handoff) a host whose reference RoPE tables differ from the
    tables the identity pins: the cold recompute and every numpy engine rotate with them, and their
    inverse frequencies are a transcendental that must come out the same on every host."""
    from qualify.engines.chosen_model import rope_scaling
    from qualify.engines.reference import rope_cache_sha256

    found = rope_cache_sha256(identity.rope.theta, head_dim, identity.context_policy.max_positions, rope_scaling())
    if found != identity.rope.cache_sha256:
        raise Refused(f"{where}: rope.cache_sha256: pinned {identity.rope.cache_sha256}, this host's RoPE tables "
                      f"(theta {identity.rope.theta}, head_dim {head_dim}, {identity.context_policy.max_positions} "
                      f"positions) give {found}; the identity was frozen with other RoPE arithmetic; to calibrate "
                      f"it again: qualify calibrate --recipe {identity.recipe.value} --lane {identity.lane}")


def check_model(identity: Identity, where: str) -> None:
    """Refuse (exit 2, before any engine runs) an identity frozen for another model than the
    process's (``--model``, or the shipped model), or one whose pinned files differ from the
    model's, naming the first differing file."""
    from qualify.engines.factory import checkpoint_digests

    choice = model_choice.chosen()
    chosen_name = None if choice is None else choice.name
    if identity.model_name != chosen_name:
        pinned = "the shipped model" if identity.model_name is None else f"--model {identity.model_name}"
        given = "the shipped model (no --model)" if chosen_name is None else f"--model {chosen_name}"
        raise Refused(f"{where}: checkpoint.files: pins {pinned}, the run has {given}")
    found = checkpoint_digests(identity.lane_kind)
    for name in sorted(set(found) | set(identity.checkpoint.files)):
        pinned_digest, found_digest = identity.checkpoint.files.get(name), found.get(name)
        if pinned_digest != found_digest:
            raise Refused(f"{where}: checkpoint.files: {name}: pinned sha256 {pinned_digest or 'absent'}, "
                          f"found {found_digest or 'absent'}")


def contract_from_identity(identity_path: Path, recipe: str, drift_graded: bool, consumer: Engine,
                           connector: tuple[str, str] | None = None) -> Contract:
    """Load and seal the identity (schema, strict model, sealed digest, basis receipt), check the built
    engines against its pins and derive the run's contract; refuses an identity of another
    recipe or whose artifacts or numeric environment no longer match."""
    from qualify.contract.identity import identity_sha256, load_identity
    from qualify.contract.units import logit_units_label
    from qualify.engines.factory import lane_producer_abi
    from qualify.engines.kat import check_known_answer, check_pinned
    from qualify.evidence.records import rule_from_identity
    from qualify.handoff.protocol import expectation_from_identity

    identity = load_identity(identity_path)
    check_model(identity, f"identity {identity_path}")
    if identity.lane == VLLM_VIA_CONNECTOR_LANE or connector is not None:
        check_connector_pin(identity, connector, f"identity {identity_path}")
    if identity.recipe != recipe:
        raise Refused(f"identity {identity_path}: recipe: found {identity.recipe.value}, the run is --recipe {recipe}")
    check_engine_pins(identity, consumer, lane_producer_abi(identity.spec))
    # The consumer's arithmetic, pinned by its bits on the known-answer input (the producer
    # process checks its own before it is ready: here only that the identity pins one). A missing
    # pin is refused naming its field before any KAT runs.
    for role, pin in (("producer", identity.producer_engine), ("consumer", identity.consumer_engine)):
        check_pinned(pin.name, pin.kat_sha256, role, f"identity {identity_path}")
    check_known_answer(consumer, identity.consumer_engine.kat_sha256, "consumer")
    consumer_geometry = consumer.geometry
    check_rope_cache(identity, consumer_geometry.head_dim, f"identity {identity_path}")
    prompt = assets.load_prompt(identity.prompt.name)
    if assets.prompt_sha256(prompt) != identity.onboarding_qualification.prompt_sha256:
        raise Refused(f"prompt {identity.prompt.name}: sha256 {assets.prompt_sha256(prompt)} differs from "
                      f"the identity's prompt_sha256 {identity.onboarding_qualification.prompt_sha256}")
    qualification = identity.onboarding_qualification
    # Rung 2's rule is a bounded drift: it can only be judged by grading the deltas.
    graded = drift_graded or identity.rung == 2
    basis = checked_basis(identity, where=f"identity {identity_path}")
    basis_records, anchors, controls = basis.records, basis.anchors, basis.controls
    # Localisation compares each layer's handed-off KV delta with the fixture's own handoffs' (the
    # anchor, which a deterministic producer reproduces exactly, or a non-deterministic producer's
    # envelope handoffs); the calibration cells, other documents, would hide a small fault under
    # their larger deltas.
    kv_envelope: list[tuple[float, float]] | None
    if identity.rung == 3:
        kv_envelope = [(0.0, 0.0)] * consumer_geometry.layers
    else:
        kv_envelope = kv_envelope_from_records([dict(record) for record in basis.fixture], consumer_geometry.layers)

    return Contract(
        spec=identity.spec,
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
        anchor_records=anchors,
        controls=controls,
        deterministic_producer=qualification.require_deterministic_remote_output,
        deadlines=phase_deadlines(basis_records),
        link_floor_gbit_per_s=None if identity.link_floor is None else identity.link_floor.gbit_per_s_minimum,
        fixture_envelope=basis.envelope,
    )


def run_contract(recipe: str, identity_path: Path) -> Contract:
    """The contract a ``qualify --recipe`` run under ``identity_path`` checks against, derived as the
    run derives it (the lane's consumer built, every check of :func:`contract_from_identity`), for
    ``qualify producer expect``: the ``--expect`` document a remote producer is started with."""
    from qualify.contract.identity import load_identity
    from qualify.engines.factory import build_consumer

    identity = load_identity(identity_path)
    return contract_from_identity(identity_path, recipe, False, build_consumer(identity.spec))


def comparison_bounds(rule: BoundedDriftRule | BitExactRule | None) -> tuple[float, float]:
    """The bounds a comparison localises against: rung 2's declared bounds, 0 for rung 3 (any
    difference breaks it), and no bound at all for a calibration, which only measures."""
    if isinstance(rule, BoundedDriftRule):
        return rule.maximum_absolute, rule.maximum_mean_absolute
    if isinstance(rule, BitExactRule):
        return 0.0, 0.0
    return sys.float_info.max, sys.float_info.max


def check_lane_engines(spec: LaneSpec, producer: str, consumer: str) -> None:
    """An identity whose lane runs other engines than ``--producer``/``--consumer`` is refused."""
    engines = spec.engines
    chosen = (engine_named("--producer", producer), engine_named("--consumer", consumer))
    if engines != chosen:
        raise Refused(f"identity lane {spec.name} runs producer {engines[0].value} and consumer {engines[1].value}, "
                      f"the run asked for --producer {producer} --consumer {consumer}")


CALIBRATION_SCHEMA = "trust-ladder.calibration.v3"
"""The document a calibration runs under in place of an identity (digest over its RFC 8785 bytes):
v3 names every handoff (the calibration set's cells, then the fixture anchors), the set and the
stated rules, and the controls criteria (v1/v2 receipts measured the fixture itself)."""


@dataclass(frozen=True)
class CalibrationHandoff:
    """One handoff a calibration makes: a calibration-set cell or a fixture anchor."""

    part: str  # qualify.judge.calibration.CALIBRATION_PART or ANCHOR_PART
    document: str
    prompt: np.ndarray


def calibration_contract(spec: LaneSpec, recipe: str, handoffs: list[CalibrationHandoff], *,
                         calibration_set: dict[str, str], controls: dict[str, str] | None,
                         output_tokens: int = 256, fixture_envelope: dict[str, Any] | None = None) -> Contract:
    """A contract for measuring a lane before its identity exists: the lane's real artifacts and
    cache identity, a calibration document (every handoff it will make, the set and the rules;
    for a producer declared non-deterministic, the fixture envelope it states: ``fixture_envelope``)
    in place of the identity, no rule, and the first handoff's prompt (the run switches prompts
    per handoff: :meth:`qualify.run.qualification.QualificationRun.switch_prompt`)."""
    from qualify.contract.rules import BOUND_RULE, BOUND_RULE_STATEMENT, FLOOR_RULE, FLOOR_RULE_STATEMENT
    from qualify.engines.factory import build_cache_identity, checkpoint_digests, lane_kv_dtype, producer_facts

    lane = spec.name
    if spec.recipe.value != recipe:
        raise Refused(f"lane {lane}: recipe: found {spec.recipe.value}, the run is --recipe {recipe}")
    if not handoffs:
        raise Refused(f"calibration of {lane}: no handoffs to make")
    producer = producer_facts(spec)
    cache_identity = build_cache_identity(spec)
    document: dict[str, Any] = {
        "schema": CALIBRATION_SCHEMA,
        "lane": lane,
        "recipe": recipe,
        "producer_mode": spec.mode.value,
        "producer_engine": {"name": producer.name, "version": producer.version, "abi": producer.abi},
        "checkpoint": checkpoint_digests(spec.kind),
        "calibration_set": dict(calibration_set),
        "bound_rule": {"name": BOUND_RULE, "statement": BOUND_RULE_STATEMENT},
        "floor_rule": ({"name": FLOOR_RULE, "statement": FLOOR_RULE_STATEMENT} if spec.speculative_draft else None),
        "handoffs": [{"part": handoff.part, "document": handoff.document, "prompt_tokens": len(handoff.prompt),
                      "prompt_sha256": assets.prompt_sha256(handoff.prompt)} for handoff in handoffs],
        "output_tokens": output_tokens,
        "controls": None if controls is None else dict(controls),
        "target_cache_identity_sha256": cache_identity,
    }
    if fixture_envelope is not None:  # only then: a deterministic calibration's document is as it was
        document["fixture_envelope"] = dict(fixture_envelope)
    digest = document_sha256(document)
    first = handoffs[0]
    return Contract(
        spec=spec, recipe=spec.recipe, rung=spec.recipe.rung, producer_mode=spec.mode,
        identity_document=document, identity_sha256=digest,
        target_cache_identity=cache_identity, logit_units="raw",
        prompt_name=first.document, prompt=first.prompt, prompt_sha256=assets.prompt_sha256(first.prompt),
        handoff_positions=len(first.prompt) - 1, output_tokens=output_tokens,
        repetitions=ORDERED_HANDOFFS, rule=None,
        expectation=ProducerExpectation(
            engine_version=producer.version, geometry=producer.geometry, identity_sha256=digest,
            engine_name=producer.name, engine_abi=producer.abi, digests=producer.digests,
            kv_dtype=lane_kv_dtype(spec)),
    )
