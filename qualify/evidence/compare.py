"""Full-logit comparison of a handoff branch against the cold local recompute (pure numpy, no I/O).

Both branches decode the same 256 greedy steps; the handoff branch starts from the producer's KV,
the cold branch from the consumer's own prefill. This module measures how far apart they are:
tokens exactly, logits in the contract's units, digests of the emitted bytes, and, when they
disagree, where and why (localisation). It judges nothing: :mod:`qualify.judge` does.

Conventions (defined once, here):

* **Contract units.** Deltas and margins are computed after the contract's logit transform
  (``raw``, or ``tanh-softcap:<cap>`` = ``cap * tanh(x / cap)``, evaluated in float32) is applied
  to both branches (seed §32.6: a bound is a number *and* a unit). Pass ``raw`` when the engine
  already emits logits in contract units (see :func:`transform_between`).
* **Digests** are over the bytes the engines emitted (float32 little-endian, before any
  transform), so a digest match means bit-identical engine output. A row digest is the SHA-256 of
  one row; the block digest is the SHA-256 of all rows concatenated in order. The generated-token
  digest is the SHA-256 of the token ids as little-endian uint32.
* **Memory.** Blocks are streamed in chunks of at most ``CHUNK_BYTES`` (at least one row); extra
  memory is O(chunk), never a ``[rows, vocab]`` delta array.

Divergence classification (the rule, and why). Let ``d`` be the first step where the greedy tokens
differ, ``m`` the cold run's top-1 minus top-2 margin at ``d`` and ``D`` the max abs logit delta at
row ``d`` (teacher-forced row ``d`` when given, else the free-running row ``d``; both score the
same context because tokens agree before ``d``). If every logit of a row moves by at most ``D``,
two logits can swap order only when their gap is at most ``2·D`` (``c_a - c_b <= δ_b - δ_a <=
2D``). So the divergence is a **near-tie** when ``m <= 2 · min(D, maximum_absolute)``: drift no
larger than what the lane showed at that row *and* no larger than its declared envelope explains
the flip (numerics). It is **decisive** otherwise: either the measured drift at that row cannot
produce the flip at all (the decode did not follow its own logits: state changed between runs), or
it needed drift beyond the lane's envelope (a corruption signal). Non-finite inputs are decisive.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np

from qualify.core.errors import Refused
from qualify.core.numerics import tree_sum
from qualify.engines.base import DecodeResult

CHUNK_BYTES = 1 << 19
"""Rows are streamed in chunks of about this many bytes per branch (kept cache-resident)."""

DIGEST_THREADS = 2
"""Worker threads hashing the two branches' logit blocks while the deltas are computed."""

DivergenceClass = Literal["near-tie", "decisive"]


# --------------------------------------------------------------------------- logit transform


@dataclass(frozen=True, slots=True)
class LogitTransform:
    """The contract's logit units: ``cap is None`` for raw logits, else ``cap * tanh(x / cap)``."""

    spec: str
    cap: float | None

    def apply(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows in contract units (float32); returns ``rows`` itself for ``raw`` when no ``out``."""
        if self.cap is None:
            if out is None:
                return rows
            np.copyto(out, rows)
            return out
        cap = np.float32(self.cap)
        result: np.ndarray = np.divide(rows, cap, out=out, dtype=np.float32)
        np.tanh(result, out=result)
        np.multiply(result, cap, out=result)
        return result


def parse_logit_transform(spec: str) -> LogitTransform:
    """Parse ``raw`` or ``tanh-softcap:<cap>`` (cap finite and positive); refuse anything else."""
    if spec == "raw":
        return LogitTransform("raw", None)
    prefix = "tanh-softcap:"
    if isinstance(spec, str) and spec.startswith(prefix):
        try:
            cap = float(spec[len(prefix):])
        except ValueError:
            cap = math.nan
        if math.isfinite(cap) and cap > 0:
            return LogitTransform(spec, cap)
    raise Refused(f"logit transform: found {spec!r}, expected 'raw' or 'tanh-softcap:<positive cap>'")


def transform_between(emitted_units: str, contract_units: str) -> LogitTransform:
    """The transform taking an engine's emitted logits into the contract's units.

    Equal units need none (``raw``); raw logits under a soft-cap contract get the cap; any other
    pair (e.g. capped logits under a raw or differently capped contract) cannot be undone and is
    refused.
    """
    emitted = parse_logit_transform(emitted_units)
    contract = parse_logit_transform(contract_units)
    if emitted.cap == contract.cap:
        return LogitTransform("raw", None)
    if emitted.cap is None:
        return contract
    raise Refused(
        f"logit units: engine emits {emitted.spec}, contract compares in {contract.spec}; "
        f"a soft cap cannot be undone"
    )


# --------------------------------------------------------------------------- input checks


def _as_tokens(tokens: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise Refused(f"{what}: expected a 1-D integer token array, found {array.dtype}{list(array.shape)}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > 0xFFFFFFFF):
        raise Refused(f"{what}: token ids must fit uint32")
    return array


def _as_logits(logits: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(logits)
    if array.ndim != 2 or array.dtype != np.float32:
        raise Refused(f"{what}: expected float32 [rows, vocab] logits, found {array.dtype}{list(array.shape)}")
    if array.shape[1] == 0:
        raise Refused(f"{what}: logit rows are empty")
    return array


def _same_shape(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.shape != b.shape:
        raise Refused(f"{what}: shapes differ: handoff {list(a.shape)} vs cold {list(b.shape)}")


def _le_bytes(rows: np.ndarray) -> np.ndarray:
    """Rows as C-contiguous little-endian float32 (a view when they already are)."""
    return np.ascontiguousarray(rows, dtype="<f4")


def _chunk_rows(vocab: int, itemsize: int = 4) -> int:
    return max(1, CHUNK_BYTES // max(1, vocab * itemsize))


# --------------------------------------------------------------------------- digests and tokens


def generated_token_sha256(tokens: np.ndarray) -> str:
    """SHA-256 of generated token ids as little-endian uint32."""
    array = _as_tokens(tokens, "generated tokens")
    return hashlib.sha256(array.astype("<u4").tobytes()).hexdigest()


@dataclass(frozen=True, slots=True)
class LogitDigests:
    """Per-row SHA-256 of float32 little-endian rows, and of the whole block."""

    row_sha256: tuple[str, ...]
    block_sha256: str


class _DigestStream:
    """Accumulates row and block digests chunk by chunk."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.block = hashlib.sha256()

    def update(self, chunk: np.ndarray) -> None:
        chunk = _le_bytes(chunk)
        self.block.update(chunk.data)
        self.rows.extend(hashlib.sha256(row).hexdigest() for row in chunk)

    def result(self) -> LogitDigests:
        return LogitDigests(tuple(self.rows), self.block.hexdigest())


def logit_digests(logits: np.ndarray) -> LogitDigests:
    """Row and block digests of an emitted float32 logit block (streamed)."""
    array = _as_logits(logits, "logits")
    stream = _DigestStream()
    step = _chunk_rows(array.shape[1])
    for start in range(0, array.shape[0], step):
        stream.update(array[start:start + step])
    return stream.result()


def _digest_blocks_in_background(*blocks: np.ndarray) -> list[Future[LogitDigests]]:
    """Hash each block on its own worker thread (hashlib releases the GIL on large buffers), so
    SHA-256, the slowest part of a comparison, overlaps the delta pass on the calling thread."""
    executor = ThreadPoolExecutor(max_workers=min(DIGEST_THREADS, len(blocks)))
    try:
        return [executor.submit(logit_digests, block) for block in blocks]
    finally:
        executor.shutdown(wait=False)


def first_digest_mismatch(handoff: LogitDigests, cold: LogitDigests) -> int | None:
    """First row whose digests differ (a length difference counts at the shorter length)."""
    for index, (left, right) in enumerate(zip(handoff.row_sha256, cold.row_sha256, strict=False)):
        if left != right:
            return index
    if len(handoff.row_sha256) != len(cold.row_sha256):
        return min(len(handoff.row_sha256), len(cold.row_sha256))
    return None


@dataclass(frozen=True, slots=True)
class TokenAgreement:
    """Fraction of equal greedy tokens and the first step where they differ (None if none)."""

    rate: float
    first_divergence: int | None


def token_agreement(handoff_tokens: np.ndarray, cold_tokens: np.ndarray) -> TokenAgreement:
    """Token agreement rate and first diverging position; lengths must match."""
    handoff = _as_tokens(handoff_tokens, "handoff tokens")
    cold = _as_tokens(cold_tokens, "cold tokens")
    _same_shape(handoff, cold, "tokens")
    if handoff.size == 0:
        raise Refused("tokens: no generated tokens to compare")
    equal = handoff == cold
    mismatches = np.flatnonzero(~equal)
    first = int(mismatches[0]) if mismatches.size else None
    return TokenAgreement(float(np.count_nonzero(equal)) / handoff.size, first)


# --------------------------------------------------------------------------- logit deltas


@dataclass(frozen=True)
class LogitDelta:
    """Abs deltas of two logit blocks in contract units: per row and overall.

    ``mean_abs`` is the mean over all elements; ``first_row_over_rule`` is the first row whose
    max abs delta exceeds ``maximum_absolute`` or whose mean abs delta exceeds
    ``maximum_mean_absolute`` (non-finite rows count as over), None if no row does or no rule was
    given.
    """

    max_abs: float
    mean_abs: float
    row_max_abs: np.ndarray
    row_mean_abs: np.ndarray
    first_row_over_rule: int | None


def first_row_over_rule(
    row_max_abs: np.ndarray,
    row_mean_abs: np.ndarray,
    maximum_absolute: float | None,
    maximum_mean_absolute: float | None,
) -> int | None:
    """First row breaking the rule (max or mean); NaN rows break it (fail closed)."""
    if maximum_absolute is None and maximum_mean_absolute is None:
        return None
    within = np.ones(row_max_abs.shape, dtype=bool)
    if maximum_absolute is not None:
        within &= row_max_abs <= maximum_absolute
    if maximum_mean_absolute is not None:
        within &= row_mean_abs <= maximum_mean_absolute
    over = np.flatnonzero(~within)
    return int(over[0]) if over.size else None


class _DeltaStream:
    """Accumulates per-row max and mean abs deltas from cache-resident chunk buffers."""

    def __init__(self, rows: int, vocab: int, chunk: int) -> None:
        self.vocab = vocab
        self.row_max = np.empty(rows)  # float64, numpy's default, as every array below
        self.row_sum = np.empty(rows)
        self._scratch = np.empty((chunk, vocab), dtype=np.float32)

    def update(self, start: int, left: np.ndarray, right: np.ndarray) -> None:
        count = left.shape[0]
        diff = self._scratch[:count]
        np.subtract(left, right, out=diff)
        np.abs(diff, out=diff)
        self.row_max[start:start + count] = diff.max(axis=1)
        # A fixed-order float64 sum: the sealed mean must not depend on numpy's SIMD dispatch.
        self.row_sum[start:start + count] = tree_sum(diff.astype(np.float64))[:, 0]

    def result(self, maximum_absolute: float | None, maximum_mean_absolute: float | None) -> LogitDelta:
        rows = self.row_max.shape[0]
        row_mean = self.row_sum / self.vocab
        max_abs = float(self.row_max.max()) if rows else math.nan
        mean_abs = float(tree_sum(self.row_sum)[0] / (rows * self.vocab)) if rows else math.nan
        return LogitDelta(
            max_abs,
            mean_abs,
            self.row_max,
            row_mean,
            first_row_over_rule(self.row_max, row_mean, maximum_absolute, maximum_mean_absolute),
        )


def compare_logit_blocks(
    handoff_logits: np.ndarray,
    cold_logits: np.ndarray,
    transform: LogitTransform | str = "raw",
    *,
    maximum_absolute: float | None = None,
    maximum_mean_absolute: float | None = None,
) -> LogitDelta:
    """Per-row and overall max/mean abs deltas in contract units, streamed (the full-logit check)."""
    transform = parse_logit_transform(transform) if isinstance(transform, str) else transform
    handoff = _as_logits(handoff_logits, "handoff logits")
    cold = _as_logits(cold_logits, "cold logits")
    _same_shape(handoff, cold, "logits")
    rows, vocab = handoff.shape
    step = _chunk_rows(vocab)
    deltas = _DeltaStream(rows, vocab, step)
    handoff_units = np.empty((step, vocab), dtype=np.float32) if transform.cap is not None else None
    cold_units = np.empty((step, vocab), dtype=np.float32) if transform.cap is not None else None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        left = handoff[start:stop]
        right = cold[start:stop]
        if handoff_units is not None and cold_units is not None:  # capped units
            left = transform.apply(left, out=handoff_units[: stop - start])
            right = transform.apply(right, out=cold_units[: stop - start])
        deltas.update(start, left, right)
    return deltas.result(maximum_absolute, maximum_mean_absolute)


# --------------------------------------------------------------------------- margins


def _top1_minus_top2(rows: np.ndarray) -> np.ndarray:
    """Per-row top-1 minus top-2 value (0 on an exact tie, NaN if a row holds NaN)."""
    count, vocab = rows.shape
    if vocab < 2:
        return np.full(count, math.inf)
    best = rows.argmax(axis=1)
    margins = np.empty(count)
    for index in range(count):
        row = rows[index]
        column = int(best[index])
        top1 = float(row[column])
        below = row[:column].max() if column > 0 else -np.inf
        above = row[column + 1:].max() if column + 1 < vocab else -np.inf
        # argmax returns the first NaN of a row holding one, so such a row's margin is NaN.
        margins[index] = top1 - float(max(below, above))
    return margins


def top1_top2_margins(logits: np.ndarray, transform: LogitTransform | str = "raw") -> np.ndarray:
    """The top-1 minus top-2 margin (contract units, float64) of every row, streamed."""
    transform = parse_logit_transform(transform) if isinstance(transform, str) else transform
    array = _as_logits(logits, "logits")
    rows, vocab = array.shape
    step = _chunk_rows(vocab)
    scratch = np.empty((step, vocab), dtype=np.float32) if transform.cap is not None else None
    margins = np.empty(rows)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = array[start:stop]
        if scratch is not None:  # capped units
            chunk = transform.apply(chunk, out=scratch[: stop - start])
        margins[start:stop] = _top1_minus_top2(chunk)
    return margins


# --------------------------------------------------------------------------- classification


def classify_divergence(
    cold_margin: float, drift_at_row: float, maximum_absolute: float
) -> DivergenceClass:
    """``near-tie`` when ``cold_margin <= 2 * min(drift_at_row, maximum_absolute)``, else ``decisive``.

    Two logits each moved by at most D can swap order only if their gap is at most 2·D; the
    module docstring gives the full rule. Non-finite inputs are ``decisive`` (fail closed).
    """
    values = (cold_margin, drift_at_row, maximum_absolute)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return "decisive"
    explainable = 2.0 * min(float(drift_at_row), float(maximum_absolute))
    return "near-tie" if float(cold_margin) <= explainable else "decisive"


# --------------------------------------------------------------------------- teacher forcing


@dataclass(frozen=True)
class TeacherForcedDrift:
    """The handoff branch fed the cold tokens, against the cold logits (contract units).

    ``top1_flips`` counts rows whose emitted argmax differs from the cold row's emitted argmax;
    ``partings`` lists those rows in order with the cold top-1 minus top-2 margin there (contract
    units), what the teacher-forced rule judges a parting by.
    """

    max_abs: float
    mean_abs: float
    first_row_over_rule: int | None
    top1_flips: int
    row_max_abs: np.ndarray
    row_mean_abs: np.ndarray
    partings: tuple[tuple[int, float], ...] = ()

    @property
    def max_row_mean_abs(self) -> float:
        """The largest per-row mean abs delta (NaN when a row's is): each row is judged alone."""
        return largest(self.row_mean_abs)


def teacher_forced_drift(
    teacher_forced_logits: np.ndarray,
    cold_logits: np.ndarray,
    transform: LogitTransform | str = "raw",
    *,
    maximum_absolute: float | None = None,
    maximum_mean_absolute: float | None = None,
) -> TeacherForcedDrift:
    """Drift summary of teacher-forced handoff logits against the cold logits (streamed)."""
    forced = _as_logits(teacher_forced_logits, "teacher-forced logits")
    cold = _as_logits(cold_logits, "cold logits")
    _same_shape(forced, cold, "teacher-forced logits")
    delta = compare_logit_blocks(
        forced, cold, transform,
        maximum_absolute=maximum_absolute, maximum_mean_absolute=maximum_mean_absolute,
    )
    transform = parse_logit_transform(transform) if isinstance(transform, str) else transform
    parted: list[np.ndarray] = []
    margins = np.empty(forced.shape[0])
    step = _chunk_rows(forced.shape[1])
    for start in range(0, forced.shape[0], step):
        stop = start + step
        parted.append(start + np.flatnonzero(forced[start:stop].argmax(axis=1) != cold[start:stop].argmax(axis=1)))
        margins[start:stop] = _top1_minus_top2(transform.apply(cold[start:stop]))
    return TeacherForcedDrift(
        delta.max_abs, delta.mean_abs, delta.first_row_over_rule, sum(len(rows) for rows in parted),
        delta.row_max_abs, delta.row_mean_abs, partings_at(np.concatenate(parted), margins),
    )


def partings_at(rows: np.ndarray, cold_margins: np.ndarray) -> tuple[tuple[int, float], ...]:
    """``(row, cold margin there)`` for each parted row, in row order."""
    return tuple((int(row), float(cold_margins[row])) for row in np.sort(rows))


def largest(values: np.ndarray) -> float:
    """The largest value of a per-row series, NaN when any is (a non-finite row is never hidden); 0.0 when empty."""
    if values.size == 0:
        return 0.0
    return float("nan") if bool(np.isnan(values).any()) else float(values.max())


# --------------------------------------------------------------------------- KV deltas


@dataclass(frozen=True, slots=True)
class KVLayerDelta:
    """Max abs delta of one layer's handed-off K and V against the consumer's own prefill, and
    the position where each maximum sits (first such position)."""

    layer: int
    k: float
    v: float
    k_position: int
    v_position: int


@dataclass(frozen=True)
class KVComparison:
    """Per-layer K/V deltas and, per handed-off position, the max abs delta over every layer,
    head and dim of K and V (locates a positional fault such as swapped blocks). The host comparer
    also keeps each tensor's own per-position maxima, ``tensor_position_max_abs`` [2 * layers,
    positions] (layer by layer, K before V), what a fixture envelope judges position by position;
    the device comparer leaves it None."""

    layers: tuple[KVLayerDelta, ...]
    position_max_abs: np.ndarray
    tensor_position_max_abs: np.ndarray | None = None

    def first_position_over(self, threshold: float) -> int | None:
        """First position whose KV delta exceeds ``threshold`` (NaN counts as over)."""
        over = np.flatnonzero(~(self.position_max_abs <= threshold))
        return int(over[0]) if over.size else None


def _tensor_delta(handoff: np.ndarray, own: np.ndarray, what: str, profile: np.ndarray,
                  rows: list[np.ndarray]) -> tuple[float, int]:
    """Max abs delta of one handed-off tensor and its first position; folds per-position maxima
    into ``profile`` (NaN propagates, so a NaN position counts as over any threshold) and appends
    them to ``rows``."""
    heads, positions, dim = handoff.shape
    if own.ndim != 3 or own.shape[0] != heads or own.shape[2] != dim or own.shape[1] < positions:
        raise Refused(f"{what}: handed-off shape {list(handoff.shape)} does not fit own prefill {list(own.shape)}")
    per_position = np.full(positions, -np.inf)
    for head in range(heads):
        diff = np.subtract(handoff[head], own[head, :positions], dtype=np.float32)
        np.abs(diff, out=diff)
        np.maximum(per_position, diff.max(axis=1), out=per_position)
    np.maximum(profile, per_position, out=profile)
    rows.append(per_position)
    if positions == 0:
        return 0.0, 0
    position = int(per_position.argmax())
    return float(per_position[position]), position


def compare_kv(
    handoff_keys: Sequence[np.ndarray],
    handoff_values: Sequence[np.ndarray],
    own_keys: Sequence[np.ndarray],
    own_values: Sequence[np.ndarray],
) -> KVComparison:
    """Per-layer K and V max abs deltas of the handed-off KV against the consumer's own prefill.

    Only the handed-off positions are compared (a block-granular producer hands off fewer); a NaN
    anywhere makes that layer's value NaN. Memory is one head at a time.
    """
    if not (len(handoff_keys) == len(handoff_values) == len(own_keys) == len(own_values)):
        raise Refused(
            f"kv: layer counts differ: handoff {len(handoff_keys)}/{len(handoff_values)}, "
            f"own {len(own_keys)}/{len(own_values)}"
        )
    if not handoff_keys:
        raise Refused("kv: no layers to compare")
    positions: int | None = None
    profile = np.zeros(0)
    rows: list[np.ndarray] = []  # [2 * layers] of [positions]: K then V per layer
    layers = []
    for layer, tensors in enumerate(zip(handoff_keys, handoff_values, own_keys, own_values, strict=True)):
        key, value, own_key, own_value = (np.asarray(t) for t in tensors)
        for name, tensor in (("K", key), ("V", value)):
            if tensor.ndim != 3:
                raise Refused(f"kv layer {layer} {name}: expected [kv_heads, positions, head_dim], "
                              f"found {list(tensor.shape)}")
            if positions is None:
                positions = tensor.shape[1]
                profile = np.zeros(positions)
            if tensor.shape[1] != positions:
                raise Refused(f"kv layer {layer} {name}: {tensor.shape[1]} handed-off positions, "
                              f"layer 0 has {positions}")
        k, k_position = _tensor_delta(key, own_key, f"kv layer {layer} K", profile, rows)
        v, v_position = _tensor_delta(value, own_value, f"kv layer {layer} V", profile, rows)
        layers.append(KVLayerDelta(layer, k, v, k_position, v_position))
    return KVComparison(tuple(layers), profile, np.stack(rows))


# --------------------------------------------------------------------------- speculative draft


def draft_tokens_sha256(trace: Sequence[tuple[Sequence[int], int]] | None) -> str | None:
    """SHA-256 of every proposed draft token in order (little-endian uint32); None without a trace."""
    if trace is None:
        return None
    proposed = [int(token) for tokens, _ in trace for token in tokens]
    return generated_token_sha256(np.asarray(proposed, dtype=np.int64))


def draft_trace_sha256(trace: Sequence[tuple[Sequence[int], int]] | None) -> str | None:
    """SHA-256 of the canonical JSON ``[[proposed tokens], accepted count]`` per step; None without."""
    if trace is None:
        return None
    steps = [[[int(token) for token in tokens], int(accepted)] for tokens, accepted in trace]
    return hashlib.sha256(json.dumps(steps, separators=(",", ":")).encode("ascii")).hexdigest()


def draft_counts(trace: Sequence[tuple[Sequence[int], int]] | None) -> tuple[int, int] | None:
    """(proposed, accepted) draft tokens over a trace; None without a trace. The counts a sealed
    acceptance floor is derived from (a rate alone does not say how many tokens it rests on)."""
    if trace is None:
        return None
    return sum(len(tokens) for tokens, _ in trace), sum(int(count) for _, count in trace)


def draft_acceptance_rate(trace: Sequence[tuple[Sequence[int], int]] | None) -> float | None:
    """Accepted over proposed draft tokens; None without a trace or with nothing proposed."""
    counts = draft_counts(trace)
    if counts is None or counts[0] == 0:
        return None
    return counts[1] / counts[0]


def localise_divergence(
    divergence: int | None,
    cold_margins: np.ndarray,
    delta: LogitDelta,
    teacher: TeacherForcedDrift | None,
    maximum_absolute: float,
) -> tuple[float | None, float | None, DivergenceClass | None]:
    """The cold margin and the drift at the first divergence, and its class (see the module
    docstring): the teacher-forced row when there is one, else the free-running row."""
    if divergence is None:
        return None, None, None
    margin_at = float(cold_margins[divergence])
    source = teacher.row_max_abs if teacher is not None else delta.row_max_abs
    drift_at = float(source[divergence])
    return margin_at, drift_at, classify_divergence(margin_at, drift_at, maximum_absolute)


DraftTrace = Sequence[tuple[Sequence[int], int]] | None


def draft_fields(handoff_trace: DraftTrace, cold_trace: DraftTrace) -> dict[str, str | float | tuple[int, int] | None]:
    """The draft fields of a :class:`BranchComparison` from both branches' draft traces
    (all None without a draft)."""
    return {
        "handoff_draft_counts": draft_counts(handoff_trace),
        "handoff_draft_tokens_sha256": draft_tokens_sha256(handoff_trace),
        "cold_draft_tokens_sha256": draft_tokens_sha256(cold_trace),
        "handoff_draft_trace_sha256": draft_trace_sha256(handoff_trace),
        "cold_draft_trace_sha256": draft_trace_sha256(cold_trace),
        "draft_acceptance_rate": draft_acceptance_rate(handoff_trace),
    }


# --------------------------------------------------------------------------- one sample


@dataclass(frozen=True)
class BranchComparison:
    """Everything one handoff sample measures against its cold recompute (see module docstring).

    Localisation fields (``first_divergence``, ``cold_margin_at_divergence``,
    ``drift_at_divergence``, ``divergence_class``, ``teacher_forced``, ``kv``) are None when not
    applicable or not computed. ``handoff_tokens``/``cold_tokens`` are the generated token ids
    (int64, one per position) the receipt's series stores beside their digests.
    """

    output_tokens: int
    vocab: int
    transform: str
    token_agreement_rate: float
    first_divergence: int | None
    delta: LogitDelta
    cold_margins: np.ndarray
    handoff_digests: LogitDigests
    cold_digests: LogitDigests
    first_logit_digest_mismatch: int | None
    handoff_generated_token_sha256: str
    cold_generated_token_sha256: str
    handoff_tokens: np.ndarray
    cold_tokens: np.ndarray
    cold_margin_at_divergence: float | None
    drift_at_divergence: float | None
    divergence_class: DivergenceClass | None
    teacher_forced: TeacherForcedDrift | None
    kv: KVComparison | None
    handoff_draft_tokens_sha256: str | None
    cold_draft_tokens_sha256: str | None
    handoff_draft_trace_sha256: str | None
    cold_draft_trace_sha256: str | None
    draft_acceptance_rate: float | None
    # (proposed, accepted) draft tokens of the handoff branch; None without a draft.
    handoff_draft_counts: tuple[int, int] | None = None

    @property
    def max_abs(self) -> float:
        return self.delta.max_abs

    @property
    def mean_abs(self) -> float:
        return self.delta.mean_abs

    @property
    def logit_row_digests_equal(self) -> bool:
        return self.first_logit_digest_mismatch is None


def compare_branches(
    handoff: DecodeResult,
    cold: DecodeResult,
    transform: LogitTransform | str,
    *,
    maximum_absolute: float,
    maximum_mean_absolute: float,
    teacher_forced_logits: np.ndarray | None = None,
    handoff_kv: tuple[Sequence[np.ndarray], Sequence[np.ndarray]] | None = None,
    own_kv: tuple[Sequence[np.ndarray], Sequence[np.ndarray]] | None = None,
) -> BranchComparison:
    """Compare one handoff branch against the cold branch in a single streamed pass.

    ``maximum_absolute`` / ``maximum_mean_absolute`` are the contract's bounds (0 for a bit-exact
    rung); they locate the first rule-breaking row and classify a divergence, nothing more.
    ``teacher_forced_logits`` are the handoff branch's logits with the cold tokens fed;
    ``handoff_kv``/``own_kv`` are ``(keys, values)`` per layer for KV localisation.
    """
    transform = parse_logit_transform(transform) if isinstance(transform, str) else transform
    handoff_tokens = _as_tokens(handoff.tokens, "handoff tokens")
    cold_tokens = _as_tokens(cold.tokens, "cold tokens")
    handoff_logits = _as_logits(handoff.logits, "handoff logits")
    cold_logits = _as_logits(cold.logits, "cold logits")
    _same_shape(handoff_logits, cold_logits, "logits")
    rows, vocab = cold_logits.shape
    if handoff_tokens.shape[0] != rows or cold_tokens.shape[0] != rows:
        raise Refused(
            f"decode result: {rows} logit rows but {handoff_tokens.shape[0]} handoff and "
            f"{cold_tokens.shape[0]} cold tokens"
        )
    forced = None
    if teacher_forced_logits is not None:
        forced = _as_logits(teacher_forced_logits, "teacher-forced logits")
        _same_shape(forced, cold_logits, "teacher-forced logits")
    agreement = token_agreement(handoff_tokens, cold_tokens)

    step = _chunk_rows(vocab)
    digest_jobs = _digest_blocks_in_background(handoff_logits, cold_logits)
    deltas = _DeltaStream(rows, vocab, step)
    forced_deltas = _DeltaStream(rows, vocab, step) if forced is not None else None
    margins = np.empty(rows)
    parted: list[np.ndarray] = []
    capped = transform.cap is not None
    handoff_units = np.empty((step, vocab), dtype=np.float32) if capped else None
    cold_units = np.empty((step, vocab), dtype=np.float32) if capped else None
    forced_units = np.empty((step, vocab), dtype=np.float32) if capped and forced is not None else None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        count = stop - start
        left, right = handoff_logits[start:stop], cold_logits[start:stop]
        if forced is not None:
            parted.append(start + np.flatnonzero(forced[start:stop].argmax(axis=1) != right.argmax(axis=1)))
        if handoff_units is not None and cold_units is not None:  # capped units
            left = transform.apply(left, out=handoff_units[:count])
            right = transform.apply(right, out=cold_units[:count])
        deltas.update(start, left, right)
        margins[start:stop] = _top1_minus_top2(right)
        if forced is not None and forced_deltas is not None:
            forced_chunk = forced[start:stop]
            if forced_units is not None:  # capped units
                forced_chunk = transform.apply(forced_chunk, out=forced_units[:count])
            forced_deltas.update(start, forced_chunk, right)
    delta = deltas.result(maximum_absolute, maximum_mean_absolute)
    teacher = None
    if forced_deltas is not None:
        forced_delta = forced_deltas.result(maximum_absolute, maximum_mean_absolute)
        teacher = TeacherForcedDrift(
            forced_delta.max_abs, forced_delta.mean_abs, forced_delta.first_row_over_rule,
            sum(len(rows) for rows in parted), forced_delta.row_max_abs, forced_delta.row_mean_abs,
            partings_at(np.concatenate(parted), margins),
        )

    divergence = agreement.first_divergence
    margin_at, drift_at, divergence_class = localise_divergence(
        divergence, margins, delta, teacher, maximum_absolute)

    kv = None
    if handoff_kv is not None and own_kv is not None:
        kv = compare_kv(handoff_kv[0], handoff_kv[1], own_kv[0], own_kv[1])

    handoff_digests, cold_digests = (job.result() for job in digest_jobs)
    return BranchComparison(
        output_tokens=rows,
        vocab=vocab,
        transform=transform.spec,
        token_agreement_rate=agreement.rate,
        first_divergence=divergence,
        delta=delta,
        cold_margins=margins,
        handoff_digests=handoff_digests,
        cold_digests=cold_digests,
        first_logit_digest_mismatch=first_digest_mismatch(handoff_digests, cold_digests),
        handoff_generated_token_sha256=generated_token_sha256(handoff_tokens),
        cold_generated_token_sha256=generated_token_sha256(cold_tokens),
        handoff_tokens=handoff_tokens.astype(np.int64),
        cold_tokens=cold_tokens.astype(np.int64),
        cold_margin_at_divergence=margin_at,
        drift_at_divergence=drift_at,
        divergence_class=divergence_class,
        teacher_forced=teacher,
        kv=kv,
        # One dict for five fields of different types: mypy cannot split it per keyword.
        **draft_fields(handoff.draft_trace, cold.draft_trace),  # type: ignore[arg-type]
    )
