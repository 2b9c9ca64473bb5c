#!/usr/bin/env python3
"""mutmut's type-check pre-filter: strict mypy over mutmut's rewritten tree, reporting only the
errors that lie inside one mutant's own function.

CI runs strict mypy on the package (tools/test.sh), so a mutant that mypy rejects could never land:
it is detected without running a test. mutmut (``type_check_command`` in pyproject.toml) runs this
in its ``mutants/`` directory and reads mypy's JSON lines from its output; the word ``mypy`` among
its arguments is how mutmut knows that format.

mutmut's rewrite itself confuses mypy in places (its trampolines' ``type: ignore`` comments, and
a few type narrowings across its decorated copies), and mutmut refuses a run with any error outside
a mutant. Those errors are not a mutant's doing: the unmutated tree is mypy-clean, which CI checks.
So an error counts only inside a mutant's function (``…__mutmut_<N>``), and only where mutmut's
unmutated copy of that same function (``…__mutmut_orig``) has no error: a function whose copy
already errs gets no mutant caught by type check, and its mutants run the tests instead.

mutmut maps each error to its mutant by parsing the mutated files with libcst, which took over 7
minutes on these files; ``mutmut`` as the first argument runs mutmut with that step done by the
standard library's ``ast`` instead (seconds), the same mapping. tools/mutation.py runs it so, with
the options that let it run mutmut in phases (each overrides pyproject.toml for this run only):
``--mutate FILE`` mutates only those files (a ``--groups`` run), ``--tests TEST`` runs only those
tests (the golden-file tests, for message-text mutants), ``--no-type-check`` skips mypy (no
message-text mutant changes a type), and the command ``generate`` writes the mutants and stops.
It also changes how mutmut runs a mutant's tests, never which: from one session collected before
the first mutant, module by module, mypy beside the stats run (docs/mutation.md, "What each
mutant's run costs").

    python tools/mutation_typecheck.py mutmut run --max-children 2   # mutmut, with the fast mapping
    python tools/mutation_typecheck.py mutmut --mutate a.py generate --max-children 1  # only a.py's mutants
    cd mutants && python tools/mutation_typecheck.py mypy           # what mutmut runs to type-check
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

MUTMUT_FUNCTION = re.compile(r"(?P<function>.+)__mutmut_(?P<which>\d+|orig)")


def mutmut_functions(source: str) -> list[tuple[int, int, str, str]]:
    """(first line, last line, function, mutant number or "orig") of each mutmut copy, in a module
    or a class body (where mutmut puts them)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            if named := MUTMUT_FUNCTION.fullmatch(node.name):
                found.append((node.lineno, node.end_lineno, named["function"], named["which"]))
    return found


def mutant_errors(errors: list[dict[str, object]], sources: dict[str, str]) -> list[dict[str, object]]:
    """The errors inside a mutant whose function's unmutated copy type-checks clean."""
    kept = []
    by_file: dict[str, list[dict[str, object]]] = defaultdict(list)
    for error in errors:
        by_file[str(error["file"])].append(error)
    for file, file_errors in by_file.items():
        copies = mutmut_functions(sources[file])
        placed = []
        for error in file_errors:
            line = error["line"]
            copy = next((c for c in copies if isinstance(line, int) and c[0] <= line <= c[1]), None)
            placed.append((error, copy))
        erring_originals = {copy[2] for _, copy in placed if copy is not None and copy[3] == "orig"}
        kept += [error for error, copy in placed if copy is not None and copy[3] != "orig" and copy[2] not in erring_originals]
    return kept


class TypeCheckInBackground(Mapping[str, Any]):
    """mutmut's ``filter_mutants_with_type_checker`` (mutmut 3.8): mutant name -> its first type error,
    from its ``type_check_command`` run in ``mutants/``, each error placed in its function by ``ast``.

    mypy starts when mutmut asks (after the mutants are written) and runs on one core beside
    mutmut's stats run, which runs the selected tests on the other; the first mutant's look-up waits
    for it. mutmut reads nothing of it before then (a fresh run has no stats to invalidate)."""

    def __init__(self) -> None:
        from mutmut.configuration import config

        self._mypy = subprocess.Popen(config().type_check_command, cwd="mutants", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      encoding="utf-8")
        self._caught: dict[str, Any] | None = None

    def _result(self) -> dict[str, Any]:
        if self._caught is None:
            stdout, stderr = self._mypy.communicate()
            self._caught = self._place(stdout, stderr)
        return self._caught

    def _place(self, stdout: str, stderr: str) -> dict[str, Any]:
        from mutmut.mutation.file_mutation import FailedTypeCheckMutant, MutatedMethodLocation
        from mutmut.type_checking import parse_mypy_report
        from mutmut.utils.format_utils import get_mutant_name

        try:  # as mutmut's run_type_checker reads mypy: one JSON object a line, a lone newline for none
            report = [json.loads(line) for line in stdout.splitlines() if line.strip()]
        except json.JSONDecodeError:
            raise RuntimeError(f"type check command did not return JSON. Got: {stdout} (stderr: {stderr})") from None
        caught: dict[str, Any] = {}
        with contextlib.chdir("mutants"):  # mutmut names mutants by their path relative to mutants/
            by_file: dict[Path, list[Any]] = defaultdict(list)
            for error in parse_mypy_report(report):
                by_file[error.file_path].append(error)
            for path, file_errors in by_file.items():
                copies = mutmut_functions(path.read_text(encoding="utf-8"))
                for error in file_errors:
                    first, last, function, which = next(c for c in copies if c[0] <= error.line_number <= c[1])
                    method = f"{function}__mutmut_{which}"
                    name = get_mutant_name(path.relative_to(Path(".").absolute()), method)
                    location = MutatedMethodLocation(file=path, function_name=method, line_number_start=first,
                                                     line_number_end=last)
                    caught.setdefault(name, FailedTypeCheckMutant(method_location=location, name=name, error=error))
        return caught

    def __getitem__(self, name: str) -> Any:
        return self._result()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._result())

    def __len__(self) -> int:
        return len(self._result())


def run_mutmut(arguments: list[str]) -> int:
    """``mutmut <command>`` in this process, its type-check mapping done by :func:`caught_by_type_check`,
    with this run's overrides of pyproject.toml's ``[tool.mutmut]`` (the module docstring lists them)."""
    parser = argparse.ArgumentParser(prog="mutation_typecheck.py mutmut")
    parser.add_argument("--mutate", action="append", default=[], metavar="FILE", help="mutate only these files")
    parser.add_argument("--tests", action="append", default=[], metavar="TEST", help="run only these tests")
    parser.add_argument("--no-type-check", action="store_true", help="skip the type-check pre-filter")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="generate, or a mutmut command and its arguments")
    options = parser.parse_args(arguments)
    if not options.command:
        parser.error("expected a command: generate, or one of mutmut's")

    import mutmut.__main__ as mutmut_main
    from mutmut.configuration import config

    sys.path[0] = os.getcwd()  # as under `python -m mutmut`: the working directory, not this script's folder
    mutmut_main.filter_mutants_with_type_checker = TypeCheckInBackground  # type: ignore[attr-defined,assignment]  # a mapping mutmut reads by .get
    run_pytest_in_fresh_basetemps_cheapest_tests_first()
    run_mutants_in_one_collected_session()
    skip_the_clean_run_after_a_full_stats_run(mutmut_main)
    settings = config()  # read from ./pyproject.toml once; every mutmut step reads this same object
    if options.mutate:
        settings.only_mutate = options.mutate
    if options.tests:
        settings.pytest_add_cli_args_test_selection = options.tests
    if options.no_type_check:
        settings.type_check_command = []
    if options.command[0] == "generate":
        generate = argparse.ArgumentParser(prog="mutation_typecheck.py mutmut generate")
        generate.add_argument("--max-children", type=int, default=os.cpu_count() or 1, help="processes writing mutants")
        generate_mutants(mutmut_main, generate.parse_args(options.command[1:]).max_children)
        return 0
    try:
        mutmut_main.cli(options.command, prog_name="mutmut")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    return 0


class TestCosts:
    """What each selected test cost in mutmut's stats run: its setup, call and teardown (mutmut
    records the call alone), and, per test module, its dearest setup (a module-scoped fixture is
    paid by whichever of the module's tests runs first in a mutant's run)."""

    def __init__(self) -> None:
        self.by_test: dict[str, float] = defaultdict(float)
        self.setup_by_module: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.by_test[report.nodeid] += report.duration
        if report.when == "setup":
            module = report.nodeid.split("::", 1)[0]
            self.setup_by_module[module] = max(self.setup_by_module[module], report.duration)


STATS_COSTS = TestCosts()
SUSPICIOUS = 35  # mutmut 3.8's exit code for a "suspicious" result (mutmut.stats.status_by_exit_code)


def run_pytest_in_fresh_basetemps_cheapest_tests_first() -> None:
    """Two overrides of mutmut 3.8's pytest runner, for speed only (which tests run is unchanged).

    - Each pytest session gets its own ``--basetemp``, removed when the session returns. mutmut ends
      each mutant's process with ``os._exit``, so pytest's numbered temp folders kept their locks and
      were never cleaned: one more per mutant, each session listing all the earlier ones (about
      38,000 folders and 29 GB on a machine that had run the gate a few times).
    - A mutant's tests run cheapest first, by :class:`TestCosts` from the stats run. mutmut passes
      them in a set's order (then sorts them by call time alone) and runs them with ``-x``, so a test
      whose fixtures cost seconds could run before the quick one that kills the mutant.
    """
    import shutil
    import tempfile

    from mutmut.runners.harness import PytestRunner

    execute_pytest = PytestRunner.execute_pytest
    run_tests = PytestRunner.run_tests

    def execute_pytest_in_fresh_basetemp(self: Any, params: list[str], **kwargs: Any) -> int:
        basetemp = tempfile.mkdtemp(prefix="mutation-pytest-")
        if "plugins" in kwargs:  # only the stats run passes a plugin (its collector): record the costs too
            kwargs["plugins"] = [*kwargs["plugins"], STATS_COSTS]
        try:
            return int(execute_pytest(self, [*params, "--basetemp", basetemp], **kwargs))
        finally:
            shutil.rmtree(basetemp, ignore_errors=True)

    def run_tests_cheapest_first(self: Any, *, mutant_name: str | None, tests: Any) -> int:
        return int(run_tests(self, mutant_name=mutant_name, tests=cheapest_first(tests)))

    PytestRunner.execute_pytest = execute_pytest_in_fresh_basetemp  # type: ignore[method-assign]
    PytestRunner.run_tests = run_tests_cheapest_first  # type: ignore[method-assign]


def cheapest_first(tests: Any, costs: TestCosts | None = None) -> list[str]:
    """``tests`` module by module, the module whose share costs least first (its dearest setup and
    its tests' own costs, by ``costs``, default the stats run's), each module's tests cheapest first.
    Module by module, as pytest runs a file: interleaved, each switch of module tears down its
    module-scoped fixtures and the next test of that module sets them up again."""
    costs = STATS_COSTS if costs is None else costs
    by_module: dict[str, list[str]] = defaultdict(list)
    for test in tests:
        by_module[test.split("::", 1)[0]].append(test)

    def share(module: str) -> float:
        own = sum(costs.by_test.get(test, 0.0) for test in by_module[module])
        return costs.setup_by_module.get(module, 0.0) + own

    return [test for module in sorted(by_module, key=lambda module: (share(module), module))
            for test in sorted(by_module[module], key=lambda test: (costs.by_test.get(test, 0.0), test))]


class CollectedSession:
    """The selected tests collected once, in the fork runner's parent, for every mutant's process.

    mutmut 3.8 starts each mutant's tests with ``pytest.main`` in its forked process: arguments,
    plugins, conftests and the collection of every module it names, 0.1 to 0.3 s before the first
    test runs, about half of a typical mutant's run. Here the parent collects the selection once,
    with mutmut's own arguments, after its stats run; each forked mutant process runs its tests, from
    that session, through pytest's ``pytest_runtest_protocol`` hook (every plugin's fixtures, capture
    and wrappers, as ``pytest.main`` would run them) and stops at the first failure, as mutmut's
    ``-x`` does. Exit 1 when a test failed, 0 when none did, as ``pytest.main`` returns.
    """

    def __init__(self, config: Any, session: Any) -> None:
        self.config = config
        self.session = session
        self.items = {item.nodeid: item for item in session.items}

    @classmethod
    def collect(cls, arguments: list[str]) -> CollectedSession | None:
        """The session of ``arguments``, collected in ``mutants/``, or None where its collection failed."""
        from _pytest.config import _prepareconfig
        from _pytest.main import Session

        # Its terminal reporter writes to the null device (open for the process's life), here and in every fork.
        null = open(os.devnull, "w")
        with contextlib.redirect_stdout(null), contextlib.chdir("mutants"):
            config = _prepareconfig(arguments)
            config._do_configure()
            session = Session.from_config(config)
            config.hook.pytest_sessionstart(session=session)
            config.hook.pytest_collection(session=session)
        if session.testsfailed:  # a collection error: each mutant then runs pytest.main, as mutmut does
            return None
        return cls(config, session)

    def run(self, tests: list[str]) -> int | None:
        """Run ``tests`` (node ids) in this process, in order, stopping at the first failure; None where
        the session lacks one of them. A failing test is a report, never an exception; an exception
        here is the runner's own failure, and it answers mutmut's "suspicious" (which the gate counts as
        not detected), never a kill."""
        import shutil
        import tempfile

        from _pytest.tmpdir import TempPathFactory

        found = [self.items.get(test) for test in tests]
        items = [item for item in found if item is not None]
        if not items or len(items) < len(found):
            return None
        # A temp folder of this process's own, removed when it is done (two run at once).
        self.config.option.basetemp = tempfile.mkdtemp(prefix="mutation-pytest-")
        self.config._tmp_path_factory = TempPathFactory.from_config(self.config, _ispytest=True)
        try:
            with contextlib.chdir("mutants"):
                for index, item in enumerate(items):
                    following = items[index + 1] if index + 1 < len(items) else None
                    item.ihook.pytest_runtest_protocol(item=item, nextitem=following)
                    if self.session.shouldfail or self.session.shouldstop:
                        break
            return 1 if self.session.testsfailed else 0
        except Exception as error:  # the runner's own failure: reported, and answered as not detected
            print(f"mutation_typecheck: the collected session failed: {error!r}", file=sys.__stderr__)
            return SUSPICIOUS
        finally:
            shutil.rmtree(self.config.option.basetemp, ignore_errors=True)


def run_mutants_in_one_collected_session() -> None:
    """mutmut's fork runner collects the selection once before its first mutant (:class:`CollectedSession`),
    and each mutant's process runs its tests from that collection; where it cannot (a collection
    error, a test the collection lacks), the mutant runs ``pytest.main`` as mutmut does."""
    from mutmut.runners.harness import PytestRunner
    from mutmut.workers.isolation import ForkRunner

    startup = ForkRunner.startup
    run_tests = PytestRunner.run_tests
    collected: CollectedSession | None = None

    def startup_with_one_collection(self: Any) -> None:
        nonlocal collected
        runner = self.test_runner
        if isinstance(runner, PytestRunner):
            collected = CollectedSession.collect(
                ["--rootdir=.", "--tb=native", *runner._pytest_args_regular_run([]), *runner._pytest_add_cli_args])
        startup(self)  # mutmut freezes the garbage collector's heap for the forks: the collection with it

    def run_tests_from_the_collection(self: Any, *, mutant_name: str | None, tests: Any) -> int:
        if collected is not None and mutant_name is not None:
            code = collected.run(cheapest_first(tests))
            if code is not None:
                return code
        return int(run_tests(self, mutant_name=mutant_name, tests=tests))

    ForkRunner.startup = startup_with_one_collection  # type: ignore[method-assign]
    PytestRunner.run_tests = run_tests_from_the_collection  # type: ignore[method-assign]


def skip_the_clean_run_after_a_full_stats_run(mutmut_main: Any) -> None:
    """mutmut 3.8 runs every selected test twice before the mutants: its stats run, then its clean
    run. A full stats run already runs them all unmutated and stops mutmut (exit 1) when one fails,
    so after one the clean run only repeats it (about a minute of the gate's logic step). After an
    incremental stats run (stats loaded from an earlier run) the clean run still runs."""
    from mutmut.workers.isolation import ForkRunner, ForkServerRunner

    collect_full_stats = mutmut_main.run_stats_collection
    full_stats_passed = False

    def run_stats_collection(runner: Any, tests: Any = None) -> None:
        nonlocal full_stats_passed
        collect_full_stats(runner, tests)  # exits the run if a test fails
        full_stats_passed = full_stats_passed or not tests

    def unless_stats_ran_them(run_clean_tests: Any) -> Any:
        def run_clean_tests_unless_stats_ran_them(self: Any, tests: Any) -> int:
            return 0 if full_stats_passed else int(run_clean_tests(self, tests))
        return run_clean_tests_unless_stats_ran_them

    mutmut_main.run_stats_collection = run_stats_collection
    for runner_class in (ForkRunner, ForkServerRunner):  # mutmut's process_isolation "fork" and "forkserver"
        runner_class.run_clean_tests = unless_stats_ran_them(runner_class.run_clean_tests)  # type: ignore[method-assign]


def generate_mutants(mutmut_main: Any, processes: int) -> None:
    """The first step of ``mutmut run`` (mutmut 3.8's ``_run``), alone: every mutant written to
    ``mutants/`` with its ``.meta`` file, no test run. A later ``mutmut run`` keeps them (their
    files are newer than the sources) and the results recorded in their ``.meta`` files."""
    from mutmut.mutation.trampoline import set_mutant_under_test

    set_mutant_under_test("mutant_generation")
    Path("mutants").mkdir(exist_ok=True)
    mutmut_main.copy_src_dir()
    mutmut_main.copy_also_copy_files()
    mutmut_main.setup_source_paths()
    mutmut_main.store_lines_covered_by_tests()
    mutmut_main.create_mutants(processes)


def type_check() -> int:
    # --no-warn-unused-ignores: mutmut's trampolines carry `type: ignore` comments mypy may not need.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--output", "json", "--no-warn-unused-ignores"], capture_output=True, text=True
    )
    if done.returncode not in (0, 1):
        # mypy itself failed: words that are not JSON make mutmut refuse the run (never "no errors").
        print(f"mutation_typecheck: mypy exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
        return done.returncode
    errors = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    errors = [error for error in errors if error.get("severity") == "error"]
    sources = {file: Path(file).read_text(encoding="utf-8") for file in {str(error["file"]) for error in errors}}
    for error in mutant_errors(errors, sources):
        print(json.dumps(error))
    print()  # mutmut reads mypy's "no errors" as a lone newline
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["mutmut"]:
        sys.exit(run_mutmut(sys.argv[2:]))
    sys.exit(type_check())
