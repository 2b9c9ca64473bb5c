"""Harness overhead on a real vLLM lane: one qualification run against vLLM's own work.

Runs ``qualify --recipe native-text`` on a vLLM lane in this process (the producer is its own
process, as always; a vLLM consumer lives here), then times vLLM's own prefill plus 256-token
greedy decode of the same prompt, in this process, as many times as the run needed that work
(3 handoff decodes plus the cold recompute; no full logits, no connector). Prints both, the
run's activity split, and the ratio; the last line is ``vllm_lane_overhead: <ratio>``.

Usage (in .venv-vllm, after tools/install_vllm.sh)::

    .venv-vllm/bin/python bench/vllm_lane.py [--lane vllm-to-vllm] [--receipts DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from qualify import assets
from qualify.contract.lanes import VLLM_LANE_ENGINES
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lane", default="vllm-to-vllm", choices=sorted(VLLM_LANE_ENGINES))
    parser.add_argument("--receipts", type=Path, default=None)
    args = parser.parse_args(argv)
    producer, consumer = VLLM_LANE_ENGINES[args.lane]
    receipts = args.receipts or Path(tempfile.mkdtemp(prefix="vllm-lane-bench-"))
    options = RunOptions(recipe="native-text", producer=producer, consumer=consumer,
                         reference_once=True, receipts=receipts,
                         command_line=["bench/vllm_lane.py", "--lane", args.lane])
    run = QualificationRun(options)
    step_s: dict[str, float] = {}
    started = time.perf_counter()
    try:
        for label in STEP_LABELS:
            outcome = run.step(label)
            step_s[label] = outcome.seconds
            if not outcome.passed:
                print(f"step {label} failed: {outcome.message}")
                return 1
    finally:
        run.close()
    run_s = time.perf_counter() - started

    from qualify.engines.vllm_engine import VllmEngine

    consumer = run.consumer.engine if run.consumer is not None else None
    engine = consumer if isinstance(consumer, VllmEngine) else VllmEngine(role="consumer")
    prompt = [int(t) for t in assets.load_prompt()]
    works = 1 + len(STEP_LABELS[3:6])  # the cold recompute and three handoff decodes
    engine._generate(prompt, 8, None, logits=False)  # warm the path once, untimed
    baseline_started = time.perf_counter()
    for _ in range(works):
        engine._generate(prompt, run.contract.output_tokens, None, logits=False)
    baseline_s = time.perf_counter() - baseline_started

    print(f"lane {args.lane}: qualification run {run_s:.2f} s (verdict: {run.verdict.headline})")
    for label, seconds in step_s.items():
        print(f"  step {label:<20} {seconds:8.2f} s")
    for activity, seconds in sorted(run.seconds.items()):
        print(f"  activity {activity:<16} {seconds:8.2f} s")
    for record in run.records:
        phases = ", ".join(f"{name} {record[name]:.3f}" for name in (
            "producer_compute_s", "serialize_s", "transport_s", "verify_s", "install_s", "decode_s",
            "recompute_s") if record.get(name) is not None)
        print(f"  sample {record['repetition']}: max_abs {record['max_abs']:.3g} mean_abs "
              f"{record['mean_abs']:.3g}; {phases}")
    print(f"vLLM's own prefill+decode of the same work ({works} x 2048-token prompt + "
          f"{run.contract.output_tokens} tokens, no logits, same process): {baseline_s:.2f} s")
    starts = step_s.get("identity sealed", 0.0) + step_s.get("producer ready", 0.0)
    print(f"engine starts inside the run (consumer build in 'identity sealed', producer process in "
          f"'producer ready'): {starts:.2f} s; run without them: {run_s - starts:.2f} s, "
          f"ratio {(run_s - starts) / baseline_s:.2f}")
    print(f"receipt: {run.receipt_path}")
    print(f"vllm_lane_overhead: {run_s / baseline_s:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
