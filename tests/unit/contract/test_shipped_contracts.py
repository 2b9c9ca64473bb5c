"""The shipped identities, their seal, the generated schema and the artifacts agree with each other.

If a model file, prompt, tokenizer or engine ABI changes without a re-freeze, these fail; so do an
identity model change without ``tools/freeze_identity.py --write-schema`` and an identity edit
without ``--write-sealed``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from qualify.archive.reader import resolve_receipt_uri
from qualify.archive.verify import check_receipt
from qualify.contract.identity import (
    DEFAULT_ARCHIVE_DIR,
    IDENTITY_SCHEMA_IDS,
    IDENTITY_SCHEMA_PATHS,
    check_basis_receipt,
    identity_json_schema,
    identity_schema_text,
    load_identity,
    parse_identity_document,
)
from qualify.contract.lanes import VLLM_LANE_ENGINES, LaneKind, lane_spec, target_cache_identity
from qualify.contract.sealed_data import SEALED_BASIS_MANIFESTS, SEALED_IDENTITIES
from qualify.core import assets
from qualify.core.digests import canonical_json_bytes, sha256_bytes, sha256_file
from qualify.engines.factory import (
    build_cache_identity,
    build_consumer,
    build_producer,
    checkpoint_digests,
)

SHIPPED = sorted(assets.CONTRACTS_DIR.glob("*-identity-v1.json"))
"""The shipped model's identities (the tests below check these lanes' engines and artifacts)."""
MODEL_IDENTITIES = sorted(assets.CONTRACTS_DIR.glob("models/*/*-identity-v1.json"))
"""A published model's identities, sealed as ``<model>/<lane>`` (``docs/models.md``)."""
CONNECTOR_IDENTITIES = sorted([*assets.CONTRACTS_DIR.glob("connectors/*-identity-v1.json"),
                               *assets.CONTRACTS_DIR.glob("models/*/connectors/*-identity-v1.json")])
"""Connector lanes' identities, sealed as ``[<model>/]vllm-via-connector/<connector>`` (docs/connectors.md)."""


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def test_every_sealed_lane_ships_an_identity_and_every_identity_is_sealed():
    shipped_lanes = {json.loads(path.read_text())["lane"] for path in SHIPPED}
    shipped_lanes |= {f"{path.parent.name}/{json.loads(path.read_text())['lane']}" for path in MODEL_IDENTITIES}
    shipped_lanes |= {parse_identity_document(json.loads(path.read_text()), where=str(path)).seal_name
                      for path in CONNECTOR_IDENTITIES}
    assert MODEL_IDENTITIES and CONNECTOR_IDENTITIES
    assert shipped_lanes == set(SEALED_IDENTITIES) == set(SEALED_BASIS_MANIFESTS)
    assert {"native-text", "kquant-target-plus-dflash"} <= {
        json.loads(path.read_text())["recipe"] for path in SHIPPED}


@pytest.mark.parametrize("schema_id", IDENTITY_SCHEMA_IDS)
def test_the_committed_schema_is_the_one_generated_from_the_identity_model(schema_id: str):
    committed = IDENTITY_SCHEMA_PATHS[schema_id].read_bytes()
    assert canonical_json_bytes(json.loads(committed)) == canonical_json_bytes(identity_json_schema(schema_id)), (
        "regenerate it: .venv/bin/python tools/freeze_identity.py --write-schema")
    assert committed == identity_schema_text(schema_id).encode("utf-8")
    jsonschema.Draft202012Validator.check_schema(identity_json_schema(schema_id))


def _freeze_tool() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("freeze_identity", assets.REPO_ROOT / "tools" / "freeze_identity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_sealed_data_is_what_the_freeze_tool_generates():
    freeze = _freeze_tool()
    seals = freeze.shipped_seals(assets.CONTRACTS_DIR, DEFAULT_ARCHIVE_DIR)
    assert freeze.SEALED_DATA_PATH.read_text(encoding="utf-8") == freeze.sealed_data_source(seals), (
        "regenerate it: .venv/bin/python tools/freeze_identity.py --write-sealed")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_identity_validates_and_pins_the_real_artifacts(path: Path):
    jsonschema.Draft202012Validator(identity_json_schema()).validate(json.loads(path.read_bytes()))
    identity = load_identity(path)
    basis = check_basis_receipt(identity, resolve_receipt_uri, check_receipt, where=f"identity {path}")
    assert sha256_file(basis.parent / "manifest.json") == SEALED_BASIS_MANIFESTS[identity.lane]
    for relpath, digest in identity.checkpoint.files.items():
        assert sha256_file(assets.REPO_ROOT / relpath) == digest, relpath
    assert sha256_file(assets.MODEL_DIR / "tokenizer.json") == identity.tokenizer_sha256
    prompt = assets.load_prompt(identity.prompt.name)
    assert len(prompt) == identity.onboarding_qualification.prompt_tokens
    assert assets.prompt_sha256(prompt) == identity.onboarding_qualification.prompt_sha256
    # The cache identity is derived, not asserted: the lane's producer ABI and checkpoint digests.
    spec = lane_spec(identity.lane)
    assert target_cache_identity(spec, checkpoint_digests(spec.kind), identity.producer_engine.abi) \
        == identity.target_cache_identity_sha256
    # A vLLM producer's ABI pins the installed vLLM (RECORD digest): derivable only where it is; a
    # transformers CUDA producer's names the GPU: derivable only on one.
    if identity.lane in VLLM_LANE_ENGINES and VLLM_LANE_ENGINES[identity.lane][0] == "vllm" \
            and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM producer ABI: needs the vllm extra (tools/install_vllm.sh)")
    if spec.kind in (LaneKind.TRANSFORMERS, LaneKind.TORCH_LLAMA) and not _cuda_available():
        pytest.skip(f"{spec.kind.value} CUDA producer ABI names the GPU: needs an NVIDIA GPU")
    assert build_cache_identity(spec) == identity.target_cache_identity_sha256


def test_prompt_digest_is_over_little_endian_uint32_token_ids():
    prompt = assets.load_prompt()
    assert assets.prompt_sha256(prompt) == sha256_bytes(b"".join(int(t).to_bytes(4, "little") for t in prompt))


_KV_DIGEST = """
import sys, numpy as np
from qualify.core import assets
from qualify.core.digests import sha256_bytes
from qualify.contract.lanes import lane_spec
from qualify.engines.factory import build_consumer, build_producer
engine = build_producer("nvfp4-exact", "exact") if sys.argv[1] == "producer" else build_consumer(lane_spec("nvfp4-native-w4a4"))
kv = engine.prefill(assets.load_prompt()[:2047])
print(sha256_bytes(b"".join(np.ascontiguousarray(t).tobytes() for t in kv.tensors().values())))
"""


def _kv_digest(role: str, blas_threads: str, blas_kernel: str | None = None) -> str:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=blas_threads)
    if blas_kernel is not None:
        env["OPENBLAS_CORETYPE"] = blas_kernel
    return subprocess.run([sys.executable, "-c", _KV_DIGEST, role], env=env, check=True,
                          capture_output=True, text=True, timeout=600).stdout.strip()


@pytest.mark.slow
def test_exact_mode_prefill_is_bit_identical_to_the_consumers_across_processes_and_thread_counts():
    # The consumer on two BLAS threads and OpenBLAS's SSE3 kernels (named Katmai; every x86-64
    # CPU runs them), the producer on one thread and the kernel picked for this CPU.
    assert _kv_digest("producer", "1") == _kv_digest("consumer", "2", "Prescott")


def test_native_producer_is_not_the_consumer():
    """The native lanes really differ from the consumer (otherwise rung 2 would test nothing)."""
    prompt = assets.load_prompt()[:300]
    consumer_kv = build_consumer(lane_spec("nvfp4-native-splitk")).prefill(prompt)
    native_kv = build_producer("nvfp4-native-splitk", "native").prefill(prompt)
    assert any(not np.array_equal(a, b) for a, b in zip(consumer_kv.keys, native_kv.keys, strict=False))


AWAITING_VLLM_KNOWN_ANSWER = {
    "models/smollm2-135m-instruct-q4_1/vllm-to-reference-identity-v1.json":
        "calibrated on 2026-12-01 on class x86_64+avx2+avx512f+avx512_bf16+avx512_vnni, before vLLM known "
        "answers; its re-calibration (a numpy SmolLM2 consumer, about 20 minutes on two idle cores) did not "
        "fit the round that added them (docs/models.md)",
}
"""Shipped identities frozen before vLLM known-answer digests existed, by path under contracts/."""


@pytest.mark.parametrize("path", [*SHIPPED, *MODEL_IDENTITIES, *CONNECTOR_IDENTITIES],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_shipped_identity_pins_no_source_bytes_and_a_known_answer_for_each_engine_that_has_one(path: Path):
    """An engine source edit that keeps the arithmetic needs no re-freeze: no identity pins a
    source file, and each numpy or vLLM engine is pinned by its known-answer digest instead."""
    from qualify.core.errors import Refused
    from qualify.engines.kat import KAT_ENGINE_NAMES, check_pinned

    document = json.loads(path.read_bytes())
    assert "adapter" not in document
    for role in ("producer_engine", "consumer_engine"):
        engine = document[role]
        assert "numpy-" not in engine["abi"].replace("numpy-llama", "")
        where = path.relative_to(assets.CONTRACTS_DIR).as_posix()
        if where in AWAITING_VLLM_KNOWN_ANSWER and engine["name"] == "vllm":
            # No run can use it until it is re-frozen: refused at 'identity sealed'.
            with pytest.raises(Refused, match=f"{role}.kat_sha256: pinned none"):
                check_pinned(engine["name"], engine["kat_sha256"], role.removesuffix("_engine"), str(path))
            continue
        assert (engine["kat_sha256"] is not None) == (engine["name"] in KAT_ENGINE_NAMES)


GPU_KNOWN_ANSWERS = assets.REPO_ROOT / "bench" / "results" / "gpu-lanes" / "known-answers.json"
"""Where the ``transformers`` lanes' producer KATs were measured (on their H200, by
``tools/measure_known_answer.py``) and pinned from (``tools/freeze_identity.py --producer-kat-evidence``)."""


@pytest.mark.parametrize("path", [p for p in SHIPPED if json.loads(p.read_bytes())["lane_kind"] == "transformers"],
                         ids=lambda p: p.name)
def test_a_gpu_identity_pins_the_producer_known_answer_measured_on_its_engine(path: Path):
    """The digest a transformers identity pins for its GPU producer is the one the committed evidence
    records for that very engine (name, version and ABI equal, every measurement the same;
    ``test_freeze_known_answer_evidence.py`` re-freezes each from that file, byte for byte)."""
    producer = json.loads(path.read_bytes())["producer_engine"]
    lane = json.loads(path.read_bytes())["lane"]
    assert producer["name"] == "transformers-torch"
    assert _freeze_tool().evidence_known_answer(GPU_KNOWN_ANSWERS, lane, producer) == producer["kat_sha256"]


LLAMA_KNOWN_ANSWERS = assets.REPO_ROOT / "bench" / "results" / "gpu-lanes" / "known-answers-llama3-8b-shape.json"
"""Where both engines of the ``torch-llama`` lane are recorded once measured (on the H200 its identity
pins) and pinned from (``--producer-kat-evidence`` and ``--consumer-kat-evidence``)."""


@pytest.mark.parametrize("path", [p for p in SHIPPED if json.loads(p.read_bytes())["lane_kind"] == "torch-llama"],
                         ids=lambda p: p.name)
@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_torch_llama_identity_pins_both_known_answers_measured_on_its_engines(path: Path, role: str):
    """Both digests the 8B-shaped identity pins (its eager producer's, its CUDA-graph consumer's) are
    the ones the committed evidence records for those very engines (name, version and ABI equal,
    every measurement the same)."""
    document = json.loads(path.read_bytes())
    pin = document[f"{role}_engine"]
    assert pin["name"] == "torch-llama"
    assert _freeze_tool().evidence_known_answer(LLAMA_KNOWN_ANSWERS, document["lane"], pin, role) == pin["kat_sha256"]


def _exact_consumer(path: Path) -> bool:
    from qualify.engines.kat import EXACT_ENGINE_NAMES

    return json.loads(path.read_bytes())["consumer_engine"]["name"] in EXACT_ENGINE_NAMES


@pytest.mark.parametrize("path", [p for p in SHIPPED if _exact_consumer(p)], ids=lambda p: p.name)
def test_this_hosts_consumer_gives_the_known_answer_its_shipped_identity_pins(path: Path):
    from qualify.engines.kat import known_answer_sha256

    identity = load_identity(path)
    assert known_answer_sha256(build_consumer(identity.spec)) == identity.consumer_engine.kat_sha256


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_identity_pins_the_rope_tables_this_host_builds(path: Path):
    """A run recomputes the RoPE tables and refuses an identity pinning other ones (exit 2), so a
    host whose RoPE arithmetic differs is refused before any handoff, never judged as drift."""
    from qualify.core.errors import Refused
    from qualify.run.run_contract import check_rope_cache

    freeze = _freeze_tool()
    identity = load_identity(path)
    config_path = freeze.lane_model_dir(identity.spec, None) / "config.json"
    _, head_dim, _ = freeze._geometry(freeze._read_config(config_path), config_path)
    check_rope_cache(identity, head_dim, f"identity {path.name}")
    stale = identity.model_copy(update={"rope": identity.rope.model_copy(update={"cache_sha256": "0" * 64})})
    with pytest.raises(Refused, match=rf"^identity x: rope.cache_sha256: pinned {'0' * 64}, this host's RoPE "
                                      rf"tables \(theta {identity.rope.theta}, head_dim {head_dim}, "
                                      rf"{identity.context_policy.max_positions} positions\) give "
                                      rf"{identity.rope.cache_sha256}; .*--lane {identity.lane}$"):
        check_rope_cache(stale, head_dim, "identity x")
