"""Known-answer checks: the digest moves with the arithmetic and only with it.

Each arithmetic change below keeps the engine's ABI name (what a version pin would see) and moves
its known-answer digest; an edit to an engine's source that keeps its arithmetic, or another BLAS
thread count, leaves the digest as the shipped identities pin it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from qualify.contract.identity import load_identity
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.engines import reference
from qualify.engines.kat import check_known_answer, has_known_answer, known_answer_sha256
from qualify.engines.reference import DenseLinear, ReferenceEngine

# The dense reference engine's identity pin: the consumer of the vLLM-to-reference lane.
DENSE_IDENTITY = assets.CONTRACTS_DIR / "vllm-to-reference-identity-v1.json"
NUDGED = "model.layers.2.mlp.down_proj.weight"
"""The one projection whose contraction the arithmetic changes below touch."""


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine.from_model_dir()


@pytest.fixture(scope="module")
def pinned() -> str:
    digest = load_identity(DENSE_IDENTITY).consumer_engine.kat_sha256
    assert digest is not None
    return digest


class OneUlpUp(DenseLinear):
    """The dense contraction with one output element one ULP higher (same declared kind)."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = super().__call__(x)
        out[:, 0] = np.nextafter(out[:, 0], np.float32(np.inf))
        return out


class TruncatedLastBit(DenseLinear):
    """The dense contraction rounded differently: its float32 results' last mantissa bit cleared
    (truncation where round-to-nearest set it), under the same declared kind."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.ascontiguousarray(super().__call__(x), dtype=np.float32)
        return (out.view(np.uint32) & np.uint32(0xFFFFFFFE)).view(np.float32)


def changed_at_one_projection(kind: type[DenseLinear]) -> ReferenceEngine:
    def make_linear(name: str, weight: np.ndarray) -> DenseLinear:
        return kind(weight, name) if name == NUDGED else DenseLinear(weight, name)
    return ReferenceEngine.from_model_dir(make_linear=make_linear)


def test_the_shipped_dense_engine_gives_the_pinned_known_answer(engine: ReferenceEngine, pinned: str) -> None:
    assert has_known_answer(engine)
    assert known_answer_sha256(engine) == pinned
    check_known_answer(engine, pinned, "consumer")


@pytest.mark.parametrize("kind", [OneUlpUp, TruncatedLastBit], ids=["one-ulp", "rounding"])
def test_a_changed_contraction_under_the_same_abi_moves_the_known_answer(
        engine: ReferenceEngine, pinned: str, kind: type[DenseLinear]) -> None:
    changed = changed_at_one_projection(kind)
    assert changed.abi == engine.abi
    assert known_answer_sha256(changed) != pinned
    with pytest.raises(Refused, match=pinned):
        check_known_answer(changed, pinned, "consumer")


def test_another_prefill_query_block_moves_the_known_answer(
        engine: ReferenceEngine, pinned: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "PREFILL_QUERY_BLOCK", 64)
    monkeypatch.setattr(reference, "CAUSAL_SQUARE", reference.CAUSAL_SQUARE[:64, :64])
    assert known_answer_sha256(engine) != pinned


def test_the_blas_thread_split_leaves_the_known_answer(engine: ReferenceEngine, pinned: str) -> None:
    """The numpy engines' bits do not depend on the BLAS thread count (integer contractions), so
    their KAT has no thread split to catch; it must not refuse one either."""
    for threads in (1, 2):
        with threadpool_limits(limits=threads, user_api="blas"):
            assert known_answer_sha256(engine) == pinned


@pytest.fixture
def docstring_edited_reference(tmp_path: Path) -> Iterator[object]:
    """A copy of the reference engine's module with its docstring edited, imported apart."""
    source = Path(reference.__file__).read_text(encoding="utf-8")
    edited = tmp_path / "reference_edited.py"
    edited.write_text(source.replace('"""The numpy reference engine:', '"""Edited. The numpy reference engine:', 1),
                      encoding="utf-8")
    spec = importlib.util.spec_from_file_location("reference_edited", edited)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["reference_edited"] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["reference_edited"]


def test_a_docstring_edit_in_an_engine_source_needs_no_refreeze(docstring_edited_reference: object,
                                                                  pinned: str) -> None:
    """No identity pins source bytes; the edited engine gives the pinned ABI and known answer, so
    the sealed identity stays loadable and its pins hold."""
    edited = docstring_edited_reference.ReferenceEngine.from_model_dir()  # type: ignore[attr-defined]
    assert Path(docstring_edited_reference.__file__).read_bytes() != Path(reference.__file__).read_bytes()  # type: ignore[attr-defined]
    identity = load_identity(DENSE_IDENTITY)
    assert "adapter" not in json.loads(DENSE_IDENTITY.read_bytes())
    assert edited.abi == identity.consumer_engine.abi
    check_known_answer(edited, pinned, "consumer")


class NotExact:
    """An engine the KAT does not cover: every engine the harness builds has one (the compact torch
    Llama too, since its identity pins its measured digests); an operator's engine factory
    (``--engine-factory``) may build another."""

    name = "operator-engine"
    abi = "operator-engine-test"


def test_a_pin_must_match_whether_the_engine_has_a_known_answer(engine: ReferenceEngine, pinned: str) -> None:
    check_known_answer(NotExact(), None, "producer")
    with pytest.raises(Refused, match="known-answer"):
        check_known_answer(NotExact(), pinned, "producer")
    with pytest.raises(Refused, match="known-answer"):
        check_known_answer(engine, None, "consumer")


class MeasuredElsewhere:
    """A vLLM engine whose process measures its own KAT (the connector lane's consumer facts)."""

    name = "vllm"
    abi = "vllm-cpu-test"
    known_answer_in_engine_process = True


def test_an_engine_measured_in_its_own_process_is_checked_against_what_it_reported(pinned: str) -> None:
    check_known_answer(MeasuredElsewhere(), pinned, "consumer")  # at 'identity sealed': a pin is required
    wrapped = type("LaneEngine", (), {"name": "vllm", "engine": MeasuredElsewhere()})()
    check_known_answer(wrapped, pinned, "consumer")  # as the lane wraps it
    check_known_answer(MeasuredElsewhere(), pinned, "consumer", found=pinned)
    with pytest.raises(Refused, match="known-answer"):
        check_known_answer(MeasuredElsewhere(), None, "consumer")
    with pytest.raises(Refused, match="known-answer"):
        check_known_answer(MeasuredElsewhere(), pinned, "producer", found="0" * 64)


def test_an_identity_pinning_no_known_answer_for_a_vllm_producer_is_refused(pinned: str) -> None:
    from qualify.engines.kat import check_pinned

    check_pinned("vllm", pinned, "producer", "identity x")
    check_pinned("operator-engine", None, "producer", "identity x")
    with pytest.raises(Refused, match="producer_engine.kat_sha256"):
        check_pinned("vllm", None, "producer", "identity x")
    with pytest.raises(Refused, match="producer_engine.kat_sha256"):
        check_pinned("reference-numpy", None, "producer", "identity x")


def test_an_identity_pinning_no_known_answer_for_a_transformers_producer_is_refused(pinned: str) -> None:
    """The GPU producer of the transformers lanes is measured where it runs, as vLLM is: an identity
    must pin its digest (checked at 'identity sealed'; the producer process checks the digest itself)."""
    from qualify.engines.kat import MEASURED_ENGINE_NAMES, check_pinned

    assert MEASURED_ENGINE_NAMES == {"vllm", "transformers-torch", "torch-llama"}
    check_pinned("transformers-torch", pinned, "producer", "identity x")
    with pytest.raises(Refused, match=r"^identity x: producer_engine.kat_sha256: pinned none, expected the "
                                      r"transformers-torch engine's known-answer digest \(re-freeze the identity\)$"):
        check_pinned("transformers-torch", None, "producer", "identity x")


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_an_identity_pinning_no_known_answer_for_either_torch_llama_engine_is_refused(pinned: str, role: str) -> None:
    """The compact torch Llama (both sides of the 8B-shaped lane) is measured on its GPU, as the
    transformers producer is: an identity must pin each side's digest, and 'identity sealed' refuses
    one that pins none, naming the field, before any KAT runs."""
    from qualify.engines.kat import KAT_ENGINE_NAMES, MEASURED_ENGINE_NAMES, check_pinned

    assert "torch-llama" in MEASURED_ENGINE_NAMES and "torch-llama" in KAT_ENGINE_NAMES
    check_pinned("torch-llama", pinned, role, "identity x")
    with pytest.raises(Refused, match=rf"^identity x: {role}_engine.kat_sha256: pinned none, expected the "
                                      r"torch-llama engine's known-answer digest \(re-freeze the identity\)$"):
        check_pinned("torch-llama", None, role, "identity x")


def test_the_kat_input_names_the_token_ids_it_feeds() -> None:
    """What a KAT measured elsewhere records of its input: another seed, size or numpy drawing other
    ids gives another ``kat_input`` (the freeze refuses evidence of another input)."""
    import hashlib

    from qualify.engines.kat import KAT_PROMPT_TOKENS, kat_input, kat_tokens

    facts = kat_input(512)
    assert facts == kat_input(512) != kat_input(513)
    assert facts["tokens_sha256"] == hashlib.sha256(kat_tokens(512).astype("<i8").tobytes()).hexdigest()
    assert facts["prompt_tokens"] == KAT_PROMPT_TOKENS and facts["vocab"] == 512


class HandsOffWholeBlocks:
    """The reference engine behind vLLM's shape of prefill: whole blocks handed off, the prompt kept
    for a cold recompute; ``handed_nudge`` moves only the decode from the handed-off KV."""

    def __init__(self, engine: ReferenceEngine, handed_nudge: float = 0.0) -> None:
        self.base, self.handed_nudge, self.geometry = engine, handed_nudge, engine.geometry

    def prefill(self, tokens: np.ndarray) -> object:
        from qualify.core.kv import KVCache

        whole = (len(tokens) // 128) * 128
        kv = self.base.prefill(tokens[:whole])
        cold = KVCache(kv.keys, kv.values)
        cold.source_tokens = np.asarray(tokens)  # type: ignore[attr-defined]  # vLLM's ColdKV carries it
        return cold

    def decode(self, kv: object, pending: np.ndarray, n: int) -> object:
        source = getattr(kv, "source_tokens", None)
        if source is not None:  # the cold recompute: the whole prompt again
            return self.base.decode(self.base.prefill(source), pending, n)
        result = self.base.decode(kv, pending, n)
        result.logits = np.asarray(result.logits) + np.float32(self.handed_nudge)
        return result


def test_a_whole_block_engine_digests_its_decode_from_the_handed_off_kv_too(engine: ReferenceEngine) -> None:
    digest = known_answer_sha256(HandsOffWholeBlocks(engine))
    assert digest == known_answer_sha256(HandsOffWholeBlocks(engine))
    assert known_answer_sha256(HandsOffWholeBlocks(engine, handed_nudge=1e-3)) != digest
