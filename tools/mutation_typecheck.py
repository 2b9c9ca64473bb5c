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


def caught_by_type_check() -> dict[str, Any]:
    """mutmut's ``filter_mutants_with_type_checker`` (mutmut 3.8): mutant name -> its first type error,
    from its ``type_check_command`` run in ``mutants/``, each error placed in its function by ``ast``."""
    from mutmut.configuration import config
    from mutmut.mutation.file_mutation import FailedTypeCheckMutant, MutatedMethodLocation
    from mutmut.type_checking import run_type_checker
    from mutmut.utils.format_utils import get_mutant_name

    caught: dict[str, Any] = {}
    with contextlib.chdir("mutants"):
        errors = run_type_checker(config().type_check_command)
        by_file: dict[Path, list[Any]] = defaultdict(list)
        for error in errors:
            by_file[error.file_path].append(error)
        for path, file_errors in by_file.items():
            copies = mutmut_functions(path.read_text(encoding="utf-8"))
            for error in file_errors:
                first, last, function, which = next(c for c in copies if c[0] <= error.line_number <= c[1])
                method = f"{function}__mutmut_{which}"
                name = get_mutant_name(path.relative_to(Path(".").absolute()), method)
                location = MutatedMethodLocation(file=path, function_name=method, line_number_start=first, line_number_end=last)
                caught.setdefault(name, FailedTypeCheckMutant(method_location=location, name=name, error=error))
    return caught


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
    mutmut_main.filter_mutants_with_type_checker = caught_by_type_check
    run_pytest_in_fresh_basetemps_fastest_tests_first()
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


def run_pytest_in_fresh_basetemps_fastest_tests_first() -> None:
    """Two overrides of mutmut 3.8's pytest runner, for speed only (which tests run is unchanged).

    - Each pytest session gets its own ``--basetemp``, removed when the session returns. mutmut ends
      each mutant's process with ``os._exit``, so pytest's numbered temp folders kept their locks and
      were never cleaned: one more per mutant, each session listing all the earlier ones (about
      38,000 folders and 29 GB on a machine that had run the gate a few times).
    - A mutant's tests run fastest first, by the stats run's durations. mutmut passes them in a
      set's order and runs them with ``-x``, so a slow test could run before the fast one that
      kills the mutant.
    """
    import shutil
    import tempfile

    from mutmut.runners.harness import PytestRunner
    from mutmut.state import state

    execute_pytest = PytestRunner.execute_pytest
    run_tests = PytestRunner.run_tests

    def execute_pytest_in_fresh_basetemp(self: Any, params: list[str], **kwargs: Any) -> int:
        basetemp = tempfile.mkdtemp(prefix="mutation-pytest-")
        try:
            return int(execute_pytest(self, [*params, "--basetemp", basetemp], **kwargs))
        finally:
            shutil.rmtree(basetemp, ignore_errors=True)

    def run_tests_fastest_first(self: Any, *, mutant_name: str | None, tests: Any) -> int:
        durations = state().duration_by_test
        ordered = sorted(tests, key=lambda test: (durations.get(test, 0.0), test))
        return int(run_tests(self, mutant_name=mutant_name, tests=ordered))

    PytestRunner.execute_pytest = execute_pytest_in_fresh_basetemp  # type: ignore[method-assign]
    PytestRunner.run_tests = run_tests_fastest_first  # type: ignore[method-assign]


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
