"""All judging of the trust ladder: pure functions from records and a rule to a verdict.

Where is each thing judged?

* a handoff sample, the summary over repetitions, the reproduction of the anchor (rung 2 bounded
  drift, rung 3 bit-exact), a run that stopped early: :mod:`qualify.judge.handoffs`;
* a calibration, and the bounds and floor its stated rules derive: :mod:`qualify.judge.calibration`;
* a producer declared non-deterministic, held to the fixture envelope its honest handoffs state:
  :mod:`qualify.judge.envelope`;
* a served pair over HTTP, and its top-k rule: :mod:`qualify.judge.served`; a served pair's
  calibration, its bounds derived by the lanes' policy: :mod:`qualify.judge.served_calibration`;
* the E1/E2 controls against their yardstick gates: :mod:`qualify.judge.controls`;
* what a verdict covers (its scope line): :mod:`qualify.judge.scope`;
* rung 1, parity of paired throughput cells: :mod:`qualify.judge.parity`.

No module outside this package builds a :class:`Verdict`; nothing here does I/O.
"""

from qualify.judge.calibration import (
    ZERO_DRIFT_BOUND,
    CalibrationJudgement,
    judge_calibration,
)
from qualify.judge.handoffs import (
    DRAFT_REPRODUCTION_FIELDS,
    REFUSED_PREFIX,
    REPRODUCTION_FIELDS,
    Check,
    Verdict,
    judge_draft_acceptance,
    judge_failed_step,
    judge_incomplete,
    judge_link_floor,
    judge_qualification,
    judge_refused,
    judge_reproduction,
    judge_rung2_sample,
    judge_rung3_sample,
    judge_sample,
    judge_summary,
)
from qualify.judge.parity import (
    CellSummary,
    ParityJudgement,
    ParityOutcome,
    ThroughputCell,
    judge_parity,
)

__all__ = [
    "DRAFT_REPRODUCTION_FIELDS", "REFUSED_PREFIX", "REPRODUCTION_FIELDS", "ZERO_DRIFT_BOUND",
    "CalibrationJudgement", "Check", "Verdict", "judge_calibration", "judge_draft_acceptance",
    "judge_failed_step", "judge_incomplete", "judge_link_floor", "judge_qualification", "judge_refused", "judge_reproduction",
    "judge_rung2_sample", "judge_rung3_sample", "judge_sample", "judge_summary",
    "CellSummary", "ParityJudgement", "ParityOutcome", "ThroughputCell", "judge_parity",
]
from qualify.judge.controls import (
    CellJudgement,
    ControlsJudgement,
    DocumentJudgement,
    LengthEffectRule,
    ProfileWindow,
    cell_gate,
    exceeds_gate,
    judge_controls,
)

__all__ += ["CellJudgement", "ControlsJudgement", "DocumentJudgement", "LengthEffectRule", "ProfileWindow",
            "cell_gate", "exceeds_gate", "judge_controls"]
