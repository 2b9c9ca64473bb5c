"""What ``qualify calibrate`` prints after a calibration (qualify/run/onboarding.py): its command
lines are accepted by the tools they call exactly as printed. That they, after a real calibration
in a scratch checkout, run verbatim from another directory and freeze an identity that then checks
is asserted by tests/system/test_onboarding_doc.py, on the calibration its walk-through runs."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qualify.core.assets import REPO_ROOT
from qualify.judge.calibration import CellDrift
from qualify.run.calibrate import Calibration
from qualify.run.onboarding import COMMAND_STYLE, COMMANDS_HEADING, StepLine, next_steps
from tests.support.scripts import load_script

FREEZE = load_script(REPO_ROOT / "tools" / "freeze_identity.py")
RUN_ID = "20261201T000000Z-0123456789abcdef"
SPLITK = "nvfp4-native-splitk"


def calibration(receipt: Path | None, *, maximum: float | None = 0.25, mean: float | None = 0.025,
                observed: float = 0.25, tokens_exact: bool = True, deterministic: bool = True,
                failures: list[str] | None = None, floor: float | None = None, passed: bool | None = None,
                headline: str = "") -> Calibration:
    """A calibration result as ``qualify.run.calibrate.calibrate`` returns it (no records needed)."""
    cells = tuple(CellDrift(n, "doc", 1024, observed * (1 - n / 10), observed / 10, False) for n in (0, 1))
    ok = tokens_exact and deterministic and not failures
    return Calibration(SPLITK, [], cells, maximum, mean, floor, receipt, failures or [], tokens_exact,
                       deterministic, ok if passed is None else passed, headline)


def commands(lines: list[StepLine]) -> list[list[str]]:
    """The command lines, split as a shell splits them."""
    return [shlex.split(line.text) for line in lines if line.style == COMMAND_STYLE]


def freeze_arguments(lines: list[StepLine]) -> object:
    """The printed freeze command parsed by the freeze tool's own parser."""
    (freeze,) = [argv for argv in commands(lines) if "tools/freeze_identity.py" in argv]
    assert freeze[0] == sys.executable and freeze[1] == "tools/freeze_identity.py"
    return FREEZE.build_parser().parse_args(freeze[2:])


finite_positive = st.floats(min_value=5e-324, max_value=1e6, allow_nan=False, allow_infinity=False)
directory_names = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Cf", "Co", "Cn", "Zl", "Zp"),
                                        blacklist_characters="/") | st.sampled_from(" '\"$`\\!*?;&|<>(){}#~="),
                          min_size=1, max_size=12).filter(lambda name: name not in (".", ".."))
"""Directory names a shell must quote (spaces, quotes, $, backslashes, any printable Unicode)."""


@settings(derandomize=True, deadline=None, max_examples=200,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(maximum=finite_positive, mean=finite_positive, archive=directory_names)
@example(maximum=0.25, mean=0.025, archive="two\nlines")
@example(maximum=0.25, mean=0.025, archive="tab\there")
def test_rung2_freeze_command_round_trips_the_receipt_path(tmp_path: Path, fuzz_tally, maximum: float,
                                                           mean: float, archive: str) -> None:
    """Any derived bounds and any archive directory name: the printed commands split back into the
    exact receipt path, and the freeze tool's parser reads back the lane and the basis URI of that
    receipt, with --write-sealed, and no number (the tool derives them from the receipt again).
    The derived bounds are printed for review. A name no one-line command can carry (a line break,
    a control character) gets no command, and a line that says so."""
    fuzz_tally.add("examples")
    receipt = tmp_path / archive / RUN_ID
    lines = next_steps(calibration(receipt, maximum=maximum, mean=mean), SPLITK, "native-text")
    assert all(line.text.count("\n") == 0 for line in lines)
    argvs = commands(lines)
    if not str(receipt.resolve()).isprintable():
        assert not argvs and "no command can be printed on one line" in lines[-1].text
        fuzz_tally.add("refused")
        return
    assert argvs[0] == ["cd", str(REPO_ROOT)]
    assert argvs[1] == ["cp", "-r", str(receipt.resolve()), "receipts/"]
    args = freeze_arguments(lines)
    assert (args.lane, args.maximum_absolute, args.maximum_mean_absolute) == (SPLITK, None, None)
    assert f"maximum_absolute {maximum!r}, maximum_mean_absolute {mean!r}" in lines[0].text
    assert args.basis == f"receipt://{RUN_ID}/command.log" and args.write_sealed and args.replace
    assert argvs[-1][-3:] == ["identity", "check", f"contracts/{SPLITK}-identity-v1.json"]
    fuzz_tally.add("accepted")


def test_commands_follow_the_heading_and_carry_no_prose(tmp_path: Path) -> None:
    """The heading comes first, then only command lines (the block a reader pastes)."""
    lines = next_steps(calibration(tmp_path / RUN_ID), SPLITK, "native-text")
    heading = next(index for index, line in enumerate(lines) if line.text.startswith(COMMANDS_HEADING))
    assert lines[heading].style != COMMAND_STYLE
    assert [line.style for line in lines[heading + 1:]] == [COMMAND_STYLE] * 4


def test_receipt_already_in_receipts_is_not_copied_onto_itself() -> None:
    """A calibration archived straight into the checkout's receipts/ needs no cp (cp would fail:
    the same file)."""
    lines = next_steps(calibration(REPO_ROOT / "receipts" / RUN_ID), SPLITK, "native-text")
    assert [argv[0] for argv in commands(lines)][:2] == ["cd", sys.executable]


def test_new_lane_freeze_does_not_replace_an_identity(tmp_path: Path) -> None:
    """A lane with no identity in contracts/ (the exact anchor) is frozen without --replace."""
    assert not (REPO_ROOT / "contracts" / "nvfp4-exact-identity-v1.json").exists()
    lines = next_steps(calibration(tmp_path / RUN_ID, maximum=5e-324, mean=5e-324, observed=0.0),
                       "nvfp4-exact", "native-text")
    args = freeze_arguments(lines)
    assert not args.replace and args.lane == "nvfp4-exact"
    assert args.maximum_absolute is None and "maximum_absolute 5e-324, maximum_mean_absolute 5e-324" in lines[1].text
    assert lines[0].text.startswith("no drift observed")


def test_rung3_states_the_derived_floor_and_passes_no_number(tmp_path: Path) -> None:
    """Rung 3 has no bound: the floor its rule derived from the anchor is printed, and the freeze
    command passes no number (the tool derives the floor from the receipt again)."""
    lines = next_steps(calibration(tmp_path / RUN_ID, maximum=None, mean=None, floor=0.828), "kquant-exact-dflash",
                       "kquant-target-plus-dflash")
    args = freeze_arguments(lines)
    assert args.acceptance_floor is None and args.maximum_absolute is None and args.replace
    assert "draft acceptance floor 0.828" in lines[0].text


@pytest.mark.parametrize("result, lane, recipe, words", [
    (calibration(Path(RUN_ID), tokens_exact=False), SPLITK, "native-text", "does not keep exact tokens"),
    (calibration(Path(RUN_ID), failures=["handoff 2: producer failed"]), SPLITK, "native-text", "a handoff failed"),
    (calibration(Path(RUN_ID), deterministic=False), SPLITK, "native-text", "anchors differ across restarts"),
    (calibration(Path(RUN_ID), passed=False, headline="2 producer restarts (at least 3)"), SPLITK, "native-text",
     "at least 3"),
    (calibration(Path(RUN_ID), maximum=None), SPLITK, "native-text", "no bound can be derived"),
    (calibration(None), SPLITK, "native-text", "archived no receipt"),
    (calibration(Path(RUN_ID), maximum=None, mean=None), "kquant-native", "kquant-target-plus-dflash",
     "no draft floor was derived"),
], ids=["tokens-differ", "handoff-failed", "not-deterministic", "not-passed", "no-bound", "no-receipt",
        "rung3-no-floor"])
def test_no_rule_no_commands(result: Calibration, lane: str, recipe: str, words: str) -> None:
    """A calibration that cannot be frozen says why and prints no command."""
    lines = next_steps(result, lane, recipe)
    assert not commands(lines) and any(words in line.text for line in lines), lines


def test_commands_cd_to_the_checkout_and_copy_the_resolved_receipt_from_any_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Printed from another working directory, for a receipt named by a relative path: the first
    command changes to the imported package's checkout (not the working directory) and the copy
    names the receipt's absolute path (the commands are pasted anywhere, after that cd)."""
    monkeypatch.chdir(tmp_path)
    lines = next_steps(calibration(Path("archive") / RUN_ID), SPLITK, "native-text")
    argvs = commands(lines)
    assert argvs[0] == ["cd", str(REPO_ROOT)] and REPO_ROOT.resolve() != tmp_path.resolve()
    assert argvs[1] == ["cp", "-r", str(tmp_path.resolve() / "archive" / RUN_ID), "receipts/"]


def test_a_chosen_models_freeze_names_its_model_and_its_own_identity_file(tmp_path: Path) -> None:
    """Under --model the freeze and the check carry the same --model, and the identity goes to
    contracts/models/<name>/ (not over the shipped model's)."""
    from types import MappingProxyType

    from qualify.core import model_choice

    choice = model_choice.ModelChoice(name="tiny", argument="path/to/tiny", path=tmp_path, files=MappingProxyType({}),
                                      file_sizes=MappingProxyType({}), tokenizer=None, tokenizer_sha256="0" * 64)
    model_choice.choose(choice)
    try:
        lines = next_steps(calibration(tmp_path / RUN_ID), SPLITK, "native-text")
    finally:
        model_choice.choose(None)
    args = freeze_arguments(lines)
    assert args.model == "path/to/tiny" and args.lane == SPLITK and not args.replace
    check = commands(lines)[-1]
    assert check[-4:] == ["check", f"contracts/models/tiny/{SPLITK}-identity-v1.json", "--model", "path/to/tiny"]
