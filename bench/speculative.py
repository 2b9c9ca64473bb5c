"""Speculative (EAGLE-1 draft) vs plain greedy decode on the k-quant target, side by side.

Per held-out document: the producer prefill of ``prompt[:2047]`` once, then, alternating within
each repetition, plain greedy decode and speculative decode of the same 256 tokens from the same
KV (the order alternates between repetitions so neither always runs on a warmer cache). Reports
acceptance rate, mean accepted draft tokens per step, per-document median decode seconds, in
process CPU seconds (the engine is single-threaded with OPENBLAS_NUM_THREADS=1; CPU time is far
less disturbed than wall time by other work on a shared machine; wall seconds are printed beside
it). Plain and speculative are compared only through ``qualify.judge.judge_parity`` on paired
cells (tokens per CPU second, one cell per lane per document, and pooled over the documents per
repetition): a split inside the cells' spread is parity, and no lane is put ahead from one
ratio. Tokens and logits of the two decodes are compared bit for bit every time (a mismatch is an
error, not a number).

Numbers are for this machine and its load at the time. The last line is
``plain_over_speculative_decode_cpu: <ratio>``: plain over speculative decode CPU seconds, pooled
over the documents, median over the repetitions (its min and max are printed on the line before).

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

from qualify.core import assets
from qualify.engines.base import DecodeResult
from qualify.engines.kquant import KQuantEngine
from qualify.engines.speculative import DEFAULT_PROPOSAL_TOKENS, build_speculative_engine
from qualify.judge import ThroughputCell, judge_parity

HANDOFF = 2047


def timed_decode(decode, kv, pending: np.ndarray, n: int) -> tuple[DecodeResult, float, float]:
    """(result, CPU seconds of this process, wall seconds) of one decode."""
    cpu_began, wall_began = time.process_time(), time.perf_counter()
    result = decode(kv, pending, n)
    return result, time.process_time() - cpu_began, time.perf_counter() - wall_began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposal-tokens", default=str(DEFAULT_PROPOSAL_TOKENS),
                        help="k, or a comma-separated list; the headline reports the first")
    parser.add_argument("--repeats", type=int, default=3, help="paired repetitions (at least 2: a cell needs a spread)")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: the parity judge needs each cell's spread")
    ks = [int(k) for k in args.proposal_tokens.split(",")]

    spec = build_speculative_engine(proposal_tokens=ks[0])
    plain = KQuantEngine(spec.target)  # the same target model object: same weights, same arithmetic
    print(f"# machine: {os.cpu_count()} CPUs, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, "
          f"numpy {np.__version__}; engines: plain {plain.name}, speculative {spec.name} {spec.abi}")
    prepared = []
    for name in assets.PROMPT_NAMES:
        prompt = assets.load_prompt(name)
        began = time.perf_counter()
        kv = spec.prefill(prompt[:HANDOFF])
        print(f"# prefill {name}: {time.perf_counter() - began:.2f} s")
        prepared.append((name, kv, prompt[HANDOFF:]))

    headline: dict[int, float] = {}
    for k in ks:
        spec.proposal_tokens = k
        plain_lane, spec_lane = "plain", f"speculative k={k}"  # engines: the '# machine' line
        per_token = "tokens per CPU second"
        print(f"\n## k = {k} proposals per step, {args.tokens} tokens, {args.repeats} repeats")
        print(f"{'document':28} {'accept':>7} {'acc/step':>8} {'tok/fwd':>7} {'plain cpu':>9} "
              f"{'spec cpu':>9} {'plain wall':>10} {'spec wall':>9}  rung 1 (paired cells)")
        pooled_plain, pooled_spec = [0.0] * args.repeats, [0.0] * args.repeats
        judgements = []
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
                pooled_plain[repeat] += plain_seconds[-1]
                pooled_spec[repeat] += spec_seconds[-1]
            assert result is not None and result.draft_trace is not None
            proposed = sum(len(step[0]) for step in result.draft_trace)
            accepted = sum(step[1] for step in result.draft_trace)
            drafting = sum(1 for step in result.draft_trace if step[0])
            workload = f"{name}: {args.tokens} tokens from its {HANDOFF}-token KV"
            judgement = judge_parity(ThroughputCell(plain_lane, workload, per_token, [args.tokens / s for s in plain_seconds]),
                                     ThroughputCell(spec_lane, workload, per_token, [args.tokens / s for s in spec_seconds]))
            judgements.append(judgement)
            print(f"{name:28} {accepted / proposed:7.3f} {accepted / drafting:8.2f} "
                  f"{(len(result.tokens) - 1) / len(result.draft_trace):7.2f} {statistics.median(plain_seconds):9.2f} "
                  f"{statistics.median(spec_seconds):9.2f} {statistics.median(plain_wall):10.2f} "
                  f"{statistics.median(spec_wall):9.2f}  {judgement.outcome}")
        tokens = args.tokens * len(prepared)
        pooled = judge_parity(
            ThroughputCell(plain_lane, f"all {len(prepared)} documents, {args.tokens} tokens each", per_token,
                           [tokens / s for s in pooled_plain]),
            ThroughputCell(spec_lane, f"all {len(prepared)} documents, {args.tokens} tokens each", per_token,
                           [tokens / s for s in pooled_spec]))
        for (name, _, _), judgement in zip(prepared, judgements, strict=True):
            print(f"rung 1, {name}: {judgement.words}")
        print(f"rung 1, all documents: {pooled.words}")
        ratios = [p / s for p, s in zip(pooled_plain, pooled_spec, strict=True)]
        headline[k] = statistics.median(ratios)
        print(f"plain over speculative decode CPU seconds, all documents, per repetition: median {headline[k]:.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {args.repeats} repetitions)")
    print(f"plain_over_speculative_decode_cpu: {headline[ks[0]]:.3f}")  # k = the first --proposal-tokens
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
