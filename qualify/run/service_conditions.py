"""Service conditions for a qualification (``--service-conditions``, issue 38): what the run does
around its three ordered handoffs, and the evidence it records for :mod:`qualify.judge.service`.

* ``aba``: the fixture (A) is handed off first on a fresh producer; before handoff 2 the same warm
  producer serves a second shipped prompt (B), before handoff 3 a third (C); after handoff 3, B
  and C are each served solo, first on a freshly started producer. So every prompt is served
  right after another one on a warm engine, and compared with its own solo run.
* ``recovery``: after handoff 1 the producer is killed (SIGKILL) and started again; handoffs 2
  and 3 go to the new process and must equal handoff 1 bit for bit.

The extra prompts are decoded by the consumer (their logit and token digests) but not compared
with a cold recompute: what they show is equality with their own solo run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qualify.core.assets import PROMPT_NAMES
from qualify.judge.service import RESTARTED, SERVICE_DIGESTS, SERVICE_SCHEMA

FIXTURE_DIGESTS: dict[str, str] = {
    "payload_sha256": "payload_sha256",
    "seams_sha256": "seams_sha256",
    "logit_block_sha256": "handoff_logit_block_sha256",
    "generated_token_sha256": "handoff_generated_token_sha256",
}
"""Where each service digest of a fixture handoff is read from its sample record."""


@dataclass
class ServiceLog:
    """The producer starts and requests of a run under service conditions, in the order served."""

    conditions: str
    fixture: str
    starts: list[dict[str, Any]] = field(default_factory=lambda: [{"start": 1, "began": "run start"}])
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def other_prompts(self) -> tuple[str, ...]:
        """The shipped prompts B and C that ``aba`` interleaves with the fixture."""
        return tuple(name for name in PROMPT_NAMES if name != self.fixture)[:2]

    def started(self, began: str, killed_exit_status: int | None = None) -> None:
        """A new producer start: ``began`` says why (:data:`RESTARTED` after a kill)."""
        start: dict[str, Any] = {"start": len(self.starts) + 1, "began": began}
        if began == RESTARTED:
            start["killed_exit_status"] = killed_exit_status
        self.starts.append(start)

    def served(self, request: str, prompt: str, digests: dict[str, str] | None = None) -> None:
        """A request the current producer start served; a fixture handoff's digests come from its
        sample record (:meth:`document`), another prompt's are given here."""
        start = len(self.starts)
        position = 1 + sum(1 for served in self.requests if served["start"] == start)
        self.requests.append({"request": request, "prompt": prompt, "start": start, "position": position,
                              **(digests or {})})

    def document(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The evidence document, a fixture handoff's digests read from the sample record of its
        repetition (``sample-<n>``; a missing record leaves them missing, which fails)."""
        by_request = {f"sample-{record.get('repetition')}": record for record in records}
        requests = []
        for request in self.requests:
            record = by_request.get(request["request"]) if request["prompt"] == self.fixture else None
            if record is not None:
                request = {**request, **{name: record.get(FIXTURE_DIGESTS[name]) for name, _ in SERVICE_DIGESTS}}
            requests.append(request)
        return {"schema": SERVICE_SCHEMA, "conditions": self.conditions, "fixture": self.fixture,
                "starts": list(self.starts), "requests": requests}
