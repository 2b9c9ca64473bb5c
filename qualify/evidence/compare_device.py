"""Full-logit comparison computed where the logits are (torch, on the GPU), same result as numpy.

:func:`compare_branches_device` produces the very :class:`qualify.evidence.compare.BranchComparison` that
:func:`qualify.evidence.compare.compare_branches` produces from numpy arrays, so
:func:`qualify.evidence.sample.sample_record` and :mod:`qualify.judge` are reused unchanged. The
definitions (contract units, digests, the divergence rule) are compare.py's; this module only
moves the arithmetic to the device and reuses compare.py's helpers for everything else
(``token_agreement``, ``localise_divergence``, ``first_row_over_rule``, ``first_digest_mismatch``,
``generated_token_sha256``, the result dataclasses).

What crosses to the host, and why:

* **Summaries only, for the deltas.** Per row max and sum of ``|handoff - cold|`` (one pass over
  both blocks on the device, plus the teacher-forced block when given), the cold block's top-1 -
  top-2 margins, the teacher-forced argmax flip count, the generated tokens, and for KV the
  per-layer max deltas, their positions and the per-position profile: a few KB per sample
  instead of two ``[256, vocab]`` float32 blocks (263 MB at vocab 128256).
* **The logit blocks themselves, for the digests only.** A sample record carries the SHA-256 of
  every float32 little-endian logit row and of the whole block (compare.py's definition), and
  there is no SHA-256 on the GPU. So each block is copied once, asynchronously, into pinned host
  memory (:class:`LogitDigester`) and hashed on a thread pool (hashlib releases the GIL), while
  the device computes the deltas and the caller goes on with its next GPU work. The block digest
  is one sequential SHA-256 pass; the row digests are split over the other threads. The cold
  block is copied and hashed once per run (:func:`prepare_cold`) and reused by every sample.

Deltas are accumulated in float32 on the device (``torch.linalg.vector_norm`` over each row,
ord inf and ord 1) and widened to float64 on the host; compare.py sums float32 rows with numpy's
pairwise summation. Row maxima, margins, digests, tokens and KV deltas are therefore identical to
compare.py's, and row/overall means agree to float32 summation rounding (relative 1e-5; the CPU
test checks it). A row holding a NaN reads NaN in its max too (fail closed, as in compare.py).
"""

from __future__ import annotations

import hashlib
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qualify.core.errors import Refused
from qualify.evidence.compare import (
    BranchComparison,
    KVComparison,
    KVLayerDelta,
    LogitDelta,
    LogitDigests,
    LogitTransform,
    TeacherForcedDrift,
    draft_fields,
    first_digest_mismatch,
    first_row_over_rule,
    generated_token_sha256,
    localise_divergence,
    parse_logit_transform,
    partings_at,
    token_agreement,
)

DIGEST_THREADS = 6
"""Threads hashing logit blocks: one runs a block's sequential SHA-256, the rest its rows."""


# --------------------------------------------------------------------------- inputs


@dataclass
class DeviceBranch:
    """One branch's decode where it was computed: ``tokens`` integer [rows], ``logits`` float32
    [rows, vocab] (any device). ``draft_trace`` as in DecodeResult (None without a draft)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    draft_trace: list[tuple[tuple[int, ...], int]] | None = None


def _check_logits(logits: object, what: str) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.dtype != torch.float32:
        found = f"{logits.dtype}{list(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise Refused(f"{what}: expected float32 [rows, vocab] logits, found {found}")
    if logits.shape[1] == 0:
        raise Refused(f"{what}: logit rows are empty")
    return logits


def _host_tokens(tokens: object, what: str) -> np.ndarray:
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 1 or tokens.dtype.is_floating_point \
            or tokens.dtype == torch.bool:
        found = f"{tokens.dtype}{list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise Refused(f"{what}: expected a 1-D integer token tensor, found {found}")
    return tokens.cpu().numpy().astype(np.int64)


# --------------------------------------------------------------------------- digests


class DigestJob:
    """The digests of one logit block, being computed: :meth:`result` waits for them."""

    def __init__(self, block: Future[str], rows: list[Future[list[str]]]) -> None:
        self._block, self._rows = block, rows

    def result(self) -> LogitDigests:
        block = self._block.result()
        return LogitDigests(tuple(digest for part in self._rows for digest in part.result()), block)


class LogitDigester:
    """Copies logit blocks into reusable host buffers (pinned when the block is on CUDA, so the
    copy is asynchronous) and computes compare.py's row and block SHA-256 on a thread pool.

    :meth:`submit` returns at once on CUDA: the copy is queued on the current stream behind the
    work that produced the block, and the hashing threads wait for it on a CUDA event. The buffer
    is reused once its job is done, so the caller may overwrite the device block right after
    submitting (stream order puts the copy first).
    """

    def __init__(self, threads: int = DIGEST_THREADS) -> None:
        if sys.byteorder != "little":
            raise Refused("logit digests: float32 rows are hashed as little-endian bytes; "
                          "this host is big-endian")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 2:
            raise Refused(f"logit digester threads: expected an integer >= 2, found {threads!r}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads)
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        # Seconds the hashing threads spent, and bytes hashed (row and block passes both count).
        self.hash_seconds = 0.0
        self.hashed_bytes = 0

    def reserve(self, rows: int, vocab: int, count: int, pinned: bool) -> None:
        """Allocate ``count`` host buffers now (pinned allocation is slow; do it in setup)."""
        with self._lock:
            for _ in range(count):
                self._free.append(torch.empty(rows * vocab, dtype=torch.float32, pin_memory=pinned))

    def _acquire(self, elements: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            for index, buffer in enumerate(self._free):
                if buffer.numel() >= elements and buffer.is_pinned() == pinned:
                    return self._free.pop(index)
        return torch.empty(elements, dtype=torch.float32, pin_memory=pinned)

    def _release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)

    def submit(self, logits: torch.Tensor) -> DigestJob:
        """Start hashing ``logits`` (float32 [rows, vocab], any device)."""
        logits = _check_logits(logits, "logits")
        rows, vocab = logits.shape
        on_cuda = logits.device.type == "cuda"  # pragma: no mutate (CUDA only)
        buffer = self._acquire(rows * vocab, pinned=on_cuda)
        host = buffer[:rows * vocab].view(rows, vocab)
        ready = None
        if on_cuda:
            host.copy_(logits, non_blocking=True)  # pragma: no mutate (CUDA only)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch ships Event unannotated
            ready.record()
        else:
            host.copy_(logits)
        array = host.numpy()  # float32 [rows, vocab], little-endian on this host

        def wait() -> None:
            if ready is not None:
                ready.synchronize()  # releases the GIL while the copy lands

        def block_digest() -> str:
            wait()
            began = time.perf_counter()
            digest = hashlib.sha256(array.data).hexdigest()
            self._account(time.perf_counter() - began, array.nbytes)
            return digest

        def row_digests(start: int, stop: int) -> list[str]:
            wait()
            began = time.perf_counter()
            digests = [hashlib.sha256(row).hexdigest() for row in array[start:stop]]
            self._account(time.perf_counter() - began, array[start:stop].nbytes)
            return digests

        block = self._pool.submit(block_digest)
        parts = max(1, min(rows, self.threads - 1))
        bounds = [rows * part // parts for part in range(parts + 1)]
        row_jobs = [self._pool.submit(row_digests, bounds[i], bounds[i + 1]) for i in range(parts)]
        remaining = [1 + len(row_jobs)]

        def finished(_: Future[str] | Future[list[str]]) -> None:
            with self._lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._release(buffer)

        jobs: list[Future[str] | Future[list[str]]] = [block, *row_jobs]
        for job in jobs:
            job.add_done_callback(finished)
        return DigestJob(block, row_jobs)

    def _account(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.hash_seconds += seconds
            self.hashed_bytes += nbytes

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LogitDigester:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- device arithmetic


class DeviceClock:
    """Device seconds of the work between :meth:`start` and the returned stop: CUDA events on the
    GPU (read later, without a host sync in between), wall time on the CPU (which runs
    synchronously)."""

    # Lines marked "pragma: no mutate (CUDA only)" here and in comparers.py act only on a GPU: the
    # host mutation run (docs/mutation.md) cannot tell their mutants apart; the gpu tests run them.
    # torch leaves cuda.Event unannotated (the type: ignore).
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"  # pragma: no mutate (CUDA only)

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # pragma: no mutate (CUDA only)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> Callable[[], float]:
        """A function returning the elapsed seconds (it waits for the stop event)."""
        if self.cuda:
            stopped = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # pragma: no mutate (CUDA only)
            stopped.record()

            def seconds() -> float:
                stopped.synchronize()
                return float(started.elapsed_time(stopped)) / 1000.0  # pragma: no mutate (CUDA only)
            return seconds
        elapsed = time.perf_counter() - started
        return lambda: elapsed

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _units(logits: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """Logits in contract units: the block itself for ``raw``, else ``cap * tanh(x / cap)`` in
    float32 (compare.py's order: divide, tanh, multiply)."""
    if transform.cap is None:
        return logits
    units = torch.div(logits, transform.cap)
    units.tanh_()
    units.mul_(transform.cap)
    return units


def _row_deltas(left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row max and sum of |left - right| (float32 [rows] each): one difference pass and two
    fused norm reductions over it."""
    difference = torch.sub(left, right)
    row_max = torch.linalg.vector_norm(difference, ord=math.inf, dim=1)
    row_sum = torch.linalg.vector_norm(difference, ord=1, dim=1)
    return row_max, row_sum


def _logit_delta(row_max: np.ndarray, row_sum: np.ndarray, vocab: int,
                 maximum_absolute: float | None, maximum_mean_absolute: float | None) -> LogitDelta:
    """compare.py's LogitDelta from per-row max and sum (float64 host arrays)."""
    row_max = np.where(np.isnan(row_sum), np.nan, row_max)  # a NaN row reads NaN in its max too
    rows = row_max.shape[0]
    row_mean = row_sum / vocab
    max_abs = float(row_max.max()) if rows else math.nan
    mean_abs = float(row_sum.sum() / (rows * vocab)) if rows else math.nan
    return LogitDelta(max_abs, mean_abs, row_max, row_mean,
                      first_row_over_rule(row_max, row_mean, maximum_absolute, maximum_mean_absolute))


# --------------------------------------------------------------------------- the cold branch


@dataclass
class ColdReference:
    """The cold branch prepared once per run: its tokens, its logits in contract units on the
    device, their per-row argmax (emitted units, for teacher-forced flips) and top-1 - top-2
    margins, and its digests (being computed)."""

    tokens: np.ndarray
    logits: torch.Tensor
    units: torch.Tensor
    argmax: torch.Tensor
    margins: np.ndarray
    digests: DigestJob
    generated_token_sha256: str
    draft_trace: list[tuple[tuple[int, ...], int]] | None = None


def prepare_cold(cold: DeviceBranch, transform: LogitTransform | str,
                 digester: LogitDigester) -> ColdReference:
    """Margins, argmax and digests of the cold branch (the logits stay on their device; keep
    ``cold.logits`` unmodified while the reference is in use)."""
    transform = parse_logit_transform(transform) if isinstance(transform, str) else transform
    logits = _check_logits(cold.logits, "cold logits")
    tokens = _host_tokens(cold.tokens, "cold tokens")
    if tokens.shape[0] != logits.shape[0]:
        raise Refused(f"decode result: {logits.shape[0]} cold logit rows but {tokens.shape[0]} cold tokens")
    digests = digester.submit(logits)
    with torch.inference_mode():
        units = _units(logits, transform)
        rows, vocab = units.shape
        if vocab < 2:
            margins = np.full(rows, math.inf)
        else:
            top2 = torch.topk(units, 2, dim=1).values.double()  # [rows, 2]
            margin = (top2[:, 0] - top2[:, 1]).masked_fill(torch.isnan(units).any(dim=1), math.nan)
            margins = margin.cpu().numpy()
        argmax = logits.argmax(dim=1)
    return ColdReference(tokens=tokens, logits=logits, units=units, argmax=argmax, margins=margins,
                         digests=digests, generated_token_sha256=generated_token_sha256(tokens),
                         draft_trace=cold.draft_trace)


# --------------------------------------------------------------------------- KV


def compare_kv_device(handoff_keys: Sequence[torch.Tensor], handoff_values: Sequence[torch.Tensor],
                      own_keys: Sequence[torch.Tensor], own_values: Sequence[torch.Tensor]) -> KVComparison:
    """compare.py's :func:`~qualify.evidence.compare.compare_kv` on the device: per layer K and V max abs
    delta of the handed-off KV ([kv_heads, positions, head_dim] each, any float dtype) against
    the consumer's own prefill (at least as many positions), with the first position of each
    maximum, and the per-position profile over all layers. Differences are taken in float32."""
    if not (len(handoff_keys) == len(handoff_values) == len(own_keys) == len(own_values)):
        raise Refused(f"kv: layer counts differ: handoff {len(handoff_keys)}/{len(handoff_values)}, "
                      f"own {len(own_keys)}/{len(own_values)}")
    if not handoff_keys:
        raise Refused("kv: no layers to compare")
    positions = None
    per_position = []  # [2 * layers] of [positions] float32, K then V per layer
    with torch.inference_mode():
        for layer, tensors in enumerate(zip(handoff_keys, handoff_values, own_keys, own_values, strict=True)):
            for name, handoff, own in (("K", tensors[0], tensors[2]), ("V", tensors[1], tensors[3])):
                if handoff.ndim != 3:
                    raise Refused(f"kv layer {layer} {name}: expected [kv_heads, positions, head_dim], "
                                  f"found {list(handoff.shape)}")
                if positions is None:
                    positions = handoff.shape[1]
                if handoff.shape[1] != positions:
                    raise Refused(f"kv layer {layer} {name}: {handoff.shape[1]} handed-off positions, "
                                  f"layer 0 has {positions}")
                heads, _, dim = handoff.shape
                if own.ndim != 3 or own.shape[0] != heads or own.shape[2] != dim or own.shape[1] < positions:
                    raise Refused(f"kv layer {layer} {name}: handed-off shape {list(handoff.shape)} does "
                                  f"not fit own prefill {list(own.shape)}")
                difference = torch.sub(handoff.float(), own[:, :positions].float()).abs_()
                per_position.append(difference.amax(dim=(0, 2)))  # [positions]; amax keeps NaN
        profile = torch.stack(per_position)  # [2 * layers, positions]
        maxima, where = profile.max(dim=1)  # first position of each maximum
        overall = torch.maximum(profile.amax(dim=0), torch.zeros((), device=profile.device))  # pragma: no mutate (CUDA only)
        summary = torch.cat([maxima.double(), where.double(), overall.double()]).cpu().numpy()
    count = profile.shape[0]
    maxima_host, where_host = summary[:count], summary[count:2 * count].astype(np.int64)
    layers = tuple(KVLayerDelta(layer, float(maxima_host[2 * layer]), float(maxima_host[2 * layer + 1]),
                                int(where_host[2 * layer]), int(where_host[2 * layer + 1]))
                   for layer in range(count // 2))
    return KVComparison(layers, summary[2 * count:])


# --------------------------------------------------------------------------- one sample


@dataclass
class PendingComparison:
    """A comparison whose device work is done and whose handoff digests are still being
    computed: :meth:`result` waits for them and returns the BranchComparison. ``timings``:
    ``logit_pass_s`` (device time of the delta passes over the logit blocks), ``logit_pass_bytes``
    (the bytes of the blocks those passes read), ``summaries_s`` (wall time of everything up to
    here, small host copies included), ``digest_wait_s`` (filled by :meth:`result`)."""

    fields: dict[str, Any]
    handoff_digests: DigestJob
    cold_digests: DigestJob
    timings: dict[str, float] = field(default_factory=dict)

    def result(self) -> BranchComparison:
        began = time.perf_counter()
        handoff_digests, cold_digests = self.handoff_digests.result(), self.cold_digests.result()
        self.timings["digest_wait_s"] = time.perf_counter() - began
        return BranchComparison(
            handoff_digests=handoff_digests,
            cold_digests=cold_digests,
            first_logit_digest_mismatch=first_digest_mismatch(handoff_digests, cold_digests),
            **self.fields,
        )


def start_comparison(
    handoff: DeviceBranch,
    cold: ColdReference,
    transform: LogitTransform | str,
    *,
    maximum_absolute: float,
    maximum_mean_absolute: float,
    digester: LogitDigester,
    teacher_forced_logits: torch.Tensor | None = None,
    handoff_kv: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    own_kv: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
) -> PendingComparison:
    """The device part of :func:`compare_branches_device`: submits the handoff block's digests,
    runs the delta passes, KV comparison and localisation, copies the summaries to the host, and
    returns without waiting for the digests. The handoff logits may be overwritten once this
    returns (their host copy is queued first)."""
    began = time.perf_counter()
    transform = parse_logit_transform(transform) if isinstance(transform, str) else transform
    logits = _check_logits(handoff.logits, "handoff logits")
    if tuple(logits.shape) != tuple(cold.units.shape):
        raise Refused(f"logits: shapes differ: handoff {list(logits.shape)} vs cold {list(cold.units.shape)}")
    rows, vocab = logits.shape
    handoff_tokens = _host_tokens(handoff.tokens, "handoff tokens")
    if handoff_tokens.shape[0] != rows or cold.tokens.shape[0] != rows:
        raise Refused(f"decode result: {rows} logit rows but {handoff_tokens.shape[0]} handoff and "
                      f"{cold.tokens.shape[0]} cold tokens")
    forced = None
    if teacher_forced_logits is not None:
        forced = _check_logits(teacher_forced_logits, "teacher-forced logits")
        if tuple(forced.shape) != tuple(logits.shape):
            raise Refused(f"teacher-forced logits: shapes differ: handoff {list(forced.shape)} vs "
                          f"cold {list(logits.shape)}")
    agreement = token_agreement(handoff_tokens, cold.tokens)
    digests = digester.submit(logits)

    with torch.inference_mode():
        clock = DeviceClock(logits.device.type)
        started = clock.start()
        row_max, row_sum = _row_deltas(_units(logits, transform), cold.units)
        summaries = [row_max, row_sum]
        passed_bytes = 2 * logits.numel() * 4
        if forced is not None:
            forced_max, forced_sum = _row_deltas(_units(forced, transform), cold.units)
            parted = (forced.argmax(dim=1) != cold.argmax).double()  # 1.0 where the top token changed
            summaries += [forced_max, forced_sum, parted]
            passed_bytes += 2 * forced.numel() * 4
        logit_pass_s = clock.stop(started)
        host = torch.stack(summaries).double().cpu().numpy()  # [2 or 5, rows]
    delta = _logit_delta(host[0], host[1], vocab, maximum_absolute, maximum_mean_absolute)
    teacher = None
    if forced is not None:
        forced_delta = _logit_delta(host[2], host[3], vocab, maximum_absolute, maximum_mean_absolute)
        parted_rows = np.flatnonzero(host[4])
        teacher = TeacherForcedDrift(forced_delta.max_abs, forced_delta.mean_abs, forced_delta.first_row_over_rule,
                                     int(parted_rows.size), forced_delta.row_max_abs, forced_delta.row_mean_abs,
                                     partings_at(parted_rows, cold.margins))

    divergence = agreement.first_divergence
    margin_at, drift_at, divergence_class = localise_divergence(
        divergence, cold.margins, delta, teacher, maximum_absolute)

    kv = None
    if handoff_kv is not None and own_kv is not None:
        kv = compare_kv_device(handoff_kv[0], handoff_kv[1], own_kv[0], own_kv[1])

    fields = dict(
        output_tokens=rows,
        vocab=vocab,
        transform=transform.spec,
        token_agreement_rate=agreement.rate,
        first_divergence=divergence,
        delta=delta,
        cold_margins=cold.margins,
        handoff_generated_token_sha256=generated_token_sha256(handoff_tokens),
        cold_generated_token_sha256=cold.generated_token_sha256,
        handoff_tokens=handoff_tokens,
        cold_tokens=cold.tokens,
        cold_margin_at_divergence=margin_at,
        drift_at_divergence=drift_at,
        divergence_class=divergence_class,
        teacher_forced=teacher,
        kv=kv,
        **draft_fields(handoff.draft_trace, cold.draft_trace),
    )
    timings = {"logit_pass_s": logit_pass_s(), "logit_pass_bytes": float(passed_bytes),
               "summaries_s": time.perf_counter() - began}
    return PendingComparison(fields, digests, cold.digests, timings)


def compare_branches_device(
    handoff: DeviceBranch,
    cold: DeviceBranch | ColdReference,
    transform: LogitTransform | str,
    *,
    maximum_absolute: float,
    maximum_mean_absolute: float,
    teacher_forced_logits: torch.Tensor | None = None,
    handoff_kv: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    own_kv: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    digester: LogitDigester | None = None,
) -> BranchComparison:
    """compare.py's :func:`~qualify.evidence.compare.compare_branches` with the logits (and KV) left on
    their device; the arguments mean the same. Pass a prepared :class:`ColdReference` to reuse
    the cold branch's margins and digests across samples, and a :class:`LogitDigester` to share
    its threads and buffers."""
    own_digester = digester is None
    digester = LogitDigester() if digester is None else digester
    try:
        reference = cold if isinstance(cold, ColdReference) else prepare_cold(cold, transform, digester)
        return start_comparison(
            handoff, reference, transform, maximum_absolute=maximum_absolute,
            maximum_mean_absolute=maximum_mean_absolute, digester=digester,
            teacher_forced_logits=teacher_forced_logits, handoff_kv=handoff_kv, own_kv=own_kv,
        ).result()
    finally:
        if own_digester:
            digester.close()
