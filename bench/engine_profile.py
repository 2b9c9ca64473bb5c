"""Where the numpy engines' time goes, by function, in the work one ``qualify --recipe native-text``
handoff does: the consumer's cold recompute (prefill of the fixture, then greedy decode) and the
producer's prefill of the recipe's default lane; then one prefill attention block taken apart into
its passes, and the decode step set against the time numpy takes to stream the arrays it reads.

Each phase runs once under ``cProfile`` (after one unprofiled warm-up decode step); the table lists
the functions with the most time of their own, as a share of the phase (numpy's ufuncs, matmuls
included, count in the Python function that calls them). The attention block is the last
``PREFILL_QUERY_BLOCK`` rows of a prefill of ``--positions`` keys on random operands of the model's
shape, each pass timed alone over ``--repeats`` runs. The decode floor is numpy's own float64 GEMV
over every weight array a decode step reads (the lane's integer weights, the tied head) plus the
K and V images it attends over, measured in this run: memory traffic no implementation of this
arithmetic avoids.

Usage: python bench/engine_profile.py [--model NAME|PATH] [--decode-steps 64] [--top 12]
The last line is the headline ``engine_profile: decode step <ms> ms, <ratio>x its float64 stream floor``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

import numpy as np

from qualify.contract.lanes import DEFAULT_LANES, Recipe, lane_spec
from qualify.core import assets
from qualify.core.numerics import FixedPointRows, exp, matmul_rows, tree_sum, weighted_sum
from qualify.engines.factory import build_consumer, build_producer, producer_mode
from qualify.engines.reference import CAUSAL_SQUARE, PREFILL_QUERY_BLOCK, ReferenceEngine


def profiled(run: Callable[[], object]) -> tuple[float, pstats.Stats]:
    """``run()`` under cProfile: its wall seconds (profiled) and the stats."""
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    run()
    profile.disable()
    return time.perf_counter() - began, pstats.Stats(profile)


def own_time_table(title: str, seconds: float, stats: pstats.Stats, top: int) -> None:
    """The ``top`` functions by time of their own, as shares of the phase's profiled total."""
    rows = []
    for (path, line, name), (_, calls, own, _cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = name if path == "~" else f"{'/'.join(path.split('/')[-2:])}:{line} {name}"
        rows.append((own, calls, where))
    total = sum(own for own, _, _ in rows)
    print(f"\n{title}: {seconds:.2f} s profiled")
    for own, calls, where in sorted(rows, reverse=True)[:top]:
        print(f"  {own / total:6.1%}  {own:7.3f} s  {calls:7d} calls  {where}")


def attention_block_passes(engine: ReferenceEngine, positions: int, repeats: int) -> dict[str, float]:
    """Seconds per pass of the last prefill attention block over ``positions`` keys (median of
    ``repeats``), in the order ``DecoderLayer._prefill_attention`` runs them."""
    g = engine.geometry
    group, rows = g.heads // g.kv_heads, PREFILL_QUERY_BLOCK
    rng = np.random.default_rng(0)
    queries = rng.standard_normal((g.kv_heads, group * rows, g.head_dim)).astype(np.float32)
    key_rows = FixedPointRows.of(rng.standard_normal((g.kv_heads, positions, g.head_dim)).astype(np.float32))
    value_rows = FixedPointRows.of(rng.standard_normal((g.kv_heads, positions, g.head_dim)).astype(np.float32))
    scale, start = np.float32(1.0 / np.sqrt(g.head_dim)), positions - rows
    samples: dict[str, list[float]] = {}

    def timed(name: str, step: Callable[[], np.ndarray]) -> np.ndarray:
        began = time.perf_counter()
        result = step()
        samples.setdefault(name, []).append(time.perf_counter() - began)
        return result

    for _ in range(repeats):
        scores = timed("scores q K^T (matmul_rows)", lambda: matmul_rows(queries, key_rows))
        scores = scores.reshape(g.kv_heads, group, rows, positions)

        def scale_and_mask(s: np.ndarray = scores) -> np.ndarray:
            s *= scale
            s[..., start:] += CAUSAL_SQUARE[:rows, :rows]
            return s

        def subtract_max(s: np.ndarray = scores) -> np.ndarray:
            s -= s.max(axis=-1, keepdims=True)
            return s

        def normalize(s: np.ndarray = scores) -> np.ndarray:
            s /= tree_sum(s)
            return s

        timed("scale, causal mask", scale_and_mask)
        timed("subtract row max", subtract_max)
        scores[...] = timed("exp (polynomial)", lambda s=scores: exp(s))
        timed("tree sum, divide", normalize)
        timed("probabilities V (weighted_sum)",
              lambda s=scores: weighted_sum(s.reshape(g.kv_heads, group * rows, positions), value_rows))
    return {name: float(np.median(values)) for name, values in samples.items()}


def stream_floor(consumer: object, engine: ReferenceEngine, positions: int, repeats: int) -> tuple[float, int]:
    """Median seconds of numpy's float64 GEMV over every array one decode step at ``positions``
    streams (the consumer lane's weight images, the tied head, K and V images), and their bytes."""
    arrays: list[np.ndarray] = [engine.lm_head_rows.integers.T]
    for layer in engine.layers:
        for linear in layer.linears:
            for name in ("weight_rows", "_weight_q10_t_by_super_block", "_quants_by_block", "_weight_q10_t"):
                held = getattr(linear, name, None)
                if isinstance(held, FixedPointRows):
                    arrays.append(held.integers.T)
                elif isinstance(held, list):
                    arrays += [block for block in held if isinstance(block, np.ndarray)]
                elif isinstance(held, np.ndarray):
                    arrays.append(held.reshape(-1, held.shape[-1]))
    g = engine.geometry
    kv = np.ones((g.kv_heads, g.head_dim, positions))
    arrays += [kv] * (2 * g.layers)  # K and V images per layer, float64
    operands = [(np.ones((1, array.shape[-2]) if array.ndim == 2 else (g.kv_heads, 1, g.head_dim)), array)
                for array in arrays]
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        for row, array in operands:
            row @ array
        samples.append(time.perf_counter() - began)
    return float(np.median(samples)), sum(array.nbytes for array in arrays)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a published model's name, a Hugging Face directory or a GGUF file")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--positions", type=int, default=2048, help="keys of the attention block taken apart")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if args.model is not None:
        from qualify.engines.chosen_model import use_model

        use_model(args.model)
    lane = DEFAULT_LANES[Recipe.NATIVE_TEXT]
    consumer = build_consumer(lane_spec(lane))
    producer = build_producer(lane, producer_mode("native"))
    engine = consumer.engine if isinstance(getattr(consumer, "engine", None), ReferenceEngine) else consumer
    assert isinstance(engine, ReferenceEngine), f"the consumer of {lane} is not a numpy reference engine"
    prompt = assets.load_prompt()[:2048]
    handoff = prompt.size - 1
    print(f"lane {lane}, model {args.model or 'shipped'}, fixture {prompt.size} tokens, "
          f"decode {args.decode_steps} steps, one process")

    seconds, stats = profiled(lambda: consumer.prefill(prompt[:handoff]))
    own_time_table(f"consumer prefill of {handoff} positions", seconds, stats, args.top)
    kv = consumer.prefill(prompt[:handoff])
    consumer.decode(kv, prompt[handoff:], 1)  # warm-up
    seconds, stats = profiled(lambda: consumer.decode(kv, prompt[handoff:], args.decode_steps))
    own_time_table(f"consumer greedy decode, {args.decode_steps} steps", seconds, stats, args.top)
    seconds, stats = profiled(lambda: producer.prefill(prompt[:handoff]))
    own_time_table(f"producer ({lane}, native) prefill", seconds, stats, args.top)

    passes = attention_block_passes(engine, args.positions, args.repeats)
    block = sum(passes.values())
    print(f"\none prefill attention block: {PREFILL_QUERY_BLOCK} rows x {args.positions} keys, "
          f"{block * 1e3:.1f} ms (median of {args.repeats} per pass)")
    for name, value in passes.items():
        print(f"  {value / block:6.1%}  {value * 1e3:7.2f} ms  {name}")

    began = time.perf_counter()
    consumer.decode(kv, prompt[handoff:], args.decode_steps)
    step = (time.perf_counter() - began) / args.decode_steps
    floor, streamed = stream_floor(consumer, engine, handoff + args.decode_steps // 2, args.repeats)
    print(f"\ndecode step (unprofiled): {step * 1e3:.2f} ms; float64 stream floor {floor * 1e3:.2f} ms "
          f"({streamed / 1e6:.1f} MB a step, {streamed / floor / 1e9:.1f} GB/s)")
    print(f"engine_profile: decode step {step * 1e3:.2f} ms, {step / floor:.1f}x its float64 stream floor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
