"""All judging of the trust ladder: pure functions from records and a rule to a verdict.

Where is each thing judged?

* a handoff sample, the summary over repetitions, the reproduction of the basis (rung 2 bounded
  drift, rung 3 bit-exact), a run that stopped early: :mod:`qualify.judge.handoffs`;
* a calibration and the bounds its rule derives: :mod:`qualify.judge.handoffs`
  (:func:`judge_calibration`).

No module outside this package builds a :class:`Verdict`; nothing here does I/O.
"""

from qualify.judge.handoffs import (
    DRAFT_REPRODUCTION_FIELDS,
    REFUSED_PREFIX,
    REPRODUCTION_FIELDS,
    ZERO_DRIFT_BOUND,
    CalibrationJudgement,
    Check,
    Verdict,
    judge_calibration,
    judge_draft_acceptance,
    judge_failed_step,
    judge_incomplete,
    judge_qualification,
    judge_refused,
    judge_reproduction,
    judge_rung2_sample,
    judge_rung3_sample,
    judge_sample,
    judge_summary,
    propose_bound,
)

__all__ = [
    "DRAFT_REPRODUCTION_FIELDS", "REFUSED_PREFIX", "REPRODUCTION_FIELDS", "ZERO_DRIFT_BOUND",
    "CalibrationJudgement", "Check", "Verdict", "judge_calibration", "judge_draft_acceptance",
    "judge_failed_step", "judge_incomplete", "judge_qualification", "judge_refused", "judge_reproduction",
    "judge_rung2_sample", "judge_rung3_sample", "judge_sample", "judge_summary", "propose_bound",
]
