"""mutmut's type-check pre-filter (tools/mutation_typecheck.py): a mypy error catches a mutant only
inside that mutant's own function, and only where mutmut's unmutated copy of it is clean."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
typecheck = load_script(ROOT / "tools" / "mutation_typecheck.py")

# A module as mutmut rewrites it: the trampoline, the unmutated copy and two mutants of each function.
MUTATED = """\
def scale(value: int) -> int:
    return _trampoline("x_scale", value)


def x_scale__mutmut_orig(value: int) -> int:
    return value * 2


def x_scale__mutmut_1(value: int) -> int:
    return value / 2


def x_scale__mutmut_2(value: int) -> int:
    return value * 3


class Box:
    def xǁBoxǁopen__mutmut_orig(self) -> str:
        return "open"

    def xǁBoxǁopen__mutmut_1(self) -> str:
        return None
"""


def error(line: int) -> dict[str, object]:
    return {"file": "pkg/mod.py", "line": line, "message": "m", "severity": "error"}


def lines_of(kept: list[dict[str, object]]) -> list[object]:
    return [e["line"] for e in kept]


def test_an_error_inside_a_mutant_catches_it_and_nothing_else() -> None:
    kept = typecheck.mutant_errors([error(10), error(22)], {"pkg/mod.py": MUTATED})
    assert lines_of(kept) == [10, 22]


def test_errors_outside_every_mutant_are_mutmuts_scaffolding_not_a_mutant() -> None:
    assert typecheck.mutant_errors([error(2), error(1)], {"pkg/mod.py": MUTATED}) == []


def test_a_function_whose_unmutated_copy_errs_gets_no_mutant_caught() -> None:
    # The copy at line 6 errs: its mutant's error at 10 is the rewrite's, not the mutation's.
    kept = typecheck.mutant_errors([error(6), error(10), error(22)], {"pkg/mod.py": MUTATED})
    assert lines_of(kept) == [22]


def test_mutant_copies_are_found_in_modules_and_class_bodies() -> None:
    found = {(function, which) for _, _, function, which in typecheck.mutmut_functions(MUTATED)}
    assert found == {("x_scale", "orig"), ("x_scale", "1"), ("x_scale", "2"), ("xǁBoxǁopen", "orig"), ("xǁBoxǁopen", "1")}


def _report(nodeid: str, when: str, duration: float) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)


def test_a_mutants_tests_run_module_by_module_the_cheapest_share_first() -> None:
    """A module whose fixture costs a second goes after a module of quick tests, even where one
    of its tests alone is quicker; each module's tests stay together, cheapest first."""
    costs = typecheck.TestCosts()
    for report in [_report("a.py::slow", "setup", 1.0), _report("a.py::slow", "call", 0.001),
                   _report("a.py::quick", "setup", 0.0), _report("a.py::quick", "call", 0.0005),
                   _report("b.py::one", "setup", 0.01), _report("b.py::one", "call", 0.02),
                   _report("b.py::two", "call", 0.01), _report("b.py::two", "teardown", 0.002)]:
        costs.pytest_runtest_logreport(report)
    assert typecheck.cheapest_first(["a.py::slow", "b.py::one", "a.py::quick", "b.py::two", "c.py::new"], costs) == \
        ["c.py::new", "b.py::two", "b.py::one", "a.py::quick", "a.py::slow"]
