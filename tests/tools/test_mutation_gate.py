"""The mutation gate (tools/mutation.py) on a two-function project mutmut really runs: logic and
message-text mutants are classed from their change and scored apart (a prose message is message
text, a dict key with spaces stays logic); message mutants run only the golden-file tests, or are
reported not run when those do not exist; surviving logic fails the gate below its floor; a rule
or an entry excuses exactly the equivalent mutants it names; a stale rule or entry, or a broken
gate file, is refused (exit 2)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
mutation = load_script(ROOT / "tools" / "mutation.py")

pytest.importorskip("mutmut", reason="mutmut (the dev extra) is not installed")
pytestmark = pytest.mark.slow  # each run of the gate runs mutmut two or three times

SOURCE = """\
def verdict(value, bound):
    if bound is None:
        raise ValueError(f"no bound for {value}: " "a bound was expected")
    return {"is within": value <= bound}


def pairs(left, right):
    return list(zip(left, right, strict=False))
"""
# A second group's file: a run with --groups bound leaves it unmutated.
OTHER_SOURCE = """\
def double(value):
    return value * 2
"""
# The refusal is an f-string and a plain string: mutmut rewords the plain part, a literal part of
# the whole f-string, so those two mutants are message text. The unit tests pin the words whole, never value == bound, never the result's key, and
# never pairs' strict=False (zip's default). So these logic mutants survive: `<=` -> `<`, the two
# rewordings of the key "is within" (a key, though it has a space), and strict dropped or None.
UNIT_TESTS = """\
import pytest

from bound import pairs, verdict
from other import double


def test_a_missing_bound_is_refused_in_these_words():
    with pytest.raises(ValueError, match="^no bound for 1: a bound was expected$"):
        verdict(1, None)


def test_below_and_above():
    assert list(verdict(1, 2).values()) == [True]
    assert list(verdict(3, 2).values()) == [False]


def test_pairs_stop_at_the_shorter():
    assert pairs([1, 2], [3]) == [(1, 3)]


def test_double():
    assert double(3) == 6
"""
# The golden test holds only part of the words: it catches the message mutant that upper-cases
# them and not the one that wraps them in XX. The unit tests would catch both: a message score of
# 50 % shows that message mutants ran the golden test alone.
GOLDEN_TEST = """\
import pytest

from bound import verdict


def test_the_refusal_names_the_bound():
    with pytest.raises(ValueError) as refused:
        verdict(1, None)
    assert "bound was expected" in str(refused.value)
"""
PYPROJECT = """\
[tool.mutmut]
source_paths = ["bound.py", "other.py"]
pytest_add_cli_args = ["-p", "no:cacheprovider"]
pytest_add_cli_args_test_selection = ["tests/test_bound.py"]
"""
GATE = """\
target = 95.0
message_tests = ["{golden}"]

[groups]
bound = ["bound.py"]

[floors]
bound = {floor}
"""
ZIP_RULE = """
[[rule]]
kind = "argument"
groups = ["bound"]
call = "zip"
keyword = "strict"
original = "{original}"
becomes = ["dropped", "None"]
reason = "False is zip's default and None is as falsy"
"""
ENTRY = """
[[equivalent]]
function = "bound.x_verdict"
removed = ['{removed}']
added = ['{added}']
reason = "test only"
"""
KEY = 'return {"is within": value <= bound}'
BOUNDARY = ENTRY.format(removed=KEY, added=KEY.replace("<=", "<"))
KEY_ENTRIES = ENTRY.format(removed=KEY, added=KEY.replace("is within", "XXis withinXX")) + ENTRY.format(
    removed=KEY, added=KEY.replace("is within", "IS WITHIN")
)
EVERY_SURVIVOR = ZIP_RULE.format(original="False") + BOUNDARY + KEY_ENTRIES
TWO_GROUPS = 'bound = ["bound.py"]\nother = ["other.py"]\n'
GOLDEN = "tests/test_words.py"
NO_GOLDEN = "tests/test_operator_words.py"


def write_project(root: Path, unit_tests: str = UNIT_TESTS) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "bound.py").write_text(SOURCE)
    (root / "other.py").write_text(OTHER_SOURCE)
    (root / "tests" / "test_bound.py").write_text(unit_tests)
    (root / "tests" / GOLDEN.split("/")[1]).write_text(GOLDEN_TEST)
    (root / "pyproject.toml").write_text(PYPROJECT)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)  # the gate copies what git lists
    return root


def gate(arguments: list[str], text: str, where: Path) -> tuple[int, str, str]:
    """tools/mutation.py's main with this gate file: its exit code, stdout and stderr."""
    path = where / "gate.toml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mutation.main([*arguments, "--gate", str(path)])
    return code, out.getvalue(), err.getvalue()


def two_groups(text: str) -> str:
    return text.replace('bound = ["bound.py"]\n', TWO_GROUPS).replace("bound = 99\n", "bound = 99\nother = 99\n")


def run_kept(factory: pytest.TempPathFactory, golden: str, *more: str) -> Path:
    project = write_project(factory.mktemp("project"))
    tree = factory.mktemp("tree") / "kept"
    run = ["--project", str(project), "--keep", str(tree), "--jobs", "1", *more]
    code, _, err = gate(run, two_groups(GATE.format(golden=golden, floor=99)), project)
    assert code == 1 and err == ""  # the survivors are below the floor
    return tree


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tree the gate ran for the group bound alone, with the golden test present."""
    return run_kept(tmp_path_factory, GOLDEN, "--groups", "bound")


@pytest.fixture(scope="module")
def no_golden_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tree the gate ran for both groups while its golden tests did not exist."""
    return run_kept(tmp_path_factory, NO_GOLDEN)


def score(tree: Path, text: str, tmp_path: Path, *more: str) -> tuple[int, str, str]:
    return gate(["--tree", str(tree), *more], text, tmp_path)


def row(out: str) -> dict[str, str]:
    """The report table's row for the group, by column."""
    lines = [line for line in out.splitlines() if "│" in line or "┃" in line]
    header = [cell.strip() for cell in lines[0].strip("┃").split("┃")]
    cells = [cell.strip() for cell in next(line for line in lines if line.startswith("│ bound")).strip("│").split("│")]
    return dict(zip(header, cells, strict=True))


def added_line(diff: str) -> str:
    """The one line a mutant's diff adds."""
    (line,) = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return line


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_surviving_logic_fails_the_gate_and_message_mutants_are_not_in_its_score(
    golden_run: Path, tmp_path: Path
) -> None:
    code, out, _ = score(golden_run, GATE.format(golden=GOLDEN, floor=99), tmp_path)
    table = row(out)
    assert code == 1
    assert (table["mutants"], table["logic"], table["message"]) == ("15", "13", "2")
    assert last_line(out) == "mutation_score: 61.5"  # 8 of the 13 logic mutants; the 2 message ones apart
    assert "target 95 %: not reached in bound" in out


def test_message_mutants_run_only_the_golden_tests(golden_run: Path, tmp_path: Path) -> None:
    # The unit tests pin the words whole and would catch both; the golden test catches one.
    code, out, _ = score(golden_run, GATE.format(golden=GOLDEN, floor=99), tmp_path)
    table = row(out)
    assert (table["message detected"], table["message %"]) == ("1", "50.0")
    assert f"message mutants ran {GOLDEN}" in out


def test_without_golden_tests_message_mutants_are_not_run_and_not_gated(no_golden_run: Path, tmp_path: Path) -> None:
    text = GATE.format(golden=NO_GOLDEN, floor=100) + "[message_floors]\nbound = 100\n" + EVERY_SURVIVOR
    code, out, _ = score(no_golden_run, text, tmp_path)
    table = row(out)
    assert (table["message"], table["message %"]) == ("2", "not run: no golden tests")
    assert code == 0 and last_line(out) == "mutation_score: 100.0"


def test_survivors_name_their_class_and_a_dict_key_with_spaces_stays_logic(golden_run: Path, tmp_path: Path) -> None:
    survivors = tmp_path / "survivors.json"
    score(golden_run, GATE.format(golden=GOLDEN, floor=99), tmp_path, "--survivors", str(survivors))
    found = sorted((entry["class"], added_line(entry["diff"])) for entry in json.loads(survivors.read_text()))
    assert found == sorted([
        ("logic", KEY.replace("<=", "<")),
        ("logic", KEY.replace("is within", "XXis withinXX")),
        ("logic", KEY.replace("is within", "IS WITHIN")),
        ("logic", "return list(zip(left, right, ))"),
        ("logic", "return list(zip(left, right, strict=None))"),
        ("message", 'raise ValueError(f"no bound for {value}: " "XXa bound was expectedXX")'),  # the golden test misses it
    ])


def test_a_rule_excuses_its_class_of_mutants_only(golden_run: Path, tmp_path: Path) -> None:
    code, out, _ = score(golden_run, GATE.format(golden=GOLDEN, floor=99) + ZIP_RULE.format(original="False"), tmp_path)
    assert row(out)["equivalent"] == "2"  # strict dropped and strict=None; strict=True is caught
    assert "equivalent mutants excused: 2 (by 1 rules and 0 entries)" in out
    assert code == 1 and last_line(out) == "mutation_score: 72.7"  # 8 of 11


def test_a_rule_matching_no_mutant_is_stale_and_refused(golden_run: Path, tmp_path: Path) -> None:
    code, out, err = score(golden_run, GATE.format(golden=GOLDEN, floor=99) + ZIP_RULE.format(original="True"), tmp_path)
    assert code == 2 and out == ""
    assert "match no logic mutant" in err and "rule[0]" in err and len(err.strip().splitlines()) == 1


def test_a_score_at_its_floor_passes_and_below_fails(golden_run: Path, tmp_path: Path) -> None:
    at_floor, out, _ = score(golden_run, GATE.format(golden=GOLDEN, floor=100) + EVERY_SURVIVOR, tmp_path)
    assert "equivalent mutants excused: 5 (by 1 rules and 3 entries)" in out
    below, _, _ = score(golden_run, GATE.format(golden=GOLDEN, floor=100) + ZIP_RULE.format(original="False"), tmp_path)
    assert (at_floor, below) == (0, 1)


def test_a_message_score_below_its_floor_fails_once_the_golden_tests_run(golden_run: Path, tmp_path: Path) -> None:
    passing = GATE.format(golden=GOLDEN, floor=100) + "[message_floors]\nbound = 50\n" + EVERY_SURVIVOR
    failing = passing.replace("bound = 50", "bound = 50.1")
    results = [score(golden_run, text, tmp_path) for text in (passing, failing)]
    assert [code for code, _, _ in results] == [0, 1]
    assert all(last_line(out) == "mutation_score: 100.0" for _, out, _ in results)


def test_an_entry_for_a_message_mutant_is_refused(golden_run: Path, tmp_path: Path) -> None:
    words = 'raise ValueError(f"no bound for {value}: " "a bound was expected")'
    entry = ENTRY.format(removed=words, added=words.replace("a bound was expected", "A BOUND WAS EXPECTED"))
    code, _, err = score(golden_run, GATE.format(golden=GOLDEN, floor=99) + entry, tmp_path)
    assert code == 2 and "match no logic mutant" in err and "A BOUND WAS EXPECTED" in err


def test_an_entry_matching_no_mutant_is_stale_and_refused(golden_run: Path, tmp_path: Path) -> None:
    stale = BOUNDARY.replace("value < bound", "value > bound")
    code, out, err = score(golden_run, GATE.format(golden=GOLDEN, floor=99) + stale, tmp_path)
    assert code == 2
    assert "match no logic mutant" in err and "value > bound" in err and len(err.strip().splitlines()) == 1
    assert out == ""


def test_an_entry_for_a_killed_mutant_is_not_stale_and_excuses_nothing(golden_run: Path, tmp_path: Path) -> None:
    killed = ENTRY.format(removed="if bound is None:", added="if bound is not None:")
    code, out, _ = score(golden_run, GATE.format(golden=GOLDEN, floor=99) + killed, tmp_path)
    assert code == 1
    assert "equivalent mutants excused: 0 (by 0 rules and 1 entries)" in out and last_line(out) == "mutation_score: 61.5"


def test_the_mutants_a_rule_or_entry_excuses_are_not_run_and_count_only_under_that_gate(tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    tree = tmp_path / "kept"
    every = GATE.format(golden=GOLDEN, floor=100) + EVERY_SURVIVOR
    code, out, err = gate(["--project", str(project), "--keep", str(tree), "--jobs", "1"], every, tmp_path)
    assert (code, err) == (0, "") and "equivalent mutants excused: 5 (by 1 rules and 3 entries)" in out
    codes = json.loads((tree / "mutants" / "bound.py.meta").read_text())["exit_code_by_key"]
    assert sorted(codes.values()).count(mutation.REVIEWED_EQUIVALENT) == 5  # mutmut ran none of them
    code, out, err = score(tree, GATE.format(golden=GOLDEN, floor=99), tmp_path)
    assert code == 2 and out == "" and "run the gate again" in err and len(err.strip().splitlines()) == 1


def test_a_stale_entry_is_refused_before_any_mutant_runs(tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    tree = tmp_path / "kept"
    stale = GATE.format(golden=GOLDEN, floor=99) + BOUNDARY.replace("value < bound", "value > bound")
    code, out, err = gate(["--project", str(project), "--keep", str(tree), "--jobs", "1"], stale, tmp_path)
    assert code == 2 and out == "" and "match no logic mutant" in err
    codes = json.loads((tree / "mutants" / "bound.py.meta").read_text())["exit_code_by_key"]
    assert set(codes.values()) == {None}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (GATE.format(golden=GOLDEN, floor=99).replace("target = 95.0", "target = 120"), "target"),
        ("target = 95\nmessage_tests = ['t.py']\n[groups]\nbound = []\n", "groups"),
        (GATE.format(golden=GOLDEN, floor=98.9), "floors"),
        (GATE.format(golden=GOLDEN, floor=99) + "[floors.other]\n", "floors"),
        (GATE.format(golden=GOLDEN, floor=99) + "[message_floors]\nother = 50\n", "message_floors"),
        (GATE.format(golden=GOLDEN, floor=99).replace(f'message_tests = ["{GOLDEN}"]', ""), "message_tests"),
        ("threshold = 1\n" + GATE.format(golden=GOLDEN, floor=99), "threshold"),
        (GATE.format(golden=GOLDEN, floor=99) + BOUNDARY.replace("test only", " "), "equivalent[0]"),
        (GATE.format(golden=GOLDEN, floor=99) + ZIP_RULE.format(original="False").replace("argument", "anything"), "kind"),
        (GATE.format(golden=GOLDEN, floor=99) + ZIP_RULE.format(original="False").replace('"bound"]', '"other"]'), "groups"),
        (GATE.format(golden=GOLDEN, floor=99) + ZIP_RULE.format(original="False("), "expression"),
        (GATE.format(golden=GOLDEN, floor=99) + ZIP_RULE.format(original="False").replace('keyword = "strict"\n', ""), "keyword"),
        ("threshold = ", "cannot read"),
    ],
)
def test_a_broken_gate_file_is_refused_naming_the_field(
    golden_run: Path, tmp_path: Path, text: str, named: str
) -> None:
    code, out, err = score(golden_run, text, tmp_path)
    assert code == 2
    assert named in err and len(err.strip().splitlines()) == 1
    assert out == ""


def test_a_groups_run_mutates_only_the_chosen_groups_files(
    golden_run: Path, no_golden_run: Path, tmp_path: Path
) -> None:
    code, out, _ = score(no_golden_run, two_groups(GATE.format(golden=NO_GOLDEN, floor=99)), tmp_path)
    assert code == 1 and "│ other " in out  # the whole run mutated both groups' files
    code, out, err = score(golden_run, two_groups(GATE.format(golden=GOLDEN, floor=99)), tmp_path)
    assert code == 2 and out == ""
    assert "other" in err and "not mutated" in err and len(err.strip().splitlines()) == 1


def test_an_unknown_group_is_refused(golden_run: Path, tmp_path: Path) -> None:
    code, _, err = score(golden_run, GATE.format(golden=GOLDEN, floor=99), tmp_path, "--groups", "bound,nothing")
    assert code == 2 and "--groups" in err and "nothing" in err and len(err.strip().splitlines()) == 1


def test_a_tree_the_gate_did_not_run_is_refused(tmp_path: Path) -> None:
    code, _, err = score(tmp_path, GATE.format(golden=GOLDEN, floor=99), tmp_path)
    assert code == 2 and "not a tree this gate ran" in err


def test_a_run_whose_clean_tests_fail_is_refused_naming_the_failing_test(tmp_path: Path) -> None:
    project = write_project(tmp_path / "project", UNIT_TESTS + "\n\ndef test_broken():\n    assert pairs([], []) == [1]\n")
    code, out, err = gate(["--project", str(project), "--jobs", "1"], GATE.format(golden=GOLDEN, floor=99), tmp_path)
    assert code == 2 and out == ""
    assert "mutmut run exited 1" in err and "FAILED tests/test_bound.py::test_broken" in err
    assert len(err.strip().splitlines()) == 1
