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

STATED_RULES: Mapping[str, str] = MappingProxyType({BOUND_RULE: BOUND_RULE_STATEMENT,
                                                     FLOOR_RULE: FLOOR_RULE_STATEMENT})
"""Rule name -> its statement: the only rules an identity may name."""
