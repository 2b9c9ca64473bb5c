"""Behaviour of the numpy reference engine and its checkpoint loader (what every engine must do is
in tests/unit/engines/test_engine_conformance.py).

Loader: every bad checkpoint is refused with one line naming the file and the field. Engine: its
ABI names its arithmetic; deterministic across processes, BLAS thread counts and kernels; decode
rows do not depend on how many rows are fed together, so pending tokens fed as a block equal
feeding them one by one bit for bit; agreement with Hugging Face transformers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult
from qualify.engines.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint, load_config
from qualify.engines.reference import (
    ABI_VERSION,
    DenseLinear,
    ReferenceEngine,
    RoundTripFloat16,
)

HANDOFF = 2047  # the producer prefills prompt[:2047]; the consumer feeds prompt[2047]
DECODE = 256


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine.from_model_dir()


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    return assets.load_prompt()


@pytest.fixture(scope="module")
def handoff_kv(engine: ReferenceEngine, prompt: np.ndarray) -> KVCache:
    return engine.prefill(prompt[:HANDOFF])


@pytest.fixture(scope="module")
def main_decode(engine: ReferenceEngine, prompt: np.ndarray, handoff_kv: KVCache) -> DecodeResult:
    return engine.decode(handoff_kv, prompt[HANDOFF:], DECODE)


@pytest.fixture(scope="module")
def shipped_config() -> dict:
    return json.loads((assets.MODEL_DIR / CONFIG_FILE).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def shipped_tensors() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(assets.MODEL_DIR / WEIGHTS_FILE))


def sha256_of(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


# ---- loader --------------------------------------------------------------------------------


def write_model_dir(directory: Path, config: dict | str | None,
                    tensors: dict[str, np.ndarray] | bytes | None) -> Path:
    """A checkpoint directory; ``None`` leaves a file out, str/bytes are written verbatim."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (directory / CONFIG_FILE).write_text(text, encoding="utf-8")
    if isinstance(tensors, bytes):
        (directory / WEIGHTS_FILE).write_bytes(tensors)
    elif tensors is not None:
        save_file(tensors, str(directory / WEIGHTS_FILE))
    return directory


def with_config(**changes: object):
    def mutate(config: dict, tensors: dict) -> tuple[dict, dict]:
        config = dict(config)
        for key, value in changes.items():
            if value is DROP:
                del config[key]
            else:
                config[key] = value
        return config, tensors
    return mutate


def with_tensor(name: str, make: object):
    def mutate(config: dict, tensors: dict) -> tuple[dict, dict]:
        tensors = dict(tensors)
        if make is DROP:
            del tensors[name]
        else:
            tensors[name] = make(tensors.get(name))  # type: ignore[operator]
        return config, tensors
    return mutate


def poisoned(value: float):
    def make(tensor: np.ndarray) -> np.ndarray:
        tensor = tensor.copy()
        tensor.flat[17] = value
        return tensor
    return make


DROP = object()
LAYER2_Q = "model.layers.2.self_attn.q_proj.weight"
LAYER1_UP = "model.layers.1.mlp.up_proj.weight"

LOADER_REFUSALS = {
    "config missing": (lambda c, t: (None, t), CONFIG_FILE, "missing"),
    "weights missing": (lambda c, t: (c, None), WEIGHTS_FILE, "missing"),
    "config not JSON": (lambda c, t: ("{\"architectures\": [", t), CONFIG_FILE, "json"),
    "config not an object": (lambda c, t: ("[1, 2]", t), CONFIG_FILE, "json"),
    "another architecture": (with_config(architectures=["GemmaForCausalLM"]), CONFIG_FILE, "architectures"),
    "mistral sliding window": (with_config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096),
                               CONFIG_FILE, "sliding_window"),
    "mistral attention bias": (with_config(architectures=["MistralForCausalLM"], model_type="mistral",
                                           attention_bias=True), CONFIG_FILE, "attention_bias"),
    "hidden_act gelu": (with_config(hidden_act="gelu"), CONFIG_FILE, "hidden_act"),
    "hidden_act missing": (with_config(hidden_act=DROP), CONFIG_FILE, "hidden_act"),
    "kv heads missing": (with_config(num_key_value_heads=DROP), CONFIG_FILE, "num_key_value_heads"),
    "hidden_size a string": (with_config(hidden_size="256"), CONFIG_FILE, "hidden_size"),
    "layers a bool": (with_config(num_hidden_layers=True), CONFIG_FILE, "num_hidden_layers"),
    "eps a string": (with_config(rms_norm_eps="1e-5"), CONFIG_FILE, "rms_norm_eps"),
    "theta missing": (with_config(rope_theta=DROP), CONFIG_FILE, "rope_theta"),
    "dynamic rope scaling": (with_config(rope_scaling={"type": "dynamic", "factor": 2.0}), CONFIG_FILE,
                             "rope_scaling.rope_type"),
    "llama3 factors inverted": (with_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                          "high_freq_factor": 1.0,
                                                          "original_max_position_embeddings": 8192}),
                                CONFIG_FILE, "rope_scaling.high_freq_factor"),
    "untied head without lm_head": (with_config(tie_word_embeddings=False), WEIGHTS_FILE, "lm_head.weight"),
    "tie not a bool": (with_config(tie_word_embeddings="yes"), CONFIG_FILE, "tie_word_embeddings"),
    "qwen2 sliding window": (with_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True),
                             CONFIG_FILE, "use_sliding_window"),
    "qwen2 without its biases": (with_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2"), WEIGHTS_FILE,
                                 "model.layers.0.self_attn.q_proj.bias"),
    "attention bias": (with_config(attention_bias=True), CONFIG_FILE, "attention_bias"),
    "heads not divisible": (with_config(num_key_value_heads=3), CONFIG_FILE, "num_key_value_heads"),
    "tensor missing": (with_tensor("model.norm.weight", DROP), WEIGHTS_FILE, "model.norm.weight"),
    "tensor mis-shaped": (with_tensor(LAYER2_Q, lambda t: t[:, :128].copy()), WEIGHTS_FILE, LAYER2_Q),
    "tensor transposed": (with_tensor("model.layers.0.mlp.down_proj.weight", lambda t: t.T.copy()),
                          WEIGHTS_FILE, "model.layers.0.mlp.down_proj.weight"),
    "tensor integer": (with_tensor(LAYER1_UP, lambda t: t.astype(np.int32)), WEIGHTS_FILE, LAYER1_UP),
    "weight inf": (with_tensor(LAYER1_UP, poisoned(np.inf)), WEIGHTS_FILE, LAYER1_UP),
    "weight nan": (with_tensor(LAYER1_UP, poisoned(np.nan)), WEIGHTS_FILE, LAYER1_UP),
    "extra lm_head": (with_tensor("lm_head.weight", lambda t: np.zeros((4096, 256), np.float16)),
                      WEIGHTS_FILE, "lm_head.weight"),
}


@pytest.mark.parametrize("case", sorted(LOADER_REFUSALS))
def test_loader_refuses_with_one_line_naming_file_and_field(
        case: str, tmp_path: Path, shipped_config: dict, shipped_tensors: dict) -> None:
    mutate, file_name, field_name = LOADER_REFUSALS[case]
    config, tensors = mutate(shipped_config, shipped_tensors)
    model_dir = write_model_dir(tmp_path / "model", config, tensors)
    with pytest.raises(Refused) as refusal:
        load_checkpoint(model_dir)
    message = str(refusal.value)
    assert "\n" not in message and "Traceback" not in message
    assert file_name in message and field_name in message, message


def test_a_windowless_mistral_and_a_config_without_head_dim_load_as_the_llama_they_are(
        tmp_path: Path, shipped_config: dict, shipped_tensors: dict) -> None:
    """A Mistral without sliding window is a Llama's arithmetic; head_dim left out (as Hub configs
    of Llama 3.x and Qwen2.5 do) is hidden_size // num_attention_heads, as Hugging Face reads it."""
    shipped = load_config(assets.MODEL_DIR)
    mistral = dict(shipped_config, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    loaded = load_config(write_model_dir(tmp_path / "mistral", mistral, shipped_tensors))
    assert loaded.architecture == "mistral" and loaded.geometry == shipped.geometry
    assert (loaded.tied_head, loaded.qkv_bias, loaded.rope_scaling) == (True, False, None)
    without = {key: value for key, value in shipped_config.items() if key != "head_dim"}
    assert load_config(write_model_dir(tmp_path / "llama", without, shipped_tensors)).geometry == shipped.geometry
    other = dict(shipped_config, head_dim=shipped.geometry.head_dim * 2)
    assert load_config(write_model_dir(tmp_path / "wide", other, shipped_tensors)).geometry.head_dim == 64


def test_loader_refuses_corrupt_safetensors(tmp_path: Path, shipped_config: dict) -> None:
    whole = (assets.MODEL_DIR / WEIGHTS_FILE).read_bytes()
    for name, data in {"truncated": whole[: len(whole) // 2], "garbage": b"\xff" * 64}.items():
        model_dir = write_model_dir(tmp_path / name, shipped_config, data)
        with pytest.raises(Refused) as refusal:
            load_checkpoint(model_dir)
        message = str(refusal.value)
        assert "\n" not in message and WEIGHTS_FILE in message, message


def test_loader_upcasts_float16_exactly(shipped_tensors: dict) -> None:
    geometry, weights = load_checkpoint(assets.MODEL_DIR)
    assert set(weights) == set(shipped_tensors)
    for name, stored in shipped_tensors.items():
        assert stored.dtype == np.float16
        assert weights[name].dtype == np.float32 and weights[name].flags.c_contiguous
        # float16 -> float32 is exact: the round trip back gives the stored bits.
        assert np.array_equal(weights[name].astype(np.float16).view(np.uint16), stored.view(np.uint16))
    assert (geometry.layers, geometry.hidden, geometry.heads, geometry.kv_heads) == (4, 256, 8, 4)
    assert (geometry.head_dim, geometry.vocab, geometry.max_positions) == (32, 4096, 4096)
    assert geometry.rope_theta == 10000.0


# ---- ABI and limits --------------------------------------------------------------------------


def test_abi_is_the_arithmetic_alone(engine: ReferenceEngine) -> None:
    assert engine.name == "reference-numpy"
    # No numpy or BLAS version: the known-answer check pins the bits they give (qualify.engines.kat).
    assert engine.abi == f"{ABI_VERSION}+{DenseLinear.kind}"


def keep_as_is(x: np.ndarray) -> np.ndarray:
    """A materialize hook without a declared kind (its function name stands for it)."""
    return x


def test_abi_names_the_arithmetic(engine: ReferenceEngine) -> None:
    f16 = ReferenceEngine.from_model_dir(materialize=RoundTripFloat16())
    assert f16.abi != engine.abi and RoundTripFloat16.kind in f16.abi

    class Undeclared:
        def __init__(self, weight: np.ndarray) -> None:
            self.n_out, self.n_in = weight.shape

        def __call__(self, x: np.ndarray) -> np.ndarray:
            return x

    # Without a declared kind, a module-level function or class name stands for the arithmetic;
    # names that do not identify one (lambdas, nested classes, partials, ufuncs) are refused.
    assert ReferenceEngine.from_model_dir(materialize=keep_as_is).abi == \
        f"{ABI_VERSION}+{DenseLinear.kind}+keep_as_is"
    for bad_hook in (lambda x: x, functools.partial(keep_as_is), np.positive):
        with pytest.raises(Refused, match="kind"):
            ReferenceEngine.from_model_dir(materialize=bad_hook)
    with pytest.raises(Refused, match="make_linear"):
        ReferenceEngine.from_model_dir(make_linear=lambda name, weight: Undeclared(weight))


def test_prefill_memory_stays_bounded(engine: ReferenceEngine, prompt: np.ndarray) -> None:
    tracemalloc.start()
    try:
        engine.prefill(prompt[:HANDOFF])
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A full [heads, T, T] float32 score matrix alone would be 134 MB.
    print(f"prefill peak traced memory: {peak_bytes / 2**20:.1f} MiB")
    assert peak_bytes < 96 * 2**20


def test_decode_refuses_running_past_max_positions(engine: ReferenceEngine, handoff_kv: KVCache,
                                                  prompt: np.ndarray) -> None:
    with pytest.raises(Refused, match="max_positions") as refusal:
        engine.decode(handoff_kv, prompt[HANDOFF:], engine.geometry.max_positions)
    assert "\n" not in str(refusal.value)


# ---- determinism ---------------------------------------------------------------------------

DETERMINISM_SCRIPT = """
import hashlib, json, numpy as np
from qualify.core import assets
from qualify.engines.reference import ReferenceEngine
engine = ReferenceEngine.from_model_dir()
prompt = assets.load_prompt()
digests = {{}}
for handed_off in {handoffs}:
    kv = engine.prefill(prompt[:handed_off])
    result = engine.decode(kv, prompt[handed_off:], {steps})
    kv_digest = hashlib.sha256()
    for array in [*kv.keys, *kv.values]:
        kv_digest.update(array.tobytes())
    digests[handed_off] = {{"kv": kv_digest.hexdigest(),
                           "logits": hashlib.sha256(result.logits.tobytes()).hexdigest(),
                           "tokens": hashlib.sha256(result.tokens.tobytes()).hexdigest()}}
print(json.dumps(digests))
"""
DETERMINISM_STEPS = 16
# The full handoff, a whole-block handoff, and a short one (reductions of many lengths).
DETERMINISM_HANDOFFS = (HANDOFF, 2032, 600)


# OpenBLAS's SSE3 kernel set (it reports the name Katmai): runs on every x86-64 CPU and differs from
# the kernels it picks for a modern one. tests/system/test_portability.py runs the full kernel matrix.
OTHER_BLAS_KERNEL = "Prescott"


def digests_in_subprocess(blas_threads: int, blas_kernel: str | None = None) -> dict[str, dict[str, str]]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(blas_threads), OMP_NUM_THREADS=str(blas_threads),
               PYTHONPATH=str(assets.REPO_ROOT))
    if blas_kernel is not None:
        env["OPENBLAS_CORETYPE"] = blas_kernel
    script = DETERMINISM_SCRIPT.format(handoffs=DETERMINISM_HANDOFFS, steps=DETERMINISM_STEPS)
    # ~25 s alone; minutes next to other test workers on 2 shared cores (a timeout, not a result).
    completed = subprocess.run([sys.executable, "-c", script], env=env, cwd=assets.REPO_ROOT,
                               capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_deterministic_across_processes_and_blas_threads(engine: ReferenceEngine, prompt: np.ndarray) -> None:
    """The same bits here, in a subprocess on one BLAS thread, and in one on two threads and
    another BLAS kernel."""
    one_thread = digests_in_subprocess(1)
    two_threads = digests_in_subprocess(2, OTHER_BLAS_KERNEL)
    here = {}
    for handed_off in DETERMINISM_HANDOFFS:
        kv = engine.prefill(prompt[:handed_off])
        result = engine.decode(kv, prompt[handed_off:], DETERMINISM_STEPS)
        here[str(handed_off)] = {"kv": sha256_of(*kv.keys, *kv.values),
                                 "logits": sha256_of(result.logits), "tokens": sha256_of(result.tokens)}
    assert one_thread == two_threads == here


# ---- decode semantics ----------------------------------------------------------------------


def test_decode_rows_do_not_depend_on_block_size(engine: ReferenceEngine, prompt: np.ndarray) -> None:
    kv = engine.prefill(prompt[:600])
    rows = prompt[600:606]
    together = engine.new_cache(kv, extra_positions=rows.size)
    block = engine.forward_rows(together, rows)
    alone = engine.new_cache(kv, extra_positions=rows.size)
    singles = [engine.forward_rows(alone, rows[i:i + 1]) for i in range(rows.size)]
    assert block.logits.tobytes() == np.concatenate([s.logits for s in singles]).tobytes()
    assert block.hidden.tobytes() == np.concatenate([s.hidden for s in singles]).tobytes()
    assert sha256_of(*together.keys, *together.values) == sha256_of(*alone.keys, *alone.values)
    # Rolling back and re-feeding (a verifier rejecting draft tokens) reproduces the same rows.
    together.truncate(600 + 2)
    refed = engine.forward_rows(together, rows[2:])
    assert refed.logits.tobytes() == block.logits[2:].tobytes()


class BatchShapeSensitiveLinear(DenseLinear):
    """Dense, plus an offset that grows with the number of rows in the call: a projection whose
    row t depends on the batch shape (as BLAS gemm vs gemv does, only louder)."""

    kind = "dense-f32-batch-sensitive"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return super().__call__(x) + np.float32(1e-3) * np.float32(x.shape[0] - 1)


def test_decode_never_lets_linear_batch_shape_leak(prompt: np.ndarray) -> None:
    engine = ReferenceEngine.from_model_dir(make_linear=lambda name, w: BatchShapeSensitiveLinear(w))
    kv = engine.prefill(prompt[:300])
    pending = prompt[300:305]
    block = engine.decode(kv, pending, 6)
    cache = engine.new_cache(kv, extra_positions=pending.size - 1)
    for token in pending[:-1]:
        engine.forward_rows(cache, np.array([token]))
    one_by_one = engine.decode(cache.export(), pending[-1:], 6)
    assert block.logits.tobytes() == one_by_one.logits.tobytes()


def test_multi_token_pending_equals_feeding_one_by_one(
        engine: ReferenceEngine, prompt: np.ndarray) -> None:
    """Bit-exact in tokens and logits: decode feeds every row alone, however it arrives."""
    handed_off = 2032  # e.g. a producer that hands off only whole 16-position blocks
    kv = engine.prefill(prompt[:handed_off])
    pending = prompt[handed_off:2048]
    block = engine.decode(kv, pending, 32)
    cache = engine.new_cache(kv, extra_positions=pending.size - 1)
    for token in pending[:-1]:
        engine.forward_rows(cache, np.array([token]))
    one_by_one = engine.decode(cache.export(), pending[-1:], 32)
    assert np.array_equal(block.tokens, one_by_one.tokens)
    assert block.logits.tobytes() == one_by_one.logits.tobytes()
    assert block.meta["pending_tokens"] == pending.size and block.meta["handed_off_positions"] == handed_off


def test_f16_materialize_changes_numerics_mildly(engine: ReferenceEngine, prompt: np.ndarray) -> None:
    f16 = ReferenceEngine.from_model_dir(materialize=RoundTripFloat16())
    tokens = prompt[:512]
    kv, kv_f16 = engine.prefill(tokens), f16.prefill(tokens)
    key_delta = max(float(np.abs(a - b).max()) for a, b in zip(kv.keys, kv_f16.keys, strict=True))
    logits = engine.decode(kv, prompt[512:513], 8).logits
    logits_f16 = f16.decode(kv_f16, prompt[512:513], 8).logits
    logit_delta = float(np.abs(logits - logits_f16).max())
    print(f"f16 materialize: max abs K delta {key_delta:.3e}, max abs logit delta {logit_delta:.3e}")
    assert 0 < key_delta < 0.5 and 0 < logit_delta < 1.0


# ---- agreement with Hugging Face transformers ------------------------------------------------


def test_projections_sharing_an_input_run_stacked_with_each_projections_bits() -> None:
    """q/k/v (and gate/up) run as one contraction over their stacked rows: every output equals the
    projection's own, bit for bit, at one row (decode) and many (prefill), and the projections'
    weight rows become views of the stacked rows (nothing held twice)."""
    from qualify.engines.reference import DenseLinear, SharedInputProjections

    rng = np.random.default_rng(7)
    weights = [rng.standard_normal((n_out, 600)).astype(np.float32) * scale
               for n_out, scale in ((96, 1.0), (32, 1e-3), (32, 40.0))]
    alone = [DenseLinear(weight, f"p{index}") for index, weight in enumerate(weights)]
    stacked_projections = [DenseLinear(weight, f"p{index}") for index, weight in enumerate(weights)]
    shared = SharedInputProjections(*stacked_projections)
    assert shared.stacked is not None
    for rows in (1, 37):
        x = rng.standard_normal((rows, 600)).astype(np.float32)
        for together, single in zip(shared(x), alone, strict=True):
            assert np.array_equal(together.view(np.uint32), single(x).view(np.uint32))
    for projection in stacked_projections:
        assert np.shares_memory(projection.weight_rows.integers, shared.stacked.weight_rows.integers)
    # Another arithmetic is applied projection by projection.
    doubling = _Doubling(alone[1])
    other = SharedInputProjections(alone[0], doubling)
    assert other.stacked is None
    x = rng.standard_normal((3, 600)).astype(np.float32)
    first, second = other(x)
    assert np.array_equal(first, alone[0](x)) and np.array_equal(second, doubling(x))


class _Doubling:
    """A projection of another arithmetic (not DenseLinear): twice a dense one."""

    kind = "doubling-test"

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.n_in, self.n_out = inner.n_in, inner.n_out  # type: ignore[attr-defined]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return 2 * self.inner(x)  # type: ignore[operator]


def test_one_product_reductions_keep_the_chunked_bits(engine: ReferenceEngine, prompt: np.ndarray,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill, decode and row scoring give the same bits whether reductions longer than
    REDUCTION_CHUNK run as one product (the fast path) or as chunks added left to right."""
    from qualify.core import numerics
    from qualify.engines import reference

    tokens = prompt[:600]  # attention over up to 600 keys, down_proj over 512 terms

    def run() -> list[np.ndarray]:
        kv = engine.prefill(tokens[:-4])
        decoded = engine.teacher_forced(kv, tokens[-4:-3], tokens[-3:])  # [3, vocab]
        return [*kv.keys, *kv.values, decoded, engine.score_rows(tokens[:300], engine.prefill(tokens[:300]))]

    one_products = []

    def counted(left: np.ndarray, right_bits: int = 21, *, nonnegative: bool = False) -> bool:
        exact = numerics.whole_rows_are_exact(left, right_bits, nonnegative=nonnegative)
        one_products.append(exact and left.shape[-1] > numerics.REDUCTION_CHUNK)
        return exact

    monkeypatch.setattr(reference, "whole_rows_are_exact", counted)
    fast = run()
    assert any(one_products)  # the scoring attention took the fast path
    monkeypatch.setattr(numerics, "whole_rows_are_exact", lambda *args, **kwargs: False)
    monkeypatch.setattr(reference, "whole_rows_are_exact", lambda *args, **kwargs: False)
    for found, chunked in zip(fast, run(), strict=True):
        assert np.array_equal(found.view(np.uint32), chunked.view(np.uint32))
