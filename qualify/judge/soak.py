"""A soak's verdict (``qualify soak``, issue 38): N back-to-back handoffs against one producer,
each verified by the wire, its payload equal to the anchor's, its rate at or above the
preregistered floor, and no producer death.

Records in, verdict out. Every handoff is its own check (its rate, and what failed), so the
verdict reports each one; the headline states the scope, and a pass at N never claims more than N.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from qualify.judge.handoffs import Verdict, _Judgement


def _rate(record: Mapping[str, Any]) -> float | None:
    rate = record.get("payload_gbit_per_s")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
        return None
    return float(rate)


def _handoff_problem(record: Mapping[str, Any], floor: float, anchor: str | None) -> str | None:
    """Why one handoff fails the soak, or None."""
    error = record.get("error")
    if error is not None:
        return str(error)
    rate = _rate(record)
    if rate is None:
        return "payload rate missing or not a number"
    if rate < floor:
        return f"{rate:.3f} Gbit/s, below the floor {floor:g} Gbit/s"
    payload = record.get("payload_sha256")
    if anchor is None:
        return f"{rate:.3f} Gbit/s, its payload held to no anchor (the basis receipt has none)"
    if payload != anchor:
        return f"payload sha256 {str(payload)[:12]}… differs from the anchor's {str(anchor)[:12]}…"
    return None


def anchor_payload(anchor_records: Sequence[Mapping[str, Any]]) -> str | None:
    """The one payload digest every anchor sample agrees on, or None (no anchor to hold a soak to)."""
    digests = {record.get("payload_sha256") for record in anchor_records if isinstance(record, Mapping)}
    if len(digests) != 1 or len(anchor_records) == 0:
        return None
    (digest,) = digests
    return digest if isinstance(digest, str) else None


def judge_soak(records: Sequence[Mapping[str, Any]], *, handoffs: int, link_floor_gbit_per_s: float,
               anchor_payload_sha256: str | None, link_words: str, criteria: str) -> Verdict:
    """The soak's verdict over its handoff ``records`` (one per attempted handoff, in order)."""
    judgement = _Judgement()
    floor = link_floor_gbit_per_s
    if anchor_payload_sha256 is None:
        judgement.check("anchor", False, "soak: the basis receipt has no single anchor payload digest to hold "
                                         "the handoffs to")
    deaths = [number for number, record in enumerate(records, start=1)
              if isinstance(record, Mapping) and record.get("producer_died") is True]
    completed = sum(1 for record in records if isinstance(record, Mapping) and record.get("error") is None)
    # First, so that a death or a short soak leads the headline.
    judgement.check("handoffs completed", completed == handoffs and len(records) == handoffs,
                    f"{completed} of {handoffs} handoffs completed" + (
                        f"; the producer died at handoff {deaths[0]}" if deaths else "; no producer death"))
    for number, record in enumerate(records, start=1):
        problem = _handoff_problem(record, floor, anchor_payload_sha256) if isinstance(record, Mapping) \
            else "not a handoff record"
        rate = _rate(record) if isinstance(record, Mapping) else None
        shown = "no rate" if rate is None else f"{rate:.3f} Gbit/s"
        judgement.check(f"handoff {number}", problem is None,
                        f"handoff {number}: {shown}, verified, payload as anchored" if problem is None
                        else f"handoff {number}: {problem}")
    rates = [rate for rate in (_rate(record) for record in records if isinstance(record, Mapping)) if rate is not None]
    spread = (f"slowest {min(rates):.3f}, median {statistics.median(rates):.3f} Gbit/s" if rates else "no rates")
    scope = f"{handoffs} back-to-back handoffs against one producer {link_words} (criteria {criteria})"
    if judgement.failures:
        more = f" (and {len(judgement.failures) - 1} more)" if len(judgement.failures) > 1 else ""
        return Verdict(False, f"SOAK FAILED on {scope}: {judgement.failures[0]}{more}; {spread}",
                       list(judgement.failures), list(judgement.checks))
    return Verdict(True, f"SOAK PASSED on {scope}: each verified, its payload equal to the anchor's, at or above "
                         f"{floor:g} Gbit/s ({spread}); no producer death. This covers {handoffs} handoffs and "
                         f"claims nothing beyond them",
                   [judgement.checks[0].detail], list(judgement.checks))
