"""How far a GPU producer's KV moves run to run when only the batch around a request changes: the
measured basis of the emulated jitter in ``bench/detection_power.py --non-deterministic``.

A transformers Llama of SmolLM2-135M's shape (``--layers`` layers; random weights from a fixed
seed, so no download) prefills one 2047-token prompt alone, alone again, and as row 0 of batches
of 2, 4 and 8 equal-length prompts (the others drawn from the same seed). cuBLAS picks its GEMM
kernel, and with it the reduction order, by the problem's shape, so row 0's K and V may differ
between batch sizes although its inputs do not: the non-determinism a GPU serving engine shows
under batching. Per dtype (float32 with TF32 off, bfloat16) and batch size, the distance of row
0's K and V from the batch-1 run in units in the last place of that dtype: the largest over all
layers, the largest in the first and last layer, and the share of elements that moved.

Writes ``<out>/kv-run-to-run.json``. Last line: ``kv_run_to_run_float32_max_ulps: <ulps>`` (the
largest float32 distance over every batch size and layer).

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
    layers = cache.to_legacy_cache() if hasattr(cache, "to_legacy_cache") else cache
    return [(k[0].clone(), v[0].clone()) for k, v in layers]


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
    float32_max = 0
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(SEED)
        config = LlamaConfig(**SMOLLM2_135M, num_hidden_layers=args.layers, torch_dtype=dtype)
        model = LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()
        base = prefill_kv(model, prompts[:1].cuda())
        rows = {}
        for label, batch in (("batch 1 again", 1), *((f"batch {b}", b) for b in BATCHES[1:])):
            kv = prefill_kv(model, prompts[:batch].cuda())
            per_layer = [max(int(ulp_distance(k, k0).max()), int(ulp_distance(v, v0).max()))
                         for (k, v), (k0, v0) in zip(kv, base, strict=True)]
            moved = sum(int((ulp_distance(k, k0) > 0).sum()) + int((ulp_distance(v, v0) > 0).sum())
                        for (k, v), (k0, v0) in zip(kv, base, strict=True))
            total = sum(k.numel() + v.numel() for k, v in kv)
            rows[label] = {"max_ulps": max(per_layer), "first_layer_max_ulps": per_layer[0],
                           "last_layer_max_ulps": per_layer[-1], "moved_share": moved / total}
            if name == "float32":
                float32_max = max(float32_max, max(per_layer))
            print(f"{name} {label}: max {max(per_layer)} ULPs (layer 0: {per_layer[0]}, last: {per_layer[-1]}), "
                  f"{moved / total:.4f} of elements moved", flush=True)
        results["dtypes"][name] = rows
        del model
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv-run-to-run.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"kv_run_to_run_float32_max_ulps: {float32_max}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
