"""pytest plugin: recipe options, the shared ``qualification`` fixture, and ordered recipe steps.

A recipe module (``recipes/native_text.py``) holds one test per progress label. All tests of a
module share one :class:`qualify.run.qualification.QualificationRun`; a step whose predecessor failed
fails too (never skips), so a CI gate cannot pass on a partial run. Under pytest-xdist the
module is the unit of distribution, so one run's handoffs stay ordered on one worker while
independent runs spread over workers.

Interrupts: pytest turns SIGINT into KeyboardInterrupt, and while a run is open SIGTERM becomes one
too (the previous handler comes back when the module's run ends). Either way the run's receipt is
sealed as incomplete ("interrupted by SIGINT during <step>"), its producer's process group killed,
and pytest exits 130 (SIGINT) or 143 (SIGTERM) instead of its own 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from qualify.core.arguments import deadline_seconds, path_argument

if TYPE_CHECKING:
    from qualify.run.qualification import QualificationRun

_OPEN_RUNS: list[QualificationRun] = []
"""The qualification runs whose module is running: an interrupt seals each one's receipt."""
_INTERRUPTED_BY: list[int] = []
"""The signal that interrupted an open run (pytest's exit status becomes 128 + it)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qualify", "trust-ladder qualification recipes")
    group.addoption("--recipe", action="append", default=[],
                    help="run only recipe modules for this recipe name (repeatable)")
    group.addoption("--identity", default=None, type=path_argument, help="frozen onboarding identity JSON for the run")
    group.addoption("--producer", default="reference",
                    help="producer engine: reference (embedded default) or vllm")
    group.addoption("--consumer", default="reference",
                    help="consumer engine: reference (embedded default) or vllm")
    group.addoption("--reference-once", action="store_true", default=False,
                    help="compute the cold local recompute once per run instead of per sample")
    group.addoption("--drift-graded", action="store_true", default=False,
                    help="rung 3: compute and grade deltas instead of refusing at the first digest mismatch")
    group.addoption("--fault", default=None, help="run against a named fault lane (self-test)")
    group.addoption("--receipts", default=None, type=path_argument, help="receipt archive directory")
    group.addoption("--deadline-s", default=None, type=deadline_seconds, metavar="SECONDS",
                    help="limit every producer phase to SECONDS (default: from the identity's basis receipt)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "recipe(name): a qualification recipe module")
    # One run's steps must stay ordered on one worker: distribute by module, never by test.
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadfile"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("--recipe"))
    if not wanted:
        return
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("recipe")
        if marker is None or marker.args[0] in wanted:
            kept.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="module")
def qualification(request: pytest.FixtureRequest) -> Iterator[QualificationRun]:
    """The module's qualification run, built from its ``RECIPE`` and the command-line options."""
    from qualify.run.qualification import QualificationRun, RunOptions, interrupts_raise

    config = request.config
    recipe = getattr(request.module, "RECIPE", None)
    if recipe is None:
        pytest.fail(f"{request.module.__name__} defines no RECIPE", pytrace=False)
    receipts = config.getoption("--receipts")
    options = RunOptions(
        recipe=recipe,
        identity=config.getoption("--identity"),
        producer=config.getoption("--producer"),
        consumer=config.getoption("--consumer"),
        reference_once=config.getoption("--reference-once"),
        drift_graded=config.getoption("--drift-graded"),
        fault=config.getoption("--fault"),
        receipts=receipts,
        command_line=["pytest", *config.invocation_params.args],
        deadline_s=config.getoption("--deadline-s"),
    )
    run = QualificationRun(options)
    _OPEN_RUNS.append(run)
    try:
        with interrupts_raise():  # SIGTERM stops the run as SIGINT does, for the module's run only
            yield run
    finally:
        _OPEN_RUNS.remove(run)
        run.close()


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """SIGINT or SIGTERM: every open run stops, its receipt sealed as incomplete (a step that was
    running has done so already) and its producer killed."""
    from qualify.run.qualification import interrupt_signal

    if not _OPEN_RUNS:
        return
    signum = interrupt_signal(excinfo.value)
    _INTERRUPTED_BY.append(signum)
    for run in list(_OPEN_RUNS):
        run.interrupted(signum)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """An interrupted run's session exits as the CLI does: 128 + the signal's number."""
    if _INTERRUPTED_BY:
        session.exitstatus = 128 + _INTERRUPTED_BY[0]


def run_recipe_step(run: QualificationRun, label: str) -> None:
    """Run one labelled step; a failed or blocked step fails the test with its one-line reason."""
    outcome = run.step(label)
    if not outcome.passed:
        pytest.fail(f"{label}: {outcome.message}", pytrace=False)
