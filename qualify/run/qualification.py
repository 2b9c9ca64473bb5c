"""One qualification run: the recipe's seven ordered steps, from sealed identity to verdict.

The same :class:`QualificationRun` backs the pytest recipe modules (one test per step) and
``qualify --recipe`` (which drives the steps in-process with progress). Each handoff sample is a
real producer process handing KV across a Unix socket under a fresh run key; the consumer
verifies and installs it, decodes 256 greedy tokens keeping every full logit row, and compares
against its own cold local recompute. Judging happens in :mod:`qualify.judge`; this module only
gathers evidence and writes it to the receipt. How the producer is reached is
:mod:`qualify.handoff.setup`; how interrupt signals stop a run is :mod:`qualify.run.signals`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from qualify import __version__
from qualify.contract.rules import TEACHER_FORCED_RULE
from qualify.core import assets
from qualify.core.digests import canonical_sha256
from qualify.core.errors import HandoffRefused, ProducerFailed, Refused, one_line
from qualify.core.internal_error import InternalError, described, internal_error_line, save_traceback, traceback_lines
from qualify.core.kv import KVGeometry, first_non_finite
from qualify.engines import faults
from qualify.engines.base import LaneEngine
from qualify.evidence.cold_ahead import PlannedColdBranches, forks_cleanly
from qualify.evidence.compare import transform_between
from qualify.evidence.comparers import Comparer, ComparerFactory, ComparerSetup, HostComparer
from qualify.evidence.records import BoundedDriftRule, SampleRecord, failed_sample_record, record_json
from qualify.evidence.sample import sample_record
from qualify.evidence.series import envelope_series, sample_series
from qualify.handoff.setup import (
    RemoteProducerChoice,
    TransportFactory,
    TransportSetup,
    kill_and_reap,
    kill_producer,
    producer_process,
    remote_producer,
)
from qualify.judge import (
    Verdict,
    judge_failed_step,
    judge_incomplete,
    judge_qualification,
    judge_refused,
    judge_sample,
)
from qualify.judge.envelope import judge_envelope
from qualify.judge.scope import SERVICE_CONDITIONS, Scope
from qualify.judge.service import RESTARTED, SERVICE_EVIDENCE, judge_service_conditions
from qualify.run.fixture_envelope import NO_COMPARISON, NO_TENSOR_SERIES, handoff_series, missing_series
from qualify.run.run_contract import (
    ORDERED_HANDOFFS,
    Contract,
    check_lane_engines,
    chosen_lane,
    comparison_bounds,
    contract_from_identity,
    default_identity_path,
)
from qualify.run.service_conditions import ServiceLog
from qualify.run.signals import (
    interrupt_caught,
    interrupt_signal,
    interrupts_raise,
    raise_swallowed_interrupt,
    signals_held,
)

if TYPE_CHECKING:
    from qualify.archive.writer import ReceiptWriter
    from qualify.contract.identity import Identity
    from qualify.contract.lanes import LaneSpec
    from qualify.handoff.transport import Transport
    from qualify.handoff.wire import HandoffExpectation, HandoffManifest

_T = TypeVar("_T")

HANDOFF_STEPS: tuple[str, ...] = tuple(f"handoff {n}/{ORDERED_HANDOFFS}" for n in range(1, ORDERED_HANDOFFS + 1))
STEP_LABELS: tuple[str, ...] = ("identity sealed", "producer ready", "reference computed", *HANDOFF_STEPS, "verdict")


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
    # Threads hashing a handoff's tensors while it is verified (the wire's default is 2).
    digest_threads: int = 2
    watchdog_s: float = 900.0
    # An operator's limit on every producer phase (``--deadline-s``), else the identity's.
    deadline_s: float | None = None
    # module:function building the producer engine in the producer process (tests inject faults
    # the fault lanes do not cover, e.g. a producer that dies mid-handoff).
    engine_factory: str | None = None
    # ``--model``: a published model's name, a Hugging Face directory or a GGUF file (None: the
    # shipped model); chosen for the whole process when the run loads its identity.
    model: str | None = None
    # ``--producer-at``: connect to a running producer instead of starting one.
    producer_at: RemoteProducerChoice | None = None
    # ``--service-conditions``: aba or recovery (qualify.run.service_conditions), or None.
    service_conditions: str | None = None


@dataclass(frozen=True)
class StepOutcome:
    """How one step ended: ``passed``, a one-line message, and its wall time."""

    label: str
    passed: bool
    message: str
    seconds: float
    refused: bool = False


@contextmanager
def driven(run: QualificationRun) -> Iterator[QualificationRun]:
    """For code that drives a run's steps itself (calibration, the self-test): interrupt signals
    raise (:func:`interrupts_raise`); one arriving between steps stops the run as one during a step
    does (:meth:`QualificationRun.interrupted`: producer killed, receipt sealed incomplete) and is
    raised on; however the block ends, the run is closed."""
    with interrupts_raise():
        try:
            yield run
        except KeyboardInterrupt as exc:
            run.interrupted(interrupt_signal(exc))
            raise
        finally:
            run.close()


class QualificationRun:
    """One run of a recipe. Call :meth:`step` with each label in order (or :meth:`run_all`);
    a step whose predecessor failed fails too. :meth:`close` stops the producer and seals the
    receipt (a failing one if the run did not reach its verdict)."""

    labels: tuple[str, ...] = STEP_LABELS
    """This kind of run's steps, in order."""
    first_evidence_step: str = HANDOFF_STEPS[0]
    """The first step that gathers evidence: a refusal before it is the run's refusal (exit 2)."""

    def __init__(self, options: RunOptions, contract: Contract | None = None,
                 log: Callable[[str], None] | None = None, *,
                 transport: TransportFactory | None = None, comparer: ComparerFactory | None = None,
                 consumer: LaneEngine | None = None) -> None:
        self.options = options
        # A consumer the caller built (and warmed up) for the contract's lane; else built here.
        self._given_consumer = consumer
        # Where handoffs come from (default: the lane's producer process over its socket) and
        # where the consumer decodes and compares (default: the host, numpy).
        self._transport_factory: TransportFactory = transport or (
            producer_process if options.producer_at is None else remote_producer(options.producer_at))
        self._comparer_factory: ComparerFactory = comparer or HostComparer
        self.comparer: Comparer | None = None
        # Deferred comparisons not yet recorded: (repetition, the handoff's record builder).
        self._unsettled: list[tuple[int, Callable[[], SampleRecord]]] = []
        # Each compared sample's series (qualify.evidence.series), from its record builder until
        # _keep writes it beside the record; a failed sample without a comparison has none.
        self._series: dict[int, dict[str, np.ndarray]] = {}
        self.contract = contract
        self._echo = log
        self.outcomes: dict[str, StepOutcome] = {}
        self.records: list[dict[str, Any]] = []
        self.sample_verdicts: list[Verdict] = []
        self.verdict: Verdict | None = None
        self.receipt: ReceiptWriter | None = None
        self.receipt_path: Path | None = None
        # The identity once loaded (its receipt opens later, after the consumer is built): an
        # interrupt meanwhile still leaves a receipt under it.
        self._loaded: tuple[Path, Identity] | None = None
        # The step running now and the last one that ran, for "interrupted by SIGINT during <step>".
        self._running: str | None = None
        self._last_step: str | None = None
        # The signal (SIGINT, SIGTERM, SIGHUP) that stopped the run, once one did, and the receipt's words for it.
        self.interrupted_by: int | None = None
        self.interruption: str | None = None
        self.consumer: LaneEngine | None = None
        self.producer: Transport | None = None
        self._key: bytes | None = None
        # Environment variables set for the producer process on top of the operator's (a
        # calibration varies BLAS kernels and thread counts per handoff; a qualification sets none).
        self.producer_env: dict[str, str] = {}
        # Wall seconds per activity over the whole run, for bench/qualify.py's overhead split.
        self.seconds: dict[str, float] = {}
        # Per repetition, the handoff branch's (proposed, accepted) draft tokens (None: no draft):
        # a calibration records the anchor's, the counts a draft floor is derived from.
        self.draft_counts: dict[int, tuple[int, int] | None] = {}
        # The starts and requests of a run under --service-conditions (None: none asked for).
        self.service: ServiceLog | None = None
        # Every handoff the run will make, as (prompt, handed-off positions), when its driver knows
        # them before the first step and they bring prompts of their own (a calibration): their
        # cold branches are then computed ahead, from the identity step on, where the consumer
        # forks cleanly (qualify.evidence.cold_ahead.PlannedColdBranches).
        self.planned_handoffs: list[tuple[np.ndarray, int]] | None = None
        self.planned: PlannedColdBranches | None = None
        # Repetitions whose envelope series are recorded besides a non-deterministic contract's every
        # sample (a calibration's fixture envelope handoffs), and each recorded handoff's series
        # (series/envelope-<n>.safetensors): what a fixture envelope is stated from or holds.
        self.envelope_repetitions: set[int] = set()
        self.envelope_series: dict[int, dict[str, np.ndarray]] = {}
        # Compared handoffs whose envelope series the comparer could not give (None), until _keep.
        self._envelope_pending: dict[int, dict[str, np.ndarray] | None] = {}
        self._envelope_missing: dict[int, str] = {}

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
        labels = self.labels
        if label not in labels:
            raise Refused(f"step: found {label!r}, expected one of {', '.join(labels)}")
        index = labels.index(label)
        for earlier in labels[:index]:
            previous = self.outcomes.get(earlier)
            if previous is None or not previous.passed:
                reason = "did not run" if previous is None else "failed"
                outcome = StepOutcome(label, False, f"blocked: step '{earlier}' {reason}", 0.0)
                self.outcomes[label] = outcome
                return outcome
        started = time.perf_counter()
        self._running = self._last_step = label
        failure: Verdict | None = None
        try:
            raise_swallowed_interrupt()  # one that arrived where Python drops a handler's raise
            message = self._run(label)
            raise_swallowed_interrupt()
            outcome = StepOutcome(label, True, message, time.perf_counter() - started)
        except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM/SIGHUP under interrupts_raise()
            interrupt_caught()
            self.outcomes[label] = StepOutcome(
                label, False, f"interrupted by {signal.Signals(interrupt_signal(exc)).name}",
                time.perf_counter() - started)
            self.interrupted(interrupt_signal(exc))
            raise
        except Refused as exc:
            # Refused before any handoff: the lane cannot run here (no GPU, no vLLM, the producer
            # refused to start) or its contract was refused; exit 2, its receipt marked refused.
            outcome = StepOutcome(label, False, one_line(str(exc)), time.perf_counter() - started,
                                  refused=index < labels.index(self.first_evidence_step))
        except (ProducerFailed, StepFailed) as exc:
            outcome = StepOutcome(label, False, one_line(str(exc)), time.perf_counter() - started)
            failure = judge_failed_step(label, outcome.message, self.sample_verdicts[-1] if self.sample_verdicts else None,
                                        scope=self._scope())
        except Exception as exc:  # no refusal or failure explains it: a harness bug
            self.outcomes[label] = StepOutcome(label, False, f"internal error: {described(exc)}",
                                               time.perf_counter() - started)
            raise self._internal_error(label, exc) from exc
        finally:
            self._running = None
        self.outcomes[label] = outcome
        self.log(f"step {label}: {'ok' if outcome.passed else 'REFUSED' if outcome.refused else 'FAILED'} "
                 f"({outcome.seconds:.2f} s) {outcome.message}")
        if outcome.refused and self.receipt is not None and not self.receipt.finalized:
            self.finish(judge_refused(f"{label}: {outcome.message}"))
        if failure is not None and self.receipt is not None and not self.receipt.finalized:
            self.finish(self.verdict or failure)
        if not outcome.passed and label != "verdict":
            self._finish_failed(f"{label}: {outcome.message}")
        return outcome

    def run_all(self, on_step: Callable[[StepOutcome], None] | None = None) -> list[StepOutcome]:
        """Every step in order, stopping at the first failure (later steps are reported blocked)."""
        outcomes = []
        for label in self.labels:
            outcome = self.step(label)
            outcomes.append(outcome)
            if on_step is not None:
                on_step(outcome)
        return outcomes

    @property
    def refused(self) -> bool:
        """True when a step before the first handoff was refused: the contract itself, or the lane
        cannot run here (CLI exit 2)."""
        return any(outcome.refused for outcome in self.outcomes.values())

    def close(self) -> None:
        """Stop the comparer and producer; a receipt still open is sealed as incomplete. An
        interrupt signal meanwhile is held until all that is done (a producer stopped halfway
        would keep its temporary directory), then raised."""
        with signals_held():
            if self.comparer is not None:
                self.comparer.close()
                self.comparer = None
            if self.planned is not None:
                self.planned.close()
            if self.producer is not None:
                self.producer.close()
                self.producer = None
            if self.receipt is not None and not self.receipt.finalized:
                self._finish_failed("run ended before its verdict")

    def finish(self, verdict: Verdict) -> Path:
        """Seal the run's receipt with the judge's ``verdict`` and stop the producer: the one
        place a receipt is finalized (qualification, calibration, or a run that stopped early)."""
        self.verdict = verdict
        with signals_held():  # a signal now would leave a half-sealed receipt: raised once it is sealed
            self.receipt_path = self._receipt.finalize(verdict)
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        return self.receipt_path

    def _internal_error(self, label: str, exc: Exception) -> InternalError:
        """A step raised what no refusal or failure explains: its traceback goes into the run's
        receipt (``evidence/internal-error.json``), sealed as incomplete, when the run has one open;
        else into a file under the user state directory. The returned error's message is the
        operator's one line, naming where the traceback is."""
        what = f"during {label}: {described(exc)}"
        saved: Path | None = None
        if self.receipt is not None and not self.receipt.finalized:
            try:
                saved = self.receipt.add_evidence("internal-error", {
                    "schema": "trust-ladder.internal-error.v1", "step": label, "exception": type(exc).__name__,
                    "message": described(exc), "harness_version": __version__, "traceback": traceback_lines(exc)})
                self.log(f"internal error {what}")
                self.finish(judge_incomplete(f"internal error {what}"))
            except (Refused, OSError):
                saved = None  # an unusable archive: the traceback goes to the state directory instead
        if saved is None:
            saved = save_traceback(exc)
        return InternalError(internal_error_line(what, saved), saved)

    def _finish_failed(self, reason: str) -> None:
        if self.receipt is None or self.receipt.finalized:
            return
        self.finish(self.verdict or judge_incomplete(reason))

    def interrupted(self, signum: int) -> None:
        """Stop the run after an interrupt signal: kill the producer's process group (its
        temporary directory goes with it), stop the comparer and seal the receipt as incomplete
        ("interrupted by SIGHUP during <step>"); one
        sealed already keeps its verdict. Idempotent; a second signal meanwhile is discarded. A
        run interrupted before its identity loaded has no receipt (nothing names what it was)."""
        with signals_held(discard=True):
            if self.producer is not None:
                kill_producer(self.producer)
                self._stop_producer()  # reaps it and removes its socket directory
            if self.comparer is not None:
                self.comparer.close()
                self.comparer = None
            when = (f"during {self._running}" if self._running else f"after {self._last_step}" if self._last_step
                    else "before its first step")
            reason = f"interrupted by {signal.Signals(signum).name} {when}"
            if self.interrupted_by is None:
                self.interrupted_by, self.interruption = signum, reason
            if self.receipt is None and self._loaded is not None:
                try:
                    self._open_early_receipt(*self._loaded)
                except (Refused, OSError) as exc:  # an unusable archive: stopping matters more
                    self.log(f"{reason}; no receipt was written: {one_line(str(exc))}")
            if self.receipt is not None and not self.receipt.finalized:
                self.log(reason)
                # A receipt with no identity can only record a refusal (its run was refused first).
                self.finish(judge_refused(reason) if self.receipt.identity_sha256 is None else judge_incomplete(reason))

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
        from qualify.archive.layout import archive_dir
        from qualify.archive.writer import ReceiptWriter

        options = self.options
        if self.contract is None:
            identity_path, identity = self._load_identity()
            try:
                check_lane_engines(identity.spec, options.producer, options.consumer)
                self._check_service_conditions(identity.onboarding_qualification.require_deterministic_remote_output)
                self.consumer = self.build_consumer(identity.spec)
                self.contract = contract_from_identity(identity_path, options.recipe, options.drift_graded,
                                                       self.consumer, connector=self.connector_pin())
                self._check_link_floor(self.contract, f"identity {identity_path}")
            except Refused as refusal:
                # A sealed identity whose lane cannot run here (no GPU, no vLLM, another numeric
                # environment) or whose basis receipt fails its check: the refusal gets a receipt
                # under that identity, marked refused by step().
                raise self._refused_with_receipt(refusal, identity_path, identity) from None
        else:
            chosen_lane(options.recipe, options.producer, options.consumer)  # refuses unknown choices
            if options.fault is not None:
                faults.fault_named(options.fault)
            self._check_service_conditions(self.contract.deterministic_producer)
            self.consumer = self.build_consumer(self.contract.spec)
            self._check_link_floor(self.contract, f"lane {self.contract.lane}")
        contract = self.contract
        if contract.repetitions != ORDERED_HANDOFFS:
            raise Refused(f"identity repetitions: found {contract.repetitions}, this recipe runs "
                          f"{len(HANDOFF_STEPS)} ordered handoffs")
        # Both sides are compared in the contract's units; an engine emitting other units is
        # refused here (a soft cap cannot be undone).
        if self.planned_handoffs and self.planned is None and forks_cleanly(self.consumer):
            self.planned = PlannedColdBranches(self.consumer, self.planned_handoffs, contract.output_tokens)
        self.comparer = self._new_comparer()
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
        if options.service_conditions is not None:
            self.service = ServiceLog(options.service_conditions, contract.prompt_name)
        self.log(f"lane {contract.lane} (rung {contract.rung}, producer mode {contract.producer_mode.value}); "
                 f"identity sha256 {contract.identity_sha256}; fault {options.fault or 'none'}")
        return f"lane {contract.lane}, identity {contract.identity_sha256[:16]}"

    def _check_service_conditions(self, deterministic_producer: bool) -> None:
        """Service conditions judge bit-identical handoffs across producer starts this run makes:
        refused for a producer it does not start, and for one not declared deterministic."""
        conditions = self.options.service_conditions
        if conditions is None:
            return
        if conditions not in SERVICE_CONDITIONS:
            raise Refused(f"--service-conditions: found {conditions!r}, expected one of {', '.join(SERVICE_CONDITIONS)}")
        if self.options.producer_at is not None:
            raise Refused(f"--service-conditions {conditions}: restarts the producer between handoffs, so it needs a "
                          f"producer this run starts, not --producer-at")
        if not deterministic_producer:
            raise Refused(f"--service-conditions {conditions}: judges bit-identical handoffs, and the identity does "
                          f"not declare a deterministic producer")

    def _check_link_floor(self, contract: Contract, where: str) -> None:
        """A link-rate floor is judged on a handoff that crossed a network link: a producer this
        run starts on its own host crosses none, so the run is refused rather than judged."""
        if contract.link_floor_gbit_per_s is not None and self.options.producer_at is None:
            raise Refused(f"{where}: link_floor: {contract.link_floor_gbit_per_s:g} Gbit/s is judged on handoffs "
                          f"across a network link; run with --producer-at HOST:PORT (docs/transport.md)")

    def _new_comparer(self) -> Comparer:
        """A comparer for the contract's prompt, in the contract's units (an engine emitting other
        units is refused here: a soft cap cannot be undone)."""
        contract, consumer = self._contract, self._consumer
        maximum_absolute, maximum_mean_absolute = comparison_bounds(contract.rule)
        return self._comparer_factory(ComparerSetup(
            consumer=consumer, prompt=contract.prompt, handoff_positions=contract.handoff_positions,
            output_tokens=contract.output_tokens,
            transform=transform_between(consumer.logit_units, contract.logit_units),
            maximum_absolute=maximum_absolute, maximum_mean_absolute=maximum_mean_absolute,
            reference_once=self.options.reference_once,
            # A qualification's handoffs share its prompt; a calibration's cells each bring their own.
            handoffs=contract.repetitions if contract.rule is not None else 1,
            planned=self.planned))

    def switch_prompt(self, prompt_name: str, prompt: np.ndarray, env: dict[str, str]) -> str:
        """A calibration's next cell: the same run and receipt, another prompt. Its own comparer
        and cold recompute, and a freshly started producer under ``env`` (the handed-off prefix
        and payload size follow from the prompt)."""
        from qualify.core.assets import prompt_sha256

        self.settle_all()
        contract = self._contract
        if contract.prompt_name == prompt_name and np.array_equal(contract.prompt, prompt):
            self.restart_producer(env)  # the same prompt: its cold recompute stands
            return "the same prompt: its cold recompute stands"
        self.contract = replace(contract, prompt_name=prompt_name, prompt=prompt, prompt_sha256=prompt_sha256(prompt),
                                handoff_positions=len(prompt) - 1)
        if self.comparer is not None:
            self.comparer.close()
        self.comparer = self._new_comparer()
        self.restart_producer(env)
        return self._compute_reference()

    def build_consumer(self, spec: LaneSpec) -> LaneEngine:
        """The run's consumer for the lane ``spec``: the caller's, else the factory's."""
        from qualify.engines.factory import build_consumer

        return self._given_consumer or build_consumer(spec)

    def connector_pin(self) -> tuple[str, str] | None:
        """The (name, SHA-256) of the KV connector the identity must pin (a connector lane's);
        None: the run goes through no operator's connector."""
        return None

    def default_identity_path(self) -> Path:
        """The identity the run qualifies when ``--identity`` is not given (after ``--model``)."""
        options = self.options
        return default_identity_path(options.recipe, options.producer, options.consumer)

    def _load_identity(self) -> tuple[Path, Identity]:
        """The run's identity, loaded and sealed (schema, strict model, sealed digest). A choice or
        identity refused here (not JSON, an unknown lane, a relaxed bound) still gets a receipt,
        with no identity, marked refused by step()."""
        from qualify.contract.identity import load_identity

        options = self.options
        try:
            chosen_lane(options.recipe, options.producer, options.consumer)  # refuses unknown choices
            if options.fault is not None:
                faults.fault_named(options.fault)
            if options.model is not None:
                from qualify.engines.chosen_model import use_model

                use_model(options.model)
            identity_path = options.identity or self.default_identity_path()
            identity = load_identity(identity_path)
        except Refused as refusal:
            raise self._refused_with_receipt(refusal, None, None) from None
        self._loaded = (identity_path, identity)
        return identity_path, identity

    def _refused_with_receipt(self, refusal: Refused, identity_path: Path | None,
                              identity: Identity | None) -> Refused:
        """``refusal``, once its receipt is open; when no receipt can be written (an unusable
        archive or signing key), the refusal says so instead."""
        try:
            self._open_early_receipt(identity_path, identity)
        except (Refused, OSError) as exc:
            return Refused(f"{one_line(str(refusal))}; no receipt was written: {one_line(str(exc))}")
        return refusal

    def _open_early_receipt(self, identity_path: Path | None, identity: Identity | None) -> None:
        """A receipt for a run stopped before its contract was complete (refused, or interrupted):
        the command, the host, the identity when it loaded, and (once finished) why it stopped.
        With no identity its lane is the one the operator's choice names (None when --identity
        named a file that did not load), its rule none."""
        from qualify.archive.layout import archive_dir
        from qualify.archive.writer import ReceiptWriter
        from qualify.contract.identity import identity_sha256
        from qualify.evidence.records import rule_from_identity

        options = self.options
        command_line = options.command_line or ["qualify", "--recipe", options.recipe]
        if identity_path is None or identity is None:
            self.receipt = ReceiptWriter(archive_dir(options.receipts), command_line=command_line, identity=None,
                                         recipe=options.recipe, lane=self._chosen_lane_name(),
                                         versions={"harness": __version__})
        else:
            self.receipt = ReceiptWriter(
                archive_dir(options.receipts), command_line=command_line,
                identity=identity_path, recipe=identity.recipe.value, lane=identity.lane,
                rule=rule_from_identity(identity, drift_graded=options.drift_graded or identity.rung == 2),
                identity_sha256=identity_sha256(identity), versions={"harness": __version__})
        self.receipt_path = self.receipt.path

    def _chosen_lane_name(self) -> str | None:
        """The lane a run with no loaded identity was asked for: the one the operator's
        --recipe/--producer/--consumer choice names, whose shipped identity the run loads; None
        when --identity named the file (its lane is whatever that file says) or the choice names none."""
        options = self.options
        if options.identity is not None:
            return None
        try:
            return chosen_lane(options.recipe, options.producer, options.consumer).name
        except Refused:
            return None

    @staticmethod
    def _engine_facts(engine: LaneEngine) -> dict[str, Any]:
        return {"name": engine.name, "version": engine.version, "abi": engine.abi,
                "digests": dict(engine.digests)}

    # -- the run's state, once the step that makes it has run -------------------------------

    def _have(self, value: _T | None, what: str) -> _T:
        if value is None:
            raise StepFailed(f"no {what}: the step that makes it has not run")
        return value

    @property
    def _contract(self) -> Contract:
        return self._have(self.contract, "contract")

    @property
    def _receipt(self) -> ReceiptWriter:
        return self._have(self.receipt, "receipt")

    @property
    def _producer(self) -> Transport:
        return self._have(self.producer, "producer")

    @property
    def _comparer(self) -> Comparer:
        return self._have(self.comparer, "comparer")

    @property
    def _consumer(self) -> LaneEngine:
        return self._have(self.consumer, "consumer")

    @property
    def _run_key(self) -> bytes:
        return self._have(self._key, "run key")

    def _start_producer(self) -> str:
        from qualify.handoff.protocol import STALL_NOTE_S
        from qualify.handoff.wire import handoff_key_id, mint_run_key

        contract = self._contract
        mode = contract.producer_mode
        extra_args = ["--fault", self.options.fault] if self.options.fault is not None else []
        # A producer the operator runs was started with its run key; one this run starts gets a new one.
        self._key = mint_run_key() if self.options.producer_at is None else self.options.producer_at.key
        deadlines = contract.deadlines.overridden(self.options.deadline_s)
        self.log(f"producer deadlines ({'--deadline-s' if self.options.deadline_s is not None else 'from the basis receipt'}): "
                 f"{deadlines.describe()}")
        self.producer = self._transport_factory(TransportSetup(
            lane=contract.lane, mode=mode, key=self._key, run_id=self._receipt.run_id,
            expectation=contract.expectation, watchdog_s=self.options.watchdog_s,
            extra_args=extra_args, engine_factory=self.options.engine_factory,
            env=dict(self.producer_env),
            handed_off_positions=self._handed_off_positions(),
            deadlines=deadlines,
            # The same for every request: the size follows from the geometry alone.
            expected_payload_bytes=self._handoff_expectation("sample-1").expected_payload_bytes,
        ))
        self._producer.start()
        # What the producer process runs on (CPU, BLAS kernel and threads, GPU, commit): host.json.
        self._receipt.set_producer_host(self._producer.host_facts, problem=self._producer.host_facts_problem)
        self._log_link()
        if self._producer.ready_silence_s >= STALL_NOTE_S:
            self.log(f"producer stalled while starting: silent {self._producer.ready_silence_s:.2f} s, then recovered")
        self.log(f"producer ready (warm-up prefill done): lane {contract.lane}, mode {mode.value}, "
                 f"run key {handoff_key_id(self._key)}, producer environment overrides {self.producer_env or 'none'}")
        return f"mode {mode.value}, warm-up prefill done"

    def _handed_off_positions(self) -> int:
        contract = self._contract
        return contract.spec.handed_off_positions(contract.handoff_positions)

    def _handoff_expectation(self, request_id: str, prompt: np.ndarray | None = None) -> HandoffExpectation:
        """What every handoff of this run must be: this run, lane and key, the identity, the
        consumer's geometry at the handed-off positions, the handed-off prefix of the contract's
        prompt (or of ``prompt``, one a service condition interleaves)."""
        from qualify.handoff.wire import HandoffExpectation

        contract = self._contract
        prompt = contract.prompt if prompt is None else prompt
        handed_off = self._handed_off_positions()
        return HandoffExpectation(
            identity_sha256=contract.identity_sha256,
            cache_identity=contract.target_cache_identity,
            geometry=self._consumer.geometry.kv_geometry(handed_off, contract.expectation.kv_dtype),
            # The manifest names the tokens whose KV it carries: the handed-off prefix.
            prompt_sha256=assets.prompt_sha256(prompt[:handed_off]),
            run_id=self._receipt.run_id,
            request_id=request_id,
            draft_geometry=self._expected_draft_geometry(),
            lane=contract.lane,
            producer_mode=contract.producer_mode,
        )

    def _stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def restart_producer(self, env: dict[str, str]) -> None:
        """Stop the producer and start a fresh one with ``env`` set on top of the operator's."""
        self._stop_producer()
        self.producer_env = dict(env)
        self._start_producer()

    def _log_link(self) -> None:
        """The record of how the producer is reached: its address, and under TLS the session's
        version, cipher and the producer certificate's fingerprint (command.log)."""
        from qualify.handoff.client import RemoteProducer

        producer = self.producer
        if isinstance(producer, RemoteProducer):
            session = producer.tls_session
            tls = ("no TLS (loopback)" if session is None else
                   f"{session['version']}, {session['cipher']}, producer certificate sha256 "
                   f"{session['producer_certificate_sha256']}")
            self.log(f"producer at {producer.address} (--producer-at; {tls})")

    def _compute_reference(self) -> str:
        seconds = self._comparer.reference()
        if seconds is None:
            return "cold local recompute: one per handoff, by a forked child beside the handoffs"
        self.seconds["recompute"] = self.seconds.get("recompute", 0.0) + seconds
        return f"cold local recompute: {self._contract.output_tokens} tokens in {seconds:.2f} s"

    def _expected_draft_geometry(self) -> KVGeometry | None:
        """A speculative consumer expects the draft's own context beside the target KV."""
        assert self.consumer is not None and self.contract is not None  # set by "identity sealed"
        return self._consumer.draft_kv_geometry(self._contract.handoff_positions)

    def _handoff(self, index: int) -> str:
        from qualify.handoff.protocol import STALL_NOTE_S
        from qualify.handoff.wire import open_handoff

        contract = self._contract
        repetition = index + 1
        request_id = f"sample-{repetition}"
        measured: dict[str, Any] = {}
        self._before_handoff(index)
        try:
            handoff = self._producer.request_prefill(contract.prompt[:contract.handoff_positions], request_id)
            if self.service is not None:
                self.service.served(request_id, contract.prompt_name)
            transport = handoff.transport
            if transport is None:
                raise ProducerFailed(f"{request_id}: the transport reported no transfer figures")
            measured = {"payload_bytes": transport.payload_bytes, "payload_gbit_per_s": transport.gbit_per_s}
            opened = open_handoff(handoff, key=self._run_key, expectation=self._handoff_expectation(request_id),
                                  digest_threads=self.options.digest_threads)
            # Intact bytes of values no consumer installs: the producer's failure, this sample's.
            tainted = first_non_finite(opened.kv)
            if tainted is not None:
                raise HandoffRefused(f"{tainted}: non-finite values (NaN or infinity)", check="kv.values")
        except (ProducerFailed, HandoffRefused) as exc:
            if isinstance(exc, HandoffRefused):
                error = f"handoff refused by check {exc.check}: {one_line(str(exc))}"
            else:
                error = f"producer failed: {one_line(str(exc))}"
            # A producer that sent something refused is not asked for anything again.
            self._stop_producer()
            return self._keep(failed_sample_record(repetition, error, **measured), repetition)
        overlap = transport.phase_overlap_s
        self.log(f"{request_id}: transport {transport.kind}: {transport.payload_bytes} payload bytes in "
                 f"{transport.transfer_s:.6f} s (link {transport.gbit_per_s:.3f} Gbit/s), request {transport.request_s:.6f} s, "
                 f"phase overlap {'unknown' if overlap is None else f'{overlap:.6f} s'}")
        producer_stall_s = transport.longest_silence_s if transport.longest_silence_s >= STALL_NOTE_S else None
        if producer_stall_s is not None:
            self.log(f"{request_id}: producer stalled: silent {producer_stall_s:.2f} s, then recovered")
        manifest = opened.manifest
        pending = contract.prompt[manifest.handed_off_positions:]
        compared = self._comparer.compare(opened.kv, pending, meanwhile=self._settle_previous)
        for activity, seconds in compared.seconds.items():
            self.seconds[activity] = self.seconds.get(activity, 0.0) + seconds
        timings = opened.timings

        def build_record() -> SampleRecord:
            comparison = compared.result()
            self._series[repetition] = sample_series(comparison)
            if self._wants_envelope(repetition):
                self._envelope_pending[repetition] = envelope_series(comparison)
            self.draft_counts[repetition] = comparison.handoff_draft_counts
            return sample_record(
                repetition=repetition,
                comparison=comparison,
                payload_sha256=manifest.payload_sha256,
                seams_sha256=seams_sha256(manifest),
                payload_bytes=manifest.payload_size,
                payload_gbit_per_s=transport.gbit_per_s,
                handed_off_positions=manifest.handed_off_positions,
                recomputed_positions=len(contract.prompt) - manifest.handed_off_positions,
                kv_envelope=contract.kv_envelope,
                phases={
                    "producer_compute_s": manifest.compute_s,
                    # The producer's serialize and its payload/seam hashing, as it reported them.
                    "serialize_s": manifest.serialize_s + manifest.digest_s,
                    "transport_s": transport.transfer_s,
                    "verify_s": timings.verify_s,
                    "install_s": timings.install_s + compared.seconds.get("install", 0.0),
                    "decode_s": compared.seconds["decode"],
                    "recompute_s": compared.seconds.get("recompute", self.seconds.get("recompute", 0.0)),
                },
                producer_stall_s=producer_stall_s,
            )

        self._unsettled.append((repetition, build_record))
        # A deferred sample is recorded and judged at the next step, while that handoff decodes
        # (or at the verdict).
        message = (f"sample {repetition} compared on the device; recorded with the next step"
                   if self._comparer.deferred else self._settle())
        self._after_handoff(index)
        return message

    # -- service conditions (qualify.run.service_conditions) ---------------------------------

    def _before_handoff(self, index: int) -> None:
        """``recovery``: before handoff 2, the producer killed and started again; ``aba``: before
        handoffs 2 and 3, the warm producer serves prompt B, then C."""
        service = self.service
        if service is None or index == 0:
            return
        if service.conditions == "recovery" and index == 1:
            status = kill_and_reap(self._producer)
            self._stop_producer()
            service.started(RESTARTED, killed_exit_status=status)
            self.log(f"service conditions recovery: producer killed (SIGKILL; exit status {status}); starting it again")
            self._start_producer()
        elif service.conditions == "aba":
            self._serve_other(service.other_prompts[index - 1])

    def _after_handoff(self, index: int) -> None:
        """``aba``: after the last handoff, B and C each served solo by a freshly started producer."""
        service = self.service
        if service is None or service.conditions != "aba" or index != ORDERED_HANDOFFS - 1:
            return
        for name in service.other_prompts:
            self._stop_producer()
            service.started(f"solo run of {name}")
            self._start_producer()
            self._serve_other(name)

    def _serve_other(self, name: str) -> None:
        """Hand off the shipped prompt ``name`` on the current producer, verify it, decode it on
        the consumer and log its digests (equality with its solo run is judged at the verdict)."""
        from qualify.evidence.compare import generated_token_sha256, logit_digests
        from qualify.handoff.wire import open_handoff

        service, contract = self._have(self.service, "service log"), self._contract
        prompt = assets.load_prompt(name)
        request_id = f"service-{len(service.requests) + 1}"
        if len(prompt) != len(contract.prompt):
            raise StepFailed(f"service conditions: prompt {name} has {len(prompt)} tokens, the fixture {len(contract.prompt)}")
        try:
            handoff = self._producer.request_prefill(prompt[:contract.handoff_positions], request_id)
            opened = open_handoff(handoff, key=self._run_key, expectation=self._handoff_expectation(request_id, prompt),
                                  digest_threads=self.options.digest_threads)
            tainted = first_non_finite(opened.kv)
            if tainted is not None:
                raise HandoffRefused(f"{tainted}: non-finite values (NaN or infinity)", check="kv.values")
        except (ProducerFailed, HandoffRefused) as exc:
            self._stop_producer()
            raise StepFailed(f"service conditions: {request_id} (prompt {name}): {one_line(str(exc))}") from None
        manifest = opened.manifest
        decoded = self._consumer.decode(opened.kv, prompt[manifest.handed_off_positions:], contract.output_tokens)
        digests = {"payload_sha256": manifest.payload_sha256, "seams_sha256": seams_sha256(manifest),
                   "logit_block_sha256": logit_digests(decoded.logits).block_sha256,
                   "generated_token_sha256": generated_token_sha256(decoded.tokens)}
        service.served(request_id, name, digests)
        self.log(f"service conditions {service.conditions}: {request_id} prompt {name} (producer start "
                 f"{len(service.starts)}): payload sha256 {manifest.payload_sha256}")

    def _settle(self) -> str:
        """Record and judge the oldest compared sample not yet recorded."""
        repetition, record = self._unsettled.pop(0)
        return self._keep(record(), repetition)

    def _settle_previous(self) -> None:
        """A deferred comparer's ``meanwhile``: the previous sample, while this one decodes."""
        if self._unsettled:
            self._settle()

    def _keep(self, record: SampleRecord, repetition: int) -> str:
        started = time.perf_counter()
        document = record_json(record)
        self.records.append(document)
        self._receipt.add_sample(record)
        series = self._series.pop(repetition, None)
        if series is not None:
            self._receipt.add_series(repetition, series)
        if repetition in self._envelope_pending:
            arrays = self._envelope_pending.pop(repetition)
            if arrays is None:  # absent evidence is failed evidence: the envelope judges it so
                self._envelope_missing[repetition] = missing_series(repetition, NO_TENSOR_SERIES)
                self.log(f"sample {repetition}: no envelope series: {self._envelope_missing[repetition]}")
            else:
                self._receipt.add_envelope_series(repetition, arrays)
                self.envelope_series[repetition] = arrays
        self._add_seconds("receipt", started)
        if self._contract.rule is None:  # calibration: measure, do not judge
            return f"max_abs {document.get('max_abs')}, mean_abs {document.get('mean_abs')}"
        verdict = judge_sample(document, self._contract.rule)
        self.sample_verdicts.append(verdict)
        self.log(f"sample {repetition}: {verdict.headline}")
        if not verdict.passed:
            # A deferred comparer settles a sample during the next step: name the sample it was.
            deferred = self.comparer is not None and self.comparer.deferred
            raise StepFailed(f"sample {repetition}: {verdict.headline}" if deferred else verdict.headline)
        return verdict.headline

    def _wants_envelope(self, repetition: int) -> bool:
        """Whether a handoff's envelope series are recorded: every sample of a run held to a
        fixture envelope, and the repetitions a calibration states one from."""
        return self._contract.fixture_envelope is not None or repetition in self.envelope_repetitions

    def _judge_envelope(self) -> Verdict:
        """Every sample held to the contract's fixture envelope; a sample without its series (it
        failed before its comparison, or its comparer computes none) fails it."""
        envelope = self._contract.fixture_envelope
        assert envelope is not None  # the caller asks only under a non-deterministic contract
        repetitions = [record.get("repetition") for record in self.records]
        series, missing = [], []
        for repetition in repetitions:
            if type(repetition) is int and repetition in self.envelope_series:
                series.append(handoff_series(self.envelope_series[repetition]))
            elif type(repetition) is int and repetition in self._envelope_missing:
                missing.append(self._envelope_missing[repetition])
            else:
                missing.append(missing_series(repetition, NO_COMPARISON))
        return judge_envelope(series, envelope, missing=missing)

    def settle_all(self) -> None:
        """Record and judge every compared sample not yet recorded (a deferred comparer's)."""
        while self._unsettled:
            self._settle()

    def _scope(self) -> Scope | None:
        """What this qualification's verdict covers: its fixture and its lane's controls (None for
        a calibration, which qualifies nothing, or before the contract exists)."""
        contract = self.contract
        if contract is None or contract.rule is None:
            return None
        # The rule is named here too, so a run stopped by a sample's refusal states it; the
        # partings are counted by the whole run's judgement (judge_qualification).
        forced = isinstance(contract.rule, BoundedDriftRule) and contract.rule.teacher_forced
        return Scope(fixture=contract.prompt_name, repetitions=contract.repetitions,
                     prompt_tokens=len(contract.prompt), output_tokens=contract.output_tokens,
                     controls=contract.controls, service_conditions=self.options.service_conditions,
                     judged_by=TEACHER_FORCED_RULE if forced else None, envelope=contract.envelope_scope)

    def _judge_summary(self) -> str:
        self.settle_all()
        contract = self._contract
        if contract.rule is None:
            raise StepFailed("calibration runs have no verdict step")
        if contract.anchor_records is None:
            raise StepFailed("no anchor in the basis receipt to recheck the run's digests against")
        service = None
        if self.service is not None:
            evidence = self.service.document(self.records)
            self._receipt.add_evidence(SERVICE_EVIDENCE, evidence)
            service = judge_service_conditions(evidence)
        # A producer declared non-deterministic has no anchor: its samples are held to the envelope.
        envelope = self._judge_envelope() if contract.fixture_envelope is not None else None
        verdict = judge_qualification(self.records, contract.rule, contract.anchor_records,
                                      deterministic_producer=contract.deterministic_producer, scope=self._scope(),
                                      link_floor_gbit_per_s=contract.link_floor_gbit_per_s, service=service,
                                      envelope=envelope)
        self.finish(verdict)  # finalize writes the receipt's one "verdict:" line
        if not verdict.passed:
            raise StepFailed(verdict.headline)
        return verdict.headline



class StepFailed(Exception):
    """A step ran and its evidence failed the contract (the run is not qualified)."""


def seams_sha256(manifest: HandoffManifest) -> str:
    """One digest over a handoff's per-layer seam digests (layer, K, V), as its record keeps it."""
    return canonical_sha256([[seam.layer, seam.k_sha256, seam.v_sha256] for seam in manifest.seams])
