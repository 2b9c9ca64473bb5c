"""Full-logit comparison throughput against a plain memory copy of the same bytes, same run.

For each block shape ([256, 4096] and [256, 128256]) it times, best of several repetitions:

* ``copy``: ``np.copyto`` of the handoff block and the cold block into preallocated buffers;
* ``compare``: :func:`qualify.evidence.compare.compare_logit_blocks` (raw units): per-row and overall max
  and mean abs deltas plus the first rule-breaking row, streamed in cache-sized chunks;
* ``compare+softcap``: the same in ``tanh-softcap:30`` units (both blocks transformed);
* ``branches``: :func:`qualify.evidence.compare.compare_branches`: deltas, cold margins, per-row and block
  SHA-256 digests of both blocks and token digests (everything one sample records).

Throughput is the bytes of both input blocks divided by the time. The last line is
``compare_over_copy_bandwidth: <ratio>`` for the [256, 128256] block (compare GB/s over copy GB/s).
Run: ``.venv/bin/python bench/compare.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from qualify.engines.base import DecodeResult
from qualify.evidence.compare import compare_branches, compare_logit_blocks

SHAPES = ((256, 4096), (256, 128256))


def best_seconds(action: Callable[[], object], repetitions: int) -> float:
    """Best wall time of ``repetitions`` runs after one warm-up run."""
    action()
    best = float("inf")
    for _ in range(repetitions):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def bench_shape(rows: int, vocab: int) -> float:
    rng = np.random.default_rng(0)
    cold = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(4)
    handoff = cold + rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(0.01)
    tokens = cold.argmax(axis=1).astype(np.int32)
    copy_handoff, copy_cold = np.empty_like(handoff), np.empty_like(cold)
    both = handoff.nbytes + cold.nbytes
    repetitions = 20 if both < (64 << 20) else 5

    def copy() -> None:
        np.copyto(copy_handoff, handoff)
        np.copyto(copy_cold, cold)

    timings = {
        "copy": best_seconds(copy, repetitions),
        "compare": best_seconds(
            lambda: compare_logit_blocks(handoff, cold, "raw", maximum_absolute=11.0, maximum_mean_absolute=1.25),
            repetitions,
        ),
        "compare+softcap": best_seconds(
            lambda: compare_logit_blocks(handoff, cold, "tanh-softcap:30.0", maximum_absolute=11.0, maximum_mean_absolute=1.25),
            max(2, repetitions // 2),
        ),
        "branches": best_seconds(
            lambda: compare_branches(
                DecodeResult(tokens, handoff), DecodeResult(tokens, cold), "raw",
                maximum_absolute=11.0, maximum_mean_absolute=1.25,
            ),
            max(2, repetitions // 2),
        ),
    }
    copy_rate = both / timings["copy"] / 1e9
    print(f"block [{rows}, {vocab}] float32: {both / 2**20:.1f} MiB for both branches")
    for name, seconds in timings.items():
        rate = both / seconds / 1e9
        print(f"  {name:<16} {seconds * 1e3:9.2f} ms  {rate:7.2f} GB/s  ({rate / copy_rate:.3f} of copy)")
    return (both / timings["compare"] / 1e9) / copy_rate


def main() -> None:
    ratio = 0.0
    for rows, vocab in SHAPES:
        ratio = bench_shape(rows, vocab)
    print(f"compare_over_copy_bandwidth: {ratio:.3f}")


if __name__ == "__main__":
    main()
