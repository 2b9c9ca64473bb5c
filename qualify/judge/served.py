"""Judging a served prefill/decode pair from what its HTTP API returned (issue 36 item 3): pure
functions from the branches' tokens, logprobs and cache counts to a :class:`Verdict`.

The evidence is the strongest the decode server gives: **full** logprobs (every vocabulary entry at
every position, ``--max-logprobs`` at least the vocabulary) or **top-k** logprobs (the k most
likely tokens at every position, for the largest k it grants). The rule is calibrated for the pair
and its evidence (:mod:`qualify.judge.served_calibration`, ``qualify calibrate --prefill-url ...``)
and comes from the pair's identity; the verdict's scope names the evidence (its fixture name) and
the calibration receipt. The checks:

* the cold recompute really recomputed: the decode server's counters (``/metrics``:
  ``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``) grew by nothing over it, and the
  cached prompt tokens it reported, if it reports them, are 0;
* each handoff really went through the connector: the decode server's connector supplied prompt
  tokens for the loaded branch and its local prefix cache none (the per-request ``cached_tokens``
  is recorded but not trusted for this: under a prefill/decode handshake vLLM reports the prefill
  server's count there); and the prefill server computed the prompt itself (its connector supplied
  none of it), so the KV handed over is the prefill server's;
* greedy tokens exact: all output tokens equal the cold recompute's;
* logprobs, over the positions up to and including the first token divergence (later rows score
  other contexts): **full**: every entry of every position within ``maximum_absolute`` of the cold
  one, and their mean within ``maximum_mean_absolute``; **top-k**: every position meets the top-k
  rule (:func:`judge_top_k_row`, stated in :data:`qualify.contract.rules.SERVED_TOP_K_RULE_STATEMENT`)
  under ``maximum_absolute``, and the mean |Δ| of the ids in both rows is within
  ``maximum_mean_absolute``.

A missing piece of evidence fails its check: nothing is called a handoff without it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from qualify.judge.calibration import ZERO_DRIFT_BOUND
from qualify.judge.handoffs import Check, Verdict
from qualify.judge.scope import Scope, scope_line

EvidenceMode = Literal["full", "top-k"]
FULL: EvidenceMode = "full"
TOP_K: EvidenceMode = "top-k"


@dataclass(frozen=True)
class ServedBranch:
    """One decode on the decode server: its output token ids, per position the logprobs it gave
    (token id -> logprob), the cached prompt tokens it reported (None: not reported), and the
    prompt tokens its connector and its local prefix cache supplied (the deltas of its
    ``external_prefix_cache_hits`` and ``prefix_cache_hits`` counters; None: unknown)."""

    tokens: tuple[int, ...]
    logprobs: tuple[Mapping[int, float], ...]
    cached_tokens: int | None
    external_hits: int | None
    local_hits: int | None


@dataclass(frozen=True)
class ServedHandoff:
    """One ordered handoff: what the prefill server reported for its prefill (cached prompt tokens,
    and how many its connector supplied) and the loaded branch on the decode server."""

    repetition: int
    prefill_cached_tokens: int | None
    prefill_external_hits: int | None
    loaded: ServedBranch


@dataclass(frozen=True)
class Evidence:
    """What the decode server's logprobs are: the full vocabulary (``vocab`` entries a position)
    or its top ``k``."""

    mode: EvidenceMode
    k: int | None  # the top-k's k; None for full logprobs
    vocab: int  # entries a full position carries (the model's vocabulary); 0 when unknown under top-k

    def words(self) -> str:
        return f"full logprobs ({self.vocab} per position)" if self.mode == FULL else f"top-{self.k} logprobs"

    @property
    def needed(self) -> int:
        """Entries a position must carry for this evidence."""
        return self.vocab if self.mode == FULL else int(self.k or 0)


# --------------------------------------------------------------------------- one position


def _delta(a: float, b: float) -> float:
    """|a - b|, 0 for equal values (also two equal infinities), inf for anything not finite."""
    if a == b:
        return 0.0
    delta = abs(a - b)
    return delta if math.isfinite(delta) else math.inf


def top_ids(row: Mapping[int, float], k: int) -> list[int]:
    """The k most likely ids of a row, most likely first, ties broken by id (a row may carry the
    sampled token beyond its top k)."""
    return sorted(row, key=lambda t: (-row[t], t))[:k]


@dataclass(frozen=True)
class RowDrift:
    """One position's comparison, in nats. ``compared``: entries in both rows (full: the
    vocabulary; top-k: the ids present in both rows), with the largest and summed |Δ|; under top-k,
    the moves the rule allows only within its bound: ``order_gap`` (the largest cold gap between two
    ids the loaded row orders the other way or ties), ``leave_gap`` (the largest cold distance
    above the cold k-th of an id that left the top k), ``enter_excess`` (the largest distance from
    the cold k-th of an id that entered it: its loaded logprob above it, its cold one, where
    reported, below it), with their counts. ``movement``: the largest of
    all of them, the least bound under which the position holds. ``short``: the position lacks the
    evidence (fewer entries than needed, or full rows over other ids); it holds under no bound."""

    compared: int
    max_abs: float
    sum_abs: float
    order_gap: float = 0.0
    leave_gap: float = 0.0
    enter_excess: float = 0.0
    out_of_order: int = 0
    entered: int = 0
    left: int = 0
    short: bool = False

    @property
    def movement(self) -> float:
        return math.inf if self.short else max(self.max_abs, self.order_gap, self.leave_gap, self.enter_excess)


SHORT = RowDrift(compared=0, max_abs=0.0, sum_abs=0.0, short=True)


def full_row(cold: Mapping[int, float], loaded: Mapping[int, float], vocab: int) -> RowDrift:
    """A full-logprob position: every entry of the vocabulary on both rows, compared."""
    if len(cold) < vocab or len(loaded) < vocab or set(cold) != set(loaded):
        return SHORT
    deltas = [_delta(loaded[token], cold[token]) for token in cold]
    return RowDrift(compared=len(deltas), max_abs=max(deltas, default=0.0), sum_abs=math.fsum(deltas))


def _order_gap(common: Sequence[int], cold: Mapping[int, float], loaded: Mapping[int, float]) -> tuple[float, int]:
    """(the largest cold gap of a pair of ``common`` ids the loaded row orders the other way or
    ties, the ids below such a pair's upper one): a sweep in loaded order, O(n log n)."""
    by_loaded = sorted(common, key=lambda t: loaded[t])
    gap, moved, index = 0.0, 0, 0
    highest_cold = -math.inf
    while index < len(by_loaded):
        end = index
        while end < len(by_loaded) and loaded[by_loaded[end]] == loaded[by_loaded[index]]:
            end += 1
        group = by_loaded[index:end]  # equal loaded logprobs: tied, so ordered "the other way" too
        highest_cold = max([highest_cold, *(cold[t] for t in group)])
        for token in group:
            if highest_cold > cold[token]:
                gap = max(gap, _delta(highest_cold, cold[token]))
                moved += 1
        index = end
    return gap, moved


def top_k_row(cold: Mapping[int, float], loaded: Mapping[int, float], k: int) -> RowDrift:
    """A top-k position measured for the top-k rule (:func:`judge_top_k_row`)."""
    if k < 1 or len(cold) < k or len(loaded) < k:
        return SHORT
    cold_top, loaded_top = top_ids(cold, k), top_ids(loaded, k)
    in_cold, in_loaded = set(cold_top), set(loaded_top)
    kth = min(cold[token] for token in cold_top)
    both = [token for token in cold if token in loaded]  # every id present in both rows
    deltas = [_delta(loaded[token], cold[token]) for token in both]
    left = [token for token in cold_top if token not in in_loaded]
    entered = [token for token in loaded_top if token not in in_cold]
    order_gap, moved = _order_gap([token for token in cold_top if token in in_loaded], cold, loaded)
    excess = [_delta(loaded[token], kth) for token in entered if loaded[token] > kth]
    excess += [_delta(kth, cold[token]) for token in entered if token in cold and cold[token] < kth]
    return RowDrift(
        compared=len(deltas), max_abs=max(deltas, default=0.0), sum_abs=math.fsum(deltas), order_gap=order_gap,
        leave_gap=max((_delta(cold[token], kth) for token in left), default=0.0),
        enter_excess=max(excess, default=0.0), out_of_order=moved, entered=len(entered), left=len(left))


@dataclass(frozen=True)
class RowVerdict:
    """Whether a position meets the top-k rule under a bound, and the first clause it breaks."""

    held: bool
    drift: RowDrift
    reason: str | None


def judge_top_k_row(cold: Mapping[int, float], loaded: Mapping[int, float], k: int, bound: float) -> RowVerdict:
    """The top-k rule (``served-top-k-within-bound.v1``), for one position. With C the cold row's k
    most likely ids (ties broken by id), c_k the least cold logprob among them, L the loaded row's
    k most likely ids and b the calibrated ``bound``, the position holds when:

    1. both rows carry at least k entries;
    2. every id present in both rows has ``|loaded - cold| <= b``;
    3. no two ids in both C and L whose cold logprobs differ by more than b are in the other order,
       or tied, by their loaded logprobs (ids within b of each other may swap);
    4. an id leaves the top k only when its cold logprob lies within b of c_k;
    5. an id enters the top k only when its loaded logprob is at most ``c_k + b`` and its cold
       logprob, where the cold row reports it, lies within b of c_k (a server reports none beyond
       the top k and the sampled token; unreported, it is at most c_k).

    So: the same k ids in the same order, except for swaps and entries at the k-th place that the
    calibrated bound covers. Pure: rows in, verdict out."""
    drift = top_k_row(cold, loaded, k)
    if drift.short:
        return RowVerdict(False, drift, f"fewer than {k} logprobs on a row")
    for clause, value, words in (
            ("logprob", drift.max_abs, "an id in both rows moved by"),
            ("order", drift.order_gap, "two ids changed order (or tied) with a cold gap of"),
            ("left", drift.leave_gap, "an id left the top-k from"),
            ("entered", drift.enter_excess, "an id entered the top-k from")):
        if not value <= bound:
            where = " away from the cold k-th" if clause in ("left", "entered") else ""
            return RowVerdict(False, drift, f"{words} {value:.6g} nats{where} (bound {bound_words(bound)})")
    return RowVerdict(True, drift, None)


def bound_words(bound: float) -> str:
    """A bound as verdicts write it: the least positive double says that only a zero delta meets it."""
    if bound == ZERO_DRIFT_BOUND:
        return f"{bound!r} (the least positive double: only a zero delta meets it)"
    return f"{bound:.6g}"


# --------------------------------------------------------------------------- one branch


def first_divergence(tokens: Sequence[int], cold: Sequence[int], n: int) -> int | None:
    """The first output position where ``tokens`` differ from ``cold`` (or either ends), None when
    all ``n`` agree."""
    for position in range(n):
        if position >= len(tokens) or position >= len(cold) or tokens[position] != cold[position]:
            return position
    return None


@dataclass(frozen=True)
class BranchDrift:
    """A branch against the cold recompute over ``positions`` output positions: the token
    agreement, and per compared position (up to and including the first divergence; later rows
    score other contexts) its :class:`RowDrift`."""

    positions: int
    tokens_equal: int
    first_divergence: int | None
    rows: tuple[RowDrift, ...]

    @property
    def short(self) -> int:
        """Compared positions without the evidence (a row missing counts too)."""
        return sum(1 for row in self.rows if row.short)

    @property
    def compared(self) -> int:
        return sum(row.compared for row in self.rows)

    @property
    def max_abs(self) -> float | None:
        """The largest |Δ| over the entries compared, None when none was."""
        usable = [row.max_abs for row in self.rows if not row.short]
        return max(usable) if usable else None

    @property
    def movement(self) -> float | None:
        """The least bound every compared position holds under (inf with a position short of
        evidence), None with nothing compared."""
        return max((row.movement for row in self.rows), default=None)

    @property
    def mean_abs(self) -> float | None:
        count = self.compared
        return math.fsum(row.sum_abs for row in self.rows) / count if count else None

    @property
    def out_of_order(self) -> int:
        return sum(1 for row in self.rows if row.out_of_order)

    @property
    def membership_moves(self) -> int:
        return sum(1 for row in self.rows if row.entered or row.left)

    def series(self) -> dict[str, list[float | None]]:
        """Per compared position: the largest |Δ|, the mean |Δ| and the movement (None where the
        evidence is missing), for the receipt."""
        return {"max_abs": [None if r.short else r.max_abs for r in self.rows],
                "mean_abs": [None if r.short or not r.compared else r.sum_abs / r.compared for r in self.rows],
                "movement": [None if r.short else r.movement for r in self.rows]}

    def document(self) -> dict[str, Any]:
        return {"positions": self.positions, "tokens_equal": self.tokens_equal,
                "first_divergence_position": self.first_divergence, "positions_compared": len(self.rows),
                "positions_without_evidence": self.short, "compared_logprob_entries": self.compared,
                "max_abs": self.max_abs, "mean_abs": self.mean_abs,
                "movement": None if self.movement is None or not math.isfinite(self.movement) else self.movement,
                "positions_out_of_order": self.out_of_order, "positions_with_membership_moves": self.membership_moves,
                "series": self.series()}


def compare_branch(cold: ServedBranch, other: ServedBranch, evidence: Evidence, positions: int) -> BranchDrift:
    """``other`` against the cold recompute ``cold`` under ``evidence``."""
    first = first_divergence(other.tokens, cold.tokens, positions)
    equal = sum(1 for a, b in zip(other.tokens[:positions], cold.tokens[:positions], strict=False) if a == b)
    rows: list[RowDrift] = []
    for position in range(positions if first is None else first + 1):
        if position >= len(cold.logprobs) or position >= len(other.logprobs):
            rows.append(SHORT)
        elif evidence.mode == FULL:
            rows.append(full_row(cold.logprobs[position], other.logprobs[position], evidence.vocab))
        else:
            rows.append(top_k_row(cold.logprobs[position], other.logprobs[position], int(evidence.k or 0)))
    return BranchDrift(positions, equal, first, tuple(rows))


# --------------------------------------------------------------------------- the rule and a handoff


@dataclass(frozen=True)
class ServedRule:
    """The evidence, the calibrated bounds on |Δ logprob| (nats) and where they come from."""

    evidence: Evidence
    maximum_absolute: float
    maximum_mean_absolute: float
    prompt_tokens: int
    output_tokens: int
    repetitions: int
    basis: str  # receipt://<run-id> of the calibration
    bound_rule: str
    top_k_rule: str | None

    @property
    def fixture(self) -> str:
        """The scope's fixture name: the recipe's served pair and the evidence it was judged on."""
        evidence = "full-logprobs" if self.evidence.mode == FULL else f"top{self.evidence.k}-logprobs"
        return f"native-text-served-pair.{evidence}"

    def words(self) -> str:
        evidence = self.evidence
        what = (f"every one of the {evidence.vocab} logprobs of a position within max |Δ| <= "
                f"{bound_words(self.maximum_absolute)}" if evidence.mode == FULL else
                f"the top-{evidence.k} logprobs by rule {self.top_k_rule} (the same {evidence.k} token ids in the "
                f"same order, but for swaps and entries at the k-th place within the bound) within max |Δ| <= "
                f"{bound_words(self.maximum_absolute)}")
        return (f"greedy tokens exact and {what} and mean |Δ| <= {bound_words(self.maximum_mean_absolute)} of the "
                f"cold recompute, bounds by {self.bound_rule}")

    def document(self) -> dict[str, Any]:
        """The receipt's ``rule``: no rung (a served pair is judged black-box), its kind and evidence."""
        return {"kind": "served-pair", "evidence": self.evidence.mode, "top_k": self.evidence.k,
                "vocab": self.evidence.vocab, "maximum_absolute_logprob_delta": self.maximum_absolute,
                "maximum_mean_absolute_logprob_delta": self.maximum_mean_absolute, "bound_rule": self.bound_rule,
                "top_k_rule": self.top_k_rule, "calibrated_on": self.basis, "repetitions": self.repetitions,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens, "words": self.words()}


@dataclass
class ServedSample:
    """One handoff's numbers, as its sample record holds them."""

    repetition: int
    drift: BranchDrift
    cached_tokens: int | None
    external_hits: int | None
    local_hits: int | None
    prefill_cached_tokens: int | None
    prefill_external_hits: int | None
    output_tokens: int
    handoff_sha256: str
    cold_sha256: str
    checks: list[Check] = field(default_factory=list)

    @property
    def max_abs(self) -> float | None:
        return self.drift.max_abs

    @property
    def mean_abs(self) -> float | None:
        return self.drift.mean_abs

    @property
    def tokens_equal(self) -> int:
        return self.drift.tokens_equal

    @property
    def first_divergence(self) -> int | None:
        return self.drift.first_divergence

    @property
    def compared_entries(self) -> int:
        return self.drift.compared

    @property
    def positions_short(self) -> int:
        return self.drift.short

    def document(self) -> dict[str, Any]:
        drift = self.drift
        return {
            "repetition": self.repetition, "kind": "served-pair",
            "max_abs": drift.max_abs, "mean_abs": drift.mean_abs,
            "token_agreement_rate": drift.tokens_equal / self.output_tokens if self.output_tokens else None,
            "output_tokens": self.output_tokens, "tokens_equal": drift.tokens_equal,
            "localisation": {"first_divergence_position": drift.first_divergence},
            "positions_compared": len(drift.rows),
            "compared_logprob_entries": drift.compared, "positions_without_evidence": drift.short,
            "top_k_positions_out_of_order": drift.out_of_order,
            "top_k_positions_with_membership_moves": drift.membership_moves,
            "decode_cached_tokens": self.cached_tokens, "decode_connector_tokens": self.external_hits,
            "decode_prefix_cache_tokens": self.local_hits,
            "prefill_cached_tokens": self.prefill_cached_tokens, "prefill_connector_tokens": self.prefill_external_hits,
            "handoff_generated_token_sha256": self.handoff_sha256, "cold_generated_token_sha256": self.cold_sha256,
            "error": None, "passed": all(check.passed for check in self.checks),
            "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in self.checks],
        }


def token_sha256(tokens: Sequence[int]) -> str:
    """SHA-256 of the token ids as little-endian int64 (the harness's generated-token digest)."""
    return hashlib.sha256(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)).hexdigest()


def prefill_check(label: str, computed: int | None, prompt_tokens: int) -> Check:
    """The prefill server computed the prompt: its connector supplied none of it."""
    return Check(f"{label}: prefill computed on the prefill server", computed == 0,
                 "its connector supplied none of the prompt" if computed == 0 else
                 "the prefill server did not report its connector's hits (no evidence the KV is its own)"
                 if computed is None else
                 f"its connector supplied {computed} of {prompt_tokens} prompt tokens before it prefilled "
                 f"(the KV handed over is not its own computation)")


def loaded_check(label: str, loaded: ServedBranch, prompt_tokens: int) -> Check:
    """The loaded branch's prompt came through the decode server's connector, none of it from its
    local prefix cache."""
    external, local = loaded.external_hits, loaded.local_hits
    through = external is not None and external > 0 and local == 0
    detail = (f"{external} of {prompt_tokens} prompt tokens loaded through the decode server's connector"
              if through else
              "the decode server's /metrics did not account for the request (its connector's hits unknown)"
              if external is None or local is None else
              "the decode server's connector supplied none of the prompt: no KV was loaded" if external == 0 else
              f"{external} prompt tokens from its connector, {local} from its local prefix cache")
    return Check(f"{label}: KV loaded through the connector", through, detail)


def _logprob_check(label: str, drift: BranchDrift, cold: ServedBranch, loaded: ServedBranch,
                   rule: ServedRule) -> Check:
    evidence, bound, mean_bound = rule.evidence, rule.maximum_absolute, rule.maximum_mean_absolute
    worst, mean = drift.max_abs, drift.mean_abs
    measured = (f"max |Δ logprob| {worst:.6g}, mean {mean:.6g} over {drift.compared} entries of {len(drift.rows)} "
                f"positions" if worst is not None and mean is not None else "no entry compared")
    problems: list[str] = []
    if drift.short:
        problems.append(f"{drift.short} of {len(drift.rows)} positions without {evidence.words()} on both branches")
    if evidence.mode == FULL:
        if worst is not None and not worst <= bound:
            problems.append(f"max |Δ| outside the bound {bound_words(bound)}")
    else:
        k = int(evidence.k or 0)
        for position, row in enumerate(drift.rows):
            if row.short:
                continue
            verdict = judge_top_k_row(cold.logprobs[position], loaded.logprobs[position], k, bound)
            if not verdict.held:
                broken = sum(1 for r in drift.rows if not r.short and not r.movement <= bound)
                problems.append(f"{broken} positions break rule {rule.top_k_rule}, first at output position "
                                f"{position}: {verdict.reason}")
                break
    if mean is None or not mean <= mean_bound:
        problems.append("no entry compared" if mean is None else
                        f"mean |Δ| outside the bound {bound_words(mean_bound)}")
    words = measured + (f"; {'; '.join(problems)}" if problems else
                        f" (bounds: max {bound_words(bound)}, mean {bound_words(mean_bound)})")
    name = "full logprobs within bound" if evidence.mode == FULL else f"top-{evidence.k} logprobs within the rule"
    return Check(f"{label}: {name}", not problems, words)


def judge_served_sample(cold: ServedBranch, handoff: ServedHandoff, rule: ServedRule) -> ServedSample:
    """One handoff against the cold recompute: its checks and numbers."""
    loaded, n, label = handoff.loaded, rule.output_tokens, f"handoff {handoff.repetition}"
    drift = compare_branch(cold, loaded, rule.evidence, n)
    first = drift.first_divergence
    checks = [prefill_check(label, handoff.prefill_external_hits, rule.prompt_tokens),
              loaded_check(label, loaded, rule.prompt_tokens),
              Check(f"{label}: greedy tokens exact", first is None,
                    f"{n}/{n} tokens equal" if first is None else
                    f"{drift.tokens_equal}/{n} tokens equal; first divergence at output position {first}"),
              _logprob_check(label, drift, cold, loaded, rule)]
    return ServedSample(
        repetition=handoff.repetition, drift=drift, cached_tokens=loaded.cached_tokens,
        external_hits=loaded.external_hits, local_hits=loaded.local_hits,
        prefill_cached_tokens=handoff.prefill_cached_tokens, prefill_external_hits=handoff.prefill_external_hits,
        output_tokens=n, handoff_sha256=token_sha256(loaded.tokens), cold_sha256=token_sha256(cold.tokens),
        checks=checks)


def cold_check(cold: ServedBranch, prompt_tokens: int, name: str = "cold recompute on the decode server") -> Check:
    """The cold recompute recomputed: neither the decode server's connector nor its prefix cache
    supplied any of the prompt, and the cached-token count it reported, if any, is 0."""
    external, local, cached = cold.external_hits, cold.local_hits, cold.cached_tokens
    held = external == 0 and local == 0 and cached in (None, 0)
    return Check(name, held,
                 f"0 of {prompt_tokens} prompt tokens cached: the decode server computed the whole prompt" if held else
                 "the decode server's /metrics did not account for the request (its cache hits unknown)"
                 if external is None or local is None else
                 f"{external} of {prompt_tokens} prompt tokens from its connector, {local} from its local prefix cache, "
                 f"{cached} reported cached: not a cold recompute (clear the connector's store and restart the pair)")


def judge_served_pair(cold: ServedBranch, handoffs: Sequence[ServedHandoff],
                      rule: ServedRule) -> tuple[Verdict, list[ServedSample]]:
    """The pair's verdict over its ordered handoffs, and each handoff's sample."""
    samples = [judge_served_sample(cold, handoff, rule) for handoff in handoffs]
    checks = [cold_check(cold, rule.prompt_tokens), *(check for sample in samples for check in sample.checks)]
    if len(handoffs) != rule.repetitions:
        checks.append(Check("handoffs", False, f"{len(handoffs)} of {rule.repetitions} handoffs ran"))
    passed = all(check.passed for check in checks)
    scope = Scope(fixture=rule.fixture, repetitions=rule.repetitions, prompt_tokens=rule.prompt_tokens,
                  output_tokens=rule.output_tokens, controls=None, calibrated_on=rule.basis)
    failing = [f"{check.name}: {check.detail}" for check in checks if not check.passed]
    line = scope_line(passed, scope, failing[0] if failing else None)
    headline = f"{line}. Rule: {rule.words()} (black-box over HTTP)"
    reasons = failing if not passed else [f"{check.name}: {check.detail}" for check in checks]
    return Verdict(passed, headline, reasons, checks, scope=scope), samples
