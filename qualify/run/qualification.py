"""One qualification run: the recipe's seven ordered steps, from sealed identity to verdict.

The same :class:`QualificationRun` backs the pytest recipe modules (one test per step) and
``qualify --recipe`` (which drives the steps in-process with progress). Each handoff sample is a
real producer process handing KV across a Unix socket under a fresh run key; the consumer
verifies and installs it, decodes 256 greedy tokens keeping every full logit row, and compares
against its own cold local recompute. Judging happens in :mod:`qualify.judge`; this module only
gathers evidence and writes it to the receipt.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qualify import __version__
from qualify.core import assets
from qualify.core.digests import canonical_sha256
from qualify.core.errors import HandoffRefused, ProducerFailed, Refused, one_line
from qualify.core.kv import KVCache
from qualify.engines import faults
from qualify.engines.base import DecodeResult, Engine
from qualify.evidence.compare import compare_branches, transform_between
from qualify.evidence.records import BitExactRule, BoundedDriftRule, failed_sample_record, record_json, sample_record
from qualify.judge import Verdict, judge_qualification, judge_sample

STEP_LABELS: tuple[str, ...] = (
    "identity sealed",
    "producer ready",
    "reference computed",
    "handoff 1/3",
    "handoff 2/3",
    "handoff 3/3",
    "verdict",
)
HANDOFF_STEPS = STEP_LABELS[3:6]


ENGINE_CHOICES = ("reference", "vllm")


def lane_for_engines(recipe: str, producer: str, consumer: str) -> str | None:
    """The vLLM lane an operator's ``--producer``/``--consumer`` choice names (None: the recipe's
    embedded default, both ``reference``); refuses a choice no lane implements."""
    from qualify.contract.lanes import VLLM_LANE_ENGINES

    for name, value in (("--producer", producer), ("--consumer", consumer)):
        if value not in ENGINE_CHOICES:
            raise Refused(f"{name}: found {value!r}, expected one of {', '.join(ENGINE_CHOICES)}")
    if producer == "reference" and consumer == "reference":
        return None
    if recipe != "native-text":
        raise Refused(f"--producer {producer} --consumer {consumer}: vLLM lanes qualify under "
                      f"--recipe native-text, not {recipe}")
    for lane, engines in VLLM_LANE_ENGINES.items():
        if engines == (producer, consumer):
            return lane
    raise Refused(f"--producer {producer} --consumer {consumer}: no lane runs that pair")


def default_identity_path(recipe: str, producer: str = "reference", consumer: str = "reference") -> Path:
    """The shipped identity a recipe qualifies when ``--identity`` is not given (for a vLLM
    producer or consumer, that pair's lane: ``--producer vllm`` alone is ``vllm-to-reference``)."""
    from qualify.contract.lanes import DEFAULT_NATIVE_TEXT_LANE, KQUANT_EXACT_DFLASH_LANE

    vllm_lane = lane_for_engines(recipe, producer, consumer)
    if vllm_lane is not None:
        return identity_path_for_lane(vllm_lane)
    lanes = {"native-text": DEFAULT_NATIVE_TEXT_LANE, "kquant-target-plus-dflash": KQUANT_EXACT_DFLASH_LANE}
    if recipe not in lanes:
        raise Refused(f"--recipe: found {recipe!r}, expected one of {', '.join(lanes)}")
    return identity_path_for_lane(lanes[recipe])


def identity_path_for_lane(lane: str) -> Path:
    """Where a lane's frozen identity lives in ``contracts/``."""
    return assets.CONTRACTS_DIR / f"{lane}-identity-v1.json"


@dataclass(frozen=True)
class RunOptions:
    """What an operator or CI chose for one run."""

    recipe: str
    identity: Path | None = None
    producer: str = "reference"
    consumer: str = "reference"
    reference_once: bool = False
    drift_graded: bool = False
    fault: str | None = None
    receipts: Path | None = None
    command_line: list[str] = field(default_factory=list)
    watchdog_s: float = 900.0
    # module:function building the producer engine in the producer process (tests inject faults
    # the fault lanes do not cover, e.g. a producer that dies mid-handoff).
    engine_factory: str | None = None


@dataclass(frozen=True)
class StepOutcome:
    """How one step ended: ``passed``, a one-line message, and its wall time."""

    label: str
    passed: bool
    message: str
    seconds: float
    refused: bool = False


@dataclass
class Contract:
    """Everything the run checks against, taken from a loaded identity (or, for calibration,
    derived from the lane and its artifacts, with no rule)."""

    lane: str
    recipe: str
    rung: int
    producer_mode: str
    identity_document: Any
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
    expectation: Any
    # Per layer (K, V): the largest handed-off KV delta the lane's basis receipt measured; a
    # sample's layers above it are where a fault sits. Rung 3's envelope is zero everywhere.
    kv_envelope: list[tuple[float, float]] | None = None
    # The basis receipt's sample records (the calibration the rule came from): the run's
    # deterministic digests are rechecked against them. None for a calibration.
    basis_records: list[dict[str, Any]] | None = None
    # The identity declares the producer's output deterministic (require_deterministic_remote_output).
    deterministic_producer: bool = True


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


def check_engine_pins(identity: Any, consumer: Engine, producer_abi: str) -> None:
    """Refuse (exit 2, before any handoff) a host whose built engines differ from the engines the
    identity pins: their ABI names the numeric environment (numpy and BLAS, CPU ISA class, torch,
    CUDA, GPU), so a host the lane was not calibrated on is refused here, never judged as drift."""
    recipe = getattr(identity.recipe, "value", identity.recipe)
    calibrate_hint = f"qualify calibrate --recipe {recipe} --lane {identity.lane}"
    found_engines = {
        "producer_engine.abi": producer_abi,
        "consumer_engine.name": consumer.name,
        "consumer_engine.version": consumer.version,
        "consumer_engine.abi": consumer.abi,
    }
    for field_name, found in found_engines.items():
        role, part = field_name.split(".")
        expected = getattr(getattr(identity, role), part)
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
    """Load and seal the identity (schema, strict models, sealed constants), check the built
    engines against its pins and derive the run's contract; refuses an identity of another
    recipe or whose artifacts or numeric environment no longer match."""
    from qualify.contract.identity import identity_sha256, load_identity, logit_units_label
    from qualify.engines.factory import check_adapter, lane_producer_abi
    from qualify.evidence.records import rule_from_identity
    from qualify.handoff.service import expectation_from_identity

    identity = load_identity(identity_path)
    check_adapter(identity.lane_kind, identity.adapter.name, identity.adapter.sha256)
    if identity.recipe != recipe:
        raise Refused(f"identity {identity_path}: recipe: found {identity.recipe}, the run is --recipe {recipe}")
    check_engine_pins(identity, consumer, lane_producer_abi(identity.lane))
    consumer_geometry = consumer.geometry
    prompt = assets.load_prompt(identity.prompt.name)
    if assets.prompt_sha256(prompt) != identity.onboarding_qualification.prompt_sha256:
        raise Refused(f"prompt {identity.prompt.name}: sha256 {assets.prompt_sha256(prompt)} differs from "
                      f"the identity's prompt_sha256 {identity.onboarding_qualification.prompt_sha256}")
    qualification = identity.onboarding_qualification
    # Rung 2's rule is a bounded drift: it can only be judged by grading the deltas.
    graded = drift_graded or identity.rung == 2
    from qualify.archive.receipts import resolve_receipt_uri
    from qualify.contract.identity import DEFAULT_ARCHIVE_DIR

    basis_records = receipt_sample_records(resolve_receipt_uri(qualification.basis, DEFAULT_ARCHIVE_DIR).parent)
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
    )


def comparison_bounds(rule: BoundedDriftRule | BitExactRule | None) -> tuple[float, float]:
    """The bounds a comparison localises against: rung 2's declared bounds, 0 for rung 3 (any
    difference breaks it), and no bound at all for a calibration, which only measures."""
    if isinstance(rule, BoundedDriftRule):
        return rule.maximum_absolute, rule.maximum_mean_absolute
    if isinstance(rule, BitExactRule):
        return 0.0, 0.0
    return sys.float_info.max, sys.float_info.max


class QualificationRun:
    """One run of a recipe. Call :meth:`step` with each label in order (or :meth:`run_all`);
    a step whose predecessor failed fails too. :meth:`close` stops the producer and seals the
    receipt (a failing one if the run did not reach its verdict)."""

    def __init__(self, options: RunOptions, contract: Contract | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.contract = contract
        self._echo = log
        self.outcomes: dict[str, StepOutcome] = {}
        self.records: list[dict[str, Any]] = []
        self.sample_verdicts: list[Verdict] = []
        self.verdict: Verdict | None = None
        self.receipt = None
        self.receipt_path: Path | None = None
        self.consumer: Engine | None = None
        self.producer = None
        self._key: bytes | None = None
        self._cold: tuple[KVCache, DecodeResult, float] | None = None
        self._transform = None
        # Environment variables set for the producer process on top of the operator's (a
        # calibration varies BLAS kernels and thread counts per handoff; a qualification sets none).
        self.producer_env: dict[str, str] = {}
        # Wall seconds per activity over the whole run, for bench/qualify.py's overhead split.
        self.seconds: dict[str, float] = {}

    def _add_seconds(self, activity: str, started: float) -> None:
        self.seconds[activity] = self.seconds.get(activity, 0.0) + time.perf_counter() - started

    # -- plumbing ---------------------------------------------------------------------------

    def log(self, line: str) -> None:
        if self.receipt is not None and not self.receipt.finalized:
            self.receipt.log(line)
        if self._echo is not None:
            self._echo(line)

    def step(self, label: str) -> StepOutcome:
        """Run the step called ``label``; refuses out-of-order or unknown labels."""
        if label not in STEP_LABELS:
            raise Refused(f"step: found {label!r}, expected one of {', '.join(STEP_LABELS)}")
        index = STEP_LABELS.index(label)
        for earlier in STEP_LABELS[:index]:
            previous = self.outcomes.get(earlier)
            if previous is None or not previous.passed:
                reason = "did not run" if previous is None else "failed"
                outcome = StepOutcome(label, False, f"blocked: step '{earlier}' {reason}", 0.0)
                self.outcomes[label] = outcome
                return outcome
        started = time.perf_counter()
        try:
            message = self._run(label)
            outcome = StepOutcome(label, True, message, time.perf_counter() - started)
        except Refused as exc:
            outcome = StepOutcome(label, False, one_line(str(exc)), time.perf_counter() - started,
                                  refused=label == "identity sealed")
        except (ProducerFailed, StepFailed) as exc:
            outcome = StepOutcome(label, False, one_line(str(exc)), time.perf_counter() - started)
        self.outcomes[label] = outcome
        self.log(f"step {label}: {'ok' if outcome.passed else 'FAILED'} ({outcome.seconds:.2f} s) {outcome.message}")
        if not outcome.passed and label != "verdict":
            self._finish_failed(f"{label}: {outcome.message}")
        return outcome

    def run_all(self, on_step: Callable[[StepOutcome], None] | None = None) -> list[StepOutcome]:
        """Every step in order, stopping at the first failure (later steps are reported blocked)."""
        outcomes = []
        for label in STEP_LABELS:
            outcome = self.step(label)
            outcomes.append(outcome)
            if on_step is not None:
                on_step(outcome)
        return outcomes

    @property
    def refused(self) -> bool:
        """True when the contract itself was refused (CLI exit 2)."""
        first = self.outcomes.get(STEP_LABELS[0])
        return first is not None and first.refused

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        if self.receipt is not None and not self.receipt.finalized:
            self._finish_failed("run ended before its verdict")

    def _finish_failed(self, reason: str) -> None:
        if self.receipt is None or self.receipt.finalized:
            return
        if self.verdict is None:
            self.verdict = Verdict(False, f"not qualified: {reason}", [reason])
        self.receipt_path = self.receipt.finalize(self.verdict)
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    # -- the steps --------------------------------------------------------------------------

    def _run(self, label: str) -> str:
        if label == "identity sealed":
            return self._seal_identity()
        if label == "producer ready":
            return self._start_producer()
        if label == "reference computed":
            return self._compute_reference()
        if label in HANDOFF_STEPS:
            return self._handoff(HANDOFF_STEPS.index(label))
        return self._judge_summary()

    def _seal_identity(self) -> str:
        from qualify.archive.receipts import ReceiptWriter, archive_dir
        from qualify.engines.factory import build_consumer

        options = self.options
        chosen_lane = lane_for_engines(options.recipe, options.producer, options.consumer)
        if options.fault is not None:
            faults.fault_named(options.fault)
        if self.contract is None:
            identity_path = options.identity or default_identity_path(
                options.recipe, options.producer, options.consumer)
            from qualify.contract.identity import load_identity

            lane = load_identity(identity_path).lane
            _check_lane_engines(lane, chosen_lane, options)
            self.consumer = build_consumer(lane)
            self.contract = contract_from_identity(identity_path, options.recipe, options.drift_graded,
                                                   self.consumer)
        else:
            self.consumer = build_consumer(self.contract.lane)
        contract = self.contract
        if contract.repetitions != len(HANDOFF_STEPS):
            raise Refused(f"identity repetitions: found {contract.repetitions}, this recipe runs "
                          f"{len(HANDOFF_STEPS)} ordered handoffs")
        # Both sides are compared in the contract's units; an engine emitting other units is
        # refused here (a soft cap cannot be undone).
        self._transform = transform_between(self.consumer.logit_units, contract.logit_units)
        self.receipt = ReceiptWriter(
            archive_dir(options.receipts),
            command_line=options.command_line or ["qualify", "--recipe", options.recipe],
            identity=contract.identity_document,
            recipe=contract.recipe,
            lane=contract.lane,
            rule=contract.rule,
            identity_sha256=contract.identity_sha256,
            versions={"harness": __version__, "consumer": self._engine_facts(self.consumer)},
        )
        self.receipt_path = self.receipt.path
        self.log(f"lane {contract.lane} (rung {contract.rung}, producer mode {contract.producer_mode}); "
                 f"identity sha256 {contract.identity_sha256}; fault {options.fault or 'none'}")
        return f"lane {contract.lane}, identity {contract.identity_sha256[:16]}"

    @staticmethod
    def _engine_facts(engine: Engine) -> dict[str, Any]:
        return {"name": engine.name, "version": engine.version, "abi": engine.abi,
                "digests": dict(getattr(engine, "digests", {}))}

    def _start_producer(self) -> str:
        from qualify.handoff.client import ProducerProcess
        from qualify.handoff.wire import key_id, mint_run_key

        contract = self.contract
        mode = getattr(contract.producer_mode, "value", contract.producer_mode)
        extra_args = ["--fault", self.options.fault] if self.options.fault is not None else []
        self._key = mint_run_key()
        self.producer = ProducerProcess(
            lane=contract.lane, mode=mode, key=self._key, run_id=self.receipt.run_id,
            expectation=contract.expectation, watchdog_s=self.options.watchdog_s,
            extra_args=extra_args, engine_factory=self.options.engine_factory,
            env=dict(self.producer_env),
        )
        self.producer.start()
        # What the producer process runs on (CPU, BLAS kernel and threads, GPU, commit): host.json.
        self.receipt.set_producer_host(self.producer.host_facts, problem=self.producer.host_facts_problem)
        self.log(f"producer ready (warm-up prefill done): lane {contract.lane}, mode {mode}, "
                 f"run key {key_id(self._key)}, producer environment overrides {self.producer_env or 'none'}")
        return f"mode {mode}, warm-up prefill done"

    def restart_producer(self, env: dict[str, str]) -> None:
        """Stop the producer and start a fresh one with ``env`` set on top of the operator's."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        self.producer_env = dict(env)
        self._start_producer()

    def _cold_recompute(self) -> tuple[KVCache, DecodeResult, float]:
        contract = self.contract
        started = time.perf_counter()
        kv = self.consumer.prefill(contract.prompt[:contract.handoff_positions])
        result = self.consumer.decode(kv, contract.prompt[contract.handoff_positions:], contract.output_tokens)
        return kv, result, time.perf_counter() - started

    def _compute_reference(self) -> str:
        self._cold = self._cold_recompute()
        _, result, seconds = self._cold
        self.seconds["recompute"] = self.seconds.get("recompute", 0.0) + seconds
        return f"cold local recompute: {len(result.tokens)} tokens in {seconds:.2f} s"

    def _expected_draft_geometry(self):
        """A speculative consumer expects the draft's own context beside the target KV."""
        geometry_of = getattr(self.consumer, "draft_kv_geometry", None)
        return None if geometry_of is None else geometry_of(self.contract.handoff_positions)

    def _handoff(self, index: int) -> str:
        from qualify.handoff.wire import open_handoff

        contract = self.contract
        repetition = index + 1
        request_id = f"sample-{repetition}"
        measured: dict[str, Any] = {}
        try:
            handoff = self.producer.request_prefill(contract.prompt[:contract.handoff_positions], request_id)
            transport = handoff.transport
            measured = {"payload_bytes": transport.payload_bytes, "payload_gbit_per_s": transport.gbit_per_s}
            handed_off = expected_handed_off_positions(contract.lane, contract.handoff_positions)
            geometry = self.consumer.geometry.kv_geometry(handed_off)
            opened = open_handoff(
                handoff, key=self._key,
                expected_identity_sha256=contract.identity_sha256,
                expected_cache_identity=contract.target_cache_identity,
                expected_geometry=geometry,
                # The manifest names the tokens whose KV it carries: the handed-off prefix.
                expected_prompt_sha256=assets.prompt_sha256(contract.prompt[:handed_off]),
                expected_draft_geometry=self._expected_draft_geometry(),
                expected_run_id=self.receipt.run_id,
                expected_request_id=request_id,
            )
        except (ProducerFailed, HandoffRefused) as exc:
            kind = "handoff refused" if isinstance(exc, HandoffRefused) else "producer failed"
            record = failed_sample_record(repetition, f"{kind}: {one_line(str(exc))}", **measured)
            return self._keep(record, repetition)
        manifest = opened.manifest
        pending = contract.prompt[manifest.handed_off_positions:]
        started = time.perf_counter()
        result = self.consumer.decode(opened.kv, pending, contract.output_tokens)
        decode_s = time.perf_counter() - started
        self._add_seconds("decode", started)
        if self.options.reference_once:
            cold_kv, cold, recompute_s = self._cold
        else:
            cold_kv, cold, recompute_s = self._cold_recompute()
            self.seconds["recompute"] = self.seconds.get("recompute", 0.0) + recompute_s
        teacher_forced = None
        if not np.array_equal(result.tokens, cold.tokens):
            # Rows after a divergence compare like with like only when the handoff branch is fed
            # the cold tokens.
            started = time.perf_counter()
            teacher_forced = self.consumer.teacher_forced(opened.kv, pending, cold.tokens)
            self._add_seconds("teacher_forced", started)
        maximum_absolute, maximum_mean_absolute = comparison_bounds(contract.rule)
        started = time.perf_counter()
        comparison = compare_branches(
            result, cold, self._transform,
            maximum_absolute=maximum_absolute,
            maximum_mean_absolute=maximum_mean_absolute,
            teacher_forced_logits=teacher_forced,
            handoff_kv=(opened.kv.keys, opened.kv.values),
            own_kv=(cold_kv.keys, cold_kv.values),
        )
        self._add_seconds("compare", started)
        timings = opened.timings
        record = sample_record(
            repetition=repetition,
            comparison=comparison,
            payload_sha256=manifest.payload_sha256,
            seams_sha256=canonical_sha256([[seam.layer, seam.k_sha256, seam.v_sha256] for seam in manifest.seams]),
            payload_bytes=manifest.payload_size,
            payload_gbit_per_s=handoff.transport.gbit_per_s,
            handed_off_positions=manifest.handed_off_positions,
            recomputed_positions=len(contract.prompt) - manifest.handed_off_positions,
            kv_envelope=contract.kv_envelope,
            phases={
                "producer_compute_s": manifest.compute_s,
                # The producer's serialize and its payload/seam hashing, as it reported them.
                "serialize_s": manifest.serialize_s + manifest.digest_s,
                "transport_s": handoff.transport.transfer_s,
                "verify_s": timings.verify_s,
                "install_s": timings.install_s,
                "decode_s": decode_s,
                "recompute_s": recompute_s,
            },
        )
        return self._keep(record, repetition)

    def _keep(self, record, repetition: int) -> str:
        started = time.perf_counter()
        document = record_json(record)
        self.records.append(document)
        self.receipt.add_sample(record)
        self._add_seconds("receipt", started)
        if self.contract.rule is None:  # calibration: measure, do not judge
            return f"max_abs {document.get('max_abs')}, mean_abs {document.get('mean_abs')}"
        verdict = judge_sample(document, self.contract.rule)
        self.sample_verdicts.append(verdict)
        self.log(f"sample {repetition}: {verdict.headline}")
        if not verdict.passed:
            raise StepFailed(verdict.headline)
        return verdict.headline

    def _judge_summary(self) -> str:
        if self.contract.rule is None:
            raise StepFailed("calibration runs have no verdict step")
        contract = self.contract
        if contract.basis_records is None:
            raise StepFailed("no basis receipt to recheck the run's digests against")
        self.verdict = judge_qualification(self.records, contract.rule, contract.basis_records,
                                           deterministic_producer=contract.deterministic_producer)
        self.log(f"verdict: {self.verdict.headline}")
        self.receipt_path = self.receipt.finalize(self.verdict)
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        if not self.verdict.passed:
            raise StepFailed(self.verdict.headline)
        return self.verdict.headline


def _check_lane_engines(lane: str, chosen_lane: str | None, options: RunOptions) -> None:
    """An identity whose lane runs other engines than ``--producer``/``--consumer`` is refused."""
    from qualify.contract.lanes import VLLM_LANE_ENGINES

    engines = VLLM_LANE_ENGINES.get(lane, ("reference", "reference"))
    if chosen_lane is None and lane not in VLLM_LANE_ENGINES:
        return
    if engines != (options.producer, options.consumer):
        raise Refused(f"identity lane {lane} runs producer {engines[0]} and consumer {engines[1]}, "
                      f"the run asked for --producer {options.producer} --consumer {options.consumer}")


def expected_handed_off_positions(lane: str, handoff_positions: int) -> int:
    """How many positions a lane's producer hands off: whole blocks on every vLLM lane (vLLM
    installs whole blocks; the consumer recomputes the rest as pending tokens), else all of them."""
    from qualify.contract.lanes import VLLM_BLOCK_SIZE, VLLM_LANE_ENGINES

    if lane in VLLM_LANE_ENGINES:
        return (handoff_positions // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE
    return handoff_positions


class StepFailed(Exception):
    """A step ran and its evidence failed the contract (the run is not qualified)."""


# -- calibration --------------------------------------------------------------------------------

CALIBRATION_SCHEMA = "trust-ladder.calibration.v1"
@dataclass(frozen=True)
class CalibrationEnvironment:
    """Environment variables one calibration handoff's producer starts with, on top of the
    operator's; ``requires`` names the CPU flag the setting needs (a Haswell kernel needs AVX2);
    ``narrow_numpy`` also makes numpy run its next-narrower SIMD paths
    (:func:`qualify.core.hostenv.numpy_narrower_dispatch`)."""

    variables: dict[str, str]
    requires: str | None = None
    narrow_numpy: bool = False


# Each calibration handoff restarts the producer under the next of these, so the measured envelope
# covers producer restarts, BLAS kernels (the pinned OpenBLAS runs Zen as Haswell, so Sandybridge
# is the third), BLAS and OpenMP thread counts and numpy's SIMD dispatch: an engine whose output
# moved with any of them shows it as differing digests, and the calibration fails.
CALIBRATION_ENVIRONMENTS: tuple[CalibrationEnvironment, ...] = (
    CalibrationEnvironment({}),
    CalibrationEnvironment({"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"},
                           requires="avx2"),
    CalibrationEnvironment({"OPENBLAS_CORETYPE": "Prescott", "OPENBLAS_NUM_THREADS": "1"}),
    # VLLM_CPU_ATTN_SPLIT_KV=0 moves vLLM's decode logits unless the harness pins it (it does).
    CalibrationEnvironment({"OPENBLAS_CORETYPE": "Sandybridge", "OPENBLAS_NUM_THREADS": "2",
                            "VLLM_CPU_ATTN_SPLIT_KV": "0"}, requires="avx", narrow_numpy=True),
    CalibrationEnvironment({"OPENBLAS_NUM_THREADS": "1"}, narrow_numpy=True),
)


def calibration_environments() -> list[dict[str, str]]:
    """The calibration environments this CPU can run, in order."""
    from qualify.core.hostenv import cpu_flags, numpy_narrower_dispatch

    flags = cpu_flags()
    narrower = numpy_narrower_dispatch()
    environments = []
    for environment in CALIBRATION_ENVIRONMENTS:
        if environment.requires is not None and environment.requires not in flags:
            continue
        variables = dict(environment.variables)
        if environment.narrow_numpy and narrower:
            variables["NPY_DISABLE_CPU_FEATURES"] = narrower
        environments.append(variables)
    return environments


ZERO_DRIFT_BOUND = 5e-324
"""The least positive double: the bound of a lane that showed no drift in any calibration handoff.
Deltas are non-negative, so only a zero delta meets it: the bit-exact rule, written in the
positive-bound form a bounded-drift recipe's schema requires (never a margin chosen by taste)."""


def propose_bound(observed: float) -> float | None:
    """The bound a calibration proposes for an observed maximum: the maximum itself, with no
    margin (the handoffs already ran under every calibration environment, and the engines'
    output does not move with them); :data:`ZERO_DRIFT_BOUND` when it is exactly zero; None when
    it is not a finite non-negative number."""
    import math

    if not math.isfinite(observed) or observed < 0:
        return None
    return float(observed) if observed > 0 else ZERO_DRIFT_BOUND


def calibration_contract(lane: str, recipe: str, prompt_name: str = assets.MAIN_PROMPT,
                         output_tokens: int = 256) -> Contract:
    """A contract for measuring a lane before its identity exists: the lane's real artifacts and
    cache identity, a calibration document in place of the identity, and no rule."""
    from qualify.contract.lanes import lane_spec
    from qualify.engines.factory import build_cache_identity, checkpoint_digests, producer_facts
    from qualify.handoff.service import ProducerExpectation

    spec = lane_spec(lane)
    if spec.recipe.value != recipe:
        raise Refused(f"lane {lane}: recipe: found {spec.recipe.value}, the run is --recipe {recipe}")
    producer = producer_facts(lane)
    prompt = assets.load_prompt(prompt_name)
    handoff_positions = len(prompt) - 1
    document = {
        "schema": CALIBRATION_SCHEMA,
        "lane": lane,
        "recipe": recipe,
        "producer_mode": spec.mode.value,
        "producer_engine": {"name": producer.name, "version": producer.version, "abi": producer.abi},
        "checkpoint": checkpoint_digests(spec.kind),
        "prompt": {"name": prompt_name, "sha256": assets.prompt_sha256(prompt)},
        "handoff_positions": handoff_positions,
        "output_tokens": output_tokens,
        "target_cache_identity_sha256": build_cache_identity(spec),
    }
    digest = canonical_sha256(document)
    return Contract(
        lane=lane, recipe=recipe, rung=spec.recipe.rung, producer_mode=spec.mode.value,
        identity_document=document, identity_sha256=digest,
        target_cache_identity=document["target_cache_identity_sha256"], logit_units="raw",
        prompt_name=prompt_name, prompt=prompt, prompt_sha256=document["prompt"]["sha256"],
        handoff_positions=handoff_positions, output_tokens=output_tokens,
        repetitions=len(HANDOFF_STEPS), rule=None,
        expectation=ProducerExpectation(
            engine_version=producer.version, geometry=producer.geometry, identity_sha256=digest,
            engine_name=producer.name, engine_abi=producer.abi, digests=producer.digests),
    )


@dataclass
class Calibration:
    """A calibration's measured envelope and the rule it proposes (never applied by itself)."""

    lane: str
    records: list[dict[str, Any]]
    observed_max_abs: float
    observed_mean_abs: float
    tokens_exact: bool
    proposed_maximum_absolute: float | None
    proposed_maximum_mean_absolute: float | None
    receipt_path: Path | None
    failures: list[str]
    # Every deterministic digest equal across the handoffs (restarts, kernels, threads, dispatch).
    deterministic: bool = False


def calibrate(lane: str, recipe: str, repetitions: int, options: RunOptions,
              log: Callable[[str], None] | None = None) -> Calibration:
    """Measure ``repetitions`` handoffs of ``lane`` against the cold recompute, archive the run as
    a receipt (the basis a frozen identity cites), and propose bounds a hair above the envelope."""
    if repetitions < 1:
        raise Refused(f"--repetitions: found {repetitions}, expected at least 1")
    from qualify.contract.lanes import lane_spec
    from qualify.judge import judge_reproduction

    environments = calibration_environments()
    run = QualificationRun(options, calibration_contract(lane, recipe), log=log)
    failures: list[str] = []
    deterministic = False
    try:
        for label in STEP_LABELS[:3]:
            outcome = run.step(label)
            if not outcome.passed:
                raise Refused(f"calibration {label}: {outcome.message}")
        for index in range(repetitions):
            environment = environments[index % len(environments)]
            if index > 0:  # the first handoff uses the producer the steps started (no overrides)
                run.restart_producer(environment)
            message = run._handoff(index)
            run.log(f"calibration handoff {index + 1}/{repetitions} (fresh producer, environment "
                    f"{environment or 'as the operator set it'}): {message}")
        measured = [r for r in run.records if not r.get("error")]
        failures = [r["error"] for r in run.records if r.get("error")]
        tokens_exact = bool(measured) and all(r["token_agreement_rate"] == 1.0 for r in measured)
        observed_max = max((r["max_abs"] for r in measured), default=float("nan"))
        observed_mean = max((r["mean_abs"] for r in measured), default=float("nan"))
        proposal = (propose_bound(observed_max), propose_bound(observed_mean))
        # The samples are each other's basis: every deterministic digest must agree across them.
        spec = lane_spec(lane)
        determinism = judge_reproduction(measured, measured, rung=spec.recipe.rung, deterministic_producer=True,
                                         draft=spec.speculative_draft)
        deterministic = determinism.passed and len(measured) == repetitions
        headline = (f"calibration of {lane} over {repetitions} handoffs (a fresh producer each, "
                    f"{min(repetitions, len(environments))} environments): observed max abs {observed_max!r}, "
                    f"max mean abs {observed_mean!r}, tokens exact in every handoff: {tokens_exact}, "
                    f"deterministic digests equal in every handoff: {deterministic}; proposed rule "
                    f"maximum_absolute {proposal[0]}, maximum_mean_absolute {proposal[1]}")
        reasons = [f"handoff failed: {failure}" for failure in failures]
        if not tokens_exact:
            reasons.append("greedy tokens diverged: no bounded-drift rule can qualify this lane on this prompt")
        if not deterministic:
            reasons.append("the producer's output differs across restarts or environments: "
                           + "; ".join(check.detail for check in determinism.checks if not check.passed))
        run.verdict = Verdict(not reasons, headline, reasons or [headline])
        run.receipt_path = run.receipt.finalize(run.verdict)
    finally:
        run.close()
    return Calibration(lane, run.records, observed_max, observed_mean, tokens_exact,
                       proposal[0], proposal[1], run.receipt_path, failures, deterministic)
