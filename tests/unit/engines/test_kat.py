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
    """An engine the KAT does not cover (its bits are not exact by construction)."""

    name = "vllm"
    abi = "vllm-cpu-test"


def test_a_pin_must_match_whether_the_engine_has_a_known_answer(engine: ReferenceEngine, pinned: str) -> None:
    check_known_answer(NotExact(), None, "producer")
    with pytest.raises(Refused, match="known-answer"):
        check_known_answer(NotExact(), pinned, "producer")
    with pytest.raises(Refused, match="known-answer"):
        check_known_answer(engine, None, "consumer")
