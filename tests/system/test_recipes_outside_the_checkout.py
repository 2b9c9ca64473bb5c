"""The shipped recipes run as an operator's CI would run them, from a project that is not the
checkout and whose own conftest adds ``--model``, ``--receipts`` and ``--identity``:
``python -m pytest --pyargs qualify.recipes --junitxml=x.xml`` passes with no warning (pytest's
default JUnit family included), and the JUnit XML carries the run's properties, read back from
its receipt. One real run of the native-text recipe (~25-90 s), shared by the module."""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.archive.layout import SUMMARY
from qualify.archive.reader import read_receipt_json
from qualify.interfaces.plugin import SCOPE_PROPERTIES
from qualify.run.qualification import HANDOFF_STEPS, STEP_LABELS
from tests.unit.interfaces.test_plugin import (
    RUN_TIMEOUT_S,
    PytestRun,
    counts,
    junit_cases,
    one_verdict_case,
    project_with_its_own_options,
    properties,
    run_pytest,
    signed_predicate,
)


@pytest.fixture(scope="module")
def passing_run(tmp_path_factory: pytest.TempPathFactory) -> PytestRun:
    place = project_with_its_own_options(tmp_path_factory.mktemp("project"))
    return run_pytest(place, "--pyargs", "qualify.recipes", "--qualify-recipe", "native-text", "--qualify-reference-once",
                      "--qualify-receipts", str(place / "receipts"), "--junitxml=x.xml",
                      "-W", "error::pytest.PytestWarning", timeout=RUN_TIMEOUT_S)


@pytest.mark.slow
def test_shipped_recipe_passes_from_a_project_with_its_own_model_option_and_no_warning(passing_run: PytestRun) -> None:
    assert passing_run.returncode == pytest.ExitCode.OK, passing_run.stdout + passing_run.stderr
    assert "warning" not in (passing_run.stdout + passing_run.stderr).lower(), passing_run.stdout + passing_run.stderr
    # The kquant recipe's module is deselected by --qualify-recipe: no testcase, no count.
    assert counts(passing_run.cwd / "x.xml") == {"tests": len(STEP_LABELS), "failures": 0, "errors": 0, "skipped": 0}


@pytest.mark.slow
def test_junit_properties_are_the_receipts_verdict_lane_identity_drift_scope_and_path(passing_run: PytestRun) -> None:
    junit = passing_run.cwd / "x.xml"
    label, found = one_verdict_case(junit)
    receipt = Path(found["receipt"])
    assert label == "verdict" and receipt.parent == passing_run.cwd / "receipts" and receipt.is_dir()
    summary = read_receipt_json(receipt, SUMMARY)
    assert {name: found[name] for name in ("verdict", "headline", "recipe", "lane", "rung", "identity_sha256")} == {
        "verdict": summary["status"], "headline": summary["verdict"], "recipe": summary["recipe"],
        "lane": summary["lane"], "rung": str(summary["rung"]), "identity_sha256": summary["identity_sha256"]}
    assert found["verdict"] == "passed" and found["recipe"] == "native-text" and found["rung"] == "2"
    assert found["scope"] == signed_predicate(receipt)["scope"]
    verdict_scope = summary.get("scope")  # what the verdict covers: quoted from the summary, or null
    assert {name: found[name] for name, _ in SCOPE_PROPERTIES} == {
        name: "null" if verdict_scope is None else verdict_scope[field] for name, field in SCOPE_PROPERTIES}
    samples = [read_receipt_json(receipt, f"samples/sample-{n}.json") for n in range(1, summary["samples"] + 1)]
    assert len(samples) == len(HANDOFF_STEPS)
    cases = junit_cases(junit)
    for n, (step, sample) in enumerate(zip(HANDOFF_STEPS, samples, strict=True), start=1):
        own = properties(cases[step])
        assert (float(own[f"sample_{n}_max_abs"]), float(own[f"sample_{n}_mean_abs"])) == (
            sample["max_abs"], sample["mean_abs"]), step
    assert float(found["max_abs"]) == max(sample["max_abs"] for sample in samples)
    assert float(found["mean_abs"]) == max(sample["mean_abs"] for sample in samples)
