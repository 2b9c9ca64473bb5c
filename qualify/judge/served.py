"""Judging a served prefill/decode pair from what its HTTP API returned (issue 36 item 3): pure
functions from the branches' tokens, logprobs and cache counts to a :class:`Verdict`.

The evidence is the strongest the decode server gives: **full** logprobs (every vocabulary entry at
every position, ``--max-logprobs`` at least the vocabulary) or **top-k** logprobs (the k most
likely tokens at every position). The rule, stated in the verdict's scope (its fixture name) and
in the receipt's rule:

* the cold recompute really recomputed: the decode server's counters (``/metrics``:
  ``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``) grew by nothing over it, and the
  cached prompt tokens it reported, if it reports them, are 0;
* each handoff really went through the connector: the decode server's connector supplied prompt
  tokens for the loaded branch and its local prefix cache none (the per-request ``cached_tokens``
  is recorded but not trusted for this: under a prefill/decode handshake vLLM reports the prefill
  server's count there); and the prefill server computed the prompt itself (its connector supplied
  none of it), so the KV handed over is the prefill server's;
* greedy tokens exact: all output tokens equal the cold recompute's;
* logprobs: **full**: every entry of every position within ``bound`` of the cold one; **top-k**:
  the same k token ids at every position, each within ``bound``.

A missing piece of evidence fails its check: nothing is called a handoff without it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
class ServedRule:
    """The evidence the decode server gave and the bound on |Δ logprob| (nats)."""

    mode: EvidenceMode
    k: int | None  # the top-k's k; None for full logprobs
    vocab: int
    bound: float
    prompt_tokens: int
    output_tokens: int
    repetitions: int

    @property
    def fixture(self) -> str:
        """The scope's fixture name: the recipe's served pair and the evidence it was judged on."""
        evidence = "full-logprobs" if self.mode == FULL else f"top{self.k}-logprobs"
        return f"native-text-served-pair.{evidence}"

    def words(self) -> str:
        evidence = (f"full logprobs ({self.vocab} per position)" if self.mode == FULL
                    else f"top-{self.k} logprobs (the same {self.k} token ids at every position)")
        return f"greedy tokens exact and {evidence} within |Δ| <= {self.bound:g} of the cold recompute"

    def document(self) -> dict[str, Any]:
        """The receipt's ``rule``: no rung (an uncalibrated bound), its kind and evidence."""
        return {"kind": "served-pair", "evidence": self.mode, "top_k": self.k, "vocab": self.vocab,
                "maximum_absolute_logprob_delta": self.bound, "repetitions": self.repetitions,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens, "words": self.words()}


@dataclass
class ServedSample:
    """One handoff's numbers, as its sample record holds them."""

    repetition: int
    tokens_equal: int
    first_divergence: int | None
    max_abs: float | None
    mean_abs: float | None
    compared_entries: int
    positions_short: int  # positions without the evidence the mode needs (full: the vocab; top-k: k)
    topk_mismatches: int  # top-k: positions whose k token ids differ from the cold ones
    cached_tokens: int | None
    external_hits: int | None
    local_hits: int | None
    prefill_cached_tokens: int | None
    prefill_external_hits: int | None
    output_tokens: int
    handoff_sha256: str
    cold_sha256: str
    checks: list[Check] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        return {
            "repetition": self.repetition, "kind": "served-pair",
            "max_abs": self.max_abs, "mean_abs": self.mean_abs,
            "token_agreement_rate": self.tokens_equal / self.output_tokens if self.output_tokens else None,
            "output_tokens": self.output_tokens, "tokens_equal": self.tokens_equal,
            "localisation": {"first_divergence_position": self.first_divergence},
            "compared_logprob_entries": self.compared_entries, "positions_without_evidence": self.positions_short,
            "top_k_mismatched_positions": self.topk_mismatches,
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


def _top_ids(row: Mapping[int, float], k: int) -> frozenset[int]:
    """The k most likely ids of a row (the row may carry the sampled token beyond its top k)."""
    return frozenset(sorted(row, key=lambda t: (-row[t], t))[:k])


def _compare_rows(cold: ServedBranch, loaded: ServedBranch, rule: ServedRule) -> tuple[float | None, float | None, int, int, int]:
    """(max |Δ|, mean |Δ|, entries compared, positions short of evidence, top-k mismatches)."""
    worst, total, count, short, mismatched = 0.0, 0.0, 0, 0, 0
    needed = rule.vocab if rule.mode == FULL else (rule.k or 0)
    for position in range(rule.output_tokens):
        if position >= len(cold.logprobs) or position >= len(loaded.logprobs):
            short += 1
            continue
        ours, theirs = loaded.logprobs[position], cold.logprobs[position]
        if len(ours) < needed or len(theirs) < needed:
            short += 1
            continue
        if rule.mode == FULL:
            keys: frozenset[int] | set[int] = set(theirs)
            if set(ours) != keys:
                short += 1
                continue
        else:
            k = rule.k or 0
            keys = _top_ids(theirs, k)
            if _top_ids(ours, k) != keys:
                mismatched += 1
                continue
        for token in keys:
            delta = abs(ours[token] - theirs[token])
            if not math.isfinite(delta):
                delta = math.inf
            worst = max(worst, delta)
            total += delta
            count += 1
    if count == 0:
        return None, None, 0, short, mismatched
    return worst, total / count, count, short, mismatched


def _first_divergence(tokens: Sequence[int], cold: Sequence[int], n: int) -> int | None:
    for position in range(n):
        if position >= len(tokens) or position >= len(cold) or tokens[position] != cold[position]:
            return position
    return None


def judge_served_sample(cold: ServedBranch, handoff: ServedHandoff, rule: ServedRule) -> ServedSample:
    """One handoff against the cold recompute: its checks and numbers."""
    loaded, n, label = handoff.loaded, rule.output_tokens, f"handoff {handoff.repetition}"
    first = _first_divergence(loaded.tokens, cold.tokens, n)
    equal = sum(1 for a, b in zip(loaded.tokens[:n], cold.tokens[:n], strict=False) if a == b)
    worst, mean, compared, short, mismatched = _compare_rows(cold, loaded, rule)
    checks: list[Check] = []
    computed = handoff.prefill_external_hits
    checks.append(Check(f"{label}: prefill computed on the prefill server", computed == 0,
                        "its connector supplied none of the prompt" if computed == 0 else
                        "the prefill server did not report its connector's hits (no evidence the KV is its own)"
                        if computed is None else
                        f"its connector supplied {computed} of {rule.prompt_tokens} prompt tokens before it prefilled "
                        f"(the KV handed over is not its own computation)"))
    cached, external, local = loaded.cached_tokens, loaded.external_hits, loaded.local_hits
    through = external is not None and external > 0 and local == 0
    detail = (f"{external} of {rule.prompt_tokens} prompt tokens loaded through the decode server's connector"
              if through else
              "the decode server's /metrics did not account for the request (its connector's hits unknown)"
              if external is None or local is None else
              "the decode server's connector supplied none of the prompt: no KV was loaded" if external == 0 else
              f"{external} prompt tokens from its connector, {local} from its local prefix cache")
    checks.append(Check(f"{label}: KV loaded through the connector", through, detail))
    checks.append(Check(f"{label}: greedy tokens exact", first is None,
                        f"{n}/{n} tokens equal" if first is None else
                        f"{equal}/{n} tokens equal; first divergence at output position {first}"))
    if rule.mode == FULL:
        held = short == 0 and worst is not None and worst <= rule.bound
        words = (f"max |Δ logprob| {worst:.6g}, mean {mean:.6g} over {compared} entries (bound {rule.bound:g})"
                 if worst is not None and mean is not None else "no position carried the full vocabulary")
        if short:
            words += f"; {short} of {n} positions without the full vocabulary on both branches"
        checks.append(Check(f"{label}: full logprobs within bound", held, words))
    else:
        held = short == 0 and mismatched == 0 and worst is not None and worst <= rule.bound
        words = (f"max |Δ logprob| {worst:.6g}, mean {mean:.6g} over {compared} top-{rule.k} entries (bound {rule.bound:g})"
                 if worst is not None and mean is not None else f"no position's top-{rule.k} agreed")
        if mismatched:
            words += f"; {mismatched} of {n} positions with other top-{rule.k} token ids"
        if short:
            words += f"; {short} of {n} positions without {rule.k} logprobs on both branches"
        checks.append(Check(f"{label}: top-{rule.k} logprobs within bound", held, words))
    return ServedSample(
        repetition=handoff.repetition, tokens_equal=equal, first_divergence=first, max_abs=worst, mean_abs=mean,
        compared_entries=compared, positions_short=short, topk_mismatches=mismatched, cached_tokens=cached,
        external_hits=external, local_hits=local, prefill_cached_tokens=handoff.prefill_cached_tokens,
        prefill_external_hits=computed,
        output_tokens=n, handoff_sha256=token_sha256(loaded.tokens), cold_sha256=token_sha256(cold.tokens), checks=checks)


def cold_check(cold: ServedBranch, prompt_tokens: int) -> Check:
    """The cold recompute recomputed: neither the decode server's connector nor its prefix cache
    supplied any of the prompt, and the cached-token count it reported, if any, is 0."""
    external, local, cached = cold.external_hits, cold.local_hits, cold.cached_tokens
    held = external == 0 and local == 0 and cached in (None, 0)
    return Check("cold recompute on the decode server", held,
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
                  output_tokens=rule.output_tokens, controls=None)
    failing = [f"{check.name}: {check.detail}" for check in checks if not check.passed]
    line = scope_line(passed, scope, failing[0] if failing else None)
    headline = f"{line}. Rule: {rule.words()} (uncalibrated bound; black-box over HTTP)"
    reasons = failing if not passed else [f"{check.name}: {check.detail}" for check in checks]
    return Verdict(passed, headline, reasons, checks, scope=scope), samples
