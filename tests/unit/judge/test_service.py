"""judge_service_conditions: every request equal to its prompt's solo run, under conditions that
were exercised; anything else fails, naming the request and the digest."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from qualify.judge import judge_qualification
from qualify.judge.scope import Scope, scope_line
from qualify.judge.service import SERVICE_DIGESTS, judge_service_conditions
from tests.unit.judge.test_judge import RULE2, SEAMS_SHA, three

A, B, C = "python-textwrap", "prose-email-architecture", "config-idle-keys"


def _digests(prompt: str) -> dict[str, str]:
    return {name: f"{prompt}-{name}" for name, _ in SERVICE_DIGESTS}


def _request(request: str, prompt: str, start: int, position: int) -> dict[str, Any]:
    return {"request": request, "prompt": prompt, "start": start, "position": position, **_digests(prompt)}


def aba() -> dict[str, Any]:
    """What a passing ``aba`` run records: A, B, A, C, A on start 1; B and C solo on starts 2 and 3."""
    return {
        "conditions": "aba",
        "starts": [{"start": 1, "began": "run start"}, {"start": 2, "began": f"solo run of {B}"},
                   {"start": 3, "began": f"solo run of {C}"}],
        "requests": [_request("sample-1", A, 1, 1), _request("service-2", B, 1, 2), _request("sample-2", A, 1, 3),
                     _request("service-4", C, 1, 4), _request("sample-3", A, 1, 5),
                     _request("service-6", B, 2, 1), _request("service-7", C, 3, 1)],
    }


def recovery() -> dict[str, Any]:
    """What a passing ``recovery`` run records: A on start 1, killed; A twice on start 2."""
    return {
        "conditions": "recovery",
        "starts": [{"start": 1, "began": "run start"},
                   {"start": 2, "began": "after SIGKILL", "killed_exit_status": -9}],
        "requests": [_request("sample-1", A, 1, 1), _request("sample-2", A, 2, 1), _request("sample-3", A, 2, 2)],
    }


def failed_details(document: dict[str, Any]) -> list[str]:
    verdict = judge_service_conditions(document)
    assert not verdict.passed
    return [check.detail for check in verdict.checks if not check.passed]


def test_equal_requests_under_exercised_conditions_pass():
    for document, compared in ((aba(), 4), (recovery(), 2)):
        verdict = judge_service_conditions(document)
        assert verdict.passed, verdict.headline
        assert sum(check.passed for check in verdict.checks) == compared + 1  # and the "exercised" check


@pytest.mark.parametrize("name, words", SERVICE_DIGESTS)
def test_an_interleaved_request_that_differs_from_its_solo_run_fails_naming_it(name: str, words: str):
    document = aba()
    document["requests"][1][name] = "changed"  # B right after A
    details = failed_details(document)
    assert len(details) == 1
    assert "service-2" in details[0] and B in details[0] and "service-6" in details[0] and words in details[0]
    assert f"after prompt {A}" in details[0]


def test_a_fixture_request_after_another_prompt_that_differs_fails():
    document = aba()
    document["requests"][4]["payload_sha256"] = "changed"  # A right after C
    (detail,) = failed_details(document)
    assert "sample-3" in detail and "sample-1" in detail and "payload" in detail


def test_a_handoff_after_the_kill_that_differs_fails():
    document = recovery()
    document["requests"][1]["seams_sha256"] = "changed"
    (detail,) = failed_details(document)
    assert "sample-2" in detail and "first after the kill" in detail and "seams" in detail


def test_a_missing_digest_fails():
    document = recovery()
    del document["requests"][2]["logit_block_sha256"]
    (detail,) = failed_details(document)
    assert "sample-3" in detail and detail.endswith("in logit blocks (logit blocks missing vs python-textw…)")


@pytest.mark.parametrize("change", ["no kill", "kill not SIGKILL", "not restarted"])
def test_recovery_that_was_not_exercised_fails(change: str):
    document = recovery()
    if change == "no kill":
        document["starts"][1] = {"start": 2, "began": "run start"}
    elif change == "kill not SIGKILL":
        document["starts"][1]["killed_exit_status"] = None
    else:
        document["starts"] = document["starts"][:1]
        for request in document["requests"][1:]:
            request["start"], request["position"] = 1, request["position"] + 1
    details = failed_details(document)
    assert any("not exercised" in detail for detail in details)


def test_aba_that_never_interleaved_fails():
    document = aba()
    # B served only solo: nothing shows it unchanged after another prompt.
    document["requests"] = [request for request in document["requests"] if request["request"] != "service-2"]
    document["requests"][1]["position"], document["requests"][2]["position"] = 2, 3
    document["requests"][3]["position"] = 4
    details = failed_details(document)
    assert any("not exercised" in detail and B in detail for detail in details)


def test_aba_with_one_prompt_fails():
    document = aba()
    document["requests"] = [request for request in document["requests"] if request["prompt"] == A]
    document["requests"][1]["position"], document["requests"][2]["position"] = 2, 3
    assert any("only one prompt" in detail for detail in failed_details(document))


def test_a_request_whose_prompt_has_no_solo_run_fails():
    document = aba()
    document["requests"] = [request for request in document["requests"] if request["request"] != "service-6"]
    assert any("no solo run" in detail and B in detail for detail in failed_details(document))


@pytest.mark.parametrize("broken", [
    {"conditions": "abc"}, {"conditions": None}, {"requests": []}, {"requests": None},
    {"requests": [{"prompt": A, "start": 1}]}, {"requests": [{"request": "x", "prompt": A, "start": True, "position": 1}]},
])
def test_malformed_evidence_fails_closed(broken: dict[str, Any]):
    document = {**aba(), **copy.deepcopy(broken)}
    assert not judge_service_conditions(document).passed


def test_the_qualification_fails_when_its_service_evidence_does():
    records, anchors, rule = three(seams_sha256=SEAMS_SHA), three(seams_sha256=SEAMS_SHA), RULE2
    scope = Scope(fixture=A, repetitions=3, prompt_tokens=2048, output_tokens=256, controls=None,
                  service_conditions="recovery")
    passing = judge_qualification(records, rule, anchors, deterministic_producer=True, scope=scope, service=judge_service_conditions(recovery()))
    assert passing.passed and "under a producer killed (SIGKILL)" in passing.headline
    broken = recovery()
    broken["requests"][1]["payload_sha256"] = "changed"
    failing = judge_qualification(records, rule, anchors, deterministic_producer=True, scope=scope,
                                  service=judge_service_conditions(broken))
    assert not failing.passed and "sample-2" in failing.headline
    assert scope_line(False, scope).startswith("NOT QUALIFIED on fixture python-textwrap (3 × 2048/256, under ")


def test_a_scope_names_only_known_conditions():
    with pytest.raises(ValueError, match="service conditions"):
        Scope(fixture=A, repetitions=3, prompt_tokens=2048, output_tokens=256, controls=None, service_conditions="abc")


def _failed_names(document: object) -> list[str]:
    verdict = judge_service_conditions(document)  # type: ignore[arg-type]
    assert not verdict.passed
    return [check.name for check in verdict.checks if not check.passed]


@pytest.mark.parametrize(("broken", "detail"), [
    ({"requests": []}, "the evidence holds no requests"),
    ({"requests": "none"}, "the evidence holds no requests"),
    ({"requests": [_request("sample-1", A, 1, 1), "junk"]}, "request #2 does not name"),
    ({"requests": [_request("sample-1", A, 1, 1), {**_request("s", A, 1, 2), "prompt": 1}]}, "request #2 does not name"),
    ({"requests": [_request("sample-1", A, 1, 1), {**_request("s", A, 1, 2), "request": None}]}, "request #2 does not name"),
    ({"requests": [_request("sample-1", A, 1, 1), {**_request("s", A, 1, 2), "start": "1"}]}, "request #2 does not name"),
    ({"requests": [_request("sample-1", A, 1, 1), {**_request("s", A, 1, 2), "position": 2.0}]}, "request #2 does not name"),
])
def test_evidence_that_does_not_name_its_requests_fails_that_check(broken: dict[str, Any], detail: str):
    verdict = judge_service_conditions({**recovery(), **broken})
    assert [(check.name, detail in check.detail) for check in verdict.checks] == [("service evidence", True)]


def test_a_document_that_is_no_mapping_fails_closed():
    assert _failed_names(["not", "a", "document"]) == ["service conditions"]


def test_malformed_starts_are_passed_over():
    document = recovery()
    document["starts"] = ["junk", {"start": "2"}, *document["starts"]]
    assert judge_service_conditions(document).passed


def test_the_smallest_recovery_passes_and_its_kill_is_the_first_request_after_it():
    document = recovery()
    document["requests"] = document["requests"][:2]  # sample-1 on start 1, sample-2 first after the kill
    assert judge_service_conditions(document).passed


def test_a_prompt_first_served_after_a_kill_has_no_solo_run_and_later_requests_are_still_judged():
    document = recovery()
    document["requests"] = [_request("sample-2", A, 2, 1), _request("sample-3", A, 2, 2), _request("sample-4", A, 2, 3)]
    verdict = judge_service_conditions(document)
    no_solo = [check for check in verdict.checks if "no solo run" in check.detail]
    assert [check.detail.split(": ")[2].split(" (")[0] for check in no_solo] == [
        "request sample-2", "request sample-3", "request sample-4"]


def test_two_prompts_interleaved_are_enough_for_aba():
    document = {
        "conditions": "aba",
        "starts": [{"start": 1, "began": "run start"}, {"start": 2, "began": f"solo run of {B}"}],
        "requests": [_request("sample-1", A, 1, 1), _request("service-2", B, 1, 2), _request("sample-2", A, 1, 3),
                     _request("service-4", B, 2, 1)],
    }
    assert judge_service_conditions(document).passed
    document["requests"][2]["prompt"] = B  # B twice after A... and A never after B
    document["requests"][2].update(_digests(B))
    (detail,) = failed_details(document)
    assert detail.endswith(f"prompt(s) {A} never served right after another prompt")


def test_every_prompt_never_served_after_another_is_named():
    document = aba()
    document["requests"] = [_request("sample-1", A, 1, 1), _request("sample-2", A, 1, 2),
                            _request("service-3", B, 2, 1), _request("service-4", C, 3, 1)]
    (detail,) = [check.detail for check in judge_service_conditions(document).checks if not check.passed]
    assert detail == f"A/B/A: not exercised: prompt(s) {C}, {B}, {A} never served right after another prompt"
