"""Determinism under service conditions (issue 38): does a producer hand off the same bits for a
prompt whatever it served before (A/B/A interleaving on one warm producer), and after it was
killed and started again (recovery)?

Records in, verdict out: the evidence is the run's ``evidence/service-conditions.json`` document
(:data:`SERVICE_EVIDENCE`), one entry per request with the producer start it went to, its position
there and its digests. Each prompt's *solo run* is its first request on a fresh producer start
(one the run began, not one that came back after a kill); every other request of that prompt must
equal it in every digest of :data:`SERVICE_DIGESTS`. A check that the conditions were exercised
at all comes first: evidence that never interleaved or never killed proves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qualify.judge.handoffs import Verdict, _Judgement
from qualify.judge.scope import SERVICE_CONDITIONS as CONDITIONS

SERVICE_EVIDENCE = "service-conditions"
"""The receipt's evidence name for the document judged here."""

SERVICE_SCHEMA = "trust-ladder.service-conditions.v1"

SERVICE_DIGESTS: tuple[tuple[str, str], ...] = (
    ("payload_sha256", "payload"),
    ("seams_sha256", "seams"),
    ("logit_block_sha256", "logit blocks"),
    ("generated_token_sha256", "generated tokens"),
)
"""The digests a request must share with its prompt's solo run, and their words."""

KILLED_STATUS = -9
"""A producer start that came back after a kill must name its predecessor's exit: killed by SIGKILL."""

RESTARTED = "after SIGKILL"
"""How a start that followed a kill says so (``began``); any other start is fresh."""


def _is_int(value: object) -> bool:
    return type(value) is int


def _requests(document: Mapping[str, Any], judgement: _Judgement) -> list[Mapping[str, Any]] | None:
    """The document's requests when every one names its prompt, start and position; else None,
    with the failed check."""
    requests = document.get("requests")
    if not isinstance(requests, list) or not requests:
        judgement.check("service evidence", False, "service conditions: the evidence holds no requests")
        return None
    for number, request in enumerate(requests, start=1):
        if (not isinstance(request, Mapping) or not isinstance(request.get("prompt"), str)
                or not isinstance(request.get("request"), str)
                or not _is_int(request.get("start")) or not _is_int(request.get("position"))):
            judgement.check("service evidence", False,
                            f"service conditions: request #{number} does not name its request, prompt, start and position")
            return None
    return requests


def _starts(document: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    starts = document.get("starts")
    if not isinstance(starts, list):
        return {}
    return {start["start"]: start for start in starts if isinstance(start, Mapping) and _is_int(start.get("start"))}


def _after_kill(start: Mapping[str, Any] | None) -> bool:
    return start is not None and start.get("began") == RESTARTED


def _preceding(requests: Sequence[Mapping[str, Any]], request: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The request served just before ``request`` on the same producer start."""
    for other in requests:
        if other.get("start") == request.get("start") and other.get("position") == request["position"] - 1:
            return other
    return None


def _where(request: Mapping[str, Any], requests: Sequence[Mapping[str, Any]], starts: Mapping[int, Mapping[str, Any]]) -> str:
    before = _preceding(requests, request)
    if before is not None:
        after = f"after prompt {before['prompt']}"
    elif _after_kill(starts.get(request["start"])):
        after = "first after the kill"
    else:
        after = "first on a fresh producer"
    return f"request {request['request']} (start {request['start']}, {after})"


def _short(value: object) -> str:
    return f"{value[:12]}…" if isinstance(value, str) else "missing"


def judge_service_conditions(document: Mapping[str, Any]) -> Verdict:
    """Every request's digests equal its prompt's solo run, under conditions that were exercised."""
    judgement = _Judgement()
    conditions = document.get("conditions") if isinstance(document, Mapping) else None
    if conditions not in CONDITIONS:
        judgement.check("service conditions", False,
                        f"service conditions: {conditions!r} is not one of {', '.join(CONDITIONS)}")
        return judgement.failed()
    requests = _requests(document, judgement)
    if requests is None:
        return judgement.failed()
    starts = _starts(document)
    label = "A/B/A" if conditions == "aba" else "recovery"
    # What a request is held to: its prompt's solo run; after a kill, that is the handoff before it.
    solo_words = "its solo run" if conditions == "aba" else "the handoff before the kill"
    solo: dict[str, Mapping[str, Any]] = {}
    for request in requests:
        if request["position"] == 1 and not _after_kill(starts.get(request["start"])):
            solo.setdefault(request["prompt"], request)
    compared = [request for request in requests if solo.get(request["prompt"]) is not request]
    _exercised(conditions, label, requests, compared, starts, judgement)
    for request in compared:
        reference = solo.get(request["prompt"])
        where = _where(request, requests, starts)
        if reference is None:
            judgement.check(f"{label} prompt {request['prompt']}", False,
                            f"{label}: prompt {request['prompt']}: {where} has no solo run to equal")
            continue
        differing = [words for name, words in SERVICE_DIGESTS
                     if not isinstance(request.get(name), str) or request.get(name) != reference.get(name)]
        if differing:
            first = next(name for name, words in SERVICE_DIGESTS if words == differing[0])
            judgement.check(
                f"{label} prompt {request['prompt']}", False,
                f"{label}: prompt {request['prompt']}: {where} differs from {solo_words} {reference['request']} "
                f"in {', '.join(differing)} ({differing[0]} {_short(request.get(first))} vs {_short(reference.get(first))})")
        else:
            judgement.check(
                f"{label} prompt {request['prompt']}", True,
                f"{label}: prompt {request['prompt']}: {where} equals {solo_words} {reference['request']} "
                f"in payload, seams, logit blocks and generated tokens")
    prompts = sorted({request["prompt"] for request in requests})
    return judgement.verdict(
        f"{CONDITIONS[conditions]}: {len(compared)} requests of {len(prompts)} prompt(s) equal "
        f"{'their solo runs' if conditions == 'aba' else 'the handoff before the kill'} bit for bit over "
        f"{len({request['start'] for request in requests})} producer starts")


def _exercised(conditions: str, label: str, requests: Sequence[Mapping[str, Any]],
               compared: Sequence[Mapping[str, Any]], starts: Mapping[int, Mapping[str, Any]],
               judgement: _Judgement) -> None:
    """The check that the evidence put the producer under the conditions it claims."""
    if conditions == "aba":
        interleaved = {request["prompt"] for request in compared
                       if (before := _preceding(requests, request)) is not None and before["prompt"] != request["prompt"]}
        prompts = {request["prompt"] for request in requests}
        missing = sorted(prompts - interleaved)
        held = len(prompts) >= 2 and not missing
        judgement.check(f"{label} exercised", held,
                        f"{label}: each of {len(prompts)} prompts served right after another prompt on a warm producer"
                        if held else f"{label}: not exercised: "
                        + (f"prompt(s) {', '.join(missing)} never served right after another prompt"
                           if len(prompts) >= 2 else "only one prompt was served"))
        return
    killed = [request for request in compared
              if request["position"] == 1 and _after_kill(starts.get(request["start"]))
              and starts[request["start"]].get("killed_exit_status") == KILLED_STATUS]
    judgement.check(f"{label} exercised", bool(killed),
                    f"{label}: {len(killed)} request(s) served first by a producer started again after a SIGKILL"
                    if killed else f"{label}: not exercised: no request was served by a producer started again "
                                   f"after one killed by SIGKILL (exit status {KILLED_STATUS})")


__all__ = ["CONDITIONS", "SERVICE_DIGESTS", "SERVICE_EVIDENCE", "SERVICE_SCHEMA", "judge_service_conditions"]
