"""Host facts: what each process of a run ran on (CPU, ISA, BLAS kernel and threads, numpy SIMD,
GPU, harness commit), reported by the producer on its ready answer and recorded in host.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qualify.archive.keys import ensure_signing_key
from qualify.archive.layout import HOST, HOST_SCHEMA
from qualify.archive.reader import read_receipt_json, receipt_files
from qualify.archive.verify import verify_receipt
from qualify.archive.writer import ReceiptWriter
from qualify.contract.lanes import lane_spec
from qualify.core.assets import REPO_ROOT
from qualify.core.hostenv import (
    HOST_ENV_VARS,
    HOST_FACTS_KEYS,
    HOST_FACTS_SCHEMA,
    cpu_flags,
    host_facts,
    host_facts_problem,
)
from qualify.judge import judge_incomplete
from qualify.run.run_contract import Contract
from tests.support.receipt_forgery import check, envelope_of, make_writable
from tests.unit.archive.test_receipts import committed_receipts

IDENTITY = {"schema": "trust-ladder.calibration.v2", "lane": "nvfp4-native-splitk"}
LANE = "nvfp4-native-w4a4"


def lane_calibration_contract(lane: str = LANE) -> Contract:
    """The contract ``qualify calibrate`` runs ``lane`` under (the committed calibration set's
    cells, then two fixture anchors; no controls): the qualifier's own path, no identity needed."""
    from qualify.contract.controls import load_calibration_set
    from qualify.run.calibrate import calibration_handoffs
    from qualify.run.run_contract import calibration_contract

    calibration_set, digest = load_calibration_set()
    return calibration_contract(lane_spec(lane), "native-text", calibration_handoffs(calibration_set, 2),
                                calibration_set={"name": calibration_set.name, "sha256": digest}, controls=None,
                                output_tokens=calibration_set.output_tokens)


def facts_in_subprocess(env: dict[str, str]) -> dict:
    """host_facts() of a fresh interpreter with ``env`` set on top of ours (variables we set are
    removed first, so only ``env`` decides them)."""
    child_env = {k: v for k, v in os.environ.items() if k not in HOST_ENV_VARS}
    child_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", "import json; from qualify.core.hostenv import host_facts; print(json.dumps(host_facts()))"],
        cwd=REPO_ROOT, env=child_env, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(done.stdout)


def assert_facts_shape(facts: dict) -> None:
    assert set(facts) == HOST_FACTS_KEYS and facts["schema"] == HOST_FACTS_SCHEMA
    assert host_facts_problem(facts) is None
    assert type(facts["pid"]) is int and facts["pid"] > 0
    assert isinstance(facts["python"], str) and isinstance(facts["machine"], str) and isinstance(facts["platform"], str)
    cpu = facts["cpu"]
    assert isinstance(cpu["model"], str) and cpu["isa_class"].startswith(facts["machine"])
    assert cpu["isa_flags"] == sorted(cpu["isa_flags"]) and set(cpu["isa_flags"]) <= cpu_flags()
    assert cpu["logical_cpus"] is None or type(cpu["logical_cpus"]) is int
    assert set(facts["env"]) == set(HOST_ENV_VARS)
    assert all(value is None or isinstance(value, str) for value in facts["env"].values())
    blas = facts["blas"]
    assert isinstance(blas["library"], str) and "-" in blas["library"]
    assert blas["kernel"] is None or isinstance(blas["kernel"], str)
    assert blas["num_threads"] is None or type(blas["num_threads"]) is int
    assert isinstance(blas["pools"], list)
    assert all("/" not in pool["library"] for pool in blas["pools"])  # no paths (user names)
    numpy_facts = facts["numpy"]
    assert isinstance(numpy_facts["version"], str)
    assert set(numpy_facts["simd_dispatch_enabled"]) <= set(numpy_facts["simd_dispatch_built"])
    assert isinstance(numpy_facts["simd_baseline"], list)
    assert facts["torch"] is None or isinstance(facts["torch"], dict)
    assert facts["gpu"] is None or isinstance(facts["gpu"], dict)
    harness = facts["harness"]
    assert set(harness) == {"commit", "dirty"}
    assert harness["commit"] is None or (len(harness["commit"]) in (40, 64) and isinstance(harness["dirty"], (bool, type(None))))


def test_host_facts_fields_and_types() -> None:
    facts = host_facts()
    assert_facts_shape(facts)
    assert facts["pid"] == os.getpid()
    json.dumps(facts, allow_nan=False)
    assert facts["env"] == {name: os.environ.get(name) for name in HOST_ENV_VARS}
    text = json.dumps(facts)
    assert os.uname().nodename not in text.split('"')  # no hostname
    if (REPO_ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        assert facts["harness"]["commit"] == head


def test_host_facts_never_import_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from qualify.core.hostenv import host_facts; f = host_facts(); "
         "print('torch' in sys.modules, f['torch'], f['gpu'])"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=True,
    )
    assert done.stdout.split() == ["False", "None", "None"]


def test_host_facts_follow_the_environment_set() -> None:
    plain = facts_in_subprocess({})
    enabled = plain["numpy"]["simd_dispatch_enabled"]
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    if enabled:
        env["NPY_DISABLE_CPU_FEATURES"] = enabled[-1]  # the highest target this CPU dispatches to
    if "avx2" in cpu_flags():
        env["OPENBLAS_CORETYPE"] = "Haswell"
    facts = facts_in_subprocess(env)
    assert_facts_shape(facts)
    assert facts["env"] == {name: env.get(name) for name in HOST_ENV_VARS}
    if plain["blas"]["kernel"] is None:
        pytest.skip("threadpoolctl sees no BLAS pool in numpy here")
    assert facts["blas"]["num_threads"] == 1
    if "OPENBLAS_CORETYPE" in env:
        assert facts["blas"]["kernel"] == env["OPENBLAS_CORETYPE"]
    if enabled:
        assert enabled[-1] not in facts["numpy"]["simd_dispatch_enabled"]
        assert facts["numpy"]["simd_dispatch_enabled"] == enabled[:-1] or \
            set(facts["numpy"]["simd_dispatch_enabled"]) < set(enabled)
    assert facts["cpu"] == plain["cpu"] and facts["harness"] == plain["harness"]


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda f: "not a dict", "expected a JSON object"),
    (lambda f: {**f, "hostname": "x"}, "keys differ"),
    (lambda f: {k: v for k, v in f.items() if k != "blas"}, "keys differ"),
    (lambda f: {**f, "schema": "other"}, "schema"),
    (lambda f: {**f, "pid": "1"}, "pid"),
    (lambda f: {**f, "cpu": ["x"]}, "cpu is not an object"),
    (lambda f: {**f, "gpu": 3}, "gpu is neither"),
    (lambda f: {**f, "cpu": {**f["cpu"], "model": "x" * 5000}}, "longer than"),
    (lambda f: {**f, "blas": {**f["blas"], "x": float("nan")}}, "not finite"),
    (lambda f: {**f, "env": {"a": [[[[[[["deep"]]]]]]]}}, "deeper"),
    (lambda f: {**f, "numpy": {"v": list(range(1000))}}, "items"),
])
def test_host_facts_problem_refuses_malformed_documents(mutate, problem) -> None:
    found = host_facts_problem(mutate(host_facts()))
    assert found is not None and problem in found


# ------------------------------------------------------------------------------------------
# the producer reports its facts on the ready answer


def test_producer_reports_its_own_host_facts(tmp_path: Path) -> None:
    from qualify.handoff.client import ProducerProcess
    from tests.unit.handoff.test_handoff_service import EXPECTATION, FACTORY, HANG_GUARD_DEADLINES, KEY, RUN_ID

    with ProducerProcess(lane="stub-ok", mode="exact", key=KEY, run_id=RUN_ID, expectation=EXPECTATION,
                         watchdog_s=30.0, deadlines=HANG_GUARD_DEADLINES,
                         engine_factory=FACTORY, env={"OPENBLAS_NUM_THREADS": "1"}) as p:
        facts = p.host_facts
        assert p.host_facts_problem is None and facts is not None
        assert_facts_shape(facts)
        assert facts["pid"] == p.pid != os.getpid()
        assert facts["env"]["OPENBLAS_NUM_THREADS"] == "1"
        if facts["blas"]["kernel"] is not None:
            assert facts["blas"]["num_threads"] == 1


@pytest.mark.parametrize(("ready", "problem"), [
    ({"op": "ready", "status": "ok"}, "no host facts"),
    ({"op": "ready", "status": "ok", "host": None}, "malformed"),
    ({"op": "ready", "status": "ok", "host": {"schema": HOST_FACTS_SCHEMA}}, "malformed"),
    ({"op": "ready", "status": "ok", "host": ["x"] * 10}, "malformed"),
])
def test_client_records_missing_or_malformed_facts_as_missing(ready, problem) -> None:
    from qualify.handoff.client import checked_host_facts

    facts, why = checked_host_facts(ready)
    assert facts is None and why is not None and problem in why
    facts_here = host_facts()
    assert checked_host_facts({"op": "ready", "status": "ok", "host": facts_here}) == (facts_here, None)


# ------------------------------------------------------------------------------------------
# host.json in receipts


def _writer(tmp_path: Path, **options) -> ReceiptWriter:
    return ReceiptWriter(tmp_path, command_line=["q"], identity=IDENTITY, recipe="native-text", lane="l", **options)


def test_receipt_without_producer_has_host_json_with_producer_null(tmp_path: Path) -> None:
    receipt = _writer(tmp_path).finalize(judge_incomplete("no producer"))
    assert verify_receipt(receipt) == [] and check(receipt).state == "verified"
    assert HOST in receipt_files(receipt)  # covered by the manifest and the signed statement like every file
    host = read_receipt_json(receipt, HOST)
    assert host["schema"] == HOST_SCHEMA and host["producers"] == []
    assert_facts_shape(host["consumer"])
    assert host["consumer"]["pid"] == os.getpid()


def test_receipt_records_producer_facts_or_why_they_are_missing(tmp_path: Path) -> None:
    producer_facts = host_facts() | {"pid": 1}
    writer = _writer(tmp_path)
    writer.set_producer_host(producer_facts)
    writer.set_producer_host(producer_facts | {"pid": 2})  # a restarted producer comes after
    host = read_receipt_json(writer.finalize(judge_incomplete("x")), HOST)
    assert host["producers"] == [{"facts": producer_facts, "note": None},
                                 {"facts": producer_facts | {"pid": 2}, "note": None}]

    writer = _writer(tmp_path)
    writer.set_producer_host({"schema": "forged"})
    receipt = writer.finalize(judge_incomplete("x"))
    host = read_receipt_json(receipt, HOST)
    [start] = host["producers"]
    assert start["facts"] is None and "malformed host facts" in start["note"]
    assert verify_receipt(receipt) == [] and check(receipt).state == "verified"

    writer = _writer(tmp_path)
    writer.set_producer_host(None, problem="the producer's ready answer has no host facts")
    host = read_receipt_json(writer.finalize(judge_incomplete("x")), HOST)
    assert host["producers"] == [{"facts": None, "note": "the producer's ready answer has no host facts"}]


def test_altered_or_unlisted_host_json_fails_verification(tmp_path: Path) -> None:
    receipt = _writer(tmp_path).finalize(judge_incomplete("x"))
    make_writable(receipt)
    host = json.loads((receipt / HOST).read_text())
    host["consumer"]["cpu"]["model"] = "another CPU"
    (receipt / HOST).write_text(json.dumps(host))
    assert any(f"altered file {HOST}" in p for p in verify_receipt(receipt))
    checked = check(receipt)
    assert checked.state == "tampered"
    assert f"file {HOST}: sha256 differs from the signed statement's subject" in checked.problems


def test_committed_receipts_without_host_json_are_intact_and_unsigned() -> None:
    """The legacy receipts (most without host.json, none with a signed statement) still match
    their own manifests, and are reported unsigned, never verified. The signed ones all hold
    host.json, covered by their manifests like every file, with the consumer's and every producer
    start's facts; signed by keys this session does not trust, they are untrusted here."""
    legacy, signed = committed_receipts()
    assert legacy and signed
    ensure_signing_key(announce=lambda line: None)  # the session's trust file, listing its own key only
    for receipt in legacy:
        assert verify_receipt(receipt) == [], receipt.name
        checked = check(receipt)
        assert (checked.state, checked.problems) == ("unsigned", []), checked
    for receipt in signed:
        assert verify_receipt(receipt) == [], receipt.name  # host.json's facts included
        assert HOST in receipt_files(receipt), receipt.name
        host = read_receipt_json(receipt, HOST)
        assert host["schema"] == HOST_SCHEMA and host_facts_problem(host["consumer"]) is None, receipt.name
        assert host["producers"] and all(host_facts_problem(start["facts"]) is None for start in host["producers"])
        checked = check(receipt)  # signed by a key this session's trust file does not list
        [signature] = envelope_of(receipt)["signatures"]
        assert (checked.state, len(checked.problems)) == ("untrusted", 1), checked
        assert f"signed by key {signature['keyid'][:16]}…" in checked.problems[0]


def test_run_records_both_processes_host_facts(tmp_path: Path) -> None:
    """The qualifier's own path (identity sealed, producer ready) with the producer's environment
    overridden: host.json records the producer as it ran, not the consumer's settings."""
    from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions

    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path), lane_calibration_contract())
    run.producer_env = {"OPENBLAS_NUM_THREADS": "1"}
    if "avx2" in cpu_flags():
        run.producer_env["OPENBLAS_CORETYPE"] = "Haswell"
    try:
        outcomes = [run.step(label) for label in STEP_LABELS[:2]]
        assert all(o.passed for o in outcomes), outcomes
        producer_pid = run.producer.pid
    finally:
        run.close()
    receipt = run.receipt_path
    assert receipt is not None and verify_receipt(receipt) == [] and check(receipt).state == "verified"
    host = read_receipt_json(receipt, HOST)
    assert_facts_shape(host["consumer"])
    [start] = host["producers"]
    producer = start["facts"]
    assert_facts_shape(producer)
    assert host["consumer"]["pid"] == os.getpid() and producer["pid"] == producer_pid
    for name, value in run.producer_env.items():
        assert producer["env"][name] == value
    if producer["blas"]["kernel"] is not None:
        assert producer["blas"]["num_threads"] == 1
        if "OPENBLAS_CORETYPE" in run.producer_env:
            assert producer["blas"]["kernel"] == "Haswell"
    assert "producer host: pid" in (receipt / "command.log").read_text()


def test_run_without_a_producer_records_producer_null(tmp_path: Path) -> None:
    from qualify.run.qualification import QualificationRun, RunOptions

    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path), lane_calibration_contract())
    assert run.step("identity sealed").passed
    run.close()
    host = read_receipt_json(run.receipt_path, HOST)
    assert host["producers"] == []
    assert host["consumer"]["pid"] == os.getpid()


@pytest.mark.slow
def test_full_calibration_receipt_holds_both_host_facts(tmp_path: Path) -> None:
    """A real calibration end to end (the calibration set's documents cut to 256 tokens, and two
    anchors: no sealed identity needed)."""
    from qualify.run.calibrate import calibrate, calibration_environments
    from qualify.run.qualification import RunOptions
    from tests.conftest import small_calibration_set

    small_set = small_calibration_set(tmp_path)
    calibration = calibrate(lane_spec(LANE), "native-text", RunOptions(recipe="native-text", receipts=tmp_path),
                            calibration_set=small_set, controls=False)
    receipt = calibration.receipt_path
    assert calibration.failures == [] and receipt is not None and verify_receipt(receipt) == []
    assert check(receipt).state == "verified"
    assert "samples/sample-2.json" in receipt_files(receipt) and HOST in receipt_files(receipt)
    host = read_receipt_json(receipt, HOST)
    assert_facts_shape(host["consumer"])
    handoffs = read_receipt_json(receipt, "evidence/calibration.json")["handoffs"]
    cells = len(small_set[0].documents) * len(small_set[0].prompt_lengths)
    assert [handoff["part"] for handoff in handoffs] == ["calibration"] * cells + ["anchor"] * 2
    # Every handoff has a freshly started producer, the n-th under the n-th environment in turn
    # (the first as the operator set it: the producer the steps started).
    starts = [start["facts"] for start in host["producers"]]
    assert len(starts) == len(handoffs)
    environments = calibration_environments()
    for index, (producer, handoff) in enumerate(zip(starts, handoffs, strict=True)):
        assert_facts_shape(producer)
        assert producer["pid"] != host["consumer"]["pid"] == os.getpid()
        assert producer["cpu"] == host["consumer"]["cpu"]  # one machine here
        assert producer["harness"] == host["consumer"]["harness"]
        assert handoff["environment"] == environments[index % len(environments)]
        for name, value in handoff["environment"].items():
            if name in HOST_ENV_VARS:  # the variables host facts record
                assert producer["env"][name] == value, (index, name)
    assert len({producer["pid"] for producer in starts}) == len(starts)
    assert any(set(handoff["environment"]) & set(HOST_ENV_VARS) for handoff in handoffs[1:])
    assert calibration.deterministic
