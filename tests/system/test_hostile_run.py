"""A real qualification run against a producer that holds the run key and lies in its manifest.

The producer process is the shipped lane's own (``qualify.engines.factory.build_producer``), with
its sealing wrapped so every manifest it sends has one field rewritten and is MACed again with the
run key, as a compromised or buggy producer would. The run must end as not qualified (exit 1, not
"refused" and never "internal error"), its receipt must name the check that refused and verify,
and the producer must be gone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from qualify.archive.verify import verify_receipt
from qualify.contract.lanes import ProducerMode
from qualify.engines.base import Engine
from qualify.handoff.client import ProducerProcess
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions
from tests.support.receipt_forgery import check as authenticate

LIE_ENV = "QUALIFY_TEST_MANIFEST_LIE"
FACTORY = "tests.system.test_hostile_run:build_lying_producer"


def build_lying_producer(lane: str, mode: ProducerMode) -> Engine:
    """The lane's real producer engine; its service seals manifests with one field rewritten."""
    import qualify.handoff.service as running  # the service ``python -m qualify.interfaces.producer_command`` runs
    from qualify.engines.factory import build_producer
    from qualify.handoff.wire import SealedHandoff, manifest_canonical_bytes, manifest_mac

    honest_seal = running.seal_handoff_parts
    field, raw_value = os.environ[LIE_ENV].split("=", 1)

    def lying_seal(kv: Any, **arguments: Any) -> SealedHandoff:
        sealed: SealedHandoff = honest_seal(kv, **arguments)
        document = json.loads(sealed.manifest_bytes)
        placeholder = "\u0000lie\u0000"
        section, _, name = field.rpartition(".")
        (document[section] if section else document)[name] = placeholder
        # The raw JSON token goes in verbatim (1e400 is what no encoder writes).
        manifest = manifest_canonical_bytes(document).replace(json.dumps(placeholder).encode(), raw_value.encode())
        return SealedHandoff(manifest, manifest_mac(arguments["key"], manifest), sealed.payload_parts,
                             sealed.payload_size)

    running.seal_handoff_parts = lying_seal
    return build_producer(lane, mode)


@pytest.mark.slow
@pytest.mark.parametrize(("lie", "check"), [
    ('key_id="0123456789abcdef"', "manifest.key_id"),
    ('lane="reference-to-vllm"', "manifest.lane"),
    # One of the type lies that used to crash the consumer (the wire's own tests cover each).
    ("timings.compute_s=1e400", "manifest.json"),
], ids=["foreign-key-id", "foreign-lane", "compute-s-1e400"])
def test_a_run_given_a_lying_manifest_is_not_qualified_naming_the_check(
        lie: str, check: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIE_ENV, lie)
    run = QualificationRun(RunOptions(recipe="native-text", receipts=tmp_path, engine_factory=FACTORY))
    try:
        outcomes = [run.step(label) for label in STEP_LABELS[:2]]
        assert isinstance(run.producer, ProducerProcess)
        producer_pid = run.producer.pid
        outcomes += [run.step(label) for label in STEP_LABELS[2:4]]
    finally:
        run.close()
    assert [outcome.passed for outcome in outcomes] == [True, True, True, False]
    assert not run.refused  # not qualified (exit 1), not a refused contract (exit 2)
    assert f"handoff refused by check {check}" in outcomes[3].message
    assert run.verdict is not None and not run.verdict.passed
    assert run.receipt_path is not None and verify_receipt(run.receipt_path) == []
    assert authenticate(run.receipt_path).state == "verified"
    sample = json.loads((run.receipt_path / "samples" / "sample-1.json").read_text())
    assert f"check {check}" in sample["error"]
    assert run.producer is None
    with pytest.raises(ProcessLookupError):  # stopped and reaped: no producer left behind
        os.kill(producer_pid, 0)
