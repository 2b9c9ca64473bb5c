"""``--json``: one JSON document on stdout (nothing else there), validating against the command's
committed schema ``contracts/cli-<command>.v<n>.schema.json``, its values the receipt's (the
verdict's scope included); exit codes as without it; a refusal still one line on stderr, and
stdout the short refused document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify import __version__
from qualify.archive.keys import ensure_signing_key
from qualify.archive.reader import read_receipt_json
from qualify.contract.identity import identity_sha256, load_identity
from qualify.core.assets import CONTRACTS_DIR
from qualify.core.strict_json import parse_untrusted_json, schema_validator
from qualify.interfaces import cli, documents
from qualify.judge import judge_summary
from qualify.judge.scope import scope_document
from qualify.run.calibrate import Calibration
from qualify.run.selftest import FaultResult
from tests.support.fuzz_budget import fuzz_examples
from tests.support.receipt_forgery import make_writable, statement_of, write_receipt
from tests.unit.archive.test_receipts import RULE, as_v2_receipt
from tests.unit.interfaces.test_console_layout import sample_records
from tests.unit.interfaces.test_console_refusals import BAD_OPTIONS, Places, concrete, expected_line, places  # noqa: F401
from tests.unit.judge.test_judge import rung2_record
from tests.unit.judge.test_scope import scoped

REPO = Path(__file__).resolve().parents[3]
SHIPPED_IDENTITY = CONTRACTS_DIR / "nvfp4-native-w4a4-identity-v1.json"


def validate(command: str, document: Any) -> None:
    """``document`` is valid under ``command``'s committed schema (strict: an integer is an
    integer literal, numbers finite) and names it."""
    schema_path = CONTRACTS_DIR / documents.schema_file(command)
    errors = [error.message for error in schema_validator(schema_path).iter_errors(document)]
    assert errors == [], errors
    assert document["schema"] == documents.schema_id(command) == json.loads(schema_path.read_text())["$id"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    """``qualify ARGV`` in process: exit code, stdout parsed as exactly one strict JSON document,
    and stderr."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    document = parse_untrusted_json(out.encode(), "stdout", max_bytes=16 << 20)  # one document, nothing else
    assert out.endswith("}\n") and out.count("\n}\n") == 1, out
    return code, document, err


@pytest.fixture
def quiet_key() -> None:
    ensure_signing_key(announce=lambda line: None)  # a first run's "made signing key" line is not ours


def test_every_json_command_has_a_committed_schema_naming_itself() -> None:
    commands = ("recipe", *(name for _, name in cli.JSON_COMMANDS))
    superseded = [f"cli-{command}.v{n}.schema.json" for command, version in documents.SCHEMA_VERSIONS.items()
                  for n in range(1, version)]  # kept for consumers of the older documents
    assert sorted(path.name for path in CONTRACTS_DIR.glob("cli-*.schema.json")) == sorted(
        [*(documents.schema_file(command) for command in commands), *superseded])  # none missing, none left over
    for command in commands:
        schema = json.loads((CONTRACTS_DIR / documents.schema_file(command)).read_text())
        assert schema["$id"] == documents.schema_id(command)
        refusal = schema["$defs"]["refusal"]["properties"]
        assert refusal["schema"] == {"const": documents.schema_id(command)}
        assert refusal["status"] == {"const": "refused"} and refusal["exit_code"] == {"const": 2}


@pytest.mark.parametrize(("argv", "start"), [case for case in BAD_OPTIONS if "--json=yes" not in case[0]],
                         ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_a_refusal_under_json_is_one_stderr_line_and_the_refused_document(
    places: Places, capsys: pytest.CaptureFixture[str], argv: list[str], start: str  # noqa: F811
) -> None:
    code, document, err = run_json(capsys, *concrete(argv, places), "--json")
    command = cli.json_command([*argv, "--json"])
    assert command is not None
    validate(command, document)
    assert code == 2 and err.count("\n") == 1 and err.startswith(expected_line(start, places)), err
    assert document == documents.refusal_document(command, err.strip())
    assert list(places.archive.iterdir()) == []


def test_a_run_refused_at_its_first_step_under_json_reports_its_refused_receipt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_key: None
) -> None:
    identity = tmp_path / "identity.json"
    identity.write_text(json.dumps({"lane": "nvfp4-native-splitk"}))
    code, document, err = run_json(capsys, "--recipe", "native-text", "--identity", str(identity), "--receipts",
                                   str(tmp_path / "archive"), "--json")
    validate("recipe", document)
    (receipt,) = (tmp_path / "archive").iterdir()
    summary = read_receipt_json(receipt, "validation-summary.json")
    assert code == 2 and document["exit_code"] == 2 and document["status"] == "refused" == summary["status"]
    assert document["message"] == err.strip() == summary["error"]
    assert document["receipt"] == {"path": str(receipt), "run_id": receipt.name}
    assert document["identity"] == {"path": str(identity), "sha256": None}
    assert document["verdict"]["headline"] == summary["verdict"] and document["samples"] == []
    assert document["verdict"]["scope"].startswith("nothing was judged")


def test_the_recipe_document_is_its_receipts_word(tmp_path: Path, quiet_key: None) -> None:
    records = [rung2_record(1), rung2_record(2, install_s=5.68e-05), rung2_record(3, max_abs=10.9)]
    receipt = write_receipt(tmp_path, records)
    document = documents.recipe_document(exit_code=0, message=None, recipe="native-text",
                                         identity_path=SHIPPED_IDENTITY, receipt=receipt, status="passed")
    validate("recipe", document)
    assert_recipe_document_matches_receipt(document, receipt)


def assert_recipe_document_matches_receipt(document: dict[str, Any], receipt: Path) -> None:
    summary = read_receipt_json(receipt, "validation-summary.json")
    predicate = statement_of(receipt)["predicate"]  # what the receipt's signed statement concludes
    assert document["status"] == summary["status"] == predicate["status"]
    assert (document["lane"], document["recipe"], document["rung"]) == (summary["lane"], summary["recipe"],
                                                                        summary["rung"])
    assert document["identity"]["sha256"] == summary["identity_sha256"] == predicate["identity_sha256"]
    assert document["verdict"] == {"passed": summary["passed"], "headline": summary["verdict"],
                                   "reasons": summary["reasons"], "scope": predicate["scope"]}
    assert document["scope"] == summary.get("scope")  # null for a v2 summary, which has none
    assert document["harness_version"] == __version__ == predicate["harness_version"]
    assert document["receipt"] == {"path": str(receipt), "run_id": receipt.name}
    assert len(document["samples"]) == summary["samples"]
    for sample in document["samples"]:
        record = read_receipt_json(receipt, f"samples/sample-{sample['repetition']}.json")
        assert sample["tokens_agreed"] == round(record["token_agreement_rate"] * record["output_tokens"])
        for name in ("output_tokens", "token_agreement_rate", "max_abs", "mean_abs", "payload_bytes",
                     "payload_gbit_per_s", "error"):
            assert sample[name] == record[name], name
        assert sample["phase_seconds"] == {phase: record[f"{phase}_s"] for phase in documents.PHASES}
        localisation = record.get("localisation") or {}
        assert sample["first_divergence_position"] == localisation.get("first_divergence_position")


@pytest.mark.parametrize("passed", [True, False])
def test_the_recipe_document_carries_its_receipts_scope(tmp_path: Path, quiet_key: None, passed: bool) -> None:
    records = [rung2_record(n) for n in (1, 2, 3)] if passed else [rung2_record(1, max_abs=10.9 * 2)]
    verdict = scoped(judge_summary(records, RULE))
    assert verdict.passed == passed
    receipt = write_receipt(tmp_path, records, verdict=verdict)
    document = documents.recipe_document(exit_code=0 if passed else 1, message=None, recipe="native-text",
                                         identity_path=SHIPPED_IDENTITY, receipt=receipt, status=verdict.status)
    validate("recipe", document)
    assert_recipe_document_matches_receipt(document, receipt)
    assert document["scope"] == scope_document(verdict.scope, passed)  # type: ignore[arg-type]
    assert document["verdict"]["headline"].startswith(("QUALIFIED on " if passed else "NOT QUALIFIED on ")
                                                      + document["scope"]["fixture_words"])


def test_the_recipe_document_of_a_v2_receipt_has_a_null_scope(tmp_path: Path, quiet_key: None) -> None:
    receipt = as_v2_receipt(write_receipt(tmp_path, [rung2_record(n) for n in (1, 2, 3)]))
    document = documents.recipe_document(exit_code=0, message=None, recipe="native-text",
                                         identity_path=SHIPPED_IDENTITY, receipt=receipt, status="passed")
    validate("recipe", document)
    assert document["scope"] is None and document["verdict"]["passed"] is True


def test_the_recipe_document_v2_is_v1_with_the_scope_of_the_summary_v3() -> None:
    """v2 adds ``scope`` and nothing else; its form is the receipt summary's, part for part."""
    v1, v2 = (json.loads((CONTRACTS_DIR / f"cli-recipe.v{n}.schema.json").read_text()) for n in (1, 2))
    summary_defs = json.loads((CONTRACTS_DIR / "validation-summary.v3.schema.json").read_text())["$defs"]
    scope_parts = ("ScopeRecord", "ScopeFixture", "ScopeControls", "ScopeControlDocument", "ScopeJudgedBy", "ScopeEnvelope")
    assert {name: v2["$defs"].pop(name) for name in scope_parts} == {name: summary_defs[name] for name in scope_parts}
    result = v2["$defs"]["result"]
    assert result["properties"].pop("scope")["anyOf"] == [{"$ref": "#/$defs/ScopeRecord"}, {"type": "null"}]
    result["required"].remove("scope")
    for branch in ("refusal", "result"):
        assert v2["$defs"][branch]["properties"]["schema"] == {"const": "trust-ladder.cli-recipe.v2"}
        v2["$defs"][branch]["properties"]["schema"] = {"const": "trust-ladder.cli-recipe.v1"}
    assert (v2.pop("$id"), v2.pop("description"), v1.pop("$id")) == (
        "trust-ladder.cli-recipe.v2", v1.pop("description").replace(
            "reasons and scope,", "reasons and scope, what the verdict covers (its fixture and the lane's controls),")
        + " v2 adds scope (v1: the same document without it).", "trust-ladder.cli-recipe.v1")
    assert v2 == v1


@settings(derandomize=True, deadline=None, max_examples=fuzz_examples(200),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(records=sample_records(), divergence=st.one_of(st.none(), st.integers(min_value=0, max_value=10**6)))
def test_sample_documents_of_any_record_validate(records: list[dict[str, Any]], divergence: int | None,
                                                 fuzz_tally: Any) -> None:
    """Whatever a record holds (NaN strings, huge or tiny numbers, errors), its document is valid."""
    fuzz_tally.add("examples")
    records[0]["localisation"] = {"first_divergence_position": divergence}
    document = documents.head("recipe", 1, None)
    document.update({"recipe": "native-text", "lane": None, "rung": None, "identity": {"path": None, "sha256": None},
                     "verdict": None, "scope": None, "receipt": None,
                     "samples": [documents.sample_document(record) for record in records]})
    validate("recipe", json.loads(documents.document_text(document)))
    assert document["samples"][0]["first_divergence_position"] == divergence
    fuzz_tally.add("with error" if any(record["error"] for record in records) else "measured")


def test_receipts_verify_json_matches_its_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      quiet_key: None) -> None:
    archive = tmp_path / "archive"
    good, bad = write_receipt(archive), write_receipt(archive)
    make_writable(bad)
    (bad / "command.log").write_text("edited")
    text_code = cli.main(["receipts", "verify", str(archive)])
    text = capsys.readouterr().out.splitlines()
    code, document, err = run_json(capsys, "receipts", "verify", str(archive), "--json")
    validate("receipts-verify", document)
    assert code == text_code == document["exit_code"] == 1 and document["status"] == "failed" and err == ""
    checks = {entry["name"]: entry for entry in document["receipts"]}
    assert checks[good.name]["state"] == "verified" and checks[good.name]["status"] == "passed"
    assert checks[good.name]["path"] == str(good) and checks[good.name]["problems"] == []
    assert checks[bad.name]["state"] == "tampered"
    assert [f"TAMPERED  {bad.name}: {problem}" for problem in checks[bad.name]["problems"]] == [
        line for line in text if line.startswith("TAMPERED")]
    assert document["tally"]["receipts"] == 2 and document["tally"]["tampered"] == 1
    assert text[-1] == "2 receipts: 1 verified (1 passed), 1 tampered"


def test_receipts_verify_json_with_nothing_to_verify_says_so(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, document, err = run_json(capsys, "receipts", "verify", str(tmp_path), "--json")
    validate("receipts-verify", document)
    assert code == 1 and document["receipts"] == [] and document["message"] == f"receipts verify: no receipts under {tmp_path}"


def test_identity_check_json_is_the_identity(capsys: pytest.CaptureFixture[str]) -> None:
    code, document, err = run_json(capsys, "identity", "check", str(SHIPPED_IDENTITY), "--json")
    validate("identity-check", document)
    identity = load_identity(SHIPPED_IDENTITY)
    assert code == 0 and err == "" and document["status"] == "passed"
    assert document["identity_sha256"] == identity_sha256(identity) and document["lane"] == identity.lane
    assert document["basis"]["uri"] == identity.onboarding_qualification.basis
    assert Path(document["basis"]["path"]).is_file()


@pytest.fixture
def fake_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quiet_key: None) -> Iterator[Calibration]:
    """``calibrate`` measured (without running) three handoffs, archived as a real signed receipt."""
    from qualify.judge.calibration import CellDrift
    from qualify.run import calibrate as calibrate_module

    records = [rung2_record(n, max_abs=1.5 + n) for n in (1, 2, 3)]
    cells = (CellDrift(1, "doc-a", 1024, 4.5, 1.233789, False), CellDrift(2, "doc-b", 1024, 2.5, 1.0, True))
    result = Calibration("nvfp4-native-f16", records, cells, 4.5, 1.233789, None,
                         write_receipt(tmp_path / "archive", records), [], True, True, True, "calibrated: 3 handoffs")
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *args, **kwargs: result)
    yield result


def test_calibrate_json_of_a_non_deterministic_producer_carries_its_envelope_and_no_anchor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_calibration: Calibration, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import replace

    from qualify.judge.envelope import FixtureEnvelope
    from qualify.run import calibrate as calibrate_module

    envelope = FixtureEnvelope(8, 2, (1.0,), (0.1,), (0.5,), (0.25, 0.25), (2.0, 2.0, 7.17, 6.56))
    result = replace(fake_calibration, envelope=envelope, non_deterministic=True, deterministic=False)
    asked: dict[str, Any] = {}
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *args, **kwargs: asked.update(kwargs) or result)
    code, document, err = run_json(capsys, "calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16",
                                   "--non-deterministic", "--receipts", str(tmp_path / "archive"), "--json")
    validate("calibrate", document)
    assert code == 0 and err == "" and document["anchors"] == 0
    assert (asked["non_deterministic"], asked["envelope_handoffs"], asked["envelope_starts"]) == (True, 8, 2)
    assert document["fixture_envelope"] == {"rule": "fixture-envelope-loo-range.v1", "handoffs": 8,
                                            "producer_starts": 2, "multipliers": [2.0, 2.0, 7.17, 6.56]}


def test_calibrate_json_carries_the_cells_and_next_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_calibration: Calibration
) -> None:
    from qualify.run.onboarding import next_steps

    code, document, err = run_json(capsys, "calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16",
                                   "--anchors", "3", "--receipts", str(tmp_path / "archive"), "--json")
    validate("calibrate", document)
    assert code == 0 == document["exit_code"] and err == ""
    assert document["next_steps"] == [{"text": step.text, "style": step.style}
                                      for step in next_steps(fake_calibration, "nvfp4-native-f16", "native-text")]
    assert document["proposed_rule"] == {"maximum_absolute": 4.5, "maximum_mean_absolute": 1.233789}
    assert document["observed"] == {"max_abs": 4.5, "mean_abs": 1.233789} and document["anchors"] == 3
    assert [(cell["document"], cell["max_abs"], cell["tokens_exact"]) for cell in document["cells"]] == [
        ("doc-a", 4.5, False), ("doc-b", 2.5, True)]
    assert document["controls"] is None and document["acceptance_floor"] is None
    receipt = fake_calibration.receipt_path
    assert receipt is not None and document["receipt"] == {"path": str(receipt), "run_id": receipt.name}
    assert [sample["max_abs"] for sample in document["samples"]] == [
        read_receipt_json(receipt, f"samples/sample-{n}.json")["max_abs"] for n in (1, 2, 3)]


def test_calibrate_json_of_a_non_finite_envelope_stays_strict_json(
    capsys: pytest.CaptureFixture[str], fake_calibration: Calibration
) -> None:
    from dataclasses import replace

    from qualify.judge.calibration import CellDrift

    fake_calibration.cells = (replace(fake_calibration.cells[0], max_abs=float("nan")), *fake_calibration.cells[1:])
    assert isinstance(fake_calibration.cells[0], CellDrift)
    fake_calibration.proposed_maximum_absolute = None
    code, document, _err = run_json(capsys, "calibrate", "--recipe", "native-text", "--lane", "nvfp4-native-f16",
                                    "--json")
    validate("calibrate", document)
    assert document["observed"]["max_abs"] == "NaN" and document["proposed_rule"] is None


def test_selftest_json_lists_every_fault_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.run import selftest

    def run_fault(name: str, rung: int, receipts: Path, on_step: Any = None) -> FaultResult:
        return FaultResult(name, "native-text", True, name != "v-scale", f"{name} found at L3 1.4216",
                           receipts / f"20260101T000000Z-{rung:016x}")

    monkeypatch.setattr(selftest, "all_fault_runs", lambda: [("kv-ulp", 2), ("v-scale", 2)])
    monkeypatch.setattr(selftest, "run_fault", run_fault)
    code, document, err = run_json(capsys, "selftest", "--receipts", str(tmp_path), "--json")
    validate("selftest", document)
    assert code == 1 == document["exit_code"] and document["status"] == "failed" and err == ""
    assert [(f["fault"], f["caught"], f["localised"], f["passed"]) for f in document["faults"]] == [
        ("kv-ulp", True, True, True), ("v-scale", True, False, False)]
    assert document["faults"][0]["receipt"]["path"] == str(tmp_path / "20260101T000000Z-0000000000000002")
    code, document, err = run_json(capsys, "selftest", "--json")  # receipts in a removed temporary directory
    assert all(fault["receipt"] is None for fault in document["faults"])


@pytest.mark.slow
def test_a_real_run_under_json_prints_one_document_its_receipt_confirms(tmp_path: Path, quiet_key: None) -> None:
    """The CLI as installed, piped: stdout is one document and nothing else, stderr empty, exit 0,
    every value the sealed receipt's. About 45 s (one full qualification)."""
    archive = tmp_path / "archive"
    archive.mkdir()
    env = {**os.environ, "QUALIFY_RECEIPTS": str(archive)}
    done = subprocess.run([sys.executable, "-c", "import sys; from qualify.interfaces.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", "--recipe", "native-text", "--reference-once", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # progress goes nowhere when stderr is not a terminal
    document = parse_untrusted_json(done.stdout.encode(), "stdout", max_bytes=16 << 20)
    validate("recipe", document)
    (receipt,) = archive.iterdir()
    assert_recipe_document_matches_receipt(document, receipt)
    assert document["identity"]["path"] == str(SHIPPED_IDENTITY) and document["exit_code"] == 0
    assert document["verdict"]["passed"] is True and len(document["samples"]) == 3
