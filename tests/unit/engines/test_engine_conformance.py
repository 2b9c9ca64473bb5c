"""What every engine must do behind the Engine protocol, run against each engine the harness builds.

Engines: the numpy reference; the NVFP4 lanes' consumer (exact a16-q8) and a native producer
(split-K), as the factory builds them (LaneEngine); the k-quant target alone and with its EAGLE-1
draft (speculative); the compact torch Llama and transformers on the CPU in float32 (``torch``).
vLLM is left out: starting it costs minutes, and tests/vllm/test_vllm_lanes.py runs its lanes end to end.

Each engine, on a 600 + 1 split of the recipe's prompt (600 positions handed off): speaks the
protocol on the shipped model's geometry; prefills the canonical KV layout; decodes greedily (ties
to the lowest id) with one finite float32 logit row per token, repeatably bit for bit; decode equals
teacher forcing on its own tokens bit for bit, and a forced token changes only the rows after it;
a shorter handoff plus several pending tokens keeps every token; bad tokens, counts and KV are
refused in one line naming the field, and so is a KV that drives the logits non-finite.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # a shared 2-core machine: keep BLAS to one thread

from collections.abc import Callable

import numpy as np
import pytest

from qualify.contract.lanes import ProducerMode, lane_spec
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult, Engine
from qualify.engines.checkpoint import load_config

# A shorter split than the recipe's 2047 + 1 keeps seven engines' prefills cheap; the per-engine
# tests run the full split where it matters (agreement with the reference, determinism).
HANDOFF = 600  # the producer prefills prompt[:600]; the consumer feeds prompt[600]
DECODE = 32
SHORTER = 512  # a producer that hands off whole 128-position blocks; 89 tokens are pending


def _reference() -> Engine:
    from qualify.engines.reference import ReferenceEngine

    return ReferenceEngine.from_model_dir()


def _nvfp4_consumer() -> Engine:
    from qualify.engines.factory import build_consumer

    return build_consumer(lane_spec("nvfp4-native-w4a4"))


def _nvfp4_splitk_producer() -> Engine:
    from qualify.engines.factory import build_producer

    return build_producer("nvfp4-native-splitk", ProducerMode.NATIVE)


def _kquant() -> Engine:
    from qualify.engines.kquant import build_kquant_engine

    return build_kquant_engine()


def _speculative() -> Engine:
    from qualify.engines.speculative import build_speculative_engine

    return build_speculative_engine(proposal_tokens=3)  # k = 3: guessed rows and draft roll-back too


def _torch_llama() -> Engine:
    import torch

    from qualify.engines.torch_llama import TorchLlama

    torch.set_num_threads(1)
    return TorchLlama.from_model_dir(dtype="float32", device="cpu", cache_positions=HANDOFF + 256)


def _transformers() -> Engine:
    import torch

    from qualify.engines.transformers_engine import TransformersEngine

    torch.set_num_threads(1)
    return TransformersEngine(device="cpu", dtype="float32")


BUILDERS: dict[str, Callable[[], Engine]] = {
    "reference": _reference,
    "nvfp4-exact-consumer": _nvfp4_consumer,
    "nvfp4-splitk-producer": _nvfp4_splitk_producer,
    "kquant": _kquant,
    "kquant-speculative": _speculative,
    "torch-llama-cpu": _torch_llama,
    "transformers-cpu": _transformers,
}
TORCH_ENGINES = {"torch-llama-cpu", "transformers-cpu"}

PENDING_LOGIT_TOLERANCE = 1e-3
"""How far a shorter handoff plus pending tokens may move the logits (prefill and decode reduce in
other orders). Measured on this split: reference 1.1e-5, transformers 6.2e-6, nvfp4 split-K 2.4e-6,
the others 0."""


@pytest.fixture(scope="module", params=[name for name in BUILDERS if name not in TORCH_ENGINES])
def engine(request: pytest.FixtureRequest) -> Engine:
    return BUILDERS[request.param]()


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    return assets.load_prompt()


@pytest.fixture(scope="module")
def pending(prompt: np.ndarray) -> np.ndarray:
    """The one token the consumer feeds after the handoff."""
    return prompt[HANDOFF:HANDOFF + 1]


@pytest.fixture(scope="module")
def kv(engine: Engine, prompt: np.ndarray) -> KVCache:
    return engine.prefill(prompt[:HANDOFF])


@pytest.fixture(scope="module")
def cold(engine: Engine, kv: KVCache, pending: np.ndarray) -> DecodeResult:
    return engine.decode(kv, pending, DECODE)


def kv_bytes(kv: KVCache) -> list[bytes]:
    return [array.tobytes() for array in kv.tensors().values()]


# ---- the protocol and the canonical KV -------------------------------------------------------------


def test_speaks_the_engine_protocol(engine: Engine) -> None:
    assert isinstance(engine, Engine)
    for name in ("name", "version", "abi"):
        value = getattr(engine, name)
        assert isinstance(value, str) and value.strip(), name
    assert engine.logit_units == "raw"
    assert engine.geometry == load_config(assets.MODEL_DIR).geometry


def test_prefill_kv_is_canonical(engine: Engine, prompt: np.ndarray, kv: KVCache) -> None:
    assert kv.geometry == engine.geometry.kv_geometry(HANDOFF)
    for array in [*kv.keys, *kv.values]:
        assert array.dtype == np.float32 and array.flags.c_contiguous and np.isfinite(array).all()
    # KV of a prefix is computed over exactly that prefix.
    assert engine.prefill(prompt[:5]).geometry.positions == 5


# ---- decode ------------------------------------------------------------------------------------------


def test_decode_output_shapes_and_greedy_choice(engine: Engine, cold: DecodeResult) -> None:
    assert cold.tokens.shape == (DECODE,) and cold.tokens.dtype == np.int32
    assert cold.logits.shape == (DECODE, engine.geometry.vocab)
    assert cold.logits.dtype == np.float32 and np.isfinite(cold.logits).all()
    # Row i scored token i: the chosen token is the first maximum of its row.
    assert np.array_equal(cold.tokens, cold.logits.argmax(axis=1))
    assert cold.meta["handed_off_positions"] == HANDOFF and cold.meta["pending_tokens"] == 1


def test_prefill_and_decode_repeat_bit_for_bit(engine: Engine, prompt: np.ndarray, pending: np.ndarray,
                                               kv: KVCache, cold: DecodeResult) -> None:
    again_kv = engine.prefill(prompt[:HANDOFF])
    assert kv_bytes(again_kv) == kv_bytes(kv)
    again = engine.decode(again_kv, pending, DECODE)
    assert np.array_equal(again.tokens, cold.tokens)
    assert again.logits.tobytes() == cold.logits.tobytes()


def test_decode_equals_teacher_forced_on_its_own_tokens(engine: Engine, kv: KVCache, pending: np.ndarray,
                                                        cold: DecodeResult) -> None:
    forced = engine.teacher_forced(kv, pending, cold.tokens)
    assert forced.dtype == np.float32 and forced.shape == cold.logits.shape
    assert forced.tobytes() == cold.logits.tobytes()


def test_teacher_forced_rows_follow_the_forced_tokens(engine: Engine, kv: KVCache, pending: np.ndarray,
                                                      cold: DecodeResult) -> None:
    # Force a different token at step 3: rows 0..3 are unchanged, later rows see the new token.
    forced = cold.tokens[:8].copy()
    forced[3] = (forced[3] + 1) % engine.geometry.vocab
    logits = engine.teacher_forced(kv, pending, forced)
    assert logits[:4].tobytes() == cold.logits[:4].tobytes()
    assert not np.array_equal(logits[4], cold.logits[4])


def test_shorter_handoff_plus_pending_tokens_keeps_every_token(engine: Engine, prompt: np.ndarray,
                                                               cold: DecodeResult) -> None:
    """The consumer's view of a whole-block producer: 512 positions handed off, 89 pending."""
    result = engine.decode(engine.prefill(prompt[:SHORTER]), prompt[SHORTER:HANDOFF + 1], DECODE)
    assert result.meta["handed_off_positions"] == SHORTER
    assert result.meta["pending_tokens"] == HANDOFF + 1 - SHORTER
    delta = float(np.abs(result.logits - cold.logits).max())
    print(f"{SHORTER} handed off + {HANDOFF + 1 - SHORTER} pending vs {HANDOFF} + 1: "
          f"max abs logit delta {delta:.3e}")
    assert np.array_equal(result.tokens, cold.tokens)
    assert delta < PENDING_LOGIT_TOLERANCE


# ---- refusals -------------------------------------------------------------------------------------------

Call = Callable[[Engine, KVCache, np.ndarray], object]

BAD_INPUTS: dict[str, tuple[Call, str]] = {
    "prefill 2-D": (lambda e, kv, p: e.prefill(np.zeros((2, 3), dtype=np.int64)), "prefill tokens"),
    "prefill empty": (lambda e, kv, p: e.prefill(np.array([], dtype=np.int64)), "prefill tokens"),
    "prefill float ids": (lambda e, kv, p: e.prefill(np.array([1.0, 2.0])), "prefill tokens"),
    "prefill id = vocab": (lambda e, kv, p: e.prefill(np.array([0, e.geometry.vocab])), "prefill tokens"),
    "pending empty": (lambda e, kv, p: e.decode(kv, np.array([], dtype=np.int64), 4), "pending tokens"),
    "pending id = vocab": (lambda e, kv, p: e.decode(kv, np.array([e.geometry.vocab]), 4), "pending tokens"),
    "pending float ids": (lambda e, kv, p: e.decode(kv, np.array([1.5]), 4), "pending tokens"),
    "decode n = 0": (lambda e, kv, p: e.decode(kv, p, 0), "decode n"),
    "decode n = True": (lambda e, kv, p: e.decode(kv, p, True), "decode n"),
    "decode n = 2.0": (lambda e, kv, p: e.decode(kv, p, 2.0), "decode n"),
    "forced id -1": (lambda e, kv, p: e.teacher_forced(kv, p, np.array([-1])), "forced tokens"),
    "forced empty": (lambda e, kv, p: e.teacher_forced(kv, p, np.array([], dtype=np.int64)), "forced tokens"),
    "teacher-forced pending id = vocab": (
        lambda e, kv, p: e.teacher_forced(kv, np.array([e.geometry.vocab]), np.array([1])), "pending tokens"),
}


def _misfit(kv: KVCache, keys: list[np.ndarray], values: list[np.ndarray]) -> KVCache:
    """A KV with other tensors but the same draft context (the speculative engine checks it apart)."""
    return KVCache(keys, values, draft=kv.draft)


def _with_nan(keys: list[np.ndarray]) -> list[np.ndarray]:
    poisoned = [k.copy() for k in keys]
    poisoned[2][1, 5, 3] = np.nan
    return poisoned


BAD_KV: dict[str, tuple[Callable[[KVCache], object], str]] = {
    "not a KV cache": (lambda kv: "not a cache", "kv: expected 4 layers"),
    "a layer short": (lambda kv: _misfit(kv, kv.keys[:-1], kv.values[:-1]), "kv: expected 4 layers"),
    "float16 K": (lambda kv: _misfit(kv, [k.astype(np.float16) for k in kv.keys], kv.values), "layers.0.k"),
    "NaN in K": (lambda kv: _misfit(kv, _with_nan(kv.keys), kv.values), "layers.2.k: non-finite"),
    "V transposed": (lambda kv: _misfit(kv, kv.keys, [np.ascontiguousarray(v.transpose(1, 0, 2)) for v in kv.values]),
                     "layers.0.v: shape"),
    "a KV head short": (lambda kv: _misfit(kv, [k[:-1] for k in kv.keys], [v[:-1] for v in kv.values]),
                        "layers.0.k: shape"),
    "head_dim short": (lambda kv: _misfit(kv, [k[..., :-1] for k in kv.keys], kv.values), "layers.0.k: shape"),
    "V a position short": (lambda kv: _misfit(kv, kv.keys, [v[:, :-1] for v in kv.values]), "layers.0.v: shape"),
}


def refusal(call: Callable[[], object]) -> str:
    with pytest.raises(Refused) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_refuses_bad_tokens_and_counts(engine: Engine, kv: KVCache, pending: np.ndarray, bad: str) -> None:
    call, field = BAD_INPUTS[bad]
    message = refusal(lambda: call(engine, kv, pending))
    assert field in message, message


@pytest.mark.parametrize("bad", list(BAD_KV))
def test_refuses_a_kv_that_does_not_fit(engine: Engine, kv: KVCache, prompt: np.ndarray, pending: np.ndarray,
                                        bad: str) -> None:
    make, field = BAD_KV[bad]
    misfit = make(kv)
    for call in (lambda: engine.decode(misfit, pending, 4),
                 lambda: engine.teacher_forced(misfit, pending, prompt[:4])):
        message = refusal(call)
        assert field in message, message


def test_refuses_a_kv_that_drives_the_logits_non_finite(engine: Engine, kv: KVCache, pending: np.ndarray) -> None:
    """Finite but huge V (3e38, near float32's maximum) overflows the attention output: the decode is
    refused (by the finite-logit check, or earlier by a projection refusing non-finite activations)."""
    huge = _misfit(kv, kv.keys, [np.full_like(v, 3e38) for v in kv.values])
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the point
        message = refusal(lambda: engine.decode(huge, pending, 4))
    assert "non-finite" in message, message
