"""Rung 1, parity within noise: judges two lanes' paired throughput cells (seed 000 §32.5).

A cell is one lane's repeated throughput measurements of one workload; two cells are paired when
they measured the same workload, in the same unit, the same number of times, interleaved
(A, B, A, B, ...; the caller's duty: the judge checks what the numbers can show).

The rule, decided on the rates themselves (never on rounded percentages):

* each cell: mean rate, sample standard deviation (n - 1), CV = sd / mean;
* gap = |mean_a - mean_b|, spread = sd_a + sd_b (the cells' one-sd bands);
* **parity** when gap <= spread: the bands overlap, so the split is inside the noise and no lane
  is ahead; otherwise the lane with the higher mean is **ahead** (``a-ahead`` or ``b-ahead``).

In percent of B the split is (mean_a - mean_b) / mean_b and the bound is spread / mean_b, which is
CV_a * mean_a / mean_b + CV_b, about CV_a + CV_b. The sum of the CVs, not the larger one: §32.5's
paired P1.3 cells split by +0.1444 % with CVs 0.130 % and 0.037 % are parity there ("inside the
noise of cells whose CVs bracket it"), and max(CV) would have called that split ahead. Deciding
on |mean_a - mean_b| and sd_a + sd_b (both symmetric in IEEE arithmetic) makes swapping A and B
mirror the outcome exactly.

The words are built only here. They never say "faster": a lane outside the spread is "ahead",
stated with its lead and both cells' CVs. Bad cells (one measurement, zero spread, a value that is
not a finite positive number, a bool, unequal pairing) get outcome ``refused`` with every problem
named, and no figures: never a verdict from bad cells. Pure: no I/O, no numpy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from qualify.judge.handoffs import REFUSED_PREFIX

ParityOutcome = Literal["parity", "a-ahead", "b-ahead", "refused"]
MINIMUM_RUNS = 2  # a sample sd needs two measurements


@dataclass(frozen=True)
class ThroughputCell:
    """One lane's repeated throughput measurements (``rates``, in ``unit``, each > 0) of one
    ``workload``; a cell's spread is what a split between two lanes is judged against."""

    lane: str
    workload: str
    unit: str
    rates: Sequence[float]


@dataclass(frozen=True)
class CellSummary:
    """A judged cell: its lane, number of runs, mean rate, sample sd and CV (sd / mean, a fraction)."""

    lane: str
    runs: int
    mean: float
    sd: float
    cv: float


@dataclass(frozen=True)
class ParityJudgement:
    """The parity judgement of paired cells A and B.

    ``outcome``: parity, a-ahead, b-ahead, or refused (bad cells; ``problems`` names each, and the
    figures are None). ``split``: (mean_a - mean_b) / mean_b; ``bound``: (sd_a + sd_b) / mean_b,
    both fractions of B. ``gap`` and ``spread`` (in the cells' unit) are what was decided on.
    ``words``: the one line any output prints for this comparison."""

    outcome: ParityOutcome
    words: str
    workload: str | None = None
    unit: str | None = None
    a: CellSummary | None = None
    b: CellSummary | None = None
    split: float | None = None
    bound: float | None = None
    gap: float | None = None
    spread: float | None = None
    problems: tuple[str, ...] = ()

    @property
    def refused(self) -> bool:
        return self.outcome == "refused"


def _text(value: float, against: float | None = None, digits: int = 6) -> str:
    """``value`` to ``digits`` significant digits, or in full where that would print it equal to
    the different number it is compared ``against`` (a split one ULP over its bound stays visible)."""
    text = f"{value:.{digits}g}"
    if against is not None and value != against and text == f"{against:.{digits}g}":
        return repr(value)
    return text


def _percent(fraction: float, against: float | None = None) -> str:
    return _text(100.0 * fraction, None if against is None else 100.0 * against, digits=4)


def _cell_problems(cell: object, name: str) -> tuple[list[str], list[float]]:
    """Named problems of one cell, and its rates as floats (meaningful only without problems)."""
    if not isinstance(cell, ThroughputCell):
        return [f"cell {name} is a {type(cell).__name__}, expected a ThroughputCell"], []
    problems: list[str] = []
    label = f"cell {name} ({cell.lane!r})"
    for field_name in ("lane", "workload", "unit"):
        value = getattr(cell, field_name)
        if not isinstance(value, str) or not value.strip():
            problems.append(f"{label} {field_name} is {value!r}, expected a non-empty string")
    rates = cell.rates
    if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence):
        return problems + [f"{label} rates is a {type(rates).__name__}, expected a sequence of numbers"], []
    values: list[float] = []
    for index, rate in enumerate(rates, start=1):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            problems.append(f"{label} measurement {index} is {rate!r}, expected a number (not a bool)")
        elif not math.isfinite(rate):
            problems.append(f"{label} measurement {index} is {rate!r}, expected a finite number")
        elif rate <= 0:
            problems.append(f"{label} measurement {index} is {rate!r}, expected a rate above 0")
        else:
            values.append(float(rate))
    if len(rates) < MINIMUM_RUNS:
        problems.append(f"{label} has {len(rates)} measurement(s), expected at least {MINIMUM_RUNS} for a spread")
    elif len(values) == len(rates) and len(set(values)) == 1:
        problems.append(f"{label} has no spread: all {len(values)} measurements are {values[0]!r}, "
                        "expected measured noise to bound a split")
    return problems, values


def _summary(lane: str, values: list[float]) -> CellSummary:
    # statistics.mean and stdev sum exactly (fractions) and round once: the same rates give the
    # same figures on every machine, and dyadic test cells land exactly on a bound.
    mean = statistics.mean(values)
    sd = statistics.stdev(values)
    return CellSummary(lane, len(values), mean, sd, sd / mean)


def _refused(problems: list[str]) -> ParityJudgement:
    return ParityJudgement("refused", f"{REFUSED_PREFIX}no parity judgement from these cells: {'; '.join(problems)}",
                           problems=tuple(problems))


def judge_parity(cell_a: ThroughputCell, cell_b: ThroughputCell) -> ParityJudgement:
    """Parity, a-ahead or b-ahead for paired cells A and B by the module's rule; refused, with
    every problem named, when either cell or their pairing is bad."""
    problems_a, values_a = _cell_problems(cell_a, "A")
    problems_b, values_b = _cell_problems(cell_b, "B")
    problems = problems_a + problems_b
    if isinstance(cell_a, ThroughputCell) and isinstance(cell_b, ThroughputCell):
        if cell_a.lane == cell_b.lane:
            problems.append(f"both cells are lane {cell_a.lane!r}, expected two lanes")
        for field_name in ("workload", "unit"):
            value_a, value_b = getattr(cell_a, field_name), getattr(cell_b, field_name)
            if value_a != value_b:
                problems.append(f"cells are not paired: {field_name} {value_a!r} (A) and {value_b!r} (B) differ")
        sizes = [len(cell.rates) for cell in (cell_a, cell_b) if isinstance(cell.rates, Sequence)]
        if len(sizes) == 2 and sizes[0] != sizes[1]:
            problems.append(f"cells are not paired: A has {sizes[0]} and B has {sizes[1]} measurements, "
                            "expected one B run beside each A run")
    if problems:
        return _refused(problems)

    a, b = _summary(cell_a.lane, values_a), _summary(cell_b.lane, values_b)
    gap, spread = abs(a.mean - b.mean), a.sd + b.sd
    split, bound = (a.mean - b.mean) / b.mean, spread / b.mean
    if not all(math.isfinite(figure) for figure in (spread, split, bound)):
        return _refused([f"the cells' figures overflow (spread {spread!r}, split {split!r}, bound {bound!r})"])
    unit, workload = cell_a.unit, cell_a.workload
    runs = f"{a.runs} interleaved runs each of {workload}"
    sums = f"{_text(gap, spread)} {'<=' if gap <= spread else '>'} summed sd {_text(spread, gap)} {unit}"
    if gap <= spread:
        outcome: ParityOutcome = "parity"
        signed_split = ("+" if split >= 0 else "") + _percent(split, math.copysign(bound, split))
        words = (f"parity: {a.lane} {_text(a.mean)} {unit} (CV {_percent(a.cv)} %) and {b.lane} {_text(b.mean)} "
                 f"{unit} (CV {_percent(b.cv)} %), {runs}; split {signed_split} % "
                 f"of {b.lane} is inside the cells' spread ({_percent(bound, abs(split))} %; gap {sums}); "
                 "neither lane is ahead")
    else:
        outcome = "a-ahead" if a.mean > b.mean else "b-ahead"
        leader, trailer = (a, b) if outcome == "a-ahead" else (b, a)
        lead, lead_bound = (leader.mean - trailer.mean) / trailer.mean, spread / trailer.mean
        words = (f"{leader.lane} ahead of {trailer.lane} by {_percent(lead, lead_bound)} % (outside both cells' CV: "
                 f"{leader.lane} CV {_percent(leader.cv)} %, {trailer.lane} CV {_percent(trailer.cv)} %, spread "
                 f"{_percent(lead_bound, lead)} % of {trailer.lane}; gap {sums}): {leader.lane} "
                 f"{_text(leader.mean)} {unit} vs {trailer.lane} {_text(trailer.mean)} {unit}, {runs}")
    return ParityJudgement(outcome, words, workload, unit, a, b, split, bound, gap, spread)
