"""The cost of a known-answer check (``qualify.engines.kat``) against the work it guards, measured in
the same run.

A run checks its consumer's KAT at "identity sealed" and its producer's before "producer ready", so
the KAT is paid once per run, on an engine the run has built anyway. This bench times, on this
host and in alternating order:

* the KAT of the reference engine (numpy, exact by construction), against one handoff's consumer
  work on the same engine (prefill of the 2048-token fixture prompt and 256 greedy decode steps);
* where vLLM is installed (``--vllm``, in ``.venv-vllm``): the KAT of a vLLM engine, against that
  engine's start (which every vLLM lane pays before its KAT).

Reports the median wall seconds of each and the ratios. Speed depends on the machine and its load;
nothing here is asserted.

Usage: python bench/known_answer.py [--repeats 3] [--vllm]. The last line is the headline
``known_answer_seconds: <reference-numpy KAT median> (<ratio> of one fixture handoff)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qualify.core import assets
from qualify.engines.kat import known_answer_sha256
from qualify.engines.reference import ReferenceEngine

PROMPT_TOKENS = 2048
DECODE_STEPS = 256


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="also time a vLLM engine's KAT against its start")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: expected at least 1")

    engine = ReferenceEngine.from_model_dir()
    prompt = assets.load_prompt()[:PROMPT_TOKENS]

    def handoff() -> None:
        kv = engine.prefill(prompt[:-1])
        engine.decode(kv, prompt[-1:], DECODE_STEPS)

    kat_s: list[float] = []
    handoff_s: list[float] = []
    for repeat in range(args.repeats):  # alternating order: neither side always runs warm
        pair = [(kat_s, lambda: known_answer_sha256(engine)), (handoff_s, handoff)]
        for times, call in pair if repeat % 2 == 0 else reversed(pair):
            times.append(timed(call))
    kat, one_handoff = statistics.median(kat_s), statistics.median(handoff_s)
    print(f"reference-numpy: KAT {kat:.3f} s, one fixture handoff ({PROMPT_TOKENS}-token prefill, "
          f"{DECODE_STEPS} decode steps) {one_handoff:.3f} s, ratio {kat / one_handoff:.4f} "
          f"(medians of {args.repeats})")

    if args.vllm:
        from qualify.engines.vllm_engine import VllmEngine

        started = time.perf_counter()
        vllm = VllmEngine(role="consumer")
        start_s = time.perf_counter() - started
        vllm_kat = statistics.median(timed(lambda: known_answer_sha256(vllm)) for _ in range(args.repeats))
        vllm.close()
        print(f"vllm: KAT {vllm_kat:.3f} s, engine start {start_s:.1f} s, ratio {vllm_kat / start_s:.4f}")

    print(f"known_answer_seconds: {kat:.3f} ({kat / one_handoff:.4f} of one fixture handoff)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
