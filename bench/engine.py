"""Benchmark the numpy reference engine on this machine, and report how confident its greedy
choices are on the main prompt.

Prints prefill tokens/s (2047 tokens) and decode tokens/s (256 greedy tokens), each beside the
rate numpy's own float32 matmul reaches on exactly the matmul shapes that phase runs (measured in
the same run, so the fraction says how much the engine loses to everything that is not a matmul).
Then the top-1 minus top-2 logit gap over the 256 decoded tokens: near-ties are where tiny drift
can flip a greedy token. Where vLLM is installed it is timed on the same checkpoint.

Usage: python bench/engine.py [--repeats 3]. The last line is the headline ``name: value``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from qualify.core import assets
from qualify.engines.reference import PREFILL_QUERY_BLOCK, ReferenceEngine

HANDOFF = 2047
DECODE = 256
NEAR_TIE_GAPS = (0.02, 0.1)

MatmulShape = tuple[tuple[int, ...], tuple[int, ...]]  # (a shape, b shape) for a @ b


def best_and_median(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Wall seconds of ``run``: best and median of ``repeats`` timings."""
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    return min(seconds), statistics.median(seconds)


def matmul_flops(shapes: list[MatmulShape]) -> float:
    """2 * m * k * n summed over (possibly batched) matmuls."""
    total = 0.0
    for a_shape, b_shape in shapes:
        batch = int(np.prod(a_shape[:-2])) if len(a_shape) > 2 else 1
        total += 2.0 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]
    return total


def prefill_matmuls(engine: ReferenceEngine, positions: int) -> list[MatmulShape]:
    """The matmuls ``ReferenceEngine.prefill`` runs: projections, then attention per query block
    (the last layer stops after K and V)."""
    g = engine.geometry
    group = g.heads // g.kv_heads
    qkv = [((positions, g.hidden), (g.hidden, n)) for n in
           (g.heads * g.head_dim, g.kv_heads * g.head_dim, g.kv_heads * g.head_dim)]
    rest: list[MatmulShape] = []
    for start in range(0, positions, PREFILL_QUERY_BLOCK):
        stop = min(start + PREFILL_QUERY_BLOCK, positions)
        rows = group * (stop - start)
        rest.append(((g.kv_heads, rows, g.head_dim), (g.kv_heads, g.head_dim, stop)))
        rest.append(((g.kv_heads, rows, stop), (g.kv_heads, stop, g.head_dim)))
    rest += [((positions, g.heads * g.head_dim), (g.heads * g.head_dim, g.hidden)),
             ((positions, g.hidden), (g.hidden, engine.intermediate)),
             ((positions, g.hidden), (g.hidden, engine.intermediate)),
             ((positions, engine.intermediate), (engine.intermediate, g.hidden))]
    return qkv * g.layers + rest * (g.layers - 1)


def decode_step_matmuls(engine: ReferenceEngine, position: int) -> list[MatmulShape]:
    """The matmuls of one decode row at ``position``: 7 projections and attention per layer,
    then the tied LM head."""
    g = engine.geometry
    group, visible = g.heads // g.kv_heads, position + 1
    layer = [((1, g.hidden), (g.hidden, g.heads * g.head_dim)),
             ((1, g.hidden), (g.hidden, g.kv_heads * g.head_dim)),
             ((1, g.hidden), (g.hidden, g.kv_heads * g.head_dim)),
             ((g.kv_heads, group, g.head_dim), (g.kv_heads, g.head_dim, visible)),
             ((g.kv_heads, group, visible), (g.kv_heads, visible, g.head_dim)),
             ((1, g.heads * g.head_dim), (g.heads * g.head_dim, g.hidden)),
             ((1, g.hidden), (g.hidden, engine.intermediate)),
             ((1, g.hidden), (g.hidden, engine.intermediate)),
             ((1, engine.intermediate), (engine.intermediate, g.hidden))]
    return layer * g.layers + [((1, g.hidden), (g.hidden, g.vocab))]


def numpy_matmul_seconds(shapes: list[MatmulShape], repeats: int) -> float:
    """Best wall seconds for numpy to run exactly these float32 matmuls, one call each."""
    rng = np.random.default_rng(0)
    unique_shapes = sorted({shape for pair in shapes for shape in pair})
    operands = {shape: rng.standard_normal(shape, dtype=np.float32) for shape in unique_shapes}
    pairs = [(operands[a], operands[b]) for a, b in shapes]

    def run() -> None:
        for a, b in pairs:
            a @ b

    return best_and_median(run, repeats)[0]


def logit_gaps(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row, float64 [rows]."""
    top_two = np.partition(logits, -2, axis=1)[:, -2:].astype(np.float64)
    return top_two[:, 1] - top_two[:, 0]


def time_vllm(prompt: np.ndarray, reference_tokens: np.ndarray) -> float | None:
    """Time vLLM (CPU build) on the same checkpoint: prefill-only and prefill+256 greedy; returns
    the prefill+decode seconds, or None when vLLM is absent or failed."""
    if importlib.util.find_spec("vllm") is None:
        print("vllm: not installed")
        return None
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from vllm import LLM, SamplingParams

        from qualify.engines.checkpoint import model_files_view

        llm = LLM(model=str(model_files_view(assets.MODEL_DIR, "vllm-bench")), dtype="float32", skip_tokenizer_init=True,
                  enforce_eager=True, gpu_memory_utilization=0.2, enable_prefix_caching=False,
                  max_model_len=4096)
        request = [{"prompt_token_ids": [int(t) for t in prompt]}]

        def generate(max_tokens: int) -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False)
            return list(llm.generate(request, params, use_tqdm=False)[0].outputs[0].token_ids)

        generate(1)  # warm-up
        began = time.perf_counter()
        generate(1)
        prefill_seconds = time.perf_counter() - began
        began = time.perf_counter()
        tokens = generate(DECODE)
        total_seconds = time.perf_counter() - began
        decode_seconds = total_seconds - prefill_seconds
        matching = int(np.sum(np.asarray(tokens[:DECODE]) == reference_tokens[:len(tokens)]))
        print(f"vllm prefill: {len(prompt) / prefill_seconds:.0f} tokens/s ({prefill_seconds:.3f} s, "
              f"{len(prompt)} tokens incl. first sample)")
        print(f"vllm decode: {(DECODE - 1) / decode_seconds:.1f} tokens/s ({decode_seconds:.3f} s)")
        print(f"vllm tokens equal to reference: {matching}/{DECODE}")
        return total_seconds
    except Exception as exc:  # a bench reports, it does not crash on an optional engine
        print(f"vllm: failed ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timings per phase (best is reported)")
    args = parser.parse_args()

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, load average {load:.2f}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, numpy {np.__version__}")
    engine = ReferenceEngine.from_model_dir()
    prompt = assets.load_prompt()
    print(f"engine: {engine.name} {engine.version} abi {engine.abi}")

    engine.decode(engine.prefill(prompt[:64]), prompt[64:65], 4)  # warm-up (BLAS threads, caches)
    kv = engine.prefill(prompt[:HANDOFF])
    prefill_best, prefill_median = best_and_median(lambda: engine.prefill(prompt[:HANDOFF]), args.repeats)
    decode_best, decode_median = best_and_median(
        lambda: engine.decode(kv, prompt[HANDOFF:], DECODE), args.repeats)
    result = engine.decode(kv, prompt[HANDOFF:], DECODE)

    prefill_shapes = prefill_matmuls(engine, HANDOFF)
    decode_shapes = [s for step in range(DECODE) for s in decode_step_matmuls(engine, HANDOFF + step)]
    prefill_matmul = numpy_matmul_seconds(prefill_shapes, args.repeats)
    decode_matmul = numpy_matmul_seconds(decode_shapes, args.repeats)
    for phase, tokens, best, median, shapes, matmul in (
            ("prefill", HANDOFF, prefill_best, prefill_median, prefill_shapes, prefill_matmul),
            ("decode", DECODE, decode_best, decode_median, decode_shapes, decode_matmul)):
        flops = matmul_flops(shapes)
        print(f"{phase}: {tokens / best:.0f} tokens/s ({tokens} tokens, best {best:.3f} s, "
              f"median {median:.3f} s of {args.repeats})")
        print(f"{phase} matmuls: engine {flops / best / 1e9:.2f} GFLOP/s; numpy alone on the same "
              f"{len(shapes)} matmul calls {flops / matmul / 1e9:.2f} GFLOP/s; "
              f"fraction of numpy matmul rate {matmul / best:.2f}")

    gaps = logit_gaps(result.logits)
    near_ties = ", ".join(f"{int(np.sum(gaps < bound))} below {bound}" for bound in NEAR_TIE_GAPS)
    print(f"confidence over {DECODE} decoded tokens (top-1 minus top-2 logit): min {gaps.min():.4f} "
          f"(step {int(gaps.argmin())}), p5 {np.percentile(gaps, 5):.4f}, median {np.median(gaps):.4f}; "
          f"{near_ties}; distinct tokens {len(np.unique(result.tokens))}")

    vllm_seconds = time_vllm(prompt, result.tokens)
    if vllm_seconds is not None:
        print(f"reference prefill+decode over vLLM prefill+decode, same run: "
              f"{(prefill_best + decode_best) / vllm_seconds:.2f} (below 1: the reference is faster)")
    print(f"prefill_plus_decode_seconds: {prefill_best + decode_best:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
