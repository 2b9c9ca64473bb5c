"""The compact torch Llama's known-answer digest (KAT), on the CPU with a tiny random bf16 model.

``torch-llama`` is a measured KAT engine (``qualify.engines.kat.MEASURED_ENGINE_NAMES``): the
8B-shaped lane's identity pins both of its engines' digests measured on its GPU
(``bench/results/gpu-lanes/known-answers-llama3-8b-shape.json``); the consumer checks its own at
'identity sealed', the producer before it is ready. Here, on the CPU in bfloat16 (the lane's dtype;
one torch thread), with a model small enough for the shared CI machine but a context long enough for
the fixed KAT input: the digest is the same for two builds whose weights are drawn from the same
seed, moves under a one-ULP change of one weight, a missing pin is refused naming the field, and
measuring the lane where its GPU is not is refused in one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # a shared 2-core machine: keep BLAS to one thread

import pytest

from qualify.core import assets
from qualify.core.errors import Refused
from qualify.engines.kat import (
    KAT_DECODE_STEPS,
    KAT_ENGINE_NAMES,
    KAT_PENDING_TOKENS,
    KAT_PROMPT_TOKENS,
    MEASURED_ENGINE_NAMES,
    check_known_answer,
    check_pinned,
    has_known_answer,
    known_answer_sha256,
)

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

LANE = "llama3-8b-shape-pd"
SEED = 20261129
"""The lane's weight seed (``model/llama3-8b-shape/config.json``), at a tiny shape here."""
CACHE = KAT_PROMPT_TOKENS + KAT_PENDING_TOKENS + KAT_DECODE_STEPS
"""The smallest cache the KAT input fits (its last decoded token is never fed)."""


def build(**options: object) -> object:
    from qualify.engines.torch_llama import LlamaShape, TorchLlama

    shape = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
                       max_positions=512, rope_theta=500000.0, rms_norm_eps=1e-5, tied_embeddings=False)
    return TorchLlama.random(shape, seed=SEED, dtype="bfloat16", device="cpu", cache_positions=CACHE,
                             **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> object:
    return build()


@pytest.fixture(scope="module")
def digest(engine: object) -> str:
    return known_answer_sha256(engine)


def test_the_torch_llama_engine_is_a_measured_known_answer_engine(engine: object) -> None:
    assert engine.name == "torch-llama"  # type: ignore[attr-defined]
    assert engine.name in MEASURED_ENGINE_NAMES and engine.name in KAT_ENGINE_NAMES  # type: ignore[attr-defined]
    assert has_known_answer(engine)


def test_the_known_answer_is_the_same_for_two_builds_in_one_process(engine: object, digest: str) -> None:
    """The same engine again (its scratch positions written by the last decode), then a second
    engine on weights drawn again from the seed: the same bits; what the producer runs before it
    is ready and the consumer at 'identity sealed' passes."""
    assert known_answer_sha256(engine) == digest
    second = build(cuda_graph=False)  # the producer's build (CUDA graphs apply only on CUDA anyway)
    assert second.weights is not engine.weights  # type: ignore[attr-defined]
    assert known_answer_sha256(second) == digest
    check_known_answer(second, digest, "producer")
    check_known_answer(engine, digest, "consumer")


def test_a_one_ulp_change_of_one_weight_moves_the_known_answer(digest: str) -> None:
    """One bfloat16 ULP of the first layer's down projection: every later K/V moves. (Such a change
    in the last layer's MLP can be rounded away in the bfloat16 residual stream on this input, and
    then no KV or logit bit moves: a KAT sees what changes its output bits, no less and no more.)"""
    import torch

    changed = build()
    weight = changed.weights.layers[0].w2  # type: ignore[attr-defined]
    before = weight[0, 0].item()
    with torch.inference_mode():
        weight.view(torch.int16)[0, 0] += 1  # the next bfloat16 away from zero
    assert weight[0, 0].item() != before
    assert changed.abi == build().abi  # type: ignore[attr-defined]  # what a version pin would see: the same
    assert known_answer_sha256(changed) != digest
    with pytest.raises(Refused, match=rf"^consumer engine torch-llama \(torch-llama-abi-1\+.*\): known-answer digest: "
                                      rf"expected {digest}, found [0-9a-f]{{64}}: .* torch .*"):
        check_known_answer(changed, digest, "consumer")


def test_an_engine_started_with_no_pinned_known_answer_is_refused(engine: object) -> None:
    with pytest.raises(Refused, match="^producer engine torch-llama: known-answer digest: pinned none"):
        check_known_answer(engine, None, "producer")


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_the_llama_identity_without_either_known_answer_is_refused_naming_the_field(role: str) -> None:
    """What 'identity sealed' runs on both pins (``qualify.run.run_contract``) before the consumer
    computes its KAT: the 8B-shaped identity without one engine's digest (as shipped until both are
    measured on its H200, or with one dropped) is refused in one line naming that field."""
    document = json.loads((assets.CONTRACTS_DIR / f"{LANE}-identity-v1.json").read_bytes())
    pin = document[f"{role}_engine"]
    assert pin["name"] == "torch-llama"
    if pin["kat_sha256"] is not None:
        check_pinned(pin["name"], pin["kat_sha256"], role, f"identity {LANE}")
    with pytest.raises(Refused, match=rf"^identity {LANE}: {role}_engine.kat_sha256: pinned none, expected the "
                                      r"torch-llama engine's known-answer digest \(re-freeze the identity\)$"):
        check_pinned(pin["name"], None, role, f"identity {LANE}")


def test_measuring_the_lane_without_its_gpu_is_refused_in_one_line(tmp_path: Path) -> None:
    """``tools/measure_known_answer.py --lane llama3-8b-shape-pd`` measures only where the lane's
    engines run: here (no CUDA device visible) it is refused in one line (exit 2), nothing written."""
    import subprocess
    import sys

    out = tmp_path / "known-answers.json"
    completed = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "tools" / "measure_known_answer.py"),
                                "--lane", LANE, "--out", str(out)],
                               env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                               timeout=300, check=False)
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr == ("measure_known_answer: refused: torch llama device: 'cuda' requested but torch "
                                "sees no CUDA device\n")
    assert not out.exists()
