"""Speculative (EAGLE-1 draft) vs plain greedy decode on the k-quant target, side by side.

Per held-out document: the producer prefill of ``prompt[:2047]`` once, then, alternating within
each repetition, plain greedy decode and speculative decode of the same 256 tokens from the same
KV (the order alternates between repetitions so neither always runs on a warmer cache). Reports
acceptance rate, mean accepted draft tokens per step, per-document median decode seconds, and the
decode speedup = sum of plain medians / sum of speculative medians, in process CPU seconds (the
engine is single-threaded with OPENBLAS_NUM_THREADS=1; CPU time is far less disturbed than wall
time by other work on a shared machine; wall seconds are printed beside it). Tokens and logits of
the two decodes are compared bit for bit every time (a mismatch is an error, not a number).

Numbers are for this machine and its load at the time; the ratio is reported as measured, even
when it is below 1. The last line is ``speculative_decode_speedup: <ratio>``.

Usage: python bench/speculative.py [--proposal-tokens K[,K...]] [--repeats N] [--tokens N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qualify import assets
from qualify.engines.base import DecodeResult
from qualify.engines.kquant import KQuantEngine
from qualify.engines.speculative import DEFAULT_PROPOSAL_TOKENS, build_speculative_engine

HANDOFF = 2047


def timed_decode(decode, kv, pending: np.ndarray, n: int) -> tuple[DecodeResult, float, float]:
    """(result, CPU seconds of this process, wall seconds) of one decode."""
    cpu_began, wall_began = time.process_time(), time.perf_counter()
    result = decode(kv, pending, n)
    return result, time.process_time() - cpu_began, time.perf_counter() - wall_began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposal-tokens", default=str(DEFAULT_PROPOSAL_TOKENS),
                        help="k, or a comma-separated list; the speedup line reports the first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    ks = [int(k) for k in args.proposal_tokens.split(",")]

    spec = build_speculative_engine(proposal_tokens=ks[0])
    plain = KQuantEngine(spec.target)  # the same target model object: same weights, same arithmetic
    print(f"# machine: {os.cpu_count()} CPUs, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, "
          f"numpy {np.__version__}; engine {spec.abi}")
    prepared = []
    for name in assets.PROMPT_NAMES:
        prompt = assets.load_prompt(name)
        began = time.perf_counter()
        kv = spec.prefill(prompt[:HANDOFF])
        print(f"# prefill {name}: {time.perf_counter() - began:.2f} s")
        prepared.append((name, kv, prompt[HANDOFF:]))

    speedups: dict[int, float] = {}
    for k in ks:
        spec.proposal_tokens = k
        print(f"\n## k = {k} proposals per step, {args.tokens} tokens, {args.repeats} repeats")
        print(f"{'document':28} {'accept':>7} {'acc/step':>8} {'tok/fwd':>7} {'plain cpu':>9} "
              f"{'spec cpu':>9} {'ratio':>6} {'plain wall':>10} {'spec wall':>9}")
        plain_total = spec_total = 0.0
        for name, kv, pending in prepared:
            plain_seconds, spec_seconds, plain_wall, spec_wall = [], [], [], []
            result: DecodeResult | None = None
            for repeat in range(args.repeats):
                order = ("plain", "spec") if repeat % 2 == 0 else ("spec", "plain")
                for which in order:
                    if which == "plain":
                        baseline, seconds, wall = timed_decode(plain.decode, kv, pending, args.tokens)
                        plain_seconds.append(seconds)
                        plain_wall.append(wall)
                    else:
                        result, seconds, wall = timed_decode(spec.decode, kv, pending, args.tokens)
                        spec_seconds.append(seconds)
                        spec_wall.append(wall)
                if not (np.array_equal(baseline.tokens, result.tokens)
                        and np.array_equal(baseline.logits, result.logits)):
                    raise SystemExit(f"{name}: speculative decode differs from plain greedy decode")
            assert result is not None and result.draft_trace is not None
            proposed = sum(len(step[0]) for step in result.draft_trace)
            accepted = sum(step[1] for step in result.draft_trace)
            drafting = sum(1 for step in result.draft_trace if step[0])
            plain_median, spec_median = statistics.median(plain_seconds), statistics.median(spec_seconds)
            plain_total += plain_median
            spec_total += spec_median
            print(f"{name:28} {accepted / proposed:7.3f} {accepted / drafting:8.2f} "
                  f"{(len(result.tokens) - 1) / len(result.draft_trace):7.2f} {plain_median:9.2f} "
                  f"{spec_median:9.2f} {plain_median / spec_median:6.2f} "
                  f"{statistics.median(plain_wall):10.2f} {statistics.median(spec_wall):9.2f}")
        speedups[k] = plain_total / spec_total
        print(f"{'all documents':28} {'':7} {'':8} {'':7} {plain_total:9.2f} {spec_total:9.2f} {speedups[k]:6.2f}")
    print(f"speculative_decode_speedup: {speedups[ks[0]]:.3f}")  # k = the first --proposal-tokens
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
