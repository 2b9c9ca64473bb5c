"""One native-text qualification on the default lane: engine compute against harness overhead.

Engine compute is the producer's prefill, the consumer's decodes and the cold recomputes (the
work any qualification must do). Harness overhead is everything the harness adds around it:
producer-side serialize and hashing, transport, MAC and digest verification, install, the
full-logit comparison, and writing the receipt. Also prints the full-logit comparison's
throughput against a plain memory copy of the same bytes, measured in the same run.

Usage: python bench/qualify_run.py (named so that it never shadows the ``qualify`` package)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions


def copy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Best time of a plain memory copy of ``nbytes`` (two float32 logit blocks' worth)."""
    source = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-qualify-") as archive:
        run = QualificationRun(RunOptions(recipe="native-text", receipts=Path(archive),
                                          command_line=["python", "bench/qualify_run.py"]))
        started = time.perf_counter()
        outcomes = [run.step(label) for label in STEP_LABELS]
        wall = time.perf_counter() - started
        run.close()
    if not all(outcome.passed for outcome in outcomes):
        print("bench/qualify_run.py: the qualification did not pass: "
              + "; ".join(f"{o.label}: {o.message}" for o in outcomes if not o.passed), file=sys.stderr)
        return 1
    records = run.records
    total = lambda field: sum(record[field] for record in records)  # noqa: E731
    engine = {
        "producer prefill": total("producer_compute_s"),
        "consumer decode": run.seconds.get("decode", 0.0),
        "cold recompute (incl. reference)": run.seconds.get("recompute", 0.0),
        "teacher-forced decode": run.seconds.get("teacher_forced", 0.0),
    }
    overhead = {
        "serialize + hash (producer)": total("serialize_s"),
        "transport": total("transport_s"),
        "verify (MAC, digests)": total("verify_s"),
        "install": total("install_s"),
        "full-logit compare": run.seconds.get("compare", 0.0),
        "receipt": run.seconds.get("receipt", 0.0),
    }
    engine_s, overhead_s = sum(engine.values()), sum(overhead.values())
    other_s = wall - engine_s - overhead_s
    print(f"qualification wall time: {wall:.3f} s over {len(records)} handoffs")
    for name, seconds in engine.items():
        print(f"  engine   {name:34s} {seconds:8.3f} s")
    for name, seconds in overhead.items():
        print(f"  harness  {name:34s} {seconds:8.3f} s")
    print(f"  other (producer start, identity, orchestration)  {other_s:8.3f} s")
    print(f"engine compute {engine_s:.3f} s, harness overhead {overhead_s:.3f} s "
          f"({100 * overhead_s / engine_s:.2f} % of engine time)")

    rows, vocab = 256, 4096
    compared_bytes = 2 * rows * vocab * 4 * len(records)
    compare_rate = compared_bytes / max(overhead["full-logit compare"], 1e-9) / 1e9
    copy_rate = (compared_bytes // len(records)) / copy_seconds(compared_bytes // len(records)) / 1e9
    print(f"full-logit compare (digests, margins, deltas, KV localisation): {compare_rate:.2f} GB/s; "
          f"plain memory copy of the same bytes: {copy_rate:.2f} GB/s; ratio {compare_rate / copy_rate:.3f}")
    print(f"harness_overhead_percent_of_engine: {100 * overhead_s / engine_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
