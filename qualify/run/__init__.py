"""Running the harness: the run's contract from a sealed identity, a qualification's ordered steps,
calibration, the self-test, enrollment, onboarding's next steps and the process's interrupt
signals during a run.

May import every layer below it (:mod:`qualify.core` to :mod:`qualify.archive`); never
:mod:`qualify.interfaces` (import-linter, ``pyproject.toml``).
"""
