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
