"""Where the consumer decodes a handoff and its branch is compared: on the host (numpy) or on the
device (torch), behind one small interface the run drives.

A :class:`Comparer` owns the consumer's side of a run: the cold local recompute (the reference
every handoff is compared against) and, per handoff, install, decode, the teacher-forced decode
when the tokens diverge, and the full-logit and KV comparison. Both produce the same
:class:`~qualify.evidence.compare.BranchComparison`, so records and verdicts do not depend on
where the numbers were computed.

A *deferred* comparer (the device one) returns before the handoff's logit digests are hashed, and
calls ``meanwhile`` while its decode runs on the device: the run settles the previous sample there,
so hashing and receipt writing overlap GPU work instead of adding to the wall.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from qualify.core.kv import KVCache
from qualify.engines.base import Engine
from qualify.evidence.cold_ahead import BranchesAhead, ColdBranch, PlannedColdBranches, cold_branch, forks_cleanly
from qualify.evidence.compare import BranchComparison, LogitTransform, compare_branches

if TYPE_CHECKING:
    from qualify.evidence.compare_device import ColdReference, LogitDigester


@dataclass(frozen=True)
class ComparerSetup:
    """What a comparer needs from the run: the consumer, the prompt and where it is split, how
    many tokens to decode, the contract's logit units and the bounds localisation reports against."""

    consumer: Engine
    prompt: np.ndarray
    handoff_positions: int
    output_tokens: int
    transform: LogitTransform
    maximum_absolute: float
    maximum_mean_absolute: float
    # Compare every handoff with the reference step's cold branch; else each handoff after the
    # first recomputes its own (the first uses the reference step's).
    reference_once: bool = False
    # How many handoffs this comparer will compare (each with its own cold branch unless
    # reference_once): the host comparer computes the branches after the first ahead, beside
    # the handoffs, where the consumer forks cleanly (qualify.evidence.cold_ahead).
    handoffs: int = 1
    # A calibration's plan: every handoff's cold branch, computed ahead by a child of the run.
    planned: PlannedColdBranches | None = None


@dataclass
class ComparedHandoff:
    """One handoff's comparison (:meth:`result` waits for a deferred one) and the seconds each
    consumer-side activity took: ``install``, ``decode``, ``recompute``, ``teacher_forced``,
    ``compare``."""

    result: Callable[[], BranchComparison]
    seconds: dict[str, float] = field(default_factory=dict)


class Comparer(Protocol):
    """The consumer's side of a run."""

    deferred: bool

    def reference(self) -> float | None:
        """Compute the cold local recompute the handoffs are compared against; its seconds, or
        None where it is computed beside the handoffs instead (each comparison then reports the
        seconds its own branch took)."""
        ...

    def compare(self, kv: KVCache, pending: np.ndarray, meanwhile: Callable[[], None]) -> ComparedHandoff:
        """Install ``kv``, decode ``pending`` plus the output tokens, compare with the cold branch;
        ``meanwhile`` is called once, while the decode runs where the comparer can overlap it."""
        ...

    def close(self) -> None:
        ...


ComparerFactory = Callable[[ComparerSetup], Comparer]


class HostComparer:
    """The consumer engine's numpy API and :func:`~qualify.evidence.compare.compare_branches`."""

    deferred = False

    def __init__(self, setup: ComparerSetup) -> None:
        self.setup = setup
        self._cold: ColdBranch | None = None
        # Each handoff is compared with a cold branch of its own (one for all under
        # reference_once), so three handoffs meet three cold computations and the consumer's
        # determinism is checked across them. An in-line reference step's branch serves the first.
        self._cold_unused = False
        # Every handoff's cold branch, computed by a forked child from the reference step on.
        self._ahead: BranchesAhead | None = None

    def _recompute(self) -> ColdBranch:
        setup = self.setup
        return cold_branch(setup.consumer, setup.prompt, setup.handoff_positions, setup.output_tokens)

    def reference(self) -> float | None:
        """Where the consumer forks cleanly and no run plan holds the branches, a child computes
        every handoff's cold branch in order from now on, and this returns None at once: the
        first branch then runs beside the first handoff's prefill and decode instead of before
        them, off the run's critical path. Else the first branch is computed (or taken from the
        plan) here, and its seconds returned."""
        setup = self.setup
        if setup.planned is None and self._ahead is None and forks_cleanly(setup.consumer):
            self._ahead = BranchesAhead(self._recompute, 1 if setup.reference_once else setup.handoffs)
            return None
        self._cold = self._next_branch()
        self._cold_unused = True
        return self._cold[2]

    def _next_branch(self) -> ColdBranch:
        """The next cold branch: this comparer's child's, else the run's plan's, else recomputed here."""
        setup = self.setup
        branch = None if self._ahead is None else self._ahead.next()
        if branch is None and setup.planned is not None:
            branch = setup.planned.take(setup.prompt, setup.handoff_positions, setup.output_tokens)
        return self._recompute() if branch is None else branch

    def compare(self, kv: KVCache, pending: np.ndarray, meanwhile: Callable[[], None]) -> ComparedHandoff:
        setup, consumer = self.setup, self.setup.consumer
        seconds: dict[str, float] = {}
        started = time.perf_counter()
        result = consumer.decode(kv, pending, setup.output_tokens)
        seconds["decode"] = time.perf_counter() - started
        meanwhile()
        if self._cold is not None and (setup.reference_once or self._cold_unused):
            cold_kv, cold, _ = self._cold
            self._cold_unused = False
        else:
            self._cold = self._next_branch()
            cold_kv, cold, seconds["recompute"] = self._cold
        teacher_forced = None
        if not np.array_equal(result.tokens, cold.tokens):
            # Rows after a divergence compare like with like only when the handoff branch is fed
            # the cold tokens.
            started = time.perf_counter()
            teacher_forced = consumer.teacher_forced(kv, pending, cold.tokens)
            seconds["teacher_forced"] = time.perf_counter() - started
        started = time.perf_counter()
        comparison = compare_branches(
            result, cold, setup.transform,
            maximum_absolute=setup.maximum_absolute,
            maximum_mean_absolute=setup.maximum_mean_absolute,
            teacher_forced_logits=teacher_forced,
            handoff_kv=(kv.keys, kv.values),
            own_kv=(cold_kv.keys, cold_kv.values),
        )
        seconds["compare"] = time.perf_counter() - started
        return ComparedHandoff(lambda: comparison, seconds)

    def close(self) -> None:
        self._cold = None
        if self._ahead is not None:
            self._ahead.close()  # idempotent: the child stopped and reaped


class DeviceEngine(Protocol):
    """The device face of a consumer engine (:class:`qualify.engines.torch_llama.TorchLlama`)."""

    def prefill_device(self, tokens: Any) -> None: ...
    def kv_device(self) -> tuple[list[Any], list[Any]]: ...
    def install_device(self, keys: Any, values: Any) -> None: ...
    def decode_device(self, pending: Any, steps: int, forced: Any = None) -> Any: ...


LOGIT_DIGEST_THREADS = 6
"""Threads hashing the logit blocks beside the GPU (the block digest is one sequential pass)."""


def host_tensor(array: np.ndarray) -> Any:
    """A host array as a torch tensor over the same memory, so pinned memory stays pinned and its
    copy to the device is asynchronous (bfloat16 goes through its bits: numpy cannot hand
    ml_dtypes' bfloat16 to torch)."""
    import torch

    if str(array.dtype) == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class DeviceComparer:
    """The consumer's device methods and :func:`~qualify.evidence.compare_device.start_comparison`:
    logits and KV stay on the device; only summaries and, for the digests, the logit blocks cross
    to the host, hashed on threads while the next handoff decodes (a deferred comparer).
    ``engine_seconds`` holds the device time of every engine call (CUDA events), apart from the
    wall ``seconds`` each :class:`ComparedHandoff` reports."""

    deferred = True

    def __init__(self, setup: ComparerSetup, engine: DeviceEngine, device: str,
                 digest_threads: int = LOGIT_DIGEST_THREADS) -> None:
        import torch

        from qualify.evidence.compare_device import DeviceClock, LogitDigester

        self.setup, self.engine, self.device, self.torch = setup, engine, device, torch
        self.clock = DeviceClock(device)  # pragma: no mutate (CUDA only)
        self.digester: LogitDigester = LogitDigester(digest_threads)
        self.prompt = torch.from_numpy(np.ascontiguousarray(setup.prompt)).to(device)  # pragma: no mutate (CUDA only)
        self._cold: ColdReference | None = None
        self._cold_tokens: Any = None
        self._own_kv: tuple[list[Any], list[Any]] | None = None
        self.engine_seconds: dict[str, list[float]] = {
            "reference prefill": [], "reference decode": [], "consumer decode": [], "teacher-forced decode": []}
        self.last_timings: dict[str, float] = {}

    def reference(self) -> float:
        from qualify.evidence.compare_device import DeviceBranch, prepare_cold

        setup, engine, clock = self.setup, self.engine, self.clock
        started = clock.start()
        engine.prefill_device(self.prompt[:setup.handoff_positions])
        prefill_s = clock.stop(started)
        keys, values = engine.kv_device()
        # Every install overwrites the cache: keep the cold KV for the KV comparison.
        self._own_kv = ([k.clone() for k in keys], [v.clone() for v in values])
        started = clock.start()
        cold_run = engine.decode_device(self.prompt[setup.handoff_positions:], setup.output_tokens)
        decode_s = clock.stop(started)
        # The digests' pinned host buffers are allocated while the device decodes (hundreds of MB
        # of page-locked memory take a noticeable fraction of a second to pin).
        pinned = self.device == "cuda"  # pragma: no mutate (CUDA only)
        self.digester.reserve(setup.output_tokens, setup.consumer.geometry.vocab, 2, pinned=pinned)
        cold = DeviceBranch(cold_run.tokens.clone(), cold_run.logits.clone())
        self._cold_tokens = cold.tokens
        self.engine_seconds["reference prefill"].append(prefill_s())
        self.engine_seconds["reference decode"].append(decode_s())
        self._cold = prepare_cold(cold, setup.transform, self.digester)
        return self.engine_seconds["reference prefill"][-1] + self.engine_seconds["reference decode"][-1]

    def compare(self, kv: KVCache, pending: np.ndarray, meanwhile: Callable[[], None]) -> ComparedHandoff:
        from qualify.evidence.compare_device import DeviceBranch, start_comparison

        if self._cold is None or self._own_kv is None:
            raise RuntimeError("DeviceComparer.compare before reference()")
        torch, setup, engine, clock = self.torch, self.setup, self.engine, self.clock
        seconds: dict[str, float] = {}
        started_wall = time.perf_counter()
        engine.install_device([host_tensor(k) for k in kv.keys], [host_tensor(v) for v in kv.values])
        seconds["install"] = time.perf_counter() - started_wall
        pending_ids = torch.from_numpy(np.ascontiguousarray(pending)).to(self.device)  # pragma: no mutate (CUDA only)
        started = clock.start()
        branch = engine.decode_device(pending_ids, setup.output_tokens)
        decode_s = clock.stop(started)
        meanwhile()  # the previous sample's record and receipt, while the device decodes
        seconds["decode"] = decode_s()
        self.engine_seconds["consumer decode"].append(seconds["decode"])
        teacher_forced = None
        handoff_branch = DeviceBranch(branch.tokens, branch.logits)
        if not torch.equal(branch.tokens, self._cold_tokens):
            # Keep the free run, then decode again on the same KV, fed the cold tokens.
            handoff_branch = DeviceBranch(branch.tokens.clone(), branch.logits.clone())
            started = clock.start()
            teacher_forced = engine.decode_device(pending_ids, setup.output_tokens, forced=self._cold_tokens).logits
            seconds["teacher_forced"] = clock.stop(started)()
            self.engine_seconds["teacher-forced decode"].append(seconds["teacher_forced"])
        started_wall = time.perf_counter()
        pending_comparison = start_comparison(
            handoff_branch, self._cold, setup.transform,
            maximum_absolute=setup.maximum_absolute, maximum_mean_absolute=setup.maximum_mean_absolute,
            digester=self.digester, teacher_forced_logits=teacher_forced,
            handoff_kv=engine.kv_device(), own_kv=self._own_kv)
        seconds["compare"] = time.perf_counter() - started_wall
        self.last_timings = pending_comparison.timings

        def result() -> BranchComparison:
            comparison = pending_comparison.result()
            seconds["digest_wait"] = pending_comparison.timings.get("digest_wait_s", 0.0)
            return comparison

        return ComparedHandoff(result, seconds)

    def close(self) -> None:
        self.digester.close()
