"""The stated rules a frozen identity names: how its bounds and its draft floor follow from its
basis receipt. The words are part of the contract (an identity carries them and its digest pins
them); :mod:`qualify.judge.calibration` is the one implementation of each."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

BOUND_RULE = "cell-max-plus-one-sd.v1"
BOUND_RULE_STATEMENT = (
    "each bound is the largest per-cell value over the calibration set's cells plus one sample "
    "standard deviation (n - 1) of the per-cell values; a cell's values are its handoff's "
    "teacher-forced full-logit max and mean abs deltas against the cold recompute; when every "
    "cell's value is zero the bound is the least positive double, which only a zero delta meets"
)
"""Why one standard deviation: the fixture is not in the calibration set, so its drift is an
unseen document's; the spread of the per-cell values is the measured document-to-document
variation, and a margin of that size is what the data, not taste, justifies."""

FLOOR_RULE = "wilson-one-sided-95-lower.v1"
FLOOR_RULE_STATEMENT = (
    "the rung-3 draft acceptance floor is the one-sided 95 % Wilson score lower bound of accepted "
    "over proposed draft tokens in the fixture's first anchor handoff (the anchors are bit-identical, "
    "so their counts are one measurement, counted once)"
)

TEACHER_FORCED_BOUND_RULE = "teacher-forced-cell-max-plus-one-sd.v1"
TEACHER_FORCED_BOUND_RULE_STATEMENT = (
    "the policy of cell-max-plus-one-sd.v1 applied to four per-cell values, a cell's handoff being fed "
    "the cold recompute's tokens (teacher-forced) so that every one of its rows scores the cold "
    "recompute's context: the largest per-row max abs logit delta, the largest per-row mean abs logit "
    "delta, the largest cold top-1 minus top-2 margin at a row whose top token changed (a parting; 0 "
    "when none changed) and the share of rows whose top token changed; each sealed number is the "
    "largest per-cell value plus one sample standard deviation (n - 1) of the per-cell values, and the "
    "least positive double when every cell's value is zero"
)
"""The bound rule of a teacher-forced identity (a rung-2 lane whose greedy tokens part from the
cold recompute at near-ties): the same policy as :data:`BOUND_RULE`, over the values the
teacher-forced judging reads (:func:`qualify.judge.handoffs.judge_rung2_sample`)."""

TEACHER_FORCED_RULE = "teacher-forced-near-tie.v1"
TEACHER_FORCED_RULE_STATEMENT = (
    "the handoff branch is decoded greedily and, from its first parting on, fed the cold recompute's "
    "tokens; a row parts when its top token differs from the cold recompute's; every parting must sit "
    "where the cold top-1 minus top-2 margin is at most the sealed near-tie margin (a decisive parting "
    "fails, named by its step and margin); every one of the rows must keep its max abs logit delta "
    "within maximum_absolute and its mean abs logit delta within maximum_mean_absolute; and the share "
    "of rows that part must stay within maximum_changed_row_share"
)
"""How a teacher-forced identity judges a handoff (rung 2 for lanes that do not keep tokens);
the exact-token rule stays for lanes that keep them."""

FIXTURE_ENVELOPE_RULE = "fixture-envelope-loo-range.v1"
FIXTURE_ENVELOPE_RULE_STATEMENT = (
    "for a producer declared non-deterministic, the fixture is handed off repeatedly over more than one "
    "producer start; four series are measured per handoff: at every decoded row its max abs and its "
    "mean abs logit delta against the cold recompute (teacher-forced rows where the tokens part), at "
    "every handed-off position its max abs K or V delta against the consumer's own prefill over every "
    "layer, and the same for each layer's K and each layer's V apart; per series, "
    "k is twice the larger of 1 and the largest amount, over handoffs and indices, by which one handoff "
    "exceeded the largest value of the others at an index, in units of the others' range there (where "
    "that range is positive); each index's ceiling is the largest value the handoffs showed there plus k "
    "times their range there; every row and every handed-off position of a judged handoff must lie "
    "within its ceiling, and a non-finite value lies outside it"
)
"""How a non-deterministic producer is judged without any digest check: the bounds are the
fixture's own, index by index, so a fault that moves one row or one position beyond what the
honest producer's own run-to-run variation reached there is caught, however far inside a
cross-document maximum it stays. Why a multiple of the range: the range is the run-to-run spread
at that index, and how far an unseen honest run steps past it is measured on the same runs by
leaving each out in turn (doubled, and never less than two ranges: the leave-one-out runs see one
run fewer than the envelope does). A producer whose runs agree gets its measured values exactly."""

FIXTURE_ENVELOPE_CEILINGS_DIGEST = (
    "SHA-256 over, for each of row_max_abs, row_mean_abs, position_max_abs and tensor_position_max_abs "
    "in that order: the series' name in ASCII, a zero byte, its number of ceilings as an unsigned 64-bit "
    "little-endian integer, then its ceilings as IEEE 754 binary64 little-endian"
)
"""How a sealed fixture envelope's ``ceilings_sha256`` is computed
(:func:`qualify.judge.envelope.ceilings_sha256`): from the ceilings alone, with no JSON number form
in between, so any implementation reproduces it."""

FIXTURE_ENVELOPE_MINIMUM_HANDOFFS = 4
"""The fewest honest handoffs an envelope is stated from: with fewer, a range is too thin a measure
of run-to-run spread to widen anything by."""

FIXTURE_ENVELOPE_MINIMUM_STARTS = 2
"""The fewest producer starts an envelope is stated from: variation across a restart (another
allocation, another autotuning pick) must be in it, not only within one process."""

STATED_RULES: Mapping[str, str] = MappingProxyType({BOUND_RULE: BOUND_RULE_STATEMENT,
                                                     FLOOR_RULE: FLOOR_RULE_STATEMENT,
                                                     TEACHER_FORCED_BOUND_RULE: TEACHER_FORCED_BOUND_RULE_STATEMENT,
                                                     FIXTURE_ENVELOPE_RULE: FIXTURE_ENVELOPE_RULE_STATEMENT})
"""Rule name -> its statement: the only rules an identity may name."""

SERVED_BOUND_RULE = "served-cell-max-plus-one-sd.v1"
SERVED_BOUND_RULE_STATEMENT = (
    "the policy of cell-max-plus-one-sd.v1 applied to a served pair: each bound is the largest "
    "per-cell value over the calibration set's cells plus one sample standard deviation (n - 1) of "
    "the per-cell values, and when every cell's value is zero the bound is the least positive "
    "double, which only a zero delta meets; a cell is one calibration document at one prompt length, "
    "served by the pair as a cold recompute on the decode server, a second cold recompute and one "
    "handoff; its values are the largest, over its two comparisons against the first cold recompute "
    "(the second cold recompute, the handoff), of the per-position maximum and of the mean |delta "
    "logprob| (nats) over the positions up to and including the first greedy-token divergence; under "
    "top-k evidence a position's maximum also counts the nats each rank or membership move of the "
    "top-k rule needed"
)
"""The bound rule of a served pair's calibration: the lanes' policy (one implementation,
:func:`qualify.judge.calibration.bound_of`), with a cell's values defined for logprobs over HTTP,
where no teacher forcing is available."""

SERVED_TOP_K_RULE = "served-top-k-within-bound.v1"
SERVED_TOP_K_RULE_STATEMENT = (
    "at every position, with C the cold recompute's k most likely token ids (ties broken by id), "
    "c_k the least cold logprob among them, L the loaded branch's k most likely ids and b the "
    "calibrated bound: both rows carry at least k entries; every id present in both rows has "
    "|loaded - cold| <= b; no two ids in both C and L whose cold logprobs differ by more than b are "
    "in the other order, or tied, by their loaded logprobs (ids whose cold logprobs lie within b of "
    "each other may swap); an id may leave the top k only when its cold logprob lies within b of "
    "c_k, and enter it only when its loaded logprob is at most c_k + b and its cold logprob, where "
    "the cold row reports it, lies within b of c_k"
)
"""The rule a served pair judges top-k logprobs by (:func:`qualify.judge.served.judge_top_k_row`),
calibrated for its k: the calibration measures the nats each clause needed on its own cells."""

SERVED_RULES: Mapping[str, str] = MappingProxyType({SERVED_BOUND_RULE: SERVED_BOUND_RULE_STATEMENT,
                                                    SERVED_TOP_K_RULE: SERVED_TOP_K_RULE_STATEMENT})
"""Rule name -> statement: the only rules a served-pair identity may name."""
