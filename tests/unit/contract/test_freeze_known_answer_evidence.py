"""``tools/freeze_identity.py --producer-kat-evidence``: a KAT measured where its engine runs is
pinned only into an identity whose producer is the engine it was measured on.

The ``transformers`` lanes' producer runs on a GPU this host lacks, so its known-answer digest is
measured there (``tools/measure_known_answer.py``) and pinned here from that document. The freeze
pins it only where the document's engine for the lane is the identity's producer engine (name,
version, ABI equal), its measurements agree and its KAT input is this harness's; anything else is
refused in one line (exit 2) and writes nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qualify.core import assets
from qualify.engines.checkpoint import load_config
from qualify.engines.kat import KAT_EVIDENCE_SCHEMA, kat_input

REPO = Path(__file__).resolve().parents[3]
LANE = "transformers-cuda-bf16"
SHIPPED = assets.CONTRACTS_DIR / f"{LANE}-identity-v1.json"
MEASURED = "5e" * 32
"""A digest standing for one measured on the GPU."""


def _freeze_tool() -> types.ModuleType:
    path = REPO / "tools" / "freeze_identity.py"
    spec = importlib.util.spec_from_file_location("freeze_identity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evidence_document() -> dict[str, Any]:
    """What the measuring tool writes for the shipped bf16 identity's producer engine."""
    pinned = json.loads(SHIPPED.read_bytes())["producer_engine"]
    return {
        "schema": KAT_EVIDENCE_SCHEMA,
        "kat_input": kat_input(load_config(assets.MODEL_DIR).geometry.vocab),
        "host": {"gpu": "NVIDIA H200"},
        "lanes": {LANE: {"role": "producer", "engine": {key: pinned[key] for key in ("name", "version", "abi")},
                         "kat_sha256": MEASURED, "measurements": [MEASURED] * 3}},
    }


@pytest.fixture
def unpinned(tmp_path: Path) -> Path:
    """A copy of the shipped bf16 identity whose producer pins no known answer."""
    document = json.loads(SHIPPED.read_bytes())
    document["producer_engine"]["kat_sha256"] = None
    path = tmp_path / SHIPPED.name
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path


def write(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "known-answers.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def test_the_refreeze_pins_the_digest_measured_on_the_pinned_engine(
        unpinned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    freeze = _freeze_tool()
    before = json.loads(unpinned.read_bytes())
    argv = ["--refreeze", str(unpinned), "--producer-kat-evidence", str(write(tmp_path, evidence_document()))]
    assert freeze.main(argv) == 0, capsys.readouterr().err
    after = json.loads(unpinned.read_bytes())
    assert after["producer_engine"] == {**before["producer_engine"], "kat_sha256": MEASURED}
    assert {key: value for key, value in after.items() if key != "producer_engine"} == {
        key: value for key, value in before.items() if key != "producer_engine"}
    # Re-frozen again without the evidence: the measured digest is kept (this host cannot measure it).
    pinned = unpinned.read_bytes()
    assert freeze.main(["--refreeze", str(unpinned)]) == 0, capsys.readouterr().err
    assert unpinned.read_bytes() == pinned


def _other_abi(document: dict[str, Any]) -> None:
    engine = document["lanes"][LANE]["engine"]
    engine["abi"] = engine["abi"].replace("NVIDIA-H200", "NVIDIA-H100-80GB-HBM3")


def _other_version(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["engine"]["version"] = "transformers-5.18.0+torch-2.11.0+cu130"


def _other_lane_only(document: dict[str, Any]) -> None:
    document["lanes"] = {"transformers-cuda-fp32": document["lanes"][LANE]}


def _moving_digest(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["measurements"][2] = "0" * 64


def _one_measurement(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["measurements"] = [MEASURED]


def _other_input(document: dict[str, Any]) -> None:
    document["kat_input"]["tokens_sha256"] = "1" * 64


def _other_schema(document: dict[str, Any]) -> None:
    document["schema"] = "trust-ladder.known-answer-evidence.v0"


@pytest.mark.parametrize(("change", "refusal"), [
    (_other_abi, r"measured on producer_engine\.abi '.*NVIDIA-H100-80GB-HBM3.*', the identity pins '.*NVIDIA-H200.*': "
                 r"a known answer measured under other pins is not pinned"),
    (_other_version, r"measured on producer_engine\.version 'transformers-5\.18\.0\+torch-2\.11\.0\+cu130', the "
                     r"identity pins"),
    (_other_lane_only, rf"records no measurement of lane {LANE}"),
    (_moving_digest, r"is not what every measurement gave .*: no known answer"),
    (_one_measurement, r"is not what every measurement gave .*: no known answer"),
    (_other_input, r"kat_input: found .*, this harness's KAT input is"),
    (_other_schema, r"schema: found 'trust-ladder\.known-answer-evidence\.v0'"),
], ids=["h100-abi", "version", "no-lane", "not-deterministic", "one-measurement", "kat-input", "schema"])
def test_evidence_of_another_engine_or_input_is_refused_and_nothing_written(
        unpinned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        change: Callable[[dict[str, Any]], None], refusal: str) -> None:
    import re

    freeze = _freeze_tool()
    document = copy.deepcopy(evidence_document())
    change(document)
    before = unpinned.read_bytes()
    assert freeze.main(["--refreeze", str(unpinned), "--producer-kat-evidence", str(write(tmp_path, document))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("freeze_identity: refused: --producer-kat-evidence "), err
    assert re.search(refusal, err), err
    assert unpinned.read_bytes() == before


@pytest.mark.parametrize("lane", ["transformers-cuda-fp32", "transformers-cuda-tf32", "transformers-cuda-bf16"])
def test_the_committed_gpu_evidence_refreezes_each_shipped_gpu_identity_byte_for_byte(
        lane: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped GPU identities' producer digests are the ones measured on their H200
    (``bench/results/gpu-lanes/known-answers.json``): an identity with its digest dropped re-freezes
    from that file to exactly the shipped bytes."""
    shipped = assets.CONTRACTS_DIR / f"{lane}-identity-v1.json"
    document = json.loads(shipped.read_bytes())
    assert document["producer_engine"]["kat_sha256"] is not None
    document["producer_engine"]["kat_sha256"] = None
    path = tmp_path / shipped.name
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    evidence = REPO / "bench" / "results" / "gpu-lanes" / "known-answers.json"
    assert _freeze_tool().main(["--refreeze", str(path), "--producer-kat-evidence", str(evidence)]) == 0, (
        capsys.readouterr().err)
    assert path.read_bytes() == shipped.read_bytes()


def _lane_freeze_argv(out: Path) -> list[str]:
    """A new freeze of the bf16 lane from its basis receipt, with the engines its identity names."""
    document = json.loads(SHIPPED.read_bytes())
    producer, consumer = (document[role] for role in ("producer_engine", "consumer_engine"))
    return ["--lane", LANE, "--basis", document["onboarding_qualification"]["basis"],
            "--producer-engine", producer["name"], producer["version"], producer["abi"],
            "--consumer-engine", consumer["name"], consumer["version"], consumer["abi"], "--out", str(out)]


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def test_a_new_freeze_pins_the_measured_digest_and_without_it_is_refused_where_the_gpu_is_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--lane`` with the engines the identity names: with the committed evidence, exactly the
    shipped identity; without it, on a host that cannot build the GPU producer, refused in one line
    (an identity pinning no producer digest would be refused by every run) and nothing written."""
    freeze = _freeze_tool()
    evidence = REPO / "bench" / "results" / "gpu-lanes" / "known-answers.json"
    out = tmp_path / "frozen.json"
    assert freeze.main([*_lane_freeze_argv(out), "--producer-kat-evidence", str(evidence)]) == 0, (
        capsys.readouterr().err)
    assert out.read_bytes() == SHIPPED.read_bytes()
    if _cuda_available():
        return  # a GPU host builds the producer and measures its digest itself
    capsys.readouterr()
    bare = tmp_path / "bare.json"
    assert freeze.main(_lane_freeze_argv(bare)) == 2
    err = capsys.readouterr().err
    assert err.startswith("freeze_identity: refused: --producer-engine transformers-torch: its known-answer digest "
                          "is measured where it runs, and this host cannot build it (") and err.count("\n") == 1, err
    assert err.endswith("; measure it there (tools/measure_known_answer.py) and pass --producer-kat-evidence FILE\n")
    assert not bare.exists()
