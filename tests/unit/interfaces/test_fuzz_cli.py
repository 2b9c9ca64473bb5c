"""Fuzzing the ``qualify`` command line with invocations that are bad by construction.

Every generated invocation carries at least one element that must be refused (an unknown option or
subcommand, a bad value for any option, an empty, file or unwritable path, a missing, directory
or garbage identity, a stray positional, a dangling option, weird or very long text), so none
may run: each must exit 2 with exactly one non-empty line on stderr, never a traceback or an
"internal error", and write nothing (no receipt, key or registry anywhere), except that a run
refused at its first step (a garbage identity file) leaves its one receipt, marked refused: every
run leaves a receipt.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.archive.reader import read_receipt_json
from qualify.archive.verify import verify_receipt
from qualify.contract.lanes import LANES, EngineChoice, Recipe
from qualify.engines.faults import FAULTS
from qualify.interfaces import cli
from tests.conftest import isolate_cli_environment

REPO = Path(__file__).resolve().parents[3]
CHECKOUT_RECEIPTS = REPO / "receipts"

RECIPES = [recipe.value for recipe in Recipe]
ENGINES = [engine.value for engine in EngineChoice]
COMMAND_WORDS = {"identity", "receipts", "enroll", "calibrate", "selftest", "producer"}
# Every option some parser knows (plus help and version, which exit 0 by design).
KNOWN_OPTIONS = {"-h", "--help", "--version", "--recipe", "--identity", "--producer", "--consumer",
                 "--reference-once", "--drift-graded", "--fault", "--receipts", "--deadline-s", "--lane",
                 "--anchors", "--no-controls", "--receipt", "--registry", "--keys", "--json"}
# Calibration lanes whose recipe is not native-text: ``--recipe native-text --lane L`` is refused.
OTHER_RECIPE_LANES = sorted(name for name, spec in LANES.items() if spec.recipe is not Recipe.NATIVE_TEXT)
MAX_REPETITIONS = 1000

SPECIAL_TEXT = ["", " ", "-", "\x00", "nul\x00byte", "\x1b[31mred", "\u202eevil", "line\nbreak", "tab\there",
                "sep\u2028arator", "\x85next", "\udcff\udcfe", "\ud800", "[red]x[/]", "[/]", ":smile:",
                "%s%(prog)s", "{}", "~nosuchuser-qualify/x", "..", ".", "/", "\U0001f642" * 3, "\u01c5",
                "\ufeffbom", "é", "receipt://", "receipt://../x", "'quoted'", '"', "\\"]

long_text = st.builds(lambda character, count: character * count, st.characters(), st.integers(300, 100_000))
weird = st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL_TEXT), long_text)


def _unknown_option(name: str) -> bool:
    return bool(name) and f"--{name}".partition("=")[0] not in KNOWN_OPTIONS


unknown_options = st.one_of(
    weird.map(lambda name: f"--{name}").filter(lambda option: _unknown_option(option[2:])),
    st.tuples(st.sampled_from(["--recipes", "--identities", "--receipts-dir", "--rec", "--lanes", "--key",
                               "--repetition", "--deadline", "--Recipe", "--RECEIPTS", "-x", "-R"]),
              st.one_of(st.none(), weird)).map(lambda pair: pair[0] if pair[1] is None else f"{pair[0]}={pair[1]}"),
)
stray_positionals = weird.filter(lambda text: text != "--" and text not in COMMAND_WORDS and not text.startswith("-"))
dangling = st.sampled_from(["--recipe", "--identity", "--producer", "--consumer", "--fault", "--receipts",
                            "--deadline-s"])
bad_deadlines = st.one_of(
    st.sampled_from(["0", "-0", "-1", "nan", "NaN", "inf", "-inf", "Infinity", "1e309", "1e300", "604801", "",
                     "abc", "5s", "0x10", "--1"]),
    st.floats(max_value=0).map(repr),
    st.floats(min_value=7 * 24 * 3600 + 1, allow_infinity=True).map(repr),
    weird.filter(lambda text: not _is_number(text)),
)
bad_anchors = st.one_of(
    st.integers(max_value=1).map(str),
    st.integers(min_value=MAX_REPETITIONS + 1).map(str),
    st.sampled_from(["", "1.5", "1e3", "nan", "inf", " 5", "5 ", "1_0", "\uff15", "\u0665", "+5", "0x5", "five"]),
    # len() first: int() refuses a digit string over 4300 digits, which the weird texts can be.
    weird.filter(lambda text: not (text.isascii() and text.isdigit() and len(text) < 6 and 2 <= int(text) <= MAX_REPETITIONS)),
)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class Fixtures:
    """Paths the invocations point at: garbage identities, a file, a directory, missing paths."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.directory = root / "a-directory"
        self.directory.mkdir()
        self.file = root / "a-file"
        self.file.write_text("not a directory\n")
        self.good_receipts = root / "archive-ok"
        self.good_receipts.mkdir()
        self.garbage: list[Path] = []
        for index, content in enumerate([b"", b"not json", b"{}", b"[]", b"{\"lane\": \"nvfp4-native-splitk\"}",
                                         b"\xff\xfe\x00garbage", b"[" * 5000, b"{\"a\": NaN}", os.urandom(256)]):
            path = root / f"garbage-{index}.json"
            path.write_bytes(content)
            self.garbage.append(path)

    def missing(self, name: str) -> str:
        return str(self.root / f"missing-{name}")


def bad_paths(fixtures: Fixtures, *, directory_is_bad: bool) -> st.SearchStrategy[str]:
    """Paths refused wherever a path is asked for: empty, NUL, missing, a file or under one."""
    choices = [st.sampled_from(["", " ", "\x00", f"{fixtures.file}\x00"]),
               st.just(str(fixtures.file / "sub")), st.just(str(fixtures.file / "sub" / "deeper"))]
    if directory_is_bad:  # an input file: a directory, a missing file, or one that is not an identity
        choices += [st.just(str(fixtures.directory)), weird.map(fixtures.missing),
                    st.sampled_from([str(path) for path in fixtures.garbage])]
    else:  # an output directory: a regular file is what it cannot be
        choices.append(st.just(str(fixtures.file)))
    return st.one_of(*choices)


def _invocation(draw: Any, fixtures: Fixtures) -> tuple[str, list[str]]:
    """(family, argv): a command family's valid parts, shuffled, with at least one bad part."""
    family = draw(st.sampled_from(["recipe", "calibrate", "selftest", "enroll", "verify", "identity", "top"]))
    identities = bad_paths(fixtures, directory_is_bad=True)
    out_dirs = bad_paths(fixtures, directory_is_bad=False)
    common_bad = [unknown_options.map(lambda option: [option]), stray_positionals.map(lambda text: ["STRAY", text])]
    ok: list[list[str]] = []
    bad: list[st.SearchStrategy[list[str]]] = []
    prefix: list[str] = []
    if family == "recipe":
        recipe = draw(st.sampled_from(RECIPES))
        ok = [draw(st.sampled_from([["--recipe", recipe], [f"--recipe={recipe}"]]))]
        ok += draw(st.lists(st.sampled_from([
            ["--reference-once"], ["--drift-graded"], ["--producer", "reference"], ["--consumer", "reference"],
            ["--deadline-s", "30"], ["--receipts", str(fixtures.good_receipts)], ["--fault", "kv-ulp"]]),
            max_size=4, unique_by=lambda part: part[0]))
        bad = common_bad + [
            weird.filter(lambda text: text not in RECIPES).map(lambda text: ["REPLACE", "--recipe", text]),
            st.tuples(st.sampled_from(["--producer", "--consumer"]),
                      weird.filter(lambda text: text not in ENGINES)).map(list),
            identities.map(lambda path: ["--identity", path]),
            out_dirs.map(lambda path: ["--receipts", path]),
            weird.filter(lambda text: text not in FAULTS).map(lambda text: ["--fault", text]),
            bad_deadlines.map(lambda text: ["--deadline-s", text]),
            dangling.map(lambda option: ["DANGLING", option]),
            st.just(["DROP-RECIPE"]),
        ]
    elif family == "calibrate":
        prefix = ["calibrate"]
        ok = [["--recipe", "native-text"], ["--lane", "nvfp4-native-f16"]]
        ok += draw(st.lists(st.sampled_from([["--anchors", "2"], ["--receipts", str(fixtures.good_receipts)]]),
                            max_size=2, unique_by=lambda part: part[0]))
        bad = common_bad + [
            st.sampled_from(["--recipe", "--lane"]).map(lambda option: ["DROP", option]),
            weird.filter(lambda text: text not in LANES).map(lambda text: ["REPLACE", "--lane", text]),
            st.sampled_from(OTHER_RECIPE_LANES).map(lambda lane: ["REPLACE", "--lane", lane]),
            weird.filter(lambda text: text not in RECIPES).map(lambda text: ["REPLACE", "--recipe", text]),
            bad_anchors.map(lambda text: ["--anchors", text]),
            out_dirs.map(lambda path: ["--receipts", path]),
            st.sampled_from(["--recipe", "--lane", "--anchors", "--receipts"]).map(
                lambda option: ["DANGLING", option]),
        ]
    elif family == "selftest":
        prefix = ["selftest"]
        ok = draw(st.lists(st.sampled_from([["--fault", "kv-ulp"], ["--receipts", str(fixtures.good_receipts)]]),
                           max_size=2, unique_by=lambda part: part[0]))
        bad = common_bad + [
            weird.filter(lambda text: text not in FAULTS).map(lambda text: ["--fault", text]),
            out_dirs.map(lambda path: ["--receipts", path]),
            st.sampled_from(["--fault", "--receipts"]).map(lambda option: ["DANGLING", option]),
        ]
    elif family == "enroll":  # no passing receipt exists here: every enrollment is refused
        prefix = ["enroll"]
        ok = [["--identity", draw(st.sampled_from([str(path) for path in fixtures.garbage]))],
              ["--receipt", draw(st.sampled_from([str(fixtures.good_receipts), "receipt://run-1/command.log"]))]]
        bad = common_bad + [
            st.sampled_from(["--identity", "--receipt"]).map(lambda option: ["DROP", option]),
            identities.map(lambda path: ["REPLACE", "--identity", path]),
            st.one_of(weird, weird.map(lambda text: f"receipt://{text}"), out_dirs).map(
                lambda text: ["REPLACE", "--receipt", text]),
            out_dirs.map(lambda path: ["--keys", path]),
            st.one_of(out_dirs, st.just(str(fixtures.directory))).map(lambda path: ["--registry", path]),
            identities.map(lambda path: ["--receipts", path]),
            st.sampled_from(["--identity", "--receipt", "--keys", "--registry", "--receipts"]).map(
                lambda option: ["DANGLING", option]),
        ]
    elif family == "verify":
        prefix = ["receipts", "verify"]
        verify_paths = st.one_of(st.sampled_from(["", "\x00", str(fixtures.file)]), weird.map(fixtures.missing))
        bad = [unknown_options.map(lambda option: [option]),
               verify_paths.map(lambda path: [path]),
               # Several PATHs are allowed: a missing one among them is what must be refused.
               st.tuples(weird, weird).map(lambda pair: [str(fixtures.good_receipts), fixtures.missing(pair[0])])]
    elif family == "identity":
        prefix = ["identity", "check"]
        bad = [unknown_options.map(lambda option: [option]),
               identities.map(lambda path: [path]),
               st.tuples(weird, weird).map(lambda pair: ["STRAY", *pair])]
    else:
        bad = [st.just(["EMPTY"]), unknown_options.map(lambda option: [option]),
               weird.filter(lambda text: text not in COMMAND_WORDS and not text.startswith("-")).map(
                   lambda text: [text]),
               st.sampled_from(["identity", "receipts", "producer"]).map(lambda word: [word]),
               weird.filter(lambda text: text != "verify").map(lambda text: ["receipts", text]),
               weird.filter(lambda text: text != "check").map(lambda text: ["identity", text])]
    return family, _assemble(draw, prefix, ok, draw(st.lists(st.one_of(*bad), min_size=1, max_size=3)))


def _assemble(draw: Any, prefix: list[str], ok: list[list[str]], bad: list[list[str]]) -> list[str]:
    """Shuffle the option groups; stray positionals and dangling options go last."""
    groups = [list(part) for part in ok]
    tail: list[str] = []
    for part in bad:
        marker = part[0]
        if marker == "REPLACE":
            groups = [group for group in groups if group[0].partition("=")[0] != part[1]]
            groups.append(part[1:])
        elif marker in ("DROP", "DROP-RECIPE"):
            option = part[1] if marker == "DROP" else "--recipe"
            groups = [group for group in groups if group[0].partition("=")[0] != option]
        elif marker == "STRAY":
            tail.extend(part[1:])
        elif marker == "DANGLING":
            tail.append(part[1])
        elif marker == "EMPTY":
            continue
        else:  # a bad value replaces the valid one (argparse keeps an option's last value)
            groups = [group for group in groups if group[0].partition("=")[0] != part[0]]
            groups.append(part)
    order = draw(st.permutations(range(len(groups)))) if groups else []
    words = [word for index in order for word in groups[index]]
    dangling_last = [word for word in tail if word.startswith("--")]
    return prefix + words + [word for word in tail if not word.startswith("--")] + dangling_last[:1]


@st.composite
def invocations(draw: Any, fixtures: Fixtures) -> tuple[str, list[str]]:
    return _invocation(draw, fixtures)


def snapshot(*roots: Path) -> set[str]:
    """Every path under ``roots``, and the checkout's receipt names: what must not change."""
    return {str(path) for root in roots for path in root.rglob("*")} | set(os.listdir(CHECKOUT_RECEIPTS))


class Isolated:
    def __init__(self, root: Path) -> None:
        self.cwd, self.archive, self.data = root / "cwd", root / "archive", root / "data"
        for directory in (self.cwd, self.archive, self.data, root / "fixtures"):
            directory.mkdir()
        self.fixtures = Fixtures(root / "fixtures")


def _no_producer(setup: object) -> object:
    raise AssertionError("a bad invocation got as far as starting a producer")


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Isolated]:
    from qualify.run import qualification

    # A generator bug must fail fast, not run a qualification: no producer ever starts here.
    monkeypatch.setattr(qualification, "producer_process", _no_producer)
    made = Isolated(tmp_path)
    isolate_cli_environment(monkeypatch, cwd=made.cwd, archive=made.archive, data=made.data)
    from qualify.archive.keys import ensure_signing_key

    ensure_signing_key()  # the key a refused run's receipt is signed with exists before any snapshot
    yield made


def check_refused(isolated: Isolated, capsys: pytest.CaptureFixture[str], fuzz_tally: Any,
                  family: str, argv: list[str]) -> None:
    """One bad invocation: exit 2, one non-empty stderr line, no traceback, nothing written."""
    capsys.readouterr()
    roots = (isolated.cwd, isolated.archive, isolated.data, isolated.fixtures.root)
    before = snapshot(*roots)
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    fuzz_tally.add("examples")
    fuzz_tally.add(f"family {family}")
    fuzz_tally.add("refused" if code == 2 else "accepted")
    assert code == 2, (argv, out, err)
    assert "Traceback" not in out + err and "internal error" not in out + err, (argv, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), (argv, err)
    after = snapshot(*roots)
    assert before <= after, argv
    receipts = {path for path in after - before
                if Path(path).parent in (isolated.archive, isolated.fixtures.good_receipts)}
    for receipt in receipts:  # a run refused at its first step: its receipt, marked refused, intact
        assert read_receipt_json(Path(receipt), "validation-summary.json")["status"] == "refused", argv
        assert verify_receipt(Path(receipt)) == [], argv
        fuzz_tally.add("refused runs with their receipt")
    assert all(any(path == receipt or path.startswith(receipt + os.sep) for receipt in receipts)
               for path in after - before), argv
    fuzz_tally.add("one-line refusals")


FUZZ_SETTINGS = {"derandomize": True, "deadline": None, "database": None,
                 "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.filter_too_much, HealthCheck.data_too_large]}


def _fuzz(isolated: Isolated, capsys: pytest.CaptureFixture[str], fuzz_tally: Any, examples: int) -> None:
    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(invocations(isolated.fixtures))
    def refused(invocation: tuple[str, list[str]]) -> None:
        check_refused(isolated, capsys, fuzz_tally, *invocation)

    refused()
    assert fuzz_tally.counts.get("accepted", 0) == 0
    assert fuzz_tally.counts["examples"] >= examples


def test_bad_cli_invocations_are_refused_in_one_line(
    isolated: Isolated, capsys: pytest.CaptureFixture[str], fuzz_tally: Any
) -> None:
    _fuzz(isolated, capsys, fuzz_tally, 300)


@pytest.mark.slow
def test_bad_cli_invocations_are_refused_in_one_line_2000(
    isolated: Isolated, capsys: pytest.CaptureFixture[str], fuzz_tally: Any
) -> None:
    _fuzz(isolated, capsys, fuzz_tally, 2000)
