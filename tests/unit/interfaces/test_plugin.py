"""The pytest plugin as an operator meets it: installed through its ``pytest11`` entry point, so
``--pyargs qualify.recipes`` and a copy of the recipes in a ``recipes/`` directory run from any
directory with no conftest; bad options are one usage line (exit 4); one failing step is one
failure naming its cause, the steps it blocks skipped with it; the JUnit XML carries the run's
verdict, lane, identity, drift, scope and receipt. Real ``pytest`` subprocesses; the runs of the
native-text recipe (~25 s each) are in the slow tier. The passing run, from a project with its own
``--model`` option, is tests/system/test_recipes_outside_the_checkout.py."""

from __future__ import annotations

import base64
import importlib.metadata
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qualify.archive.attestation import ENVELOPE
from qualify.archive.keys import ensure_signing_key
from qualify.archive.layout import SUMMARY
from qualify.archive.reader import read_receipt_json
from qualify.interfaces.plugin import SCOPE_PROPERTIES, SPLITTING_DIST_MODES, receipt_properties
from qualify.judge import judge_summary
from qualify.run.qualification import HANDOFF_STEPS, STEP_LABELS
from tests.unit.archive.test_receipts import RULE, as_v2_receipt, write_receipt
from tests.unit.judge.test_judge import rung2_record
from tests.unit.judge.test_scope import scoped

REPO = Path(__file__).resolve().parents[3]
PLUGIN_MODULE = "qualify.interfaces.plugin"
RUN_TIMEOUT_S = 600
"""Bound on one recipe run in a subprocess (a run takes ~25-45 s here)."""
COLLECT_TIMEOUT_S = 120


# -- helpers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PytestRun:
    """A finished ``python -m pytest`` subprocess and where it ran."""

    returncode: int
    stdout: str
    stderr: str
    cwd: Path


def copied_recipes(place: Path) -> Path:
    """The recipe modules of ``recipes/`` copied into ``place/recipes``, a directory outside
    the checkout with no conftest, no pytest configuration and no package around it."""
    target = place / "recipes"
    shutil.copytree(REPO / "recipes", target, ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
    assert not (place / "conftest.py").exists() and not (place / "pyproject.toml").exists()
    return target


def run_pytest(cwd: Path, *args: str, timeout: int = COLLECT_TIMEOUT_S) -> PytestRun:
    """``python -m pytest ARGS`` in ``cwd`` with the venv's interpreter (the plugin comes from the
    installed entry point, nothing else loads it)."""
    ensure_signing_key()  # made once, before any subprocess signs a receipt with it
    done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)
    return PytestRun(done.returncode, done.stdout, done.stderr, cwd)


def suite(junit: Path) -> ET.Element:
    """The one ``<testsuite>`` of a JUnit XML file."""
    (element,) = ET.parse(junit).getroot().iter("testsuite")
    return element


def junit_cases(junit: Path) -> dict[str, ET.Element]:
    """Testcases by step label (``test_step[handoff 1/3]`` -> ``handoff 1/3``)."""
    return {case.attrib["name"].removeprefix("test_step[").removesuffix("]"): case
            for case in suite(junit).iter("testcase")}


def properties(case: ET.Element) -> dict[str, str]:
    names = [prop.attrib["name"] for prop in case.iter("property")]
    assert len(names) == len(set(names)), f"a property recorded twice: {names}"
    return {prop.attrib["name"]: prop.attrib["value"] for prop in case.iter("property")}


def counts(junit: Path) -> dict[str, int]:
    return {name: int(suite(junit).attrib[name]) for name in ("tests", "failures", "errors", "skipped")}


def signed_predicate(receipt: Path) -> dict[str, Any]:
    """The predicate of the receipt's signed statement (decoded here, not by the harness)."""
    envelope = json.loads((receipt / ENVELOPE).read_text())
    return dict(json.loads(base64.b64decode(envelope["payload"]))["predicate"])


def one_verdict_case(junit: Path) -> tuple[str, dict[str, str]]:
    """The one testcase carrying the run's verdict properties (the step that sealed its receipt)."""
    carrying = [(label, properties(case)) for label, case in junit_cases(junit).items()
                if "verdict" in properties(case)]
    assert len(carrying) == 1, f"verdict properties on {[label for label, _ in carrying]}"
    return carrying[0]


# -- the scope properties (fast: receipts written here) ------------------------------------------


def test_junit_scope_properties_quote_the_receipts_scope_word_for_word(tmp_path: Path) -> None:
    records = [rung2_record(n) for n in (1, 2, 3)]
    receipt = write_receipt(tmp_path, records, verdict=scoped(judge_summary(records, RULE)))
    found = dict(receipt_properties(receipt))
    summary = read_receipt_json(receipt, SUMMARY)
    assert found["qualify.scope"] == summary["scope"]["line"] == (
        f"QUALIFIED on {found['qualify.fixture']}; {found['qualify.controls']}")
    assert found["qualify.fixture"] == "fixture python-textwrap (3 × 2048/256)" == summary["scope"]["fixture_words"]
    assert found["qualify.controls"] == summary["scope"]["controls_words"]
    assert "2 of 3 documents within E1 gates" in found["qualify.controls"]
    assert "prose-idle-news exceeds at 1024–4096" in found["qualify.controls"]
    assert found["headline"].startswith(found["qualify.scope"]) and found["verdict"] == "passed"


def test_junit_scope_properties_are_null_without_a_scope(tmp_path: Path) -> None:
    """A verdict without a scope, and a v2 receipt written before summaries held one."""
    for receipt in (write_receipt(tmp_path / "unscoped"),
                    as_v2_receipt(write_receipt(tmp_path / "v2", verdict=scoped(judge_summary(
                        [rung2_record(n) for n in (1, 2, 3)], RULE))))):
        found = dict(receipt_properties(receipt))
        assert {name: found[name] for name, _ in SCOPE_PROPERTIES} == dict.fromkeys(
            ("qualify.scope", "qualify.fixture", "qualify.controls"), "null")
        assert found["verdict"] == "passed"


# -- installation and collection (fast) ----------------------------------------------------------


def test_plugin_is_installed_as_one_pytest11_entry_point() -> None:
    """One name for the plugin module (pytest loads an entry point once per name; a stale
    ``*.egg-info`` beside the checkout may list the same one again)."""
    names = {entry.name for entry in importlib.metadata.entry_points(group="pytest11") if entry.value == PLUGIN_MODULE}
    assert names, "the pytest11 entry point is not installed (reinstall: pip install -e .)"
    assert len(names) == 1, f"the plugin is installed under two names: {sorted(names)}"


def test_recipes_copied_outside_the_checkout_are_collected_with_no_configuration(tmp_path: Path) -> None:
    copied_recipes(tmp_path)
    done = run_pytest(tmp_path, str(tmp_path / "recipes"), "--co", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{2 * len(STEP_LABELS)} tests collected" in done.stdout, done.stdout


PROJECT_CONFTEST = """def pytest_addoption(parser):
    parser.addoption("--model", default=None)
    parser.addoption("--receipts", default=None)
    parser.addoption("--identity", default=None)
"""
"""A project's own conftest, adding options the plugin's would clash with were they unprefixed."""


def project_with_its_own_options(place: Path) -> Path:
    """``place`` as an unrelated project: a conftest adding ``--model``, ``--receipts`` and ``--identity``."""
    (place / "conftest.py").write_text(PROJECT_CONFTEST, encoding="utf-8")
    return place


def test_shipped_recipes_are_collected_by_pyargs_beside_a_project_with_its_own_model_option(tmp_path: Path) -> None:
    project_with_its_own_options(tmp_path)
    done = run_pytest(tmp_path, "--pyargs", "qualify.recipes", "--co", "-q", "-W", "error::pytest.PytestWarning",
                      "--model", "the-projects-own")
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert f"{2 * len(STEP_LABELS)} tests collected" in done.stdout, done.stdout
    assert "warning" not in (done.stdout + done.stderr).lower()


def test_naming_the_plugin_module_again_does_not_register_it_twice(tmp_path: Path) -> None:
    """``-p qualify.interfaces.plugin`` (or an old conftest's ``pytest_plugins``) on top of the
    installed entry point neither crashes nor doubles its options."""
    copied_recipes(tmp_path)
    done = run_pytest(tmp_path, str(tmp_path / "recipes"), "--co", "-q", "-p", PLUGIN_MODULE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{2 * len(STEP_LABELS)} tests collected" in done.stdout, done.stdout


def test_recipes_directory_not_named_on_the_command_line_is_left_to_pytest(tmp_path: Path) -> None:
    """The plugin loads in every pytest session of the environment: a ``recipes/`` directory
    pytest only walks past (an unrelated project's) is collected by pytest's own rules, not as recipes."""
    copied_recipes(tmp_path)
    done = run_pytest(tmp_path, str(tmp_path), "--co", "-q")
    assert done.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, done.stdout + done.stderr


# -- bad options (fast) ---------------------------------------------------------------------------


BAD_OPTIONS = [
    pytest.param("--qualify-deadline-s=-3", "ERROR: argument --qualify-deadline-s: found '-3', expected a positive number of seconds, at most 604800",
                 id="negative-deadline"),
    pytest.param("--qualify-receipts=", "ERROR: argument --qualify-receipts: found an empty path '', expected a path", id="empty-receipts"),
    pytest.param("--qualify-recipe=native_text", "ERROR: argument --qualify-recipe: found 'native_text', expected one of kquant-target-plus-dflash, native-text",
                 id="unknown-recipe"),
    pytest.param("--qualify-fault=v_scale", "ERROR: argument --qualify-fault: fault: unknown name 'v_scale'; expected one of block-order, "
                 "kv-ulp, other-mode, other-prompt, rope-offset, v-scale, or NAME=VALUE with NAME one of block-swap, "
                 "element-scale, head-swap, k-scale, kv-ulp, last-position-scale, position-shift, v-scale", id="unknown-fault"),
    # Exactly 1 scales by nothing: one below the range's lower end, refused like any value outside it.
    pytest.param("--qualify-fault=k-scale=1", "ERROR: argument --qualify-fault: fault k-scale: found '1', expected a number from "
                 "1.0000001 to 2 (F: layer 2 K multiplied by F)", id="fault-value-outside-its-range"),
    pytest.param("--qualify-identity={tmp}/missing.json", "ERROR: --qualify-identity '{tmp}/missing.json': no such file, expected a regular file",
                 id="missing-identity"),
    pytest.param("--qualify-receipts={tmp}/a-file", "ERROR: --qualify-receipts '{tmp}/a-file': is a file or other non-directory, expected a directory",
                 id="receipts-is-a-file"),
]


@pytest.mark.parametrize(("option", "expected"), BAD_OPTIONS)
def test_bad_plugin_option_is_a_usage_error_in_one_line_naming_it(option: str, expected: str, tmp_path: Path) -> None:
    """Exit 4 is pytest's usage error (its own for an unknown option): kept, with one line."""
    (tmp_path / "a-file").write_text("not a directory")
    done = run_pytest(tmp_path, str(tmp_path), "--co", "-q", option.format(tmp=tmp_path))
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [expected.format(tmp=tmp_path)]
    assert done.stdout == ""


# -- blocked steps without a producer (fast) ------------------------------------------------------


def test_step_whose_predecessor_never_ran_fails_instead_of_skipping(tmp_path: Path) -> None:
    """``-k verdict`` drops the steps the verdict needs: a failure, never a skip a gate could pass on."""
    recipes = copied_recipes(tmp_path)
    junit = tmp_path / "x.xml"
    done = run_pytest(tmp_path, str(recipes / "native_text.py"), "-k", "verdict", f"--junitxml={junit}",
                      "--qualify-receipts", str(tmp_path / "receipts"))
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert counts(junit) == {"tests": 1, "failures": 1, "errors": 0, "skipped": 0}
    failure = junit_cases(junit)["verdict"].find("failure")
    assert failure is not None and failure.text == "verdict: blocked: step 'identity sealed' did not run"


def test_refused_identity_is_one_failure_and_every_later_step_is_skipped_naming_it(tmp_path: Path) -> None:
    recipes = copied_recipes(tmp_path)
    garbage = tmp_path / "identity.json"
    garbage.write_text(json.dumps({"lane": "nvfp4-native-splitk"}))
    junit = tmp_path / "x.xml"
    done = run_pytest(tmp_path, str(recipes / "native_text.py"), f"--junitxml={junit}", "--qualify-identity", str(garbage),
                      "--qualify-receipts", str(tmp_path / "receipts"))
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert counts(junit) == {"tests": len(STEP_LABELS), "failures": 1, "errors": 0, "skipped": len(STEP_LABELS) - 1}
    cases = junit_cases(junit)
    failure = cases["identity sealed"].find("failure")
    assert failure is not None and failure.text is not None
    cause, _, receipt = failure.text.removeprefix("identity sealed: ").partition("; receipt: ")
    assert cause.startswith(f"identity {garbage}: "), failure.text
    for label in STEP_LABELS[1:]:
        skipped = cases[label].find("skipped")
        assert skipped is not None and skipped.attrib["message"] == f"blocked by identity sealed: {cause}"
    label, found = one_verdict_case(junit)
    summary = read_receipt_json(receipt, SUMMARY)
    assert (label, found["verdict"], found["receipt"]) == ("identity sealed", "refused", receipt)
    assert summary["status"] == "refused" and found["identity_sha256"] == "null" and summary["identity_sha256"] is None


# -- real runs (slow) -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> PytestRun:
    """The native-text recipe against the ``other-mode`` fault lane: its first handoff is refused
    on its cache identity, before any decode (the fastest failing handoff)."""
    place = tmp_path_factory.mktemp("faulty")
    copied_recipes(place)
    return run_pytest(place, str(place / "recipes"), "--qualify-recipe", "native-text", "--qualify-reference-once",
                      "--qualify-fault", "other-mode", "--qualify-receipts", str(place / "receipts"), "--junitxml=x.xml",
                      timeout=RUN_TIMEOUT_S)


@pytest.mark.slow
def test_one_failing_handoff_is_one_failure_and_the_steps_it_blocks_are_skipped_naming_it(faulty_run: PytestRun) -> None:
    assert faulty_run.returncode == pytest.ExitCode.TESTS_FAILED, faulty_run.stdout + faulty_run.stderr
    junit = faulty_run.cwd / "x.xml"
    blocked = [*HANDOFF_STEPS[1:], "verdict"]
    assert counts(junit) == {"tests": len(STEP_LABELS), "failures": 1, "errors": 0, "skipped": len(blocked)}
    cases = junit_cases(junit)
    failure = cases[HANDOFF_STEPS[0]].find("failure")
    assert failure is not None and failure.text is not None
    cause, _, receipt = failure.text.removeprefix(f"{HANDOFF_STEPS[0]}: ").partition("; receipt: ")
    assert "handoff refused by check cache_identity" in cause, failure.text
    for label in blocked:
        skipped = cases[label].find("skipped")
        assert skipped is not None and skipped.attrib["message"] == f"blocked by {HANDOFF_STEPS[0]}: {cause}", label
    label, found = one_verdict_case(junit)
    summary = read_receipt_json(receipt, SUMMARY)
    assert (label, found["receipt"], found["verdict"], found["headline"]) == (
        HANDOFF_STEPS[0], receipt, summary["status"], summary["verdict"])
    assert found["verdict"] == "failed" and cause in found["headline"]
    # The refused handoff was never compared: its sample and the run have no drift to report.
    assert (found["sample_1_max_abs"], found["max_abs"]) == ("null", "null")


ORDERED_STEPS = """\
import os

RAN = []


def _step(number):
    assert RAN == [os.getpid()] * (number - 1), f"step {number} after steps {len(RAN)} run in this process"
    RAN.append(os.getpid())


"""


def ordered_steps(count: int) -> str:
    """A recipe-shaped module: ``count`` steps, each passing only after all the earlier ones ran in its process."""
    return ORDERED_STEPS + "".join(f"def test_step_{n}():\n    _step({n})\n\n\n" for n in range(1, count + 1))


@pytest.mark.parametrize("mode", sorted(SPLITTING_DIST_MODES))
def test_a_dist_mode_that_would_split_a_module_runs_each_recipe_module_whole_on_one_worker(mode: str, tmp_path: Path) -> None:
    """``-n 2 --dist MODE`` hands a module's consecutive tests to both workers (modules of 5 and
    11 ordered steps: ``load`` sends blocks of two tests, ``worksteal`` halves of eight); in a
    recipes directory each module runs whole on one worker, so every step follows its predecessors."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for name, steps in (("first.py", 5), ("second.py", 11)):
        (recipes / name).write_text(ordered_steps(steps), encoding="utf-8")
    junit = tmp_path / "x.xml"
    done = run_pytest(tmp_path, str(recipes), "-n", "2", "--dist", mode, "-p", "no:randomly", f"--junitxml={junit}")
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert counts(junit) == {"tests": 16, "failures": 0, "errors": 0, "skipped": 0}


def test_a_session_naming_no_recipes_keeps_the_dist_mode_its_user_chose(tmp_path: Path) -> None:
    """The plugin loads in every pytest session; the same ordered modules as test files of another
    directory run under ``--dist load`` as xdist deals them, split over both workers."""
    steps = tmp_path / "steps"
    steps.mkdir()
    for name, count in (("test_first.py", 5), ("test_second.py", 11)):
        (steps / name).write_text(ordered_steps(count), encoding="utf-8")
    junit = tmp_path / "x.xml"
    done = run_pytest(tmp_path, str(steps), "-n", "2", "--dist", "load", "-p", "no:randomly", f"--junitxml={junit}")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert counts(junit)["tests"] == 16 and counts(junit)["failures"] > 0


@pytest.mark.slow
def test_both_real_recipes_pass_side_by_side_under_a_splitting_dist_mode(tmp_path: Path) -> None:
    """The shipped recipes, copied, under ``-n 2 --dist worksteal``: both pass, one receipt each."""
    recipes = copied_recipes(tmp_path)
    junit = tmp_path / "x.xml"
    done = run_pytest(tmp_path, str(recipes), "-n", "2", "--dist", "worksteal", "--qualify-reference-once",
                      f"--junitxml={junit}", "--qualify-receipts", str(tmp_path / "receipts"), timeout=RUN_TIMEOUT_S)
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert counts(junit)["failures"] == 0 and counts(junit)["tests"] > len(STEP_LABELS)
    assert len([path for path in (tmp_path / "receipts").iterdir() if not path.name.startswith(".")]) == 2

