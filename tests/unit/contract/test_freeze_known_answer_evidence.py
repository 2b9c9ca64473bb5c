"""``tools/freeze_identity.py --producer-kat-evidence``/``--consumer-kat-evidence``: a KAT measured
where its engine runs is pinned only into an identity whose engine of that role is the engine it was
measured on.

The ``transformers`` lanes' producer and both ``torch-llama`` engines of the 8B-shaped lane run on a
GPU this host lacks, so their known-answer digests are measured there
(``tools/measure_known_answer.py``) and pinned here from that document. The freeze pins one only
where the document's engine for the lane and role is the identity's engine of that role (name,
version, ABI equal), its measurements agree and its KAT input is this harness's for the lane's
vocabulary; anything else is refused in one line (exit 2) and writes nothing.
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
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[3]
LANE = "transformers-cuda-bf16"
SHIPPED = assets.CONTRACTS_DIR / f"{LANE}-identity-v1.json"
MEASURED = "5e" * 32
"""A digest standing for one measured on the GPU."""


def _freeze_tool() -> types.ModuleType:
    return load_script(REPO / "tools" / "freeze_identity.py")


def evidence_document() -> dict[str, Any]:
    """What the measuring tool writes for the shipped bf16 identity's producer engine."""
    pinned = json.loads(SHIPPED.read_bytes())["producer_engine"]
    return {
        "schema": KAT_EVIDENCE_SCHEMA,
        "host": {"gpu": "NVIDIA H200"},
        "lanes": {LANE: {"kat_input": kat_input(load_config(assets.MODEL_DIR).geometry.vocab),
                         "producer": {"engine": {key: pinned[key] for key in ("name", "version", "abi")},
                                      "kat_sha256": MEASURED, "measurements": [MEASURED] * 3}}},
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
    engine = document["lanes"][LANE]["producer"]["engine"]
    engine["abi"] = engine["abi"].replace("NVIDIA-H200", "NVIDIA-H100-80GB-HBM3")


def _other_version(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["producer"]["engine"]["version"] = "transformers-5.18.0+torch-2.11.0+cu130"


def _other_lane_only(document: dict[str, Any]) -> None:
    document["lanes"] = {"transformers-cuda-fp32": document["lanes"][LANE]}


def _no_producer_entry(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["consumer"] = document["lanes"][LANE].pop("producer")


def _moving_digest(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["producer"]["measurements"][2] = "0" * 64


def _one_measurement(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["producer"]["measurements"] = [MEASURED]


def _other_input(document: dict[str, Any]) -> None:
    document["lanes"][LANE]["kat_input"]["tokens_sha256"] = "1" * 64


def _other_schema(document: dict[str, Any]) -> None:
    document["schema"] = "trust-ladder.known-answer-evidence.v0"


@pytest.mark.parametrize(("change", "refusal"), [
    (_other_abi, r"measured on producer_engine\.abi '.*NVIDIA-H100-80GB-HBM3.*', the identity pins '.*NVIDIA-H200.*': "
                 r"a known answer measured under other pins is not pinned"),
    (_other_version, r"measured on producer_engine\.version 'transformers-5\.18\.0\+torch-2\.11\.0\+cu130', the "
                     r"identity pins"),
    (_other_lane_only, rf"records no measurement of lane {LANE}$"),
    (_no_producer_entry, rf"records no measurement of lane {LANE}$"),
    (_moving_digest, r"is not what every measurement gave .*: no known answer"),
    (_one_measurement, r"is not what every measurement gave .*: no known answer"),
    (_other_input, r"kat_input: found .*, this harness's KAT input is"),
    (_other_schema, r"schema: found 'trust-ladder\.known-answer-evidence\.v0'"),
], ids=["h100-abi", "version", "no-lane", "no-producer", "not-deterministic", "one-measurement", "kat-input",
        "schema"])
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


def _lane_freeze_argv(out: Path, shipped: Path = SHIPPED) -> list[str]:
    """A new freeze of the lane of ``shipped`` (default the bf16 lane) from its basis receipt, with
    the engines its identity names."""
    document = json.loads(shipped.read_bytes())
    producer, consumer = (document[role] for role in ("producer_engine", "consumer_engine"))
    return ["--lane", document["lane"], "--basis", document["onboarding_qualification"]["basis"],
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


# ---- the 8B-shaped torch-llama lane: both of its engines measured on its GPU ------------------

LLAMA = "llama3-8b-shape-pd"
LLAMA_SHIPPED = assets.CONTRACTS_DIR / f"{LLAMA}-identity-v1.json"
LLAMA_EVIDENCE = REPO / "bench" / "results" / "gpu-lanes" / "known-answers-llama3-8b-shape.json"
"""Where both ``torch-llama`` engines' KATs measured on the H200 the identity pins are recorded
(``docs/gpu-lanes.md``, "Known answers")."""
ROLES = ("producer", "consumer")
DIGESTS = {"producer": "9a" * 32, "consumer": "c0" * 32}
"""Digests standing for the two measured on the GPU."""


def _llama_unpinned(tmp_path: Path) -> Path:
    """A copy of the shipped 8B-shaped identity whose engines pin no known answer."""
    document = json.loads(LLAMA_SHIPPED.read_bytes())
    for role in ROLES:
        assert document[f"{role}_engine"]["name"] == "torch-llama"
        document[f"{role}_engine"]["kat_sha256"] = None
    path = tmp_path / LLAMA_SHIPPED.name
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path


def llama_evidence_document() -> dict[str, Any]:
    """What the measuring tool writes for the shipped 8B-shaped identity's two engines (v2: the KAT
    input over the lane's vocabulary, an entry per role)."""
    document = json.loads(LLAMA_SHIPPED.read_bytes())
    entries = {role: {"engine": {key: document[f"{role}_engine"][key] for key in ("name", "version", "abi")},
                      "kat_sha256": DIGESTS[role], "measurements": [DIGESTS[role]] * 3} for role in ROLES}
    return {"schema": KAT_EVIDENCE_SCHEMA, "host": {"gpu": "NVIDIA H200"},
            "lanes": {LLAMA: {"kat_input": kat_input(128256), **entries}}}


def _both_evidence(path: Path) -> list[str]:
    return ["--producer-kat-evidence", str(path), "--consumer-kat-evidence", str(path)]


def test_the_llama_refreeze_pins_each_roles_digest_measured_on_its_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each role's digest goes to that role's pin (the eager producer's and the CUDA-graph
    consumer's differ), nothing else moves; one role's evidence pins that role only."""
    freeze = _freeze_tool()
    path = _llama_unpinned(tmp_path)
    before = json.loads(path.read_bytes())
    evidence = write(tmp_path, llama_evidence_document())
    assert freeze.main(["--refreeze", str(path), *_both_evidence(evidence)]) == 0, capsys.readouterr().err
    after = json.loads(path.read_bytes())
    for role in ROLES:
        assert after[f"{role}_engine"] == {**before[f"{role}_engine"], "kat_sha256": DIGESTS[role]}
    roles = {f"{role}_engine" for role in ROLES}
    assert {k: v for k, v in after.items() if k not in roles} == {k: v for k, v in before.items() if k not in roles}
    path = _llama_unpinned(tmp_path)
    assert freeze.main(["--refreeze", str(path), "--consumer-kat-evidence", str(evidence)]) == 0, (
        capsys.readouterr().err)
    document = json.loads(path.read_bytes())
    assert document["producer_engine"]["kat_sha256"] is None
    assert document["consumer_engine"]["kat_sha256"] == DIGESTS["consumer"]


def _h100(entry: dict[str, Any]) -> None:
    entry["engine"]["abi"] = entry["engine"]["abi"].replace("NVIDIA-H200", "NVIDIA-H100-80GB-HBM3")


def _the_other_roles_engine(entry: dict[str, Any]) -> None:
    """The consumer's entry carrying what was measured on the producer's engine (no CUDA graphs)."""
    entry["engine"]["abi"] = entry["engine"]["abi"].replace("+cudagraph", "+eager")


@pytest.mark.parametrize(("role", "change", "refusal"), [
    ("producer", _h100, r"measured on producer_engine\.abi '.*NVIDIA-H100-80GB-HBM3.*eager', the identity pins "
                        r"'.*NVIDIA-H200.*eager': a known answer measured under other pins is not pinned"),
    ("consumer", _h100, r"measured on consumer_engine\.abi '.*NVIDIA-H100-80GB-HBM3.*cudagraph', the identity pins "
                        r"'.*NVIDIA-H200.*cudagraph': a known answer measured under other pins is not pinned"),
    ("consumer", _the_other_roles_engine, r"measured on consumer_engine\.abi '.*\+eager', the identity pins "
                                          r"'.*\+cudagraph'"),
], ids=["producer-h100", "consumer-h100", "consumer-eager"])
def test_llama_evidence_of_another_engine_is_refused_and_nothing_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str,
        change: Callable[[dict[str, Any]], None], refusal: str) -> None:
    import re

    path = _llama_unpinned(tmp_path)
    before = path.read_bytes()
    document = llama_evidence_document()
    change(document["lanes"][LLAMA][role])
    assert _freeze_tool().main(["--refreeze", str(path), *_both_evidence(write(tmp_path, document))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"freeze_identity: refused: --{role}-kat-evidence "), err
    assert re.search(refusal, err), err
    assert path.read_bytes() == before


def test_llama_evidence_of_another_input_or_role_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The KAT input is drawn over the lane's own vocabulary (128256): evidence recording the shipped
    model's (4096) is another KAT; a document without the consumer's measurement pins none; a
    lane whose consumer is measured nowhere (the transformers lanes' exact numpy consumer) has no
    consumer evidence."""
    freeze = _freeze_tool()
    path = _llama_unpinned(tmp_path)
    before = path.read_bytes()
    document = llama_evidence_document()
    document["lanes"][LLAMA]["kat_input"] = kat_input(load_config(assets.MODEL_DIR).geometry.vocab)
    assert freeze.main(["--refreeze", str(path), *_both_evidence(write(tmp_path, document))]) == 2
    assert "kat_input: found {'seed': 35, 'vocab': 4096," in capsys.readouterr().err
    document = llama_evidence_document()
    del document["lanes"][LLAMA]["consumer"]
    evidence = write(tmp_path, document)
    assert freeze.main(["--refreeze", str(path), *_both_evidence(evidence)]) == 2
    assert capsys.readouterr().err == (f"freeze_identity: refused: --consumer-kat-evidence {evidence}: "
                                       f"records no measurement of lane {LLAMA}'s consumer\n")
    assert path.read_bytes() == before
    bf16 = tmp_path / "bf16" / SHIPPED.name
    bf16.parent.mkdir()
    bf16.write_bytes(SHIPPED.read_bytes())
    gpu = REPO / "bench" / "results" / "gpu-lanes" / "known-answers.json"
    assert freeze.main(["--refreeze", str(bf16), "--consumer-kat-evidence", str(gpu)]) == 2
    assert capsys.readouterr().err.endswith(f"records no measurement of lane {LANE}'s consumer\n")
    assert bf16.read_bytes() == SHIPPED.read_bytes()


def test_a_new_llama_freeze_pins_both_measured_digests_and_without_one_is_refused_where_the_gpu_is_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--lane llama3-8b-shape-pd`` with the engines the identity names: with evidence for both
    roles, the shipped identity with those digests; with the producer's only, on a host that cannot
    build the engines (no CUDA device, or no torch), refused in one line naming the consumer's
    option, and nothing written."""
    freeze = _freeze_tool()
    evidence = write(tmp_path, llama_evidence_document())
    out = tmp_path / "frozen.json"
    assert freeze.main([*_lane_freeze_argv(out, LLAMA_SHIPPED), *_both_evidence(evidence)]) == 0, (
        capsys.readouterr().err)
    expected = json.loads(LLAMA_SHIPPED.read_bytes())
    for role in ROLES:
        expected[f"{role}_engine"]["kat_sha256"] = DIGESTS[role]
    assert json.loads(out.read_bytes()) == expected
    if _cuda_available():
        return  # a GPU host builds the engines and measures their digests itself
    capsys.readouterr()
    bare = tmp_path / "bare.json"
    assert freeze.main([*_lane_freeze_argv(bare, LLAMA_SHIPPED), "--producer-kat-evidence", str(evidence)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("freeze_identity: refused: --consumer-engine torch-llama: its known-answer digest "
                          "is measured where it runs, and this host cannot build it (") and err.count("\n") == 1, err
    assert err.endswith("; measure it there (tools/measure_known_answer.py) and pass --consumer-kat-evidence FILE\n")
    assert not bare.exists()


def test_the_shipped_llama_identity_pins_the_digests_its_committed_evidence_records(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both engines were measured on the H200 and the evidence committed: the identity pins what it
    records, and re-freezes from it byte for byte."""
    document = json.loads(LLAMA_SHIPPED.read_bytes())
    assert [document[f"{role}_engine"]["kat_sha256"] is not None for role in ROLES] == [True, True]
    path = _llama_unpinned(tmp_path)
    assert _freeze_tool().main(["--refreeze", str(path), *_both_evidence(LLAMA_EVIDENCE)]) == 0, (
        capsys.readouterr().err)
    assert path.read_bytes() == LLAMA_SHIPPED.read_bytes()
