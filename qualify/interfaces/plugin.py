"""pytest plugin: recipe options, the shared ``qualification`` fixture, and ordered recipe steps.

Installed with the package (the ``pytest11`` entry point), so ``python -m pytest --pyargs
qualify.recipes`` works from any directory, checkout or not (the recipes ship in the wheel as
:mod:`qualify.recipes`); a copy of them in a directory named ``recipes`` runs too (``pytest
recipes/``). A recipe module (``recipes/native_text.py``, ``qualify.recipes`` once installed) holds one test per progress
label. All tests of a module share one :class:`qualify.run.qualification.QualificationRun`.
A step that fails is the run's one failure, naming its cause; the steps it blocks are skipped
with "blocked by <step>: <cause>", so one bad handoff reads as one failure, and the session still
fails on it (a CI gate never passes on a partial run). A step whose predecessor never ran (a
``-k`` or ``--deselect`` that dropped it) fails. Under pytest-xdist the module is the unit of
distribution, so one run's handoffs stay ordered on one worker while independent runs spread
over workers.

Options: the plugin loads in every pytest session of the environment, so each of its options
carries the prefix ``--qualify-`` (``--qualify-model``, ``--qualify-receipts``, ...), in one group
of ``pytest --help``: a project whose own conftest adds ``--model`` or ``--receipts`` meets no
conflict. They are checked once, when pytest configures: a bad value is pytest's usage error
(exit 4), one line naming the option, before anything is collected or run.

JUnit XML (``--junitxml``): each test carries its step's numbers as properties
(``sample_<n>_max_abs``, ``sample_<n>_mean_abs`` for the sample recorded at that step), and the
test of the step that sealed the run's receipt (the verdict, or the step that failed) carries
the run's: verdict status, lane, recipe, rung, identity digest, worst drift, scope and receipt,
and what the verdict covers (``qualify.scope``, ``qualify.fixture``, ``qualify.controls``: the
summary's scope line and its two halves, word for word), read back from the sealed receipt. They
go into the test item's ``user_properties`` (what pytest writes as ``<properties>`` in every JUnit
family), not through the ``record_property`` fixture, which warns under pytest's default family
``xunit2`` once per test.

Interrupts: pytest turns SIGINT into KeyboardInterrupt, and while a run is open SIGTERM and SIGHUP
become one too (``qualify.run.signals.INTERRUPT_SIGNALS``; the previous handlers come back
when the module's run ends). Either way the run's receipt is sealed as incomplete ("interrupted by
SIGINT during <step>"), its producer's process group killed, and pytest exits 128 + the signal's
number (130 for SIGINT, 143 for SIGTERM) instead of its own 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from qualify.core.arguments import (
    deadline_seconds,
    path_argument,
    printable_line,
    require_regular_file,
    require_writable_directory,
    shown,
)
from qualify.core.errors import Refused, one_line

if TYPE_CHECKING:
    from qualify.run.qualification import QualificationRun, StepOutcome

RECIPES_DIRECTORY = "recipes"
"""The directory whose modules are recipes: named on the command line, every module in it is
collected, whatever ``python_files`` says (outside the checkout nothing else says so)."""



@functools.cache
def shipped_recipes() -> Path | None:
    """The :mod:`qualify.recipes` package's directory, what ``--pyargs qualify.recipes`` names: the
    checkout's top-level ``recipes/`` in an editable install, the package's own in a wheel. Found by
    its spec, never imported (the recipes import this plugin, not the other way round)."""
    spec = importlib.util.find_spec("qualify.recipes")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]).resolve() if locations else None

OPTION_PREFIX = "--qualify-"
"""Every option of the plugin starts with it (the plugin loads in every pytest session)."""

_OPEN_RUNS: list[QualificationRun] = []
"""The qualification runs whose module is running: an interrupt seals each one's receipt."""
_INTERRUPTED_BY: list[int] = []
"""The signal that interrupted an open run (pytest's exit status becomes 128 + it)."""


# -- options ------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    # Values are plain strings here and checked in pytest_configure: an argparse ``type`` error
    # would reach the operator as pytest's usage block, not one line.
    group = parser.getgroup("qualify", "trust-ladder qualification recipes (python -m pytest --pyargs qualify.recipes)")
    group.addoption(f"{OPTION_PREFIX}recipe", action="append", default=[], metavar="NAME",
                    help="run only recipe modules for this recipe name (repeatable)")
    group.addoption(f"{OPTION_PREFIX}identity", default=None, metavar="PATH",
                    help="frozen onboarding identity JSON for the run")
    group.addoption(f"{OPTION_PREFIX}producer", default="reference",
                    help="producer engine: reference (embedded default) or vllm")
    group.addoption(f"{OPTION_PREFIX}consumer", default="reference",
                    help="consumer engine: reference (embedded default) or vllm")
    group.addoption(f"{OPTION_PREFIX}reference-once", action="store_true", default=False,
                    help="compute the cold local recompute once per run instead of per sample")
    group.addoption(f"{OPTION_PREFIX}drift-graded", action="store_true", default=False,
                    help="rung 3: compute and grade deltas instead of refusing at the first digest mismatch")
    group.addoption(f"{OPTION_PREFIX}fault", default=None, metavar="NAME", help="run against a named fault lane (self-test)")
    group.addoption(f"{OPTION_PREFIX}receipts", default=None, metavar="DIR", help="receipt archive directory")
    group.addoption(f"{OPTION_PREFIX}model", default=None, metavar="NAME|PATH",
                    help="qualify this model (a published name, a Hugging Face directory or a GGUF file) "
                    "instead of the shipped one")
    group.addoption(f"{OPTION_PREFIX}deadline-s", default=None, metavar="SECONDS",
                    help="limit every producer phase to SECONDS (default: from the identity's basis receipt)")
    group.addoption(f"{OPTION_PREFIX}service-conditions", default=None, metavar="aba|recovery",
                    help="also judge determinism under service conditions (see qualify --recipe --help)")


@dataclass(frozen=True)
class RecipeOptions:
    """The plugin's command-line options, checked once when pytest configures."""

    recipes: frozenset[str]
    identity: Path | None
    producer: str
    consumer: str
    reference_once: bool
    drift_graded: bool
    fault: str | None
    receipts: Path | None
    deadline_s: float | None
    model: str | None = None
    service_conditions: str | None = None


RECIPE_OPTIONS = pytest.StashKey[RecipeOptions]()
"""Where :func:`pytest_configure` keeps the checked options (``config.stash[RECIPE_OPTIONS]``)."""


def _usage_error(option: str, problem: str) -> pytest.UsageError:
    """pytest's usage error (exit 4), printed as one line naming ``option``."""
    return pytest.UsageError(printable_line(f"argument {option}: {problem}"))


def _converted(config: pytest.Config, option: str, convert: Callable[[str], Any]) -> Any:
    """``option``'s value through ``convert`` (None when not given); a value it refuses is a usage error."""
    value = config.getoption(option)
    if value is None:
        return None
    try:
        return convert(value)
    except argparse.ArgumentTypeError as exc:
        raise _usage_error(option, str(exc)) from None


def _recipe_names(names: Iterable[str]) -> frozenset[str]:
    """``--qualify-recipe`` values, each a recipe this harness knows (a typo would deselect everything)."""
    names = list(names)
    if not names:  # the plugin loads in every pytest session: import nothing it does not need
        return frozenset()
    from qualify.contract.lanes import Recipe

    known = sorted(recipe.value for recipe in Recipe)
    for name in names:
        if name not in known:
            raise _usage_error(f"{OPTION_PREFIX}recipe", f"found {shown(name)}, expected one of {', '.join(known)}")
    return frozenset(names)


def _checked_paths(identity: Path | None, receipts: Path | None, fault: str | None) -> None:
    """What ``qualify --recipe`` refuses before any step, refused here as usage errors: an
    identity that is not a regular file, an archive no receipt can be written to, an unknown fault."""
    try:
        if identity is not None:
            require_regular_file(f"{OPTION_PREFIX}identity", identity)
        if receipts is not None:
            require_writable_directory(f"{OPTION_PREFIX}receipts", receipts)
    except Refused as refusal:  # already one line naming the option
        raise pytest.UsageError(printable_line(str(refusal))) from None
    if fault is not None:
        from qualify.engines.faults import fault_named

        try:
            fault_named(fault)
        except Refused as refusal:
            raise _usage_error(f"{OPTION_PREFIX}fault", one_line(str(refusal))) from None


def recipe_options(config: pytest.Config) -> RecipeOptions:
    """The plugin's options from ``config``, checked; raises :class:`pytest.UsageError` (one line)."""
    identity = _converted(config, f"{OPTION_PREFIX}identity", path_argument)
    receipts = _converted(config, f"{OPTION_PREFIX}receipts", path_argument)
    fault = config.getoption(f"{OPTION_PREFIX}fault")
    _checked_paths(identity, receipts, fault)
    return RecipeOptions(
        recipes=_recipe_names(config.getoption(f"{OPTION_PREFIX}recipe")),
        identity=identity,
        producer=config.getoption(f"{OPTION_PREFIX}producer"),
        consumer=config.getoption(f"{OPTION_PREFIX}consumer"),
        reference_once=config.getoption(f"{OPTION_PREFIX}reference-once"),
        drift_graded=config.getoption(f"{OPTION_PREFIX}drift-graded"),
        fault=fault,
        receipts=receipts,
        deadline_s=_converted(config, f"{OPTION_PREFIX}deadline-s", deadline_seconds),
        model=config.getoption(f"{OPTION_PREFIX}model"),
        service_conditions=_service_conditions(config),
    )


def _service_conditions(config: pytest.Config) -> str | None:
    """``--qualify-service-conditions``: one of the conditions a run can be judged under, or None."""
    from qualify.judge.scope import SERVICE_CONDITIONS

    option = f"{OPTION_PREFIX}service-conditions"
    value: str | None = config.getoption(option)
    if value is not None and value not in SERVICE_CONDITIONS:
        raise _usage_error(option, f"found {value!r}, expected one of {', '.join(SERVICE_CONDITIONS)}")
    return value


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Check the options (a bad one stops pytest with one line, exit 4), declare the ``recipe``
    marker, and, where the command line names recipes, keep each module on one xdist worker
    (:func:`recipe_dist_mode`)."""
    config.stash[RECIPE_OPTIONS] = recipe_options(config)
    config.addinivalue_line("markers", "recipe(name): a qualification recipe module")
    mode = getattr(config.option, "dist", "no")
    if recipe_dist_mode(mode) != mode and names_recipes(config):
        config.option.dist = recipe_dist_mode(mode)


SPLITTING_DIST_MODES = frozenset({"load", "loadgroup", "worksteal"})
"""xdist modes that hand a module's tests to different workers (``loadgroup`` does for tests
without an ``xdist_group`` mark, as recipe steps are)."""


def names_recipes(config: pytest.Config) -> bool:
    """Whether the command line names a recipe directory or a module in one (``--pyargs`` names
    resolved by their specs, never imported): only such a run has its dist mode changed, so a
    session of other tests with the plugin installed keeps the mode its user chose."""
    for argument in config.args:
        target = argument.split("::", 1)[0]
        given = config.invocation_params.dir / target
        path = _module_path(target) if config.option.pyargs and not given.exists() else given
        if path is not None and (is_recipe_directory(path) or (path.is_file() and is_recipe_directory(path.parent))):
            return True
    return False


def _module_path(name: str) -> Path | None:
    """Where the module or package ``name`` lives, by its spec; None where it cannot be found."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin else None


def recipe_dist_mode(mode: str) -> str:
    """The xdist mode recipes run under: one run's steps must stay ordered on one worker, so a
    mode that would split a module becomes ``loadfile`` (one worker per recipe module); ``no``,
    ``loadfile``, ``loadscope`` and ``each`` (every worker runs every recipe) are kept."""
    return "loadfile" if mode in SPLITTING_DIST_MODES else mode


# -- collection ---------------------------------------------------------------------------------


class RecipeDirectory(pytest.Directory):
    """A recipes directory named on the command line: each module in it is a test module."""

    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        for path in sorted(self.path.glob("*.py")):
            if path.name.startswith("_") or path.name == "conftest.py":
                continue
            if self.ihook.pytest_ignore_collect(collection_path=path, config=self.config):
                continue  # --ignore, collect_ignore
            module: pytest.Module = self.ihook.pytest_pycollect_makemodule(module_path=path, parent=self)
            yield module


def is_recipe_directory(path: Path) -> bool:
    """The shipped :mod:`qualify.recipes` package, or a directory called ``recipes`` that is no
    package (a copy of the recipes): their modules are recipes, whatever their names."""
    if path.resolve() == shipped_recipes():
        return True
    return path.name == RECIPES_DIRECTORY and not (path / "__init__.py").exists()


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """``pytest --pyargs qualify.recipes`` (or ``pytest recipes/`` on a copy) collects the recipe
    modules there even where no ``python_files`` pattern names them (outside the checkout none
    does). Only such a directory named on the command line: elsewhere collection is pytest's own."""
    if not parent.session.isinitpath(path) or not is_recipe_directory(path):
        return None
    return RecipeDirectory.from_parent(parent, path=path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--qualify-recipe NAME``: deselect the recipe modules of other recipes (other tests stay)."""
    wanted = config.stash[RECIPE_OPTIONS].recipes
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


# -- the run ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qualification(request: pytest.FixtureRequest) -> Iterator[QualificationRun]:
    """The module's qualification run, built from its ``RECIPE`` and the command-line options."""
    from qualify.run.qualification import QualificationRun, RunOptions
    from qualify.run.signals import interrupts_raise

    config = request.config
    recipe = getattr(request.module, "RECIPE", None)
    if recipe is None:
        pytest.fail(f"{request.module.__name__} defines no RECIPE", pytrace=False)
    chosen = config.stash[RECIPE_OPTIONS]
    options = RunOptions(
        recipe=recipe,
        identity=chosen.identity,
        producer=chosen.producer,
        consumer=chosen.consumer,
        reference_once=chosen.reference_once,
        drift_graded=chosen.drift_graded,
        fault=chosen.fault,
        receipts=chosen.receipts,
        command_line=["pytest", *config.invocation_params.args],
        deadline_s=chosen.deadline_s,
        model=chosen.model,
        service_conditions=chosen.service_conditions,
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
    from qualify.run.signals import interrupt_signal

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


def run_recipe_step(run: QualificationRun, label: str, item: pytest.Item) -> None:
    """Run the step ``label`` of ``run`` as the test ``item``: skipped when an earlier step failed
    (its cause is the reason), failed with the step's one-line cause when it fails. The numbers the
    step recorded, and the run's once its receipt is sealed, become the item's JUnit properties."""
    blocker = _failed_before(run, label)
    if blocker is not None:
        pytest.skip(f"blocked by {blocker.label}: {blocker.message}")
    sealed_before = _sealed_receipt(run) is not None
    recorded_before = len(run.records)
    outcome = run.step(label)
    for record in run.records[recorded_before:]:
        item.user_properties.extend(sample_properties(record))
    receipt = _sealed_receipt(run)
    if receipt is not None and not sealed_before:
        try:
            properties = receipt_properties(receipt)
        except Refused as exc:
            pytest.fail(f"{label}: {outcome.message}; its receipt cannot be read back: {exc}", pytrace=False)
        item.user_properties.extend(properties)
    if not outcome.passed:
        where = f"; receipt: {receipt}" if receipt is not None else ""
        pytest.fail(f"{label}: {outcome.message}{where}", pytrace=False)


def _failed_before(run: QualificationRun, label: str) -> StepOutcome | None:
    """The first step before ``label`` that ran and failed (it blocks ``label``), if any."""
    from qualify.run.qualification import STEP_LABELS

    earlier = STEP_LABELS[:STEP_LABELS.index(label)] if label in STEP_LABELS else ()
    for previous in earlier:
        outcome = run.outcomes.get(previous)
        if outcome is not None and not outcome.passed:
            return outcome
    return None


def _sealed_receipt(run: QualificationRun) -> Path | None:
    """The run's receipt once it is sealed (a verdict, a refusal, or a failed step sealed it)."""
    if run.receipt is None or not run.receipt.finalized:
        return None
    return run.receipt_path


# -- JUnit properties ---------------------------------------------------------------------------


def property_value(value: object) -> str:
    """A receipt value as JUnit XML text: numbers as Python writes them, null as ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def sample_properties(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """One sample's drift as it was recorded: ``sample_<n>_max_abs`` and ``sample_<n>_mean_abs``."""
    repetition = record.get("repetition")
    return [(f"sample_{repetition}_{name}", property_value(record.get(name))) for name in ("max_abs", "mean_abs")]


def _worst(samples: list[Mapping[str, Any]], name: str) -> float | None:
    """The largest ``name`` over ``samples`` as the judge bounds it, or None when any sample has
    no finite value (a failed handoff) or there are none."""
    values = [sample.get(name) for sample in samples]
    finite = [float(v) for v in values
              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return max(finite) if finite and len(finite) == len(values) else None


SCOPE_PROPERTIES = (("qualify.scope", "line"), ("qualify.fixture", "fixture_words"),
                    ("qualify.controls", "controls_words"))
"""Each JUnit property of what the verdict covers, and the field of the summary's ``scope`` it
quotes (``null`` when the verdict has no scope): quoted, never re-worded."""


def scope_properties(verdict_scope: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``qualify.scope`` (the scope line), ``qualify.fixture`` and ``qualify.controls`` (its two
    halves) from a summary's ``scope``; each ``null`` when there is none."""
    return [(name, property_value(None if verdict_scope is None else verdict_scope[field]))
            for name, field in SCOPE_PROPERTIES]


def receipt_properties(receipt: Path) -> list[tuple[str, str]]:
    """The run's conclusion, read back from its sealed receipt: ``verdict`` (its status: passed,
    failed, refused or incomplete), ``headline``, ``recipe``, ``lane``, ``rung``,
    ``identity_sha256``, the worst ``max_abs`` and ``mean_abs`` over the samples, ``scope`` (the
    signed statement's sentence), ``receipt`` (its path) and :func:`scope_properties`. The
    summary is checked against its version's schema first (a refusal is one line)."""
    from qualify.archive.layout import HOST
    from qualify.archive.predicate import host_summary, scope
    from qualify.archive.reader import read_receipt_json, read_summary, sample_records

    summary = read_summary(receipt)
    host = read_receipt_json(receipt, HOST)
    samples = list(sample_records(receipt).values())
    return [
        ("verdict", property_value(summary["status"])),
        ("headline", summary["verdict"]),
        ("recipe", property_value(summary["recipe"])),
        ("lane", property_value(summary["lane"])),
        ("rung", property_value(summary["rung"])),
        ("identity_sha256", property_value(summary["identity_sha256"])),
        ("max_abs", property_value(_worst(samples, "max_abs"))),
        ("mean_abs", property_value(_worst(samples, "mean_abs"))),
        ("scope", scope(summary, host_summary(host.get("consumer")))),
        ("receipt", str(receipt)),
        *scope_properties(summary.get("scope")),
    ]
