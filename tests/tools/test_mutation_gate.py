"""The mutation gate (tools/mutation.py) on a one-function project mutmut really runs: a boundary
its test does not pin survives and fails the gate; an equivalent entry naming exactly that mutant
excuses it; an entry matching no mutant, or a broken gate file, is refused (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
mutation = load_script(ROOT / "tools" / "mutation.py")

pytest.importorskip("mutmut", reason="mutmut (the dev extra) is not installed")

SOURCE = """\
def within(value, bound):
    if bound is None:
        return False
    return value <= bound
"""
# Never tests value == bound, so `<=` -> `<` survives; every other mutant is killed.
TEST = """\
from bound import within


def test_below_above_and_unbounded():
    assert within(1, 2) is True
    assert within(3, 2) is False
    assert within(1, None) is False
"""
GATE = """\
target = 95.0

[groups]
bound = ["bound.py"]

[floors]
bound = {floor}
"""
BOUNDARY = """
[[equivalent]]
function = "bound.x_within"
removed = ["return value <= bound"]
added = ["return value < bound"]
reason = "{reason}"
"""


@pytest.fixture(scope="module")
def mutated_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = tmp_path_factory.mktemp("project")
    (project / "bound.py").write_text(SOURCE)
    (project / "tests").mkdir()
    (project / "tests" / "test_bound.py").write_text(TEST)
    (project / "pyproject.toml").write_text(
        '[tool.mutmut]\nsource_paths = ["bound.py"]\npytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", "1"], cwd=project, env=env, check=True, capture_output=True
    )
    return project


def gate(project: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    path = project / "gate.toml"
    path.write_text(text)
    code = mutation.main(["--tree", str(project), "--gate", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_surviving_boundary_fails_the_gate(mutated_project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = gate(mutated_project, GATE.format(floor=95), capsys)
    assert code == 1
    assert out.strip().splitlines()[-1] == "mutation_score: 66.7"  # 2 of 3 killed
    assert "target 95 %: not reached in bound" in out


def test_a_score_at_its_floor_passes_and_one_below_fails(mutated_project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    at_floor, _, _ = gate(mutated_project, GATE.format(floor=200 / 3), capsys)
    above_floor, _, _ = gate(mutated_project, GATE.format(floor=200 / 3 + 1e-9), capsys)
    assert (at_floor, above_floor) == (0, 1)


def test_an_equivalent_entry_excuses_exactly_its_mutant(mutated_project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = gate(mutated_project, GATE.format(floor=95) + BOUNDARY.format(reason="test only"), capsys)
    assert out.strip().splitlines()[-1] == "mutation_score: 100.0"
    assert "equivalent mutants excused: 1" in out
    assert code == 0


def test_an_entry_matching_no_mutant_is_stale_and_refused(mutated_project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = GATE.format(floor=95) + BOUNDARY.format(reason="test only").replace("value < bound", "value > bound")
    code, out, err = gate(mutated_project, stale, capsys)
    assert code == 2
    assert "match no mutant" in err and "value > bound" in err and len(err.strip().splitlines()) == 1
    assert "mutation_score" not in out


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (GATE.format(floor=95).replace("target = 95.0", "target = 120"), "target"),
        ("target = 95\n[groups]\nbound = []\n", "groups"),
        (GATE.format(floor=0), "floors"),
        (GATE.format(floor=95) + "[floors.other]\n", "floors"),
        (GATE.format(floor=95) + BOUNDARY.format(reason=" "), "equivalent[0]"),
        ("threshold = ", "cannot read"),
    ],
)
def test_a_broken_gate_file_is_refused_naming_the_field(
    mutated_project: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    code, out, err = gate(mutated_project, text, capsys)
    assert code == 2
    assert named in err and len(err.strip().splitlines()) == 1
    assert out == ""


def test_a_group_whose_files_were_not_mutated_is_refused(mutated_project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = GATE.format(floor=95).replace('bound = ["bound.py"]', 'bound = ["bound.py"]\nother = ["elsewhere.py"]', 1)
    code, _, err = gate(mutated_project, text + "other = 95\n", capsys)
    assert code == 2
    assert "other" in err


def test_an_entry_for_a_killed_mutant_is_not_stale_and_excuses_nothing(
    mutated_project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = BOUNDARY.format(reason="test only").replace('["return value <= bound"]', '["if bound is None:"]')
    killed = killed.replace('["return value < bound"]', '["if bound is not None:"]')
    code, out, _ = gate(mutated_project, GATE.format(floor=95) + killed, capsys)
    assert code == 1
    assert "equivalent mutants excused: 0" in out and out.strip().splitlines()[-1] == "mutation_score: 66.7"


def test_a_run_whose_clean_tests_fail_is_refused_naming_the_failing_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bound.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_bound.py").write_text(TEST + "\n\ndef test_broken():\n    assert within(5, 2)\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.mutmut]\nsource_paths = ["bound.py"]\npytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
    )
    with pytest.raises(mutation.GateError, match=r"mutmut run exited 1: .*FAILED tests/test_bound.py::test_broken"):
        mutation.run_mutmut(tmp_path, 1)
