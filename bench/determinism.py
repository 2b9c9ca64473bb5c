"""The cost of determinism: the reference engine's machine-independent numerics against today's
float32 BLAS path, measured in the same run.

``qualify.core.numerics`` makes every contraction exact by construction (fixed-point integers in
float64, chunked), every sum a fixed pairwise tree and exp/cos/sin elementwise polynomials, so the
engines' bits do not depend on the BLAS kernel, thread count or numpy's SIMD dispatch. The BLAS
path is the engine's arithmetic before that change, reconstructed here without touching the
engine: the names ``qualify.engines.reference`` imports from ``qualify.core.numerics`` are patched
with float32 stand-ins for the duration of each timed call:

* ``FixedPointRows.of`` keeps float32 rows as they are (no integer conversion);
* ``matmul_rows`` / ``weighted_sum``: float32 ``a @ b`` through numpy's BLAS, the reduction cut
  into 256-long chunks summed left to right (the engine's previous ``matmul``);
* ``tree_sum``: ``np.sum``; ``exp``: ``np.exp``; ``cos_sin``: ``np.cos`` and ``np.sin``.

Both engines are built once; each repetition times, interleaved and in alternating order,
prefill of 2047 tokens and a 256-token greedy decode from it on each path. Reports median wall
and process-CPU seconds per phase and path, the ratios numerics / BLAS with their spread over the
paired repetitions, the parity judgement of the two paths' paired tokens/s cells
(``qualify.judge.judge_parity``: a split inside the cells' spread is parity, neither path ahead),
and, as a check that the stand-ins really are the float32 engine, how far the two paths' tokens and
logits are apart. Speed depends on the machine and its load; nothing here is asserted.

Usage: python bench/determinism.py [--repeats 3] (at least 2). The last line is the headline
``determinism_cost_prefill_decode_ratio: <(prefill + decode) numerics / BLAS, wall medians>``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qualify.core import assets
from qualify.engines import reference
from qualify.engines.reference import ReferenceEngine
from qualify.judge import ThroughputCell, judge_parity

HANDOFF = 2047
DECODE = 256
REDUCTION_CHUNK = 256  # the previous engine's longest single BLAS reduction


# ---- today's BLAS path: float32 stand-ins for the names reference.py imports -----------------


@dataclass(frozen=True)
class Float32Rows:
    """Stand-in for ``FixedPointRows``: the rows kept as float32 (``integers`` holds them, the
    ``scale`` is 1), so the engine's slicing and slot writes work unchanged."""

    integers: np.ndarray  # [..., N, K] float32
    scale: np.ndarray  # [..., N, 1] float32 ones

    @classmethod
    def of(cls, values: np.ndarray, bits: int = 0, *, reuse: bool = False) -> Float32Rows:
        del bits, reuse
        rows = np.array(values, dtype=np.float32)  # a copy, as the fixed-point conversion makes
        return cls(rows, np.ones((*rows.shape[:-1], 1), dtype=np.float32))

    def __getitem__(self, index: tuple[slice, ...]) -> Float32Rows:
        return Float32Rows(self.integers[index], self.scale[index])


def chunked_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 a [..., M, K] @ b [..., K, N] through BLAS, K cut into REDUCTION_CHUNK pieces
    summed left to right (the engine's ``matmul`` before qualify.core.numerics)."""
    out = a[..., :REDUCTION_CHUNK] @ b[..., :REDUCTION_CHUNK, :]
    for start in range(REDUCTION_CHUNK, a.shape[-1], REDUCTION_CHUNK):
        out += a[..., start:start + REDUCTION_CHUNK] @ b[..., start:start + REDUCTION_CHUNK, :]
    return out


def blas_matmul_rows(a: np.ndarray, b: Float32Rows) -> np.ndarray:
    return chunked_matmul(a, np.swapaxes(b.integers, -1, -2))


def blas_weighted_sum(weights: np.ndarray, values: Float32Rows) -> np.ndarray:
    return chunked_matmul(weights, values.integers)


def blas_tree_sum(x: np.ndarray) -> np.ndarray:
    return x.sum(axis=-1, keepdims=True)


def blas_exp(x: np.ndarray) -> np.ndarray:
    return np.exp(x)


def blas_cos_sin(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.cos(angles), np.sin(angles)


STAND_INS = {"FixedPointRows": Float32Rows, "matmul_rows": blas_matmul_rows,
             "weighted_sum": blas_weighted_sum, "tree_sum": blas_tree_sum, "exp": blas_exp,
             "cos_sin": blas_cos_sin}


@contextlib.contextmanager
def blas_path() -> Iterator[None]:
    """Within: ``qualify.engines.reference`` computes with the float32 BLAS stand-ins."""
    missing = [name for name in STAND_INS if not hasattr(reference, name)]
    if missing:
        raise SystemExit(f"bench/determinism.py: qualify.engines.reference no longer imports {missing}; "
                         "update the stand-ins")
    with contextlib.ExitStack() as stack:
        for name, stand_in in STAND_INS.items():
            stack.enter_context(mock.patch.object(reference, name, stand_in))
        yield


# ---- environment ---------------------------------------------------------------------------


def blas_runtime() -> str:
    """The OpenBLAS kernel set and thread count this process runs (threadpoolctl if installed)."""
    try:
        from threadpoolctl import threadpool_info

        pools = [pool for pool in threadpool_info() if pool.get("internal_api") == "openblas"]
        if pools:
            return f"{pools[0]['architecture']}, {pools[0]['num_threads']} threads"
    except ImportError:
        pass
    found = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "libscipy_openblas64_*.so"))
    if not found:
        return "unknown (no scipy-openblas library next to numpy)"
    lib = ctypes.CDLL(found[0])
    lib.scipy_openblas_get_corename64_.restype = ctypes.c_char_p
    lib.scipy_openblas_get_num_threads64_.restype = ctypes.c_int
    return f"{lib.scipy_openblas_get_corename64_().decode()}, {lib.scipy_openblas_get_num_threads64_()} threads"


def numpy_simd() -> str:
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    enabled = [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]
    return f"widest enabled dispatch target {enabled[-1] if enabled else 'baseline'}"


# ---- timing --------------------------------------------------------------------------------


@dataclass
class Timings:
    wall: list[float]
    cpu: list[float]

    def median(self) -> tuple[float, float]:
        return statistics.median(self.wall), statistics.median(self.cpu)


def timed(run: Callable[[], object], timings: Timings, patched: bool) -> object:
    with blas_path() if patched else contextlib.nullcontext():
        wall, cpu = time.perf_counter(), time.process_time()
        result = run()
        timings.wall.append(time.perf_counter() - wall)
        timings.cpu.append(time.process_time() - cpu)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per phase and path (median reported)")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: the parity judge needs each cell's spread")

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, load average {load:.2f}, numpy {np.__version__}")
    print(f"OpenBLAS: {blas_runtime()} (OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}); numpy SIMD: {numpy_simd()}"
          f" (NPY_DISABLE_CPU_FEATURES={os.environ.get('NPY_DISABLE_CPU_FEATURES', 'unset')})")

    prompt = assets.load_prompt()
    engines = {"numerics": (ReferenceEngine.from_model_dir(), False)}
    with blas_path():
        engines["blas"] = (ReferenceEngine.from_model_dir(), True)
    for engine, patched in engines.values():  # warm-up: BLAS threads, caches, lazy imports
        with blas_path() if patched else contextlib.nullcontext():
            engine.decode(engine.prefill(prompt[:64]), prompt[64:65], 4)

    timings = {(path, phase): Timings([], []) for path in engines for phase in ("prefill", "decode")}
    results = {}
    for repetition in range(args.repeats):
        order = list(engines) if repetition % 2 == 0 else list(reversed(engines))
        for path in order:
            engine, patched = engines[path]
            kv = timed(lambda engine=engine: engine.prefill(prompt[:HANDOFF]), timings[path, "prefill"], patched)
            results[path] = timed(lambda engine=engine, kv=kv: engine.decode(kv, prompt[HANDOFF:], DECODE),
                                  timings[path, "decode"], patched)

    exact, blas = results["numerics"], results["blas"]
    agreed = int(np.sum(exact.tokens == blas.tokens))
    first = np.flatnonzero(exact.tokens != blas.tokens)
    delta = np.abs(exact.logits.astype(np.float64) - blas.logits.astype(np.float64))
    upto = int(first[0]) if first.size else DECODE  # logits compare like for like until tokens part
    print(f"check: BLAS path vs numerics, {agreed}/{DECODE} tokens equal"
          f"{f' (first difference at step {upto})' if first.size else ''}; max abs logit delta "
          f"{delta[:upto].max() if upto else float('nan'):.3g} over the {upto} steps before any token differs")

    ratios = {}
    for phase, tokens in (("prefill", HANDOFF), ("decode", DECODE)):
        (exact_wall, exact_cpu), (blas_wall, blas_cpu) = (timings["numerics", phase].median(),
                                                          timings["blas", phase].median())
        ratios[phase] = exact_wall / blas_wall
        paired = [e / b for e, b in zip(timings["numerics", phase].wall, timings["blas", phase].wall, strict=True)]
        print(f"{phase} ({tokens} tokens), medians of {args.repeats}: numerics {exact_wall:.3f} s wall "
              f"({exact_cpu:.3f} s CPU, {tokens / exact_wall:.0f} tokens/s); BLAS path {blas_wall:.3f} s wall "
              f"({blas_cpu:.3f} s CPU, {tokens / blas_wall:.0f} tokens/s); ratio numerics / BLAS "
              f"{ratios[phase]:.2f} wall, {exact_cpu / blas_cpu:.2f} CPU; per paired repetition (wall) "
              f"min {min(paired):.2f}, max {max(paired):.2f}")
        workload = f"{phase} of {tokens} tokens" + (f" from the {HANDOFF}-token KV" if phase == "decode" else "")
        judgement = judge_parity(
            ThroughputCell("numerics", workload, "tokens/s (wall)", [tokens / s for s in timings["numerics", phase].wall]),
            ThroughputCell("BLAS path", workload, "tokens/s (wall)", [tokens / s for s in timings["blas", phase].wall]))
        print(f"{phase} rung 1 (paired cells): {judgement.words}")
    total = sum(timings["numerics", phase].median()[0] for phase in ("prefill", "decode")) / \
        sum(timings["blas", phase].median()[0] for phase in ("prefill", "decode"))
    print(f"determinism_cost_prefill_ratio: {ratios['prefill']:.2f}")
    print(f"determinism_cost_decode_ratio: {ratios['decode']:.2f}")
    print(f"determinism_cost_prefill_decode_ratio: {total:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
