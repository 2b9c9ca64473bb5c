"""A non-deterministic producer's fixture envelope: derived from the fixture's own repeated honest
handoffs, index by index, and every judged handoff's rows and positions held inside it.

For a producer whose bits vary run to run no digest can be rechecked against an anchor, so drift
is the only defence; a cross-document maximum is far too loose for that (docs/detection-power.md).
The envelope is the fixture's own: per decoded row and per handed-off position, what the honest
producer reached over its repeated runs, widened by a multiple of the run-to-run range it showed
there, the multiple measured on the same runs by leaving each out in turn
(:data:`~qualify.contract.rules.FIXTURE_ENVELOPE_RULE`).

Pure: plain float sequences in, an envelope or a verdict out. Imports the contract's rule names and
:mod:`qualify.judge.handoffs`' verdict types only.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from qualify.contract.rules import (
    FIXTURE_ENVELOPE_MINIMUM_HANDOFFS,
    FIXTURE_ENVELOPE_MINIMUM_STARTS,
    FIXTURE_ENVELOPE_RULE,
)
from qualify.core.errors import Refused
from qualify.judge.handoffs import Verdict, _Judgement, _num

MINIMUM_ENVELOPE_HANDOFFS = FIXTURE_ENVELOPE_MINIMUM_HANDOFFS
"""The fewest honest handoffs an envelope is stated from (the contract's number: an identity is
refused for fewer)."""

MINIMUM_ENVELOPE_STARTS = FIXTURE_ENVELOPE_MINIMUM_STARTS
"""The fewest producer starts an envelope is stated from (the contract's number)."""

SERIES_NAMES: tuple[tuple[str, str], ...] = (
    ("row_max_abs", "row max |delta logit|"),
    ("row_mean_abs", "row mean |delta logit|"),
    ("position_max_abs", "handed-off position max |delta K or V|"),
    ("tensor_position_max_abs", "layer K or V position max |delta|"),
)
"""The four series an envelope bounds, and how a verdict names each."""


@dataclass(frozen=True)
class HandoffSeries:
    """What one handoff is held to its envelope by: per decoded row its max and mean abs logit
    delta against the cold recompute (teacher-forced rows where the tokens part); per handed-off
    position the max abs K or V delta against the consumer's own prefill over every layer (a
    receipt's series), and the same for each layer's K and for its V apart, flattened layer by
    layer, K before V (2 * layers * positions values): a fault in one layer's tensor shows there
    against that tensor's own run-to-run spread, not under another layer's larger delta."""

    row_max_abs: tuple[float, ...]
    row_mean_abs: tuple[float, ...]
    position_max_abs: tuple[float, ...]
    tensor_position_max_abs: tuple[float, ...]


@dataclass(frozen=True)
class FixtureEnvelope:
    """Per-index ceilings from ``handoffs`` honest handoffs over ``starts`` producer starts."""

    handoffs: int
    starts: int
    row_max_abs: tuple[float, ...]
    row_mean_abs: tuple[float, ...]
    position_max_abs: tuple[float, ...]
    tensor_position_max_abs: tuple[float, ...]
    multipliers: tuple[float, ...] = (2.0, 2.0, 2.0, 2.0)
    rule: str = FIXTURE_ENVELOPE_RULE


def leave_one_out_exceedance(columns: Sequence[Sequence[float]]) -> float:
    """The largest amount by which one honest handoff rose above the others' largest value at an
    index, in units of the others' range there (0 when none rose above a positive range): how far
    an unseen honest run may step past the envelope's data, measured on the data."""
    largest = 0.0
    for values in zip(*columns, strict=True):
        # Only the largest value can rise above the others' largest; the others are then every
        # value but it, whose largest is the second and whose smallest is the first in order. A
        # largest value equal to the second rose by 0.
        ordered = sorted(values)
        *_, others_max, top = ordered
        spread = others_max - ordered[0]
        if spread > 0:
            largest = max(largest, (top - others_max) / spread)
    return largest


def derive_fixture_envelope(series: Sequence[HandoffSeries], *, starts: int) -> FixtureEnvelope:
    """The envelope of ``series`` (the fixture's honest handoffs over ``starts`` producer starts):
    at each index the largest value plus a multiple of the range there, the multiple for each
    series twice the larger of 1 and its :func:`leave_one_out_exceedance`. Refused when there are
    too few handoffs or starts, the series' lengths disagree, or an honest value is not a finite
    non-negative number."""
    if len(series) < MINIMUM_ENVELOPE_HANDOFFS:
        raise Refused(f"fixture envelope: honest handoffs: found {len(series)}, expected at least "
                      f"{MINIMUM_ENVELOPE_HANDOFFS}")
    if starts < MINIMUM_ENVELOPE_STARTS or starts > len(series):
        raise Refused(f"fixture envelope: producer starts: found {starts}, expected {MINIMUM_ENVELOPE_STARTS} "
                      f"to {len(series)} (at most one per honest handoff)")
    ceilings: dict[str, tuple[float, ...]] = {}
    multipliers: list[float] = []
    for name, words in SERIES_NAMES:
        columns = [getattr(handoff, name) for handoff in series]
        lengths = {len(column) for column in columns}
        if len(lengths) != 1 or 0 in lengths:
            raise Refused(f"fixture envelope: {name}: lengths {sorted(lengths)} across the honest handoffs, "
                          "expected one non-zero length")
        for handoff, column in enumerate(columns, start=1):
            bad = next((i for i, value in enumerate(column) if not (math.isfinite(value) and value >= 0)), None)
            if bad is not None:
                raise Refused(f"fixture envelope: {name}[{bad}] of honest handoff {handoff} is "
                              f"{column[bad]!r}, expected a finite {words} >= 0")
        multiple = 2.0 * max(1.0, leave_one_out_exceedance(columns))
        multipliers.append(multiple)
        ceilings[name] = tuple(max(values) + multiple * (max(values) - min(values))
                               for values in zip(*columns, strict=True))
    return FixtureEnvelope(len(series), starts, ceilings["row_max_abs"], ceilings["row_mean_abs"],
                           ceilings["position_max_abs"], ceilings["tensor_position_max_abs"], tuple(multipliers))


def ceilings_sha256(envelope: FixtureEnvelope) -> str:
    """The digest an identity seals the ceilings by, as
    :data:`~qualify.contract.rules.FIXTURE_ENVELOPE_CEILINGS_DIGEST` states it: reproducible from
    the ceilings alone, with no JSON number form in between."""
    digest = hashlib.sha256()
    for name, _ in SERIES_NAMES:
        values: tuple[float, ...] = getattr(envelope, name)
        digest.update(name.encode("ascii") + b"\0" + struct.pack("<Q", len(values)))
        digest.update(struct.pack(f"<{len(values)}d", *values))
    return digest.hexdigest()


@dataclass(frozen=True)
class EnvelopeSeal:
    """What an identity seals of a fixture envelope: its rule, the handoffs and producer starts it
    was stated from, the multiple k of each series (:data:`SERIES_NAMES` order) and the digest of
    its ceilings (:func:`ceilings_sha256`). The ceilings themselves stay in the basis receipt."""

    rule: str
    handoffs: int
    starts: int
    multipliers: tuple[float, ...]
    ceilings_sha256: str

    @classmethod
    def of(cls, envelope: FixtureEnvelope) -> EnvelopeSeal:
        return cls(envelope.rule, envelope.handoffs, envelope.starts, envelope.multipliers, ceilings_sha256(envelope))


def seal_problems(sealed: EnvelopeSeal, series: Sequence[HandoffSeries], *, starts: int) -> tuple[list[str],
                                                                                                  FixtureEnvelope | None]:
    """Why ``sealed`` does not follow from the basis's honest handoffs ``series`` over ``starts``
    producer starts by :data:`FIXTURE_ENVELOPE_RULE` (empty: it does), each naming the sealed field;
    and the envelope the basis gives (None when it gives none)."""
    try:
        envelope = derive_fixture_envelope(series, starts=starts)
    except Refused as exc:
        return [f"fixture_envelope: the basis gives no envelope by rule {FIXTURE_ENVELOPE_RULE}: {exc}"], None
    derived = EnvelopeSeal.of(envelope)
    problems = []
    if sealed.rule != derived.rule:
        problems.append(f"fixture_envelope.rule.name: sealed {sealed.rule!r}, the basis is stated by {derived.rule!r}")
    for field, words in (("handoffs", "handoffs"), ("starts", "producer_starts")):
        if getattr(sealed, field) != getattr(derived, field):
            problems.append(f"fixture_envelope.{words}: sealed {getattr(sealed, field)!r}, the basis gives "
                            f"{getattr(derived, field)!r}")
    for (name, _), given, found in zip(SERIES_NAMES, derived.multipliers, sealed.multipliers, strict=False):
        if given != found:
            problems.append(f"fixture_envelope.multipliers.{name}: sealed {found!r}, the basis gives {given!r} by rule "
                            f"{FIXTURE_ENVELOPE_RULE}")
    if len(sealed.multipliers) != len(derived.multipliers):
        problems.append(f"fixture_envelope.multipliers: sealed {len(sealed.multipliers)}, expected "
                        f"{len(derived.multipliers)} (one per series)")
    if sealed.ceilings_sha256 != derived.ceilings_sha256:
        problems.append(f"fixture_envelope.ceilings_sha256: sealed {sealed.ceilings_sha256}, the basis gives "
                        f"{derived.ceilings_sha256} by rule {FIXTURE_ENVELOPE_RULE}")
    return problems, envelope


def judge_envelope(series: Sequence[HandoffSeries], envelope: FixtureEnvelope, *,
                   missing: Sequence[str] = ()) -> Verdict:
    """Does every handoff keep every row and handed-off position within the envelope? A value
    above its ceiling, a non-finite one, or a series of another length fails, naming the handoff,
    the index, the value and the ceiling; no handoffs fails. ``missing`` names handoffs whose
    series were not measured (absent evidence is failed evidence): each fails the check first."""
    judgement = _Judgement()
    problems: list[str] = list(missing)
    nearest = 0.0  # the largest value / ceiling over every index with a positive ceiling
    for handoff, measured in enumerate(series, start=1):
        for name, words in SERIES_NAMES:
            values, ceilings = getattr(measured, name), getattr(envelope, name)
            if len(values) != len(ceilings):
                problems.append(f"handoff {handoff}: {len(values)} {name} values, the envelope has {len(ceilings)}")
                continue
            pairs = list(zip(values, ceilings, strict=True))
            outside = [i for i, (value, ceiling) in enumerate(pairs) if not value <= ceiling]  # NaN: outside
            nearest = max([nearest] + [value / ceiling for value, ceiling in pairs if 0 < ceiling and value <= ceiling])
            if outside:
                first = outside[0]
                problems.append(f"handoff {handoff}: {words} outside the fixture envelope at {len(outside)} of "
                                f"{len(values)} indices, first at {_where(name, first, measured)} "
                                f"({_num(values[first], ceilings[first])} > {_num(ceilings[first])})")
    if not series and not missing:
        problems.append("no handoffs to hold to the fixture envelope")
    indices = sum(len(getattr(envelope, name)) for name, _ in SERIES_NAMES)
    judgement.check(
        "inside the fixture envelope", not problems,
        "; ".join(problems) if problems else
        f"every decoded row and handed-off position of {len(series)} handoffs inside the fixture envelope "
        f"({indices} ceilings from {envelope.handoffs} honest handoffs over {envelope.starts} producer starts, "
        f"{envelope.rule}, k {'/'.join(_num(k) for k in envelope.multipliers)}; nearest at {_num(nearest)} of its "
        "ceiling)", reasons=problems)
    return judgement.verdict(judgement.checks[0].detail)


def _where(name: str, index: int, measured: HandoffSeries) -> str:
    """An index as the verdict names it: a row or position by number, a tensor's position by layer,
    K or V, and position (its series holds each layer's K then V, each over every position)."""
    positions = len(measured.position_max_abs)
    if name != "tensor_position_max_abs" or positions == 0:
        return str(index)
    return f"layer {index // (2 * positions)} {'KV'[(index // positions) % 2]} position {index % positions}"
