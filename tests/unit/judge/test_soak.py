"""judge_soak: every handoff its own check with its rate; a pass only when all N held, and then
its words claim N and nothing beyond."""

from __future__ import annotations

from typing import Any

import pytest

from qualify.judge.soak import anchor_payload, judge_soak

ANCHOR = "a" * 64


def handoff(number: int, rate: float = 10.0, **fields: Any) -> dict[str, Any]:
    return {"handoff": number, "request": f"soak-{number}", "error": None, "payload_gbit_per_s": rate,
            "payload_sha256": ANCHOR, **fields}


def judged(records: list[dict[str, Any]], handoffs: int = 3, anchor: str | None = ANCHOR):
    return judge_soak(records, handoffs=handoffs, link_floor_gbit_per_s=2.0, anchor_payload_sha256=anchor,
                      link_words="over a Unix socket on this host", criteria="test")


def failed(verdict) -> list[str]:
    return [check.detail for check in verdict.checks if not check.passed]


def test_n_held_handoffs_pass_claiming_n_and_nothing_beyond():
    verdict = judged([handoff(1, 5.0), handoff(2, 3.0), handoff(3, 7.0)])
    assert verdict.passed
    assert "3 back-to-back handoffs" in verdict.headline and "claims nothing beyond them" in verdict.headline
    assert "slowest 3.000, median 5.000" in verdict.headline
    assert [check.detail for check in verdict.checks[1:]] == [
        f"handoff {n}: {rate:.3f} Gbit/s, verified, payload as anchored" for n, rate in ((1, 5.0), (2, 3.0), (3, 7.0))]


def test_a_handoff_under_the_floor_fails_and_every_rate_is_still_reported():
    verdict = judged([handoff(1), handoff(2, 1.5), handoff(3)])
    assert not verdict.passed
    assert failed(verdict) == ["handoff 2: 1.500 Gbit/s, below the floor 2 Gbit/s"]
    assert sum(check.name.startswith("handoff ") and "Gbit/s" in check.detail for check in verdict.checks) == 3


def test_a_producer_death_fails_naming_the_handoff_and_what_was_completed():
    records = [handoff(1), {"handoff": 2, "request": "soak-2", "error": "producer failed: killed by signal 9",
                            "producer_died": True, "exit_status": -9}]
    verdict = judged(records)
    assert not verdict.passed
    assert failed(verdict) == ["1 of 3 handoffs completed; the producer died at handoff 2",
                               "handoff 2: producer failed: killed by signal 9"]
    assert "on 3 back-to-back handoffs" in verdict.headline and "1 of 3 handoffs completed" in verdict.headline


def test_a_payload_other_than_the_anchors_fails():
    verdict = judged([handoff(1), handoff(2, payload_sha256="b" * 64), handoff(3)])
    assert failed(verdict) == [f"handoff 2: payload sha256 {'b' * 12}… differs from the anchor's {'a' * 12}…"]


@pytest.mark.parametrize("records", [[], [handoff(1), handoff(2)], [handoff(1), handoff(2), handoff(3), handoff(4)]])
def test_any_count_but_n_fails(records: list[dict[str, Any]]):
    assert not judged(records).passed


@pytest.mark.parametrize("rate", [None, float("nan"), float("inf"), True, "12"])
def test_a_rate_that_is_no_finite_number_fails(rate: Any):
    assert failed(judged([handoff(1), handoff(2, rate), handoff(3)])) == ["handoff 2: payload rate missing or not a number"]


def test_no_anchor_fails_closed():
    assert not judged([handoff(1), handoff(2), handoff(3)], anchor=None).passed
    assert anchor_payload([]) is None
    assert anchor_payload([{"payload_sha256": ANCHOR}, {"payload_sha256": "b" * 64}]) is None
    assert anchor_payload([{"payload_sha256": ANCHOR}, {"payload_sha256": ANCHOR}]) == ANCHOR


def test_a_rate_at_the_floor_holds():
    assert judged([handoff(1, 2.0), handoff(2, 2.0), handoff(3, 2.0)]).passed


def test_one_anchor_sample_is_an_anchor_and_a_missing_digest_is_none():
    assert anchor_payload([{"payload_sha256": ANCHOR}]) == ANCHOR
    assert anchor_payload([{"payload_sha256": None}, {"payload_sha256": None}]) is None
    assert anchor_payload([{"payload_sha256": 7}]) is None


def test_more_records_than_n_fail_the_count_even_when_n_of_them_held():
    verdict = judged([handoff(1), handoff(2), handoff(3), {"handoff": 4, "error": "producer failed: gone"}])
    completed = next(check for check in verdict.checks if check.name == "handoffs completed")
    assert not completed.passed and completed.detail.startswith("3 of 3 handoffs completed")


def test_a_record_that_is_no_mapping_fails_naming_it():
    verdict = judged([handoff(1), "junk", handoff(3)])  # type: ignore[list-item]
    assert "handoff 2: not a handoff record" in [check.detail for check in verdict.checks if not check.passed]
