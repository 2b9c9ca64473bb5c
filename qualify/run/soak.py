"""A soak run (``qualify soak``, issue 38 item 4): N back-to-back handoffs of the identity's fixture
against one producer, N and the rate floor fixed beforehand in committed criteria
(:mod:`qualify.contract.soak`), judged by :func:`qualify.judge.soak.judge_soak`.

Each handoff is requested, verified by the wire (MAC, manifest, digests, geometry) and checked
for non-finite values, its payload digest and rate recorded; none is decoded, since a payload
equal to the anchor's is the qualified one, bit for bit. A producer death or a refused handoff
ends the soak there (its receipt says at which handoff); a slow handoff does not, so the verdict
reports every rate. The run shares its identity, producer start, interrupts and receipt with a
qualification (:class:`~qualify.run.qualification.QualificationRun`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qualify.contract.soak import SoakCriteria
from qualify.core.errors import HandoffRefused, ProducerFailed, Refused, one_line
from qualify.core.kv import first_non_finite
from qualify.judge import Verdict
from qualify.judge.soak import anchor_payload, judge_soak
from qualify.run.qualification import QualificationRun, RunOptions, StepFailed

SOAK_EVIDENCE = "soak"
SOAK_SCHEMA = "trust-ladder.soak.v1"
SOAK_LABELS: tuple[str, ...] = ("identity sealed", "producer ready", "soak", "verdict")


class SoakRun(QualificationRun):
    """A soak: the qualification's first two steps, then ``soak`` (the N handoffs) and ``verdict``."""

    labels = SOAK_LABELS
    first_evidence_step = "soak"

    def __init__(self, options: RunOptions, criteria: SoakCriteria, log: Callable[[str], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(options, log=log, **kwargs)
        self.criteria = criteria
        # One record per attempted handoff, in order (qualify.judge.soak reads them).
        self.soak_records: list[dict[str, Any]] = []
        # Told each handoff's line as it ends (the console's live activity).
        self.progress: Callable[[str], None] | None = None

    def _scope(self) -> None:
        """A soak qualifies no fixture: its verdict states its own scope (N handoffs, the link)."""
        return None

    def _run(self, label: str) -> str:
        if label == "soak":
            return self._soak()
        if label == "verdict":
            return self._judge_soak()
        message = super()._run(label)
        if label == "identity sealed" and not self._contract.deterministic_producer:
            # Each soak handoff's payload is held to the anchor bit for bit; such a producer has none.
            raise Refused(f"soak: lane {self._contract.lane}: the identity declares a non-deterministic producer, "
                          f"which retains no anchor payload to hold every handoff to")
        return message

    def _soak(self) -> str:
        contract, criteria = self._contract, self.criteria
        prefix = contract.prompt[:contract.handoff_positions]
        for number in range(1, criteria.handoffs + 1):
            record = self._one_handoff(number, prefix)
            self.soak_records.append(record)
            line = (f"soak {number}/{criteria.handoffs}: " +
                    (f"{record['payload_gbit_per_s']:.3f} Gbit/s, payload {record['payload_sha256'][:16]}"
                     if record["error"] is None else record["error"]))
            self.log(line)
            if self.progress is not None:
                self.progress(line)
            if record["error"] is not None:
                self._stop_producer()
                verdict = self._verdict()
                raise StepFailed(verdict.headline)
        rates = [record["payload_gbit_per_s"] for record in self.soak_records]
        return f"{criteria.handoffs} handoffs, slowest {min(rates):.3f} Gbit/s"

    def _one_handoff(self, number: int, prefix: Any) -> dict[str, Any]:
        """Request, verify and check handoff ``number``; its record (``error`` None when it held)."""
        from qualify.handoff.wire import open_handoff

        request_id = f"soak-{number}"
        record: dict[str, Any] = {"handoff": number, "request": request_id, "error": None}
        try:
            handoff = self._producer.request_prefill(prefix, request_id)
            transport = handoff.transport
            if transport is None:
                raise ProducerFailed(f"{request_id}: the transport reported no transfer figures")
            record.update(payload_bytes=transport.payload_bytes, payload_gbit_per_s=transport.gbit_per_s,
                          transfer_s=transport.transfer_s)
            opened = open_handoff(handoff, key=self._run_key, expectation=self._handoff_expectation(request_id),
                                  digest_threads=self.options.digest_threads)
            tainted = first_non_finite(opened.kv)
            if tainted is not None:
                raise HandoffRefused(f"{tainted}: non-finite values (NaN or infinity)", check="kv.values")
            record["payload_sha256"] = opened.manifest.payload_sha256
        except ProducerFailed as exc:
            status = getattr(self.producer, "exit_status", None)
            record.update(error=f"producer failed: {one_line(str(exc))}", producer_died=status is not None,
                          exit_status=status)
        except HandoffRefused as exc:
            record["error"] = f"handoff refused by check {exc.check}: {one_line(str(exc))}"
        return record

    def _verdict(self) -> Verdict:
        """Judge the records so far, seal the receipt with the verdict; the verdict."""
        contract, criteria = self._contract, self.criteria
        self._receipt.add_evidence(SOAK_EVIDENCE, {
            "schema": SOAK_SCHEMA, "criteria": criteria.document, "criteria_sha256": criteria.sha256,
            "handoffs": self.soak_records})
        verdict = judge_soak(self.soak_records, handoffs=criteria.handoffs,
                             link_floor_gbit_per_s=criteria.link_floor_gbit_per_s,
                             anchor_payload_sha256=anchor_payload(contract.anchor_records or []),
                             link_words=criteria.link_words, criteria=criteria.name)
        self.finish(verdict)
        return verdict

    def _judge_soak(self) -> str:
        verdict = self._verdict()
        if not verdict.passed:
            raise StepFailed(verdict.headline)
        return f"passed: {verdict.reasons[0]}"
