"""How far the 8B-shape engine's decode step is from the weight-streaming floor on one GPU, and
what stands between them.

The engine is the ``llama3-8b-shape-pd`` lane's consumer (:mod:`qualify.engines.torch_llama`, its
CUDA-graph decode) on random bf16 weights of Llama-3 8B's shape. Measured in one run, on one GPU:

* the decode step: 256 steps after a 2047-token prefill, install and host copy of the tokens
  included, as a run decodes;
* the same step's weight GEMVs alone (every layer's four projections and the head, captured in
  one CUDA graph): what the step would cost if it did nothing but stream its weights through the
  engine's own matrix kernels;
* the read floor: the weights' bytes over the device's copy rate (a device-to-device copy of the
  weights' size, read plus write), the time to read every weight once;
* a profile of the same decode (install and copies included, as timed), each CUDA kernel's time
  per step, grouped into what it does (matrix products, attention, norms, elementwise,
  reductions, copies). The decode's attention is two batched matrix products over the cache
  (``TorchLlama._step``), so it counts under matrix products, beside the GEMVs.

    python bench/gpu_decode_floor.py [--steps 256] [--json PATH]

Last line: ``decode_over_floor: <decode step / read floor>``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np

from qualify.core.errors import Refused, one_line

CONFIG = REPO_ROOT / "model" / "llama3-8b-shape" / "config.json"
PROMPT_TOKENS = 2047

# What a kernel does, by the words its name carries (first match wins; the rest is "other").
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("matrix products", ("gemv", "gemm", "cutlass", "sm90", "sm80", "wmma", "splitk", "cublas", "nvjet")),
    ("norms", ("norm",)),
    ("reductions", ("reduce",)),
    ("copies", ("copy", "memcpy", "memset", "cat", "index")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_group(name: str) -> str:
    """The group a CUDA kernel's name puts it in (``KERNEL_GROUPS``), else ``other``."""
    lowered = name.lower()
    for group, words in KERNEL_GROUPS:
        if any(word in lowered for word in words):
            return group
    return "other"


def measure(steps: int) -> dict[str, Any]:
    """Every figure of the report, measured in this process on the current CUDA device."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from qualify.engines.torch_llama import TorchLlama, random_model_weights

    if not torch.cuda.is_available():
        raise Refused("CUDA: no GPU visible; this bench measures a GPU's decode")
    weights = random_model_weights(CONFIG)
    engine = TorchLlama(weights, cache_positions=PROMPT_TOKENS + 1 + steps, cuda_graph=True)
    matrices = [weights.embed, weights.lm_head] + [m for layer in weights.layers
                                                   for m in (layer.wqkv, layer.wo, layer.w13, layer.w2)]
    weight_bytes = sum(m.numel() * m.element_size() for m in matrices)
    tokens = np.arange(1, PROMPT_TOKENS + 1, dtype=np.int64) % 128000
    kv = engine.prefill(tokens)
    first = np.array([5])
    engine.decode(kv, first, steps)  # warm-up: graphs captured, allocator settled
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.decode(kv, first, steps)
    torch.cuda.synchronize()
    decode_ms = (time.perf_counter() - start) / steps * 1e3

    # The step's GEMVs alone, with the engine's own weights and dtypes, in one graph.
    hidden = weights.layers[0].wo.shape[0]
    intermediate = weights.layers[0].w2.shape[1]
    x = torch.randn(1, hidden, dtype=weights.lm_head.dtype, device="cuda")

    def gemvs() -> None:
        for layer in weights.layers:
            F.linear(x, layer.wqkv)
            F.linear(x, layer.wo)
            gate_up = F.linear(x, layer.w13)
            F.linear(gate_up[:, :intermediate], layer.w2)
        torch.mm(x, weights.lm_head.t(), out_dtype=torch.float32)

    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemvs()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        gemvs()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    gemv_ms = (time.perf_counter() - start) / 50 * 1e3

    source = torch.empty(weight_bytes // 2, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize()
    copy_s = (time.perf_counter() - start) / 10
    read_write_gb_s = 2 * weight_bytes / copy_s / 1e9
    floor_ms = weight_bytes / (read_write_gb_s * 1e9) * 1e3
    del source, target

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        engine.decode(kv, first, steps)
        torch.cuda.synchronize()
    per_kernel: collections.Counter[str] = collections.Counter()
    for event in profiler.events():
        if event.device_type.name == "CUDA":
            per_kernel[event.name] += event.device_time_total
    groups: collections.Counter[str] = collections.Counter()
    for name, microseconds in per_kernel.items():
        groups[kernel_group(name)] += microseconds
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "engine_abi": engine.abi,
        "weight_bytes": weight_bytes,
        "decode_ms_per_step": decode_ms,
        "gemvs_alone_ms": gemv_ms,
        "device_copy_read_write_gb_s": read_write_gb_s,
        "read_floor_ms": floor_ms,
        "steps": steps,
        "kernel_ms_per_step_by_group": {group: us / steps / 1e3 for group, us in groups.most_common()},
        "kernel_ms_per_step_top": {name[:100]: us / steps / 1e3 for name, us in per_kernel.most_common(12)},
    }


def print_report(values: dict[str, Any]) -> None:
    floor = values["read_floor_ms"]
    print(f"gpu {values['gpu']}, torch {values['torch']}, CUDA {values['cuda']}; engine {values['engine_abi']}")
    print(f"weights {values['weight_bytes'] / 1e9:.2f} GB; device copy {values['device_copy_read_write_gb_s']:.0f} GB/s "
          f"(read + write) -> read floor {floor:.3f} ms")
    print(f"decode step {values['decode_ms_per_step']:.3f} ms ({values['decode_ms_per_step'] / floor:.2f} x floor); "
          f"its GEMVs alone {values['gemvs_alone_ms']:.3f} ms ({values['gemvs_alone_ms'] / floor:.2f} x floor)")
    print(f"kernel time per decode step, by group ({values['steps']} profiled steps):")
    for group, ms in values["kernel_ms_per_step_by_group"].items():
        print(f"  {ms:7.3f} ms  {group}")
    print("largest kernels:")
    for name, ms in values["kernel_ms_per_step_top"].items():
        print(f"  {ms:7.3f} ms  {kernel_group(name):16s} {name}")
    print(f"decode_over_floor: {values['decode_ms_per_step'] / floor:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=256, help="decode steps timed (default 256)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    options = parser.parse_args(argv)
    if not 1 <= options.steps <= 4096:
        print(f"gpu_decode_floor: refused: --steps: found {options.steps}, expected 1 to 4096", file=sys.stderr)
        return 2
    try:
        values = measure(options.steps)
    except Refused as exc:
        print(f"gpu_decode_floor: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:  # a GPU error, out of memory...: one line, no traceback
        print(f"gpu_decode_floor: failed: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return 1
    if options.json is not None:
        options.json.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print_report(values)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
