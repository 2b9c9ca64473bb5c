"""The transformers (torch) engine against the numpy reference engine.

On the CPU in float32: its prefill KV equals the reference's within 1e-5; a KV handed from either
engine to the other's decode keeps every greedy token of the consumer's cold recompute; bad options
and runs past the context are refused with one line. On CUDA (skipped without a GPU): bf16 and fp32
(TF32 off and on) producers hand their prefill to the CPU reference decode, and the drift is
reported. What every engine must do (protocol, decode vs teacher forcing, token and KV refusals) is
in tests/unit/engines/test_engine_conformance.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # a shared 2-core machine: keep BLAS to one thread

import numpy as np
import pytest

from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult
from qualify.engines.reference import ReferenceEngine

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

PREFIX = 512  # prefill-agreement prefix
HANDOFF = 2047  # the producer prefills prompt[:2047]; the consumer feeds prompt[2047]
DECODE = 64
KV_TOLERANCE = 1e-5
LOGIT_TOLERANCE = 1e-3  # max abs logit delta of a float32 handoff against the cold recompute


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from qualify.engines.transformers_engine import TransformersEngine

    return TransformersEngine(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reference_kv(reference: ReferenceEngine, prompt: np.ndarray) -> KVCache:
    return reference.prefill(prompt[:HANDOFF])


@pytest.fixture(scope="module")
def transformers_kv(engine, prompt: np.ndarray) -> KVCache:
    return engine.prefill(prompt[:HANDOFF])


@pytest.fixture(scope="module")
def reference_cold(reference: ReferenceEngine, prompt: np.ndarray, reference_kv: KVCache) -> DecodeResult:
    return reference.decode(reference_kv, prompt[HANDOFF:], DECODE)


@pytest.fixture(scope="module")
def transformers_cold(engine, prompt: np.ndarray, transformers_kv: KVCache) -> DecodeResult:
    return engine.decode(transformers_kv, prompt[HANDOFF:], DECODE)


def max_kv_delta(a: KVCache, b: KVCache) -> tuple[float, float]:
    """Max abs K and V differences over all layers."""
    keys = max(float(np.abs(x - y).max()) for x, y in zip(a.keys, b.keys, strict=True))
    values = max(float(np.abs(x - y).max()) for x, y in zip(a.values, b.values, strict=True))
    return keys, values


def compare(name: str, handed: DecodeResult, cold: DecodeResult) -> tuple[int, float]:
    matching = int((handed.tokens == cold.tokens).sum())
    delta = float(np.abs(handed.logits - cold.logits).max())
    print(f"{name}: tokens {matching}/{cold.tokens.size}, max abs logit delta {delta:.3e}")
    return matching, delta


# ---- the engine's face -----------------------------------------------------------------------


def test_names_its_build_and_loads_only_the_target(engine) -> None:
    import torch
    import transformers

    assert engine.name == "transformers-torch"
    assert transformers.__version__ in engine.version and torch.__version__ in engine.version
    for part in ("+cpu+", "+float32+", "+tf32-off+", "+attn-sdpa"):
        assert part in engine.abi, engine.abi
    model = engine.model
    # Tied LM head, and only the target checkpoint was loaded (no draft tensors).
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.dtype == torch.float32


# ---- producer: prefill KV ----------------------------------------------------------------------


def test_prefill_kv_equals_reference(engine, reference: ReferenceEngine, prompt: np.ndarray) -> None:
    ours, theirs = engine.prefill(prompt[:PREFIX]), reference.prefill(prompt[:PREFIX])
    assert ours.geometry == theirs.geometry == engine.geometry.kv_geometry(PREFIX)
    for array in [*ours.keys, *ours.values]:
        assert array.dtype == np.float32 and array.flags.c_contiguous
    key_delta, value_delta = max_kv_delta(ours, theirs)
    print(f"prefill {PREFIX}: max abs K delta {key_delta:.3e}, V delta {value_delta:.3e}")
    # Equal K proves HF's cache holds K post-RoPE in the canonical [kv_heads, positions, hd] order.
    assert key_delta < KV_TOLERANCE and value_delta < KV_TOLERANCE


# ---- handoffs between the engines ----------------------------------------------------------------


def test_transformers_kv_into_reference_decode(
        reference: ReferenceEngine, prompt: np.ndarray, transformers_kv: KVCache,
        reference_kv: KVCache, reference_cold: DecodeResult) -> None:
    key_delta, value_delta = max_kv_delta(transformers_kv, reference_kv)
    print(f"prefill {HANDOFF}: max abs K delta {key_delta:.3e}, V delta {value_delta:.3e}")
    handed = reference.decode(transformers_kv, prompt[HANDOFF:], DECODE)
    matching, delta = compare("transformers KV -> reference decode vs reference cold", handed, reference_cold)
    assert matching == DECODE and delta < LOGIT_TOLERANCE


def test_reference_kv_into_transformers_decode(
        engine, prompt: np.ndarray, reference_kv: KVCache, transformers_cold: DecodeResult,
        reference_cold: DecodeResult) -> None:
    handed = engine.decode(reference_kv, prompt[HANDOFF:], DECODE)
    assert handed.meta == {"handed_off_positions": float(HANDOFF), "pending_tokens": 1.0}
    matching, delta = compare("reference KV -> transformers decode vs transformers cold", handed,
                              transformers_cold)
    assert matching == DECODE and delta < LOGIT_TOLERANCE
    # The two engines' own cold runs agree too (the transformers-agreement test, via this engine).
    matching, delta = compare("transformers cold vs reference cold", transformers_cold, reference_cold)
    assert matching == DECODE and delta < LOGIT_TOLERANCE


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "field_name"), [
    ({"device": "tpu"}, "device"),
    ({"dtype": "int8"}, "dtype"),
    ({"dtype": "float64"}, "dtype"),
    ({"attn_implementation": "flash_attention_2"}, "attn_implementation"),
    ({"tf32": True}, "tf32"),
    ({"tf32": 1}, "tf32"),
])
def test_refuses_bad_options(options: dict, field_name: str) -> None:
    from qualify.engines.transformers_engine import TransformersEngine

    with pytest.raises(Refused) as refusal:
        TransformersEngine(**options)
    message = str(refusal.value)
    assert "\n" not in message and field_name in message, message


def test_refuses_cuda_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from qualify.engines.transformers_engine import TransformersEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Refused, match="cuda") as refusal:
        TransformersEngine(device="cuda")
    assert "\n" not in str(refusal.value)


def test_refuses_running_past_the_context(engine, prompt: np.ndarray, transformers_kv: KVCache) -> None:
    calls = [
        (lambda: engine.decode(transformers_kv, prompt[HANDOFF:], 4096), "max_positions"),
        (lambda: engine.prefill(np.zeros(4097, dtype=np.int64)), "max_positions"),
    ]
    for call, field_name in calls:
        with pytest.raises(Refused) as refusal:
            call()
        assert "\n" not in str(refusal.value) and field_name in str(refusal.value), str(refusal.value)


# ---- CUDA producer lane (skipped without a GPU) --------------------------------------------------


    # bf16 and TF32 may break exact tokens; that is what the lane's calibration and receipts
    # report (with localisation), never what this test hides by tuning a bound.


