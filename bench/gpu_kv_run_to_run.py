"""How far a GPU producer's KV moves run to run when only the batch around a request changes: the
measured basis of the emulated jitter in ``bench/detection_power.py --non-deterministic``.

A transformers Llama of SmolLM2-135M's shape (``--layers`` layers; random weights from a fixed
seed, so no download) prefills one 2047-token prompt alone, alone again, and as row 0 of batches
of 2, 4 and 8 equal-length prompts (the others drawn from the same seed). cuBLAS picks its GEMM
kernel, and with it the reduction order, by the problem's shape, so row 0's K and V may differ
between batch sizes although its inputs do not: the non-determinism a GPU serving engine shows
under batching. Per dtype (float32 with TF32 off, bfloat16) and batch size, the distance of row
0's K and V from the batch-1 run in units in the last place of that dtype: the largest over all
layers' elements' percentiles, the largest in the first and last layer, and the share of elements
that moved.

The distance is counted per element in ULPs of that element (ordered integers, so a value that
crosses zero counts every float between: the tail percentiles, not the maximum, are the measure).
Writes ``<out>/kv-run-to-run.json``. Last line: ``kv_run_to_run_float32_p99_ulps: <ulps>`` (the
largest 99th percentile of the float32 distances over the batch sizes).

Usage: python bench/gpu_kv_run_to_run.py [--out DIR] [--layers 30] [--positions 2047]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
                "max_position_embeddings": 8192}
BATCHES = (1, 2, 4, 8)
SEED = 20261207


def ulp_distance(a: Any, b: Any) -> Any:
    """|a - b| in units in the last place of their dtype, element by element (ordered integers)."""
    import torch

    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]

    def ordered(t: Any) -> Any:
        as_int = t.contiguous().view(bits).to(torch.int64)
        return torch.where(as_int < 0, -(as_int & (2 ** (8 * t.element_size() - 1) - 1)), as_int)

    return (ordered(a) - ordered(b)).abs()


def prefill_kv(model: Any, ids: Any) -> list[tuple[Any, Any]]:
    """Row 0's K and V of every layer after one prefill of ``ids`` ([batch, positions])."""
    import torch

    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    if hasattr(cache, "layers"):  # transformers' DynamicCache of per-layer objects
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    elif hasattr(cache, "key_cache"):
        pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))
    else:
        pairs = [(k, v) for k, v in cache]
    return [(k[0].clone(), v[0].clone()) for k, v in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu-kv-run-to-run"))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--positions", type=int, default=2047)
    args = parser.parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        print("refused: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator().manual_seed(SEED)
    prompts = torch.randint(0, SMOLLM2_135M["vocab_size"], (max(BATCHES), args.positions), generator=generator)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "layers": args.layers, "positions": args.positions, "dtypes": {}}
    float32_p99 = 0.0
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(SEED)
        config = LlamaConfig(**SMOLLM2_135M, num_hidden_layers=args.layers, torch_dtype=dtype)
        model = LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()
        base = prefill_kv(model, prompts[:1].cuda())
        rows = {}
        for label, batch in (("batch 1 again", 1), *((f"batch {b}", b) for b in BATCHES[1:])):
            kv = prefill_kv(model, prompts[:batch].cuda())
            distances = torch.cat([ulp_distance(t, t0).flatten() for pair, pair0 in zip(kv, base, strict=True)
                                   for t, t0 in zip(pair, pair0, strict=True)]).double()
            relative = max(float((t.float() - t0.float()).abs().max() / t0.float().abs().max())
                           for pair, pair0 in zip(kv, base, strict=True) for t, t0 in zip(pair, pair0, strict=True))
            first, last = (max(int(ulp_distance(t, t0).max()) for t, t0 in zip(kv[i], base[i], strict=True))
                           for i in (0, -1))
            sample = distances[torch.randperm(distances.numel(), generator=generator)[:1_000_000].to(distances.device)]
            quantiles = [float(q) for q in torch.quantile(sample, torch.tensor([0.5, 0.9, 0.99, 0.999],
                                                                               dtype=torch.float64,
                                                                               device=sample.device))]
            rows[label] = {"moved_share": float((distances > 0).double().mean()),
                           "ulps_p50_p90_p99_p999": quantiles, "first_layer_max_ulps": first,
                           "last_layer_max_ulps": last,
                           "max_abs_delta_over_tensor_max_abs": relative}
            if name == "float32":
                float32_p99 = max(float32_p99, quantiles[2])
            print(f"{name} {label}: {rows[label]['moved_share']:.4f} of elements moved; ULPs p50/p90/p99/p99.9 "
                  f"{'/'.join(f'{q:g}' for q in quantiles)}; max |delta| / tensor max |x| {relative:.3g}; "
                  f"max ULPs layer 0 {first}, last layer {last}", flush=True)
        results["dtypes"][name] = rows
        del model
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv-run-to-run.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"kv_run_to_run_float32_p99_ulps: {float32_p99:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
