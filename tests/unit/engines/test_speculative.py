"""Speculative decode on the k-quant lane (rung 3): the EAGLE-1 draft proposes, the target decides.

What must hold: every emitted token is the target's greedy token and speculative decode equals
plain greedy decode in tokens and logits bit for bit (any k); the trace says what was proposed
and accepted; the producer's prefill (target KV and the draft's own KV) is bit-identical across
processes and BLAS thread counts, and so is the 256-token speculative decode from it; the draft
context and the draft checkpoint are refused in one line when they do not fit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qualify.contract.lanes import ProducerMode
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.engines.draft import load_draft_safetensors
from qualify.engines.kquant import KQuantEngine, build_kquant_engine
from qualify.engines.speculative import SpeculativeEngine, build_speculative_engine

HANDOFF = 2047
DECODE = 256
SHORT = 300  # a short prefix keeps the fast tests fast; the slow tests use the real split


@pytest.fixture(scope="module")
def spec() -> SpeculativeEngine:
    return build_speculative_engine(proposal_tokens=3)


@pytest.fixture(scope="module")
def plain(spec: SpeculativeEngine) -> KQuantEngine:
    return KQuantEngine(spec.target)


@pytest.fixture(scope="module")
def short_kv(spec: SpeculativeEngine) -> KVCache:
    return spec.prefill(assets.load_prompt()[:SHORT])


def digest(*arrays: np.ndarray) -> str:
    hasher = hashlib.sha256()
    for array in arrays:
        hasher.update(np.ascontiguousarray(array).tobytes())
    return hasher.hexdigest()


def check_trace_explains_tokens(result, n: int) -> None:
    """Each step emits its accepted proposals plus one target token, in order."""
    emitted = list(result.tokens[1:])  # token 0 comes from the pending feed
    for proposed, accepted in result.draft_trace:
        assert 0 <= accepted <= len(proposed)
        step, emitted = emitted[:accepted + 1], emitted[accepted + 1:]
        assert step[:accepted] == list(proposed[:accepted])
        if accepted < len(proposed) and len(step) == accepted + 1:
            assert step[accepted] != proposed[accepted]  # the first rejected proposal was wrong
    assert emitted == [] and len(result.tokens) == n


# ---- protocol and prefill -----------------------------------------------------------------------


def test_abis_name_the_draft_and_the_arithmetic(spec: SpeculativeEngine, plain: KQuantEngine) -> None:
    assert spec.abi != plain.abi and "q8_0-exact" in spec.abi and "eagle1" in spec.abi
    native = build_kquant_engine(ProducerMode.NATIVE)
    assert "q8_0-native" in native.abi and native.abi != plain.abi


def test_prefill_carries_the_draft_kv_of_all_but_the_last_position(spec: SpeculativeEngine,
                                                                   short_kv: KVCache) -> None:
    geometry = short_kv.geometry
    assert (geometry.layers, geometry.positions, geometry.dtype) == (4, SHORT, "float32")
    draft = short_kv.draft
    assert draft is not None and draft.draft is None
    assert (draft.geometry.layers, draft.geometry.positions) == (1, SHORT - 1)
    assert all(array.flags.c_contiguous for array in draft.keys + draft.values)
    names = list(short_kv.tensors())
    assert names[-2:] == ["draft.layers.0.k", "draft.layers.0.v"]
    # The target KV is exactly the plain engine's prefill; the draft adds, never changes, it.
    target_only = KQuantEngine(spec.target).prefill(assets.load_prompt()[:SHORT])
    for mine, theirs in zip(short_kv.keys + short_kv.values, target_only.keys + target_only.values, strict=True):
        assert np.array_equal(mine, theirs)


# ---- speculative == plain greedy ----------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5])
def test_speculative_decode_equals_plain_greedy_bit_for_bit(spec: SpeculativeEngine, plain: KQuantEngine,
                                                            short_kv: KVCache, k: int) -> None:
    prompt = assets.load_prompt()
    engine = SpeculativeEngine(spec.target, spec.draft, proposal_tokens=k)
    baseline = plain.decode(short_kv, prompt[SHORT:SHORT + 1], 48)
    result = engine.decode(short_kv, prompt[SHORT:SHORT + 1], 48)
    assert np.array_equal(result.tokens, baseline.tokens)
    assert np.array_equal(result.logits, baseline.logits)
    assert np.array_equal(result.tokens, np.argmax(result.logits, axis=1))
    check_trace_explains_tokens(result, 48)
    assert all(len(proposed) <= k for proposed, _ in result.draft_trace)


def test_several_pending_tokens_and_teacher_forcing(spec: SpeculativeEngine, plain: KQuantEngine) -> None:
    prompt = assets.load_prompt()
    kv = spec.prefill(prompt[:SHORT - 5])
    pending = prompt[SHORT - 5:SHORT]
    result = spec.decode(kv, pending, 24)
    assert np.array_equal(result.logits, plain.decode(kv, pending, 24).logits)
    assert np.array_equal(spec.teacher_forced(kv, pending, result.tokens), result.logits)
    assert np.array_equal(plain.teacher_forced(kv, pending, result.tokens), result.logits)


def test_decode_is_repeatable(spec: SpeculativeEngine, short_kv: KVCache) -> None:
    pending = assets.load_prompt()[SHORT:SHORT + 1]
    first, second = spec.decode(short_kv, pending, 32), spec.decode(short_kv, pending, 32)
    assert np.array_equal(first.logits, second.logits) and first.draft_trace == second.draft_trace


@pytest.mark.slow
def test_speculative_equals_plain_greedy_on_every_document(spec: SpeculativeEngine, plain: KQuantEngine) -> None:
    """The real split: prefill prompt[:2047], pending prompt[2047:], 256 tokens, all documents."""
    for name in assets.PROMPT_NAMES:
        prompt = assets.load_prompt(name)
        kv = spec.prefill(prompt[:HANDOFF])
        baseline = plain.decode(kv, prompt[HANDOFF:], DECODE)
        result = spec.decode(kv, prompt[HANDOFF:], DECODE)
        assert np.array_equal(result.tokens, baseline.tokens), name
        assert np.array_equal(result.logits, baseline.logits), name
        check_trace_explains_tokens(result, DECODE)


# ---- across processes and BLAS thread counts ----------------------------------------------------

PRODUCER_CONSUMER = """
import hashlib, json, sys
import numpy as np
from qualify.core import assets
from qualify.engines.speculative import build_speculative_engine
engine = build_speculative_engine()
prompt = assets.load_prompt(sys.argv[1])
kv = engine.prefill(prompt[:2047])
payload = hashlib.sha256()
for name, array in kv.tensors().items():
    payload.update(name.encode()); payload.update(np.ascontiguousarray(array).tobytes())
digests = {"payload": payload.hexdigest()}
for k in (engine.proposal_tokens, 3):  # the lane's k, and k = 3 (guessed rows, draft roll-back)
    engine.proposal_tokens = k
    result = engine.decode(kv, prompt[2047:], 256)
    digests[f"k{k}"] = {"logits": hashlib.sha256(result.logits.tobytes()).hexdigest(),
                        "tokens": hashlib.sha256(result.tokens.astype("<u4").tobytes()).hexdigest(),
                        "trace": result.draft_trace}
print(json.dumps(digests))
"""


@pytest.mark.slow
def test_producer_and_consumer_agree_across_processes_and_blas_threads() -> None:
    """Producer prefill (target + draft KV) and the 256-token speculative decode from it are
    bit-identical in separate processes with 1 BLAS thread and the kernel picked for this CPU,
    and with 2 threads and OpenBLAS's SSE3 kernels (named Katmai; every x86-64 CPU runs them)."""
    outputs = []
    for threads, kernel in (("1", None), ("2", "Prescott")):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
        if kernel is not None:
            env["OPENBLAS_CORETYPE"] = kernel
        completed = subprocess.run([sys.executable, "-c", PRODUCER_CONSUMER, assets.MAIN_PROMPT], env=env,
                                   capture_output=True, text=True, check=True, cwd=str(assets.REPO_ROOT))
        outputs.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert len(outputs[0]["k3"]["trace"]) > 0


# ---- refusals -----------------------------------------------------------------------------------


def with_draft(kv: KVCache, draft: KVCache | None) -> KVCache:
    return KVCache(kv.keys, kv.values, draft=draft)


def test_consumer_refuses_a_missing_or_misfit_draft_context(spec: SpeculativeEngine, short_kv: KVCache) -> None:
    pending = assets.load_prompt()[SHORT:SHORT + 1]
    draft = short_kv.draft
    assert draft is not None
    cases = [
        (None, r"kv: draft: missing"),
        (KVCache([k[:, :-1].copy() for k in draft.keys], [v[:, :-1].copy() for v in draft.values]),
         rf"kv: draft: {SHORT - 2} positions, expected {SHORT - 1}"),
        (KVCache(draft.keys * 2, draft.values * 2), r"kv: draft: expected one layer"),
        (KVCache([draft.keys[0].astype(np.float16)], draft.values), r"draft\.layers\.0\.k: expected float32"),
        (KVCache(draft.keys, [draft.values[0][:2].copy()]), r"draft\.layers\.0\.v: shape \[2, "),
    ]
    poisoned = draft.keys[0].copy()
    poisoned[1, 7, 3] = np.inf
    cases.append((KVCache([poisoned], draft.values), r"draft\.layers\.0\.k: non-finite values"))
    for bad, message in cases:
        with pytest.raises(Refused, match=message) as refused:
            spec.decode(with_draft(short_kv, bad), pending, 4)
        assert "\n" not in str(refused.value)


def test_engine_refuses_bad_proposal_counts(spec: SpeculativeEngine) -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(Refused, match="proposal_tokens"):
            SpeculativeEngine(spec.target, spec.draft, proposal_tokens=bad)  # type: ignore[arg-type]


def test_draft_loader_refuses_bad_checkpoints(tmp_path: Path, spec: SpeculativeEngine) -> None:
    from safetensors.numpy import load_file, save_file

    geometry = spec.geometry
    good = load_file(str(assets.MODEL_DIR / "draft.safetensors"))
    broken = {
        "missing": ({k: v for k, v in good.items() if k != "layer.mlp.up_proj.weight"},
                    r"layer\.mlp\.up_proj\.weight: tensor missing"),
        "extra": (good | {"lm_head.weight": np.zeros((4, 4), np.float16)}, r"lm_head\.weight: unexpected tensor"),
        "shape": (good | {"fc.weight": good["fc.weight"][:, :256].copy()}, r"fc\.weight: shape \[256, 256\], expected \[256, 512\]"),
        "nan": (good | {"layer.input_layernorm.weight": np.full(256, np.nan, np.float16)},
                r"layer\.input_layernorm\.weight: 256 non-finite values"),
        "dtype": (good | {"fc.weight": good["fc.weight"].astype(np.int8)}, r"fc\.weight: dtype int8"),
    }
    for case, (tensors, message) in broken.items():
        path = tmp_path / f"{case}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(Refused, match=message):
            load_draft_safetensors(path, geometry, 512)
    with pytest.raises(Refused, match="file: missing"):
        load_draft_safetensors(tmp_path / "absent.safetensors", geometry, 512)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Refused, match="unreadable safetensors"):
        load_draft_safetensors(tmp_path / "junk.safetensors", geometry, 512)


# ---- the draft's math ---------------------------------------------------------------------------


def test_lane_builders_name_their_files_and_modes() -> None:
    from qualify.engines import speculative

    target, draft = speculative.checkpoint_paths()
    assert target.is_file() and draft.is_file() and target.suffix == draft.suffix == ".gguf"
    exact = speculative.build_engine(ProducerMode.EXACT)
    native = speculative.build_engine(ProducerMode.NATIVE)
    assert isinstance(exact, SpeculativeEngine) and exact.target.mode is ProducerMode.EXACT
    assert isinstance(native, KQuantEngine) and native.model.mode is ProducerMode.NATIVE
    assert native.prefill(assets.load_prompt()[:40]).draft is None  # a native lane carries no draft
