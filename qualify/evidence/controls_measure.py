"""Measuring a lane's E2 controls (seed 000 §32.10): teacher-forced top-token disagreement with the
reference per control document and nested length, for the lane and for the E1 yardstick.

What is measured is the criteria's ``measure`` block (``contracts/e2-controls-v2.json``), one pass
per document and KV source: the producer prefills the whole document once, and the lane's consumer
scores every row r from that KV of positions 0..r-1 and its own computation at r
(:meth:`~qualify.engines.reference.ReferenceEngine.score_rows`, a teacher-forced decode step per
row). The reference is the same consumer scoring from its own cold prefill. A row's top token is
the first index of its maximum logit; a cell of length L counts the rows 0..L-1 whose top token
differs from the reference's (the model is causal: the first L rows of the document's pass are
the pass over its first L tokens). Nothing here judges: ``qualify.judge.controls`` reads the record.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from qualify.contract.controls import CONTROLS_RECORD_SCHEMA_ID, DOCUMENT_NAME, ControlsCriteria, check_controls_record
from qualify.contract.lanes import EngineChoice, LaneKind, LaneSpec, ProducerMode
from qualify.core import model_choice
from qualify.core.assets import MODEL_DIR, asset_relpath, prompt_sha256
from qualify.core.digests import is_sha256_hex
from qualify.core.errors import Refused
from qualify.core.kv import KVCache
from qualify.core.strict_json import render
from qualify.engines.base import LaneEngine, check_tokens
from qualify.engines.reference import ReferenceEngine

Progress = Callable[[str], None]
"""Called with one line after each document's pass of each KV source (what a bench prints)."""


class Producer(Protocol):
    """What the measurement asks of a producer: its ABI and the KV of exactly the tokens given."""

    @property
    def abi(self) -> str: ...

    def prefill(self, tokens: np.ndarray) -> KVCache: ...


# --------------------------------------------------------------------------------------------
# The engines of a lane's controls
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControlEngines:
    """A lane's consumer (the reference engine that scores every row), its producer in the lane's
    mode, and the yardstick producer: the plain Q8_0 k-quant target, without its draft."""

    lane: str
    consumer: ReferenceEngine
    producer: LaneEngine
    yardstick: Producer


def _consumer_is_reference(spec: LaneSpec) -> bool:
    """Whether the factory builds the lane's consumer as the numpy reference engine (decided from
    the lane table, so a vLLM or torch consumer is never started only to be refused)."""
    if spec.kind is LaneKind.VLLM:
        return spec.engines[1] is EngineChoice.REFERENCE
    return spec.kind in (LaneKind.NVFP4, LaneKind.TRANSFORMERS)


def build_control_engines(spec: LaneSpec) -> ControlEngines:
    """The three engines of the lane ``spec``'s controls; a lane whose consumer is not the reference
    engine (k-quant, vLLM or torch consumers) is refused in one line naming it."""
    from qualify.engines.factory import build_consumer, producer_engine
    from qualify.engines.kquant import build_kquant_engine

    lane = spec.name
    if not _consumer_is_reference(spec):
        raise Refused(f"lane {lane}: its consumer is not the numpy reference engine, expected a lane whose "
                      "consumer scores rows (ReferenceEngine.score_rows)")
    consumer = reference_consumer(build_consumer(spec), lane)
    producer = producer_engine(spec, spec.mode)
    # The yardstick is E1's second real quantization: the shipped Q8_0 target in llama.cpp's exact
    # arithmetic (ProducerMode.EXACT), the plain engine, never the speculative lane's draft.
    if model_choice.chosen() is not None:
        from qualify.engines import chosen_model

        # A chosen model's E1 quantization: its own float weights to Q8_0, the same arithmetic.
        return ControlEngines(lane=lane, consumer=consumer, producer=producer, yardstick=chosen_model.q8_0_engine())
    return ControlEngines(lane=lane, consumer=consumer, producer=producer,
                          yardstick=build_kquant_engine(ProducerMode.EXACT))


def reference_consumer(consumer: object, lane: str) -> ReferenceEngine:
    """``consumer`` (a :class:`LaneEngine` or a bare engine) as the reference engine that scores
    rows, refused in one line naming ``lane`` when it is any other engine."""
    engine = consumer.engine if isinstance(consumer, LaneEngine) else consumer
    if not isinstance(engine, ReferenceEngine):
        name = getattr(engine, "name", type(engine).__name__)
        raise Refused(f"lane {lane}: consumer {name} cannot score rows, expected the numpy reference engine")
    return engine


def yardstick_identity(criteria: ControlsCriteria) -> dict[str, str]:
    """The record's yardstick block from the loaded criteria (whose loader checked the file's
    SHA-256), refused unless the criteria's file is the k-quant target this harness builds."""
    from qualify.engines import kquant

    choice = model_choice.chosen()
    if choice is not None:
        from qualify.engines import chosen_model

        derived = model_choice.file_key(choice.name, chosen_model.Q8_0_DERIVED)
        digest, _ = chosen_model.q8_0_weights_sha256()
        if (criteria.yardstick.file, criteria.yardstick.sha256) != (derived, digest):
            raise Refused(f"controls criteria {criteria.name}: yardstick: found {criteria.yardstick.file} sha256 "
                          f"{criteria.yardstick.sha256}, expected {derived} sha256 {digest} (the Q8_0 weights "
                          f"derived from --model {choice.name})")
        return {"name": criteria.yardstick.name, "sha256": criteria.yardstick.sha256}
    target = asset_relpath(MODEL_DIR / "gguf" / kquant.TARGET_GGUF_NAME)  # what load_kquant_model reads
    if criteria.yardstick.file != target:
        raise Refused(f"controls criteria {criteria.name}: yardstick.file: found {render(criteria.yardstick.file)}, "
                      f"expected {target} (the k-quant target the yardstick engine reads)")
    return {"name": criteria.yardstick.name, "sha256": criteria.yardstick.sha256}


# --------------------------------------------------------------------------------------------
# One pass: a producer's KV, the consumer's rows, their top tokens
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopTokens:
    """One document's top tokens (int32 [T], row r's first index of the maximum logit) from one
    KV source, and the seconds its prefill and scoring took."""

    tokens: np.ndarray
    prefill_seconds: float
    scoring_seconds: float

    @property
    def sha256(self) -> str:
        """SHA-256 of the top tokens as little-endian int32 (the record's ``top_tokens_sha256``)."""
        return hashlib.sha256(np.ascontiguousarray(self.tokens, dtype="<i4").tobytes()).hexdigest()


def top_tokens(consumer: ReferenceEngine, producer: Producer, tokens: np.ndarray) -> TopTokens:
    """One pass: ``producer`` prefills all of ``tokens`` once, ``consumer`` scores every row from
    that KV; each row's top token is the first index of its maximum logit (``np.argmax``)."""
    began = time.perf_counter()
    past = producer.prefill(tokens)
    prefilled = time.perf_counter()
    logits = consumer.score_rows(tokens, past)  # [T, vocab]
    scored = time.perf_counter()
    return TopTokens(np.argmax(logits, axis=1).astype(np.int32), prefill_seconds=prefilled - began,
                     scoring_seconds=scored - prefilled)


@dataclass(frozen=True)
class SharedScoring:
    """The reference's and the yardstick's top tokens per document. They depend on the consumer,
    the yardstick and the documents, never on the lane, so lanes sharing a consumer (same ABI)
    measure them once."""

    consumer_abi: str
    yardstick_abi: str
    token_sha256: Mapping[str, str]
    reference: Mapping[str, TopTokens]
    yardstick: Mapping[str, TopTokens]


class _ConsumerAsProducer:
    """The consumer's own cold prefill as a KV source (the reference pass)."""

    def __init__(self, consumer: ReferenceEngine) -> None:
        self.consumer = consumer

    @property
    def abi(self) -> str:
        return self.consumer.abi

    def prefill(self, tokens: np.ndarray) -> KVCache:
        return self.consumer.prefill(tokens)


def score_shared(consumer: ReferenceEngine, yardstick: Producer, documents: Mapping[str, np.ndarray],
                 progress: Progress | None = None) -> SharedScoring:
    """The reference and yardstick passes over every document (see :class:`SharedScoring`)."""
    checked = checked_documents(documents, consumer.geometry.vocab)
    reference: dict[str, TopTokens] = {}
    measured: dict[str, TopTokens] = {}
    for name, tokens in checked.items():
        for label, source, into in (("reference", _ConsumerAsProducer(consumer), reference),
                                    ("yardstick", yardstick, measured)):
            into[name] = top_tokens(consumer, source, tokens)
            _report(progress, name, label, into[name])
    return SharedScoring(consumer_abi=consumer.abi, yardstick_abi=yardstick.abi,
                         token_sha256={name: prompt_sha256(tokens) for name, tokens in checked.items()},
                         reference=reference, yardstick=measured)


def _report(progress: Progress | None, document: str, label: str, top: TopTokens) -> None:
    if progress is not None:
        progress(f"{document}: {label} pass, prefill {top.prefill_seconds:.1f} s, "
                 f"scoring {top.scoring_seconds:.1f} s")


# --------------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------------


def measure_controls(consumer: object, producer: Producer, yardstick: Producer,
                     documents: Mapping[str, np.ndarray], lengths: Sequence[int], profile_window: int, *,
                     lane: str, criteria: Mapping[str, str], yardstick_id: Mapping[str, str],
                     progress: Progress | None = None, shared: SharedScoring | None = None) -> dict[str, Any]:
    """The controls record (``trust-ladder.controls-record.v1``) of ``lane``: per document, one
    pass of the lane's producer, of the yardstick and of the consumer's own cold prefill, each
    scored by ``consumer``; cells at ``lengths`` and a profile of ``profile_window``-row windows
    over the whole document. ``criteria`` and ``yardstick_id`` (``name``, ``sha256``) are copied
    in. ``shared`` reuses another lane's reference and yardstick passes (same consumer ABI,
    yardstick ABI and documents, else refused); their seconds count in every record they serve."""
    engine = reference_consumer(consumer, lane)
    if isinstance(producer, LaneEngine) and producer.spec.name != lane:
        raise Refused(f"lane {lane}: producer is lane {producer.spec.name}'s, expected lane {lane}'s")
    identification = {"criteria": _identification(criteria, "criteria"),
                      "yardstick": _identification(yardstick_id, "yardstick")}
    checked = checked_documents(documents, engine.geometry.vocab)
    check_layout(lengths, profile_window, {name: tokens.size for name, tokens in checked.items()})
    if shared is None:
        shared = score_shared(engine, yardstick, checked, progress)
    else:
        _check_shared(shared, engine, yardstick, checked)
    records = []
    prefill_seconds = scoring_seconds = 0.0
    for name, tokens in checked.items():
        reference, measured = shared.reference[name], shared.yardstick[name]
        lane_top = top_tokens(engine, producer, tokens)
        _report(progress, name, f"lane {lane}", lane_top)
        for top in (reference, measured, lane_top):
            prefill_seconds += top.prefill_seconds
            scoring_seconds += top.scoring_seconds
        records.append(_document_record(name, tokens, reference, lane_top, measured, lengths, profile_window))
    record = {
        "schema": CONTROLS_RECORD_SCHEMA_ID,
        "criteria": identification["criteria"],
        "lane": lane,
        "yardstick": identification["yardstick"],
        "documents": records,
        "seconds": {"prefill": round(prefill_seconds, 3), "scoring": round(scoring_seconds, 3)},
    }
    check_controls_record(record, f"controls record of lane {lane}")
    return record


def _document_record(name: str, tokens: np.ndarray, reference: TopTokens, lane: TopTokens, yardstick: TopTokens,
                     lengths: Sequence[int], profile_window: int) -> dict[str, Any]:
    """One document's cells (rows 0..L-1 of its single pass) and profile windows."""
    cells, profile = disagreement_cells({"lane": lane.tokens != reference.tokens,
                                         "yardstick": yardstick.tokens != reference.tokens}, lengths, profile_window)
    return {
        "document": name,
        "token_sha256": prompt_sha256(tokens),
        "rows": int(tokens.size),
        "cells": cells,
        "profile": profile,
        "top_tokens_sha256": {"reference": reference.sha256, "lane": lane.sha256, "yardstick": yardstick.sha256},
    }


def disagreement_cells(differs: Mapping[str, np.ndarray], lengths: Sequence[int], profile_window: int
                       ) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
    """Cells and profile of one document's pass from per-row disagreement flags (``label`` ->
    bool [T], all of one length T): a cell of length L counts rows 0..L-1 (the nesting rule), a
    profile window its ``profile_window`` rows; each count is keyed ``<label>_disagreeing``."""
    rows = {int(flags.size) for flags in differs.values()}
    if len(rows) != 1:
        raise Refused(f"controls disagreement flags: passes of {sorted(rows)} rows, expected one length")
    total = rows.pop()

    def counts(window: slice) -> dict[str, int]:
        return {f"{label}_disagreeing": int(np.count_nonzero(flags[window])) for label, flags in differs.items()}

    cells = [{"length": int(length), "rows": int(length), **counts(slice(0, length))} for length in lengths]
    profile = [{"start": start, "stop": start + profile_window, **counts(slice(start, start + profile_window))}
               for start in range(0, total, profile_window)]
    return cells, profile


# --------------------------------------------------------------------------------------------
# Checks (fail closed, one line each)
# --------------------------------------------------------------------------------------------


def _identification(block: object, field: str) -> dict[str, str]:
    """A ``{"name", "sha256"}`` block, exactly those two keys, a name and a SHA-256."""
    if not isinstance(block, Mapping) or set(block) != {"name", "sha256"}:
        raise Refused(f"controls {field}: found {render(block)}, expected exactly name and sha256")
    name, sha256 = block["name"], block["sha256"]
    if not isinstance(name, str) or DOCUMENT_NAME.fullmatch(name) is None or len(name) > 64:
        raise Refused(f"controls {field}.name: found {render(name)}, expected a name ([a-z0-9][a-z0-9_-]*)")
    if not is_sha256_hex(sha256):
        raise Refused(f"controls {field}.sha256: found {render(sha256)}, expected a SHA-256 (64 lowercase hex)")
    return {"name": name, "sha256": sha256}


def checked_documents(documents: object, vocab: int) -> dict[str, np.ndarray]:
    """Name -> token ids (int64 [T]), in the given order; refuses no documents, a bad name or ids."""
    if not isinstance(documents, Mapping) or not documents:
        raise Refused(f"controls documents: found {render(documents)}, expected a mapping of names to token ids")
    checked: dict[str, np.ndarray] = {}
    for name, tokens in documents.items():
        if not isinstance(name, str) or DOCUMENT_NAME.fullmatch(name) is None or len(name) > 64:
            raise Refused(f"controls documents: name found {render(name)}, expected a document name ([a-z0-9][a-z0-9_-]*)")
        checked[name] = check_tokens(tokens, vocab, f"controls document {name}")
    return checked


def _whole(value: object) -> int | None:
    """``value`` as a whole number (a bool or 4.0 is not one), else None."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def check_layout(lengths: object, profile_window: object, rows: Mapping[str, int]) -> None:
    """Lengths positive, strictly increasing, whole multiples of the window and within every
    document; the window a whole divisor of every document's rows (the judge reads exactly that)."""
    window = _whole(profile_window)
    if window is None or window < 1:
        raise Refused(f"controls profile_window: found {render(profile_window)}, expected a positive whole number of rows")
    if not isinstance(lengths, Sequence) or not lengths:
        raise Refused(f"controls lengths: found {render(lengths)}, expected a list of positive lengths")
    previous = 0
    for index, value in enumerate(lengths):
        length = _whole(value)
        if length is None or length <= previous:
            raise Refused(f"controls lengths[{index}]: found {render(value)}, expected a whole length above {previous}")
        if length % window:
            raise Refused(f"controls lengths[{index}]: found {length}, expected a multiple of profile_window {window}")
        previous = length
    for name, count in rows.items():
        if count < previous:
            raise Refused(f"controls document {name}: {count} tokens, expected at least the longest length {previous}")
        if count % window:
            raise Refused(f"controls document {name}: {count} tokens, expected a multiple of profile_window {window}")


def _check_shared(shared: SharedScoring, consumer: ReferenceEngine, yardstick: Producer,
                  documents: Mapping[str, np.ndarray]) -> None:
    """Refuse shared passes made with another consumer, yardstick or document set."""
    if shared.consumer_abi != consumer.abi:
        raise Refused(f"controls shared passes: consumer abi {shared.consumer_abi}, expected {consumer.abi}")
    if shared.yardstick_abi != yardstick.abi:
        raise Refused(f"controls shared passes: yardstick abi {shared.yardstick_abi}, expected {yardstick.abi}")
    digests = {name: prompt_sha256(tokens) for name, tokens in documents.items()}
    if dict(shared.token_sha256) != digests:
        raise Refused(f"controls shared passes: documents {render(dict(shared.token_sha256))}, expected {render(digests)}")
