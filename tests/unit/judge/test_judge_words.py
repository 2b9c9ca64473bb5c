"""The words a receipt shows for a judgement, check by check: each check's name, outcome and detail
for a passing sample, a sample failing every check at once, boundary values, and the summary over
repetitions (complete, broken, empty, single). A receipt's reader sees exactly these lines."""

from __future__ import annotations

import pytest

from qualify.evidence.records import BitExactRule, BoundedDriftRule
from qualify.judge import (
    Verdict,
    judge_failed_step,
    judge_qualification,
    judge_reproduction,
    judge_rung2_sample,
    judge_rung3_sample,
    judge_sample,
    judge_summary,
)
from qualify.judge.scope import DocumentOutcome, Scope
from tests.unit.judge.test_judge import RULE2, RULE3, rung2_record, rung3_record

PASSING_SAMPLE_CHECKS = [
    ("evidence", True, "every required field present"),
    ("values", True, "every value finite and well-formed"),
    ("output tokens", True, "decoded 256 tokens"),
    ("tokens exact", True, "tokens exact: 256/256"),
    ("generated-token digest", True, "generated-token digest equals the cold run's"),
    ("payload", True, f"payload {8 * 1024 * 1024} bytes"),
    ("handed-off positions", True, "2047 positions handed off, 0 recomputed"),
    ("bounded drift", True, "bounded drift: max 10.884401 <= 11, mean 1.233789 <= 1.25"),
]


def checks_of(verdict) -> list[tuple[str, bool, str]]:
    return [(check.name, check.passed, check.detail) for check in verdict.checks]


def test_a_passing_rung2_sample_shows_each_check_passed_in_words() -> None:
    verdict = judge_sample(rung2_record(), RULE2)
    assert checks_of(verdict) == PASSING_SAMPLE_CHECKS
    assert verdict.reasons == [detail for _, _, detail in PASSING_SAMPLE_CHECKS]


def test_a_sample_failing_every_check_names_each_failure_and_where_it_diverged() -> None:
    record = rung2_record(
        output_tokens=255, token_agreement_rate=0.5, cold_generated_token_sha256="7" * 64, payload_bytes=0,
        handed_off_positions=0, max_abs=12.0,
        localisation={"first_divergence_position": 3, "cold_margin_at_divergence": 0.25,
                      "divergence_class": "near-tie", "first_rule_breaking_row": 7},
    )
    failures = [
        ("output tokens", False, "decoded 255 tokens, rule requires 256"),
        ("tokens exact", False,
         "tokens diverge: agreement 0.5 (128/255); first divergence at token 3, cold margin 0.25 (near-tie)"),
        ("generated-token digest", False, "generated-token digest differs from the cold run's"),
        ("payload", False, "payload is empty (0 bytes)"),
        ("handed-off positions", False, "no positions handed off: the handoff qualified nothing"),
        ("bounded drift", False,
         "native full-logit drift exceeds its identity rule: max=12, mean=1.233789 "
         "(rule: max <= 11, mean <= 1.25); first rule-breaking logit row 7"),
    ]
    verdict = judge_sample(record, RULE2)
    assert checks_of(verdict) == PASSING_SAMPLE_CHECKS[:2] + failures
    assert verdict.reasons == [detail for _, _, detail in failures]
    assert verdict.headline == "failed: decoded 255 tokens, rule requires 256 (and 5 more)"


def test_omitted_and_malformed_values_are_named_together_and_the_rest_still_judged() -> None:
    record = rung2_record(mean_abs=float("nan"))
    del record["max_abs"]
    verdict = judge_sample(record, RULE2)
    assert checks_of(verdict)[:2] == [
        ("evidence", False, "sample omits max_abs"),
        ("values", False, "sample mean_abs is not finite: nan"),
    ]
    assert checks_of(verdict)[2:] == PASSING_SAMPLE_CHECKS[2:7]  # no drift check without both deltas
    assert verdict.reasons == ["sample omits max_abs", "sample mean_abs is not finite: nan"]


@pytest.mark.parametrize(("field", "smallest"), [("payload_bytes", 1), ("handed_off_positions", 1)])
def test_one_byte_or_one_handed_off_position_is_enough(field: str, smallest: int) -> None:
    verdict = judge_sample(rung2_record(**{field: smallest}), RULE2)
    assert verdict.passed, verdict.reasons


@pytest.mark.parametrize(
    ("field", "value"),
    [("output_tokens", 0), ("repetition", 0), ("token_agreement_rate", -0.001), ("token_agreement_rate", 1.001),
     ("payload_gbit_per_s", -0.001), ("max_abs", -0.001), ("mean_abs", -0.001), ("recomputed_positions", -1)],
)
def test_a_value_out_of_its_range_fails_the_values_check_naming_it(field: str, value: float) -> None:
    verdict = judge_sample(rung2_record(**{field: value}), RULE2)
    values = dict((name, (passed, detail)) for name, passed, detail in checks_of(verdict))["values"]
    assert values[0] is False and field in values[1], values


@pytest.mark.parametrize(("field", "value"), [("payload_gbit_per_s", 0.0), ("token_agreement_rate", 0.0)])
def test_zero_is_inside_a_range_that_starts_at_zero(field: str, value: float) -> None:
    checks = dict((name, passed) for name, passed, _ in checks_of(judge_sample(rung2_record(**{field: value}), RULE2)))
    assert checks["values"] is True


@pytest.mark.parametrize("rate", [-0.001, 1.001])
def test_a_draft_acceptance_rate_outside_0_to_1_is_malformed(rate: float) -> None:
    verdict = judge_sample(rung3_record(draft_acceptance_rate=rate), RULE3)
    values = dict((name, (passed, detail)) for name, passed, detail in checks_of(verdict))["values"]
    assert values[0] is False and "draft_acceptance_rate" in values[1], values


def test_token_words_without_a_token_count_give_no_counts() -> None:
    exact = checks_of(judge_sample(rung2_record(output_tokens="256"), RULE2))
    diverged = checks_of(judge_sample(rung2_record(output_tokens="256", token_agreement_rate=0.5), RULE2))
    assert ("tokens exact", True, "tokens exact") in exact
    assert ("tokens exact", False, "tokens diverge: agreement 0.5") in diverged
    assert not any(name == "output tokens" for name, _, _ in exact)


SUMMARY_DIGESTS = ("generated-token digest", "payload digest", "payload size", "handoff logit block digest",
                   "cold generated-token digest", "cold logit block digest")


def test_a_passing_summary_shows_each_check_and_its_headline() -> None:
    verdict = judge_summary([rung2_record(i) for i in (1, 2, 3)], RULE2)
    drift = "bounded drift: max 10.884401 <= 11, mean 1.233789 <= 1.25 in every repetition"
    assert checks_of(verdict) == [
        ("repetitions", True, "3/3 repetitions present"),
        ("samples", True, "every sample passes its rung-2 judgement"),
        ("tokens exact in every repetition", True, "token agreement exactly 1.0 in every repetition"),
        ("bounded drift in every repetition", True, drift),
        *((f"{words} across repetitions", True, f"{words} equal across 3 repetitions") for words in SUMMARY_DIGESTS),
    ]
    assert verdict.headline == (f"passed: 3/3 handoffs with exact tokens and {drift}; "
                                "generated-token and payload digests equal across repetitions")


def test_a_single_repetition_summary_passes_when_its_rule_asks_for_one() -> None:
    rule = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, repetitions=1)
    verdict = judge_summary([rung2_record(1)], rule)
    assert verdict.passed, verdict.reasons
    assert verdict.headline.startswith("passed: 1/1 handoffs with exact tokens and bounded drift: max 10.884401 <= 11")


def test_a_rung3_summary_headline_states_the_measured_acceptance_against_its_floor() -> None:
    records = [rung3_record(1, draft_acceptance_rate=0.99), rung3_record(2), rung3_record(3, draft_acceptance_rate=0.98)]
    verdict = judge_summary(records, RULE3)
    assert verdict.headline == (
        "passed: 3/3 handoffs bit-exact: tokens, full logits (digests equal, deltas 0), draft tokens and trace equal, "
        "acceptance 0.97 (floor 0.95); digests equal across repetitions"
    )
    names = [name for name, _, _ in checks_of(verdict)]
    assert names[-2:] == ["draft tokens digest across repetitions", "draft trace digest across repetitions"]


def test_a_draftless_rung3_summary_names_no_acceptance_and_no_draft_digests() -> None:
    rule = BitExactRule(acceptance_floor=None)
    verdict = judge_summary([rung3_record(i) for i in (1, 2, 3)], rule)
    assert verdict.headline == ("passed: 3/3 handoffs bit-exact: tokens, full logits (digests equal, deltas 0); "
                                "digests equal across repetitions")
    assert not any("draft" in name for name, _, _ in checks_of(verdict))


def test_a_broken_summary_names_count_gaps_strays_and_each_refused_repetition() -> None:
    records = [rung2_record(1), rung2_record(2, token_agreement_rate=0.5, max_abs=12.0), rung2_record(5), "x"]
    verdict = judge_summary(records, RULE2)
    checks = checks_of(verdict)
    assert checks[:4] == [
        ("repetitions", False, "expected 3 repetitions, found 4; repetition 3 missing; unexpected repetition index 5, None"),
        ("samples", False, "2 of 4 samples refused"),
        ("tokens exact in every repetition", False, "token agreement is not exactly 1.0 in every repetition"),
        ("bounded drift in every repetition", False,
         "full-logit drift is not inside the identity rule in every repetition"),
    ]
    assert verdict.reasons[:6] == [
        "expected 3 repetitions, found 4",
        "repetition 3 missing",
        "unexpected repetition index 5, None",
        "repetition 2: tokens diverge: agreement 0.5 (128/256)",
        "repetition 2: native full-logit drift exceeds its identity rule: max=12, mean=1.233789 "
        "(rule: max <= 11, mean <= 1.25)",
        "repetition #4: sample is not a record: str",
    ]


def test_a_repetition_seen_twice_is_named_with_its_count() -> None:
    verdict = judge_summary([rung2_record(1), rung2_record(1), rung2_record(3)], RULE2)
    assert checks_of(verdict)[0] == ("repetitions", False, "repetition 1 appears 2 times; repetition 2 missing")


def test_a_summary_drifting_outside_its_rule_names_the_worst_values() -> None:
    records = [rung2_record(1), rung2_record(2, max_abs=12.5), rung2_record(3, mean_abs=1.5)]
    checks = dict((name, (passed, detail)) for name, passed, detail in checks_of(judge_summary(records, RULE2)))
    assert checks["bounded drift in every repetition"] == (
        False, "full-logit drift is not inside the identity rule in every repetition: worst max=12.5, mean=1.5")


def test_an_empty_summary_says_no_samples() -> None:
    verdict = judge_summary([], RULE2)
    assert checks_of(verdict)[:2] == [
        ("repetitions", False,
         "expected 3 repetitions, found 0; repetition 1 missing; repetition 2 missing; repetition 3 missing"),
        ("samples", False, "no samples"),
    ]
    assert "no samples" in verdict.reasons
    assert all(detail == f"{words} missing" for (_, _, detail), words in zip(checks_of(verdict)[4:], SUMMARY_DIGESTS,
                                                                                 strict=True))


KV_EQUAL = ("kv", True, "handed-off KV equals the consumer's own prefill in every layer (K and V)")
DRAFT_EQUAL = [("draft tokens", True, "draft tokens equal to the cold run's"),
               ("draft trace", True, "draft trace equal to the cold run's")]


def rung3_checks(verdict) -> list[tuple[str, bool, str]]:
    """The rung-3 checks after the seven every sample has (evidence ... handed-off positions)."""
    assert [name for name, _, _ in checks_of(verdict)[:7]] == [name for name, _, _ in PASSING_SAMPLE_CHECKS[:7]]
    return checks_of(verdict)[7:]


def test_a_passing_rung3_sample_shows_each_bit_exact_check_in_words() -> None:
    verdict = judge_sample(rung3_record(), RULE3)
    assert rung3_checks(verdict) == [
        ("logit digests", True, "logit digests equal in every row and over the block"),
        ("logit deltas", True, "full-logit deltas exactly 0"),
        KV_EQUAL, *DRAFT_EQUAL,
        ("draft acceptance", True, "draft acceptance 0.97 >= floor 0.95"),
    ]
    assert verdict.headline == ("passed: bit-exact: tokens 256/256, full-logit digests equal, deltas 0; "
                                "draft tokens and trace equal, acceptance at or above the floor")


def test_draft_acceptance_exactly_at_its_floor_passes() -> None:
    verdict = judge_sample(rung3_record(draft_acceptance_rate=0.95), RULE3)
    assert verdict.passed and rung3_checks(verdict)[-1] == ("draft acceptance", True, "draft acceptance 0.95 >= floor 0.95")


def test_a_rung3_sample_failing_its_kv_and_draft_names_the_layer_tensor_and_position() -> None:
    layers = [{"layer": 0, "k": 0.0, "v": 0.0}, {"layer": 1, "k": 0.0, "v": 2.5, "v_position": 17}]
    record = rung3_record(draft_acceptance_rate=0.9, cold_draft_tokens_sha256="7" * 64,
                          cold_draft_trace_sha256="8" * 64, localisation={"kv_layer_max_abs": layers})
    verdict = judge_sample(record, RULE3)
    kv = "handed-off KV differs from the consumer's own prefill at layer 1 V (max abs delta 2.5 at position 17)"
    assert rung3_checks(verdict)[2:] == [
        ("kv", False, kv),
        ("draft tokens", False, "draft tokens differ from the cold run's"),
        ("draft trace", False, "draft trace differs from the cold run's"),
        ("draft acceptance", False, "draft acceptance 0.9 is below the sealed floor 0.95"),
    ]
    assert verdict.headline == f"failed: {kv} (and 3 more)"


@pytest.mark.parametrize(
    ("layers", "words"),
    [
        ([{"k": "x", "v": 0.0}], "handed-off KV differs from the consumer's own prefill at layer ? K (max abs delta 'x')"),
        ([{"layer": 2, "k": 0.0}], "handed-off KV differs from the consumer's own prefill at layer 2 V (max abs delta None)"),
        (["not a layer"], "handed-off KV differs from the consumer's own prefill at layer ? K (max abs delta None)"),
        ([], "sample omits kv_layer_max_abs (per-layer KV deltas against the consumer's own prefill)"),
        ("0.0", "sample omits kv_layer_max_abs (per-layer KV deltas against the consumer's own prefill)"),
    ],
)
def test_kv_evidence_that_is_not_a_number_per_layer_is_refused_never_read_as_zero(layers: object, words: str) -> None:
    verdict = judge_sample(rung3_record(localisation={"kv_layer_max_abs": layers}), RULE3)
    assert ("kv", False, words) in rung3_checks(verdict)
    assert verdict.headline == f"failed: {words}"


def test_a_kv_delta_prints_as_verdicts_print_numbers_not_as_its_repr() -> None:
    """Nine significant digits, as every number in a verdict, not repr's thirteen."""
    layers = [{"layer": 3, "k": 0.0, "v": 0.1234567891234}]
    verdict = judge_sample(rung3_record(localisation={"kv_layer_max_abs": layers}), RULE3)
    words = "handed-off KV differs from the consumer's own prefill at layer 3 V (max abs delta 0.123456789)"
    assert ("kv", False, words) in rung3_checks(verdict)


def test_a_draftless_rung3_sample_says_no_draft_was_declared() -> None:
    verdict = judge_sample(rung3_record(), BitExactRule(acceptance_floor=None))
    assert rung3_checks(verdict)[-2:] == [KV_EQUAL, ("draft", True, "no speculative draft declared by the identity")]
    assert verdict.headline == "passed: bit-exact: tokens 256/256, full-logit digests equal, deltas 0"


def test_drift_graded_rung3_reports_the_deltas_then_the_digests() -> None:
    graded = BitExactRule(acceptance_floor=0.95, drift_graded=True)
    assert rung3_checks(judge_sample(rung3_record(), graded))[:2] == [
        ("logit deltas", True, "full-logit deltas exactly 0"),
        ("logit digests", True, "logit digests equal in every row and over the block"),
    ]
    record = rung3_record(max_abs=0.5, mean_abs=0.01, logit_row_digests_equal=False, first_logit_digest_mismatch_row=4,
                          handoff_logit_block_sha256="9" * 64)
    verdict = judge_sample(record, graded)
    deltas = "full logits differ: max=0.5, mean=0.01 (bit-exact requires 0); logit digest mismatch at row 4"
    assert rung3_checks(verdict)[:2] == [("logit deltas", False, deltas),
                                         ("logit digests", False, "logit digest mismatch at row 4")]
    assert verdict.headline == f"failed: {deltas} (and 1 more)"


def test_equal_digests_over_nonzero_deltas_are_not_bit_exact() -> None:
    verdict = judge_sample(rung3_record(max_abs=0.5, mean_abs=0.01), RULE3)
    assert rung3_checks(verdict)[:2] == [
        ("logit digests", True, "logit digests equal in every row and over the block"),
        ("logit deltas", False, "full logits not bit-exact despite equal digests: max=0.5, mean=0.01"),
    ]


@pytest.mark.parametrize(("kind", "shown"), [("near-tie", " (near-tie)"), ("decisive", " (decisive)"), ("other", "")])
def test_a_divergence_names_its_class_only_when_it_is_a_known_one(kind: str, shown: str) -> None:
    where = {"first_divergence_position": 9, "cold_margin_at_divergence": True, "divergence_class": kind}
    checks = dict((name, detail) for name, _, detail in checks_of(
        judge_sample(rung2_record(token_agreement_rate=0.5, localisation=where), RULE2)))
    # A bool margin is no number: it is left out, never shown as 1.
    assert checks["tokens exact"] == f"tokens diverge: agreement 0.5 (128/256); first divergence at token 9{shown}"


def test_a_rule_breaking_row_is_named_for_drift_and_never_for_tokens() -> None:
    where = {"first_rule_breaking_row": 11, "first_divergence_position": True}
    checks = dict((name, detail) for name, _, detail in checks_of(
        judge_sample(rung2_record(token_agreement_rate=0.5, max_abs=12.0, localisation=where), RULE2)))
    assert checks["tokens exact"] == "tokens diverge: agreement 0.5 (128/256)"
    assert checks["bounded drift"].endswith("(rule: max <= 11, mean <= 1.25); first rule-breaking logit row 11")
    bool_row = dict((name, detail) for name, _, detail in checks_of(judge_sample(
        rung2_record(max_abs=12.0, localisation={"first_rule_breaking_row": True}), RULE2)))
    assert bool_row["bounded drift"].endswith("(rule: max <= 11, mean <= 1.25)")


@pytest.mark.parametrize(("judge", "rule", "name"), [
    (judge_rung2_sample, RULE3, "judge_rung2_sample needs a BoundedDriftRule"),
    (judge_rung3_sample, RULE2, "judge_rung3_sample needs a BitExactRule"),
])
def test_a_judge_given_another_rungs_rule_names_itself_and_the_rule_it_needs(judge, rule, name: str) -> None:
    with pytest.raises(TypeError, match=f"^{name}$"):
        judge(rung2_record(), rule)


def digest_check(records: list, words: str = "payload digest") -> tuple[str, bool, str]:
    return next(c for c in checks_of(judge_summary(records, RULE2)) if c[0] == f"{words} across repetitions")


def test_a_digest_differing_across_repetitions_names_them_against_the_first() -> None:
    records = [rung2_record(1), rung2_record(2, payload_sha256="8" * 64), rung2_record(3, payload_sha256="8" * 64)]
    assert digest_check(records) == ("payload digest across repetitions", False,
                                     "payload digest differs across repetitions (repetition 2, 3 vs 1): "
                                     "output is not deterministic")


def test_repetitions_without_an_index_are_named_by_their_place() -> None:
    first, third = rung2_record(), rung2_record(payload_sha256="8" * 64)
    del first["repetition"], third["repetition"]
    records = [first, rung2_record(2, payload_sha256="8" * 64), third]
    assert digest_check(records)[2] == ("payload digest differs across repetitions (repetition 2, 3 vs 1): "
                                        "output is not deterministic")


def test_a_missing_digest_names_the_repetitions_that_lack_it() -> None:
    second, third = rung2_record(2), rung2_record()
    del second["payload_sha256"], third["payload_sha256"], third["repetition"]
    assert digest_check([rung2_record(1), second, third])[1:] == (False, "payload digest missing in repetition 2, ?")
    # A flag where a digest belongs is not a digest: missing, with no repetition to name.
    assert digest_check([rung2_record(1), rung2_record(2, payload_sha256=True), rung2_record(3)])[1:] == (
        False, "payload digest missing")


def anchored(run: list, basis: list, **how) -> Verdict:
    return judge_reproduction(run, basis, **{"rung": 2, "deterministic_producer": False, "draft": False, **how})


ANCHOR = [rung2_record(i, seams_sha256="a" * 64) for i in (1, 2, 3)]
REPRODUCED = ("reproduced its anchor bit for bit (payload tree, seams, logit blocks and generated tokens equal "
              "the fixture anchor's in the basis receipt)")
ANCHORED_WORDS = ("payload tree", "per-layer seams", "handoff logit block", "cold logit block", "generated tokens",
                  "cold generated tokens")


def test_a_reproduced_anchor_shows_each_digest_equal_in_words() -> None:
    verdict = anchored(ANCHOR, ANCHOR)
    assert (verdict.passed, verdict.headline) == (True, REPRODUCED)
    assert checks_of(verdict) == [
        (f"{words} as anchored", True, f"{words} digest equal to the anchor's in every repetition") for words in ANCHORED_WORDS
    ]
    assert verdict.reasons == [detail for _, _, detail in checks_of(verdict)]
    draft = anchored(ANCHOR, ANCHOR, draft=True)
    assert [name for name, _, _ in checks_of(draft)][-2:] == ["draft tokens as anchored", "draft trace as anchored"]


def test_a_changed_digest_is_reported_on_rung2_and_fails_rung3_and_a_deterministic_producer() -> None:
    run = [rung2_record(1, seams_sha256="a" * 64), rung2_record(2, seams_sha256="b" * 64), ANCHOR[2]]
    words = ("did not reproduce its anchor bit for bit: per-layer seams differ from the fixture anchor in the "
             "basis receipt")
    reported = anchored(run, ANCHOR)
    assert (reported.passed, reported.headline, reported.reasons) == (True, words, [words])
    assert ("per-layer seams as anchored", False, "per-layer seams digest differs from the anchor's (repetition 2)") \
        in checks_of(reported)
    rung3 = anchored(run, ANCHOR, rung=3)
    assert (rung3.passed, rung3.headline) == (False, f"{words}; rung 3 requires it")
    deterministic = anchored(run, ANCHOR, deterministic_producer=True)
    assert (deterministic.passed, deterministic.headline) == (
        False, f"{words}: the producer's output changed since calibration (the identity declares a deterministic producer)")


def test_an_anchor_missing_or_disagreeing_on_a_digest_is_named_and_the_rest_still_compared() -> None:
    missing = [rung2_record(i) for i in (1, 2, 3)]  # no seams digest in the anchor
    verdict = anchored(ANCHOR, missing)
    assert checks_of(verdict)[1] == ("per-layer seams as anchored", False, "anchor: per-layer seams digest missing")
    assert len(checks_of(verdict)) == len(ANCHORED_WORDS)
    split = [ANCHOR[0], rung2_record(2, seams_sha256="c" * 64), ANCHOR[2]]
    assert checks_of(anchored(ANCHOR, split))[1] == (
        "per-layer seams as anchored", False, "anchor: per-layer seams digest differs among its own samples")
    assert anchored(ANCHOR, split).passed  # rung 2, a producer not declared deterministic: reported, not failed


def test_a_run_with_no_samples_or_unnamed_repetitions_against_its_anchor() -> None:
    assert checks_of(anchored([], ANCHOR))[0] == (
        "payload tree as anchored", False, "payload tree digest differs from the anchor's (repetition (no samples))")
    unnamed = rung2_record(seams_sha256="b" * 64)
    del unnamed["repetition"]
    assert checks_of(anchored([ANCHOR[0], unnamed], ANCHOR))[1][2] == (
        "per-layer seams digest differs from the anchor's (repetition ?)")
    no_anchor = anchored(ANCHOR, [])
    assert checks_of(no_anchor) == [("anchor samples", False, "the basis receipt has no readable anchor samples")]
    assert no_anchor.headline.startswith("did not reproduce its anchor bit for bit: anchor samples differ")


NOT_GRADED = BoundedDriftRule(maximum_absolute=11.0, maximum_mean_absolute=1.25, drift_graded=False)


@pytest.mark.parametrize(
    ("changes", "check"),
    [
        ({"logit_row_digests_equal": True, "first_logit_digest_mismatch_row": None, "handoff_logit_block_sha256": "3" * 64},
         ("logit digests", True, "logit digests equal in every row and over the block")),
        ({"logit_row_digests_equal": True, "first_logit_digest_mismatch_row": None},
         ("logit digests", False, "logit digest mismatch: block digests differ while every row digest is reported equal")),
        ({"logit_row_digests_equal": False, "first_logit_digest_mismatch_row": None},
         ("logit digests", False, "logit digest mismatch at an unreported row")),
        ({"first_logit_digest_mismatch_row": 5}, ("logit digests", False, "logit digest mismatch at row 5")),
    ],
)
def test_default_judging_refuses_the_first_logit_digest_mismatch_in_words(changes: dict, check: tuple) -> None:
    verdict = judge_sample(rung2_record(**changes), NOT_GRADED)
    assert checks_of(verdict)[-1] == check
    assert verdict.passed is check[1]


@pytest.mark.parametrize("absent", ["logit_row_digests_equal", "handoff_logit_block_sha256", "cold_logit_block_sha256"])
def test_default_judging_without_a_digest_gives_no_digest_verdict_only_the_omission(absent: str) -> None:
    verdict = judge_sample(rung2_record(**{absent: None}), NOT_GRADED)
    assert not verdict.passed
    assert "logit digests" not in [name for name, _, _ in checks_of(verdict)]


ROW = "a" * 64


@pytest.mark.parametrize(
    ("handoff_rows", "cold_rows", "check"),
    [
        ([ROW] * 256, [ROW] * 256, ("row digests", True, "recorded row digests agree with the reported first mismatch")),
        ([ROW] * 256, None, ("row digests", False, "sample row digests are malformed")),
        ([ROW] * 256, [ROW] * 255 + ["b" * 64], ("row digests", False,
                                                  "recorded row digests disagree with the reported first mismatch (rows say 255)")),
        ([ROW] * 256, [ROW] * 255, ("row digests", False,
                                     "recorded row digests disagree with the reported first mismatch (rows say 255)")),
    ],
)
def test_recorded_row_digests_must_agree_with_the_reported_first_mismatch(handoff_rows, cold_rows, check) -> None:
    verdict = judge_sample(rung3_record(handoff_logit_row_sha256=handoff_rows, cold_logit_row_sha256=cold_rows), RULE3)
    assert check in rung3_checks(verdict)
    assert verdict.passed is check[1]


SCOPE = Scope("python-textwrap", 3, 2048, 256, None)
FIXTURE = "fixture python-textwrap (3 × 2048/256)"
NO_CONTROLS = "controls: none declared for this lane"


def test_a_failed_step_under_a_scope_leads_with_it_and_carries_it() -> None:
    verdict = judge_failed_step("handoff 2", "wire refused  the\nmanifest", scope=SCOPE)
    assert verdict.headline == f"NOT QUALIFIED on {FIXTURE}: handoff 2: wire refused the manifest; {NO_CONTROLS}"
    assert verdict.scope == SCOPE and verdict.status == "failed"
    assert judge_failed_step("handoff 2", "refused").headline == "not qualified: handoff 2: refused"


def test_a_qualification_under_a_scope_states_it_then_the_evidence() -> None:
    passing = judge_qualification([rung2_record(i) for i in (1, 2, 3)], RULE2, [rung2_record(i) for i in (1, 2, 3)],
                                  deterministic_producer=False, scope=SCOPE)
    assert passing.passed and passing.scope == SCOPE
    assert passing.headline.startswith(f"QUALIFIED on {FIXTURE}; {NO_CONTROLS}. Evidence: passed: 3/3 handoffs")
    failing = judge_qualification([rung2_record(1), rung2_record(2, token_agreement_rate=0.5), rung2_record(3)], RULE2,
                                  [rung2_record(i) for i in (1, 2, 3)], deterministic_producer=False, scope=SCOPE)
    first = "repetition 2: tokens diverge: agreement 0.5 (128/256)"
    assert not failing.passed and failing.scope == SCOPE and failing.reasons[0] == first
    assert failing.headline.startswith(f"NOT QUALIFIED on {FIXTURE}: {first}; {NO_CONTROLS}. Evidence: failed: ")


def test_every_changed_digest_is_listed_and_a_reported_change_keeps_its_checks() -> None:
    run = [rung2_record(1, seams_sha256="b" * 64, payload_sha256="9" * 64), rung2_record(2, seams_sha256="b" * 64),
           rung2_record(3, seams_sha256="a" * 64)]
    verdict = anchored(run, ANCHOR)
    assert verdict.headline == ("did not reproduce its anchor bit for bit: payload tree, per-layer seams differ from "
                                "the fixture anchor in the basis receipt")
    assert ("per-layer seams as anchored", False, "per-layer seams digest differs from the anchor's (repetition 1, 2)") \
        in checks_of(verdict)
    assert len(verdict.checks) == len(ANCHORED_WORDS)
    assert len(anchored(run, ANCHOR, deterministic_producer=True).checks) == len(ANCHORED_WORDS)


def test_an_anchor_with_an_unreadable_sample_is_no_anchor() -> None:
    verdict = anchored(ANCHOR, [*ANCHOR[:2], "not a record"])
    assert checks_of(verdict)[0] == ("anchor samples", False, "the basis receipt has no readable anchor samples")
    assert verdict.headline.startswith("did not reproduce its anchor bit for bit: anchor samples differ")


def test_rung3_without_its_digest_flag_judges_no_deltas_only_the_omission() -> None:
    verdict = judge_sample(rung3_record(logit_row_digests_equal=None), RULE3)
    names = [name for name, _, _ in checks_of(verdict)]
    assert not verdict.passed and "logit digests" not in names and "logit deltas" not in names


def test_drift_graded_rung3_with_one_delta_missing_judges_no_deltas() -> None:
    verdict = judge_sample(rung3_record(mean_abs=None), BitExactRule(acceptance_floor=0.95, drift_graded=True))
    assert not verdict.passed and "logit deltas" not in [name for name, _, _ in checks_of(verdict)]


def test_a_one_sided_draft_digest_is_an_omission_not_a_difference() -> None:
    verdict = judge_sample(rung3_record(cold_draft_tokens_sha256=None), RULE3)
    names = [name for name, _, _ in checks_of(verdict)]
    assert not verdict.passed and "draft tokens" not in names and "draft trace" in names


@pytest.mark.parametrize(("rate", "words"), [
    (0.9500000001, "draft acceptance 0.9500000001 >= floor 0.95"),
    (0.9499999999, "draft acceptance 0.9499999999 is below the sealed floor 0.95"),
])
def test_an_acceptance_a_hair_from_its_floor_is_printed_in_full(rate: float, words: str) -> None:
    # Nine significant digits would print both as 0.95: a reader could not see why one failed.
    assert rung3_checks(judge_sample(rung3_record(draft_acceptance_rate=rate), RULE3))[-1][2] == words


def test_a_control_document_without_a_name_is_refused_naming_what_it_is() -> None:
    with pytest.raises(ValueError, match=r"^scope: control document 'no spaces', expected a name of letters"):
        DocumentOutcome("no spaces", ())
