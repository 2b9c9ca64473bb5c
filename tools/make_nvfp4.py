"""Derive the NVFP4 checkpoint model/nvfp4/ from the shipped float16 model (deterministic).

Quantizes every attention and MLP projection (``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``) with the standard NVFP4 recipe; embeddings
(the tied LM head) and norms stay float16. Weight-only (W4A16): no input scales. Written in
NVIDIA ModelOpt's layout (``weight``, ``weight_scale`` [n_out, n_in/16], ``weight_scale_2``;
``config.json`` ``quantization_config`` and ``hf_quant_config.json``, quant_algo W4A16_NVFP4), as
vLLM's ModelOpt NVFP4 reader expects (``qualify/engines/nvfp4_layouts.py``, docs/nvfp4-layouts.md).

Usage: python tools/make_nvfp4.py [--source model/model.safetensors] [--out model/nvfp4]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from qualify.core.digests import sha256_file
from qualify.core.errors import Refused
from qualify.engines.nvfp4 import (
    ACTIVATION_PRECISION_KEY,
    WEIGHT_PRECISION_KEY,
    WEIGHT_PRECISION_NVFP4,
    Nvfp4Checkpoint,
    Nvfp4Tensor,
    quantize_nvfp4,
    read_safetensors,
)
from qualify.engines.nvfp4_layouts import detect_layout, load_checkpoint, write_checkpoint

QUANTIZED_NAME = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
RECIPE = "nvfp4-modelopt-w4a16-v1"  # scale2 = amax/2688; E4M3FN(block amax/(6*scale2)); RNE E2M1


def derive(source: Path, out_dir: Path) -> Path:
    """Quantize ``source`` into ``out_dir/model.safetensors`` (ModelOpt layout) with the source's
    config.json beside it, its ``quantization_config`` added."""
    tensors, _ = read_safetensors(source)
    nvfp4: dict[str, Nvfp4Tensor] = {}
    dense_f16: dict[str, np.ndarray] = {}
    for name in sorted(tensors):
        stored = tensors[name]
        if stored.dtype != "F16":
            raise Refused(f"{source}: tensor {name}: dtype {stored.dtype}, expected F16")
        if QUANTIZED_NAME.match(name):
            nvfp4[name] = quantize_nvfp4(stored.array.astype(np.float32), name)
        else:
            dense_f16[name] = stored.array
    if not nvfp4:
        raise Refused(f"{source}: no projection weights matched {QUANTIZED_NAME.pattern}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "config.json", "hf_quant_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
    metadata = {"quantization_recipe": RECIPE, "source_sha256": sha256_file(source),
                WEIGHT_PRECISION_KEY: WEIGHT_PRECISION_NVFP4, ACTIVATION_PRECISION_KEY: "a16"}
    shutil.copyfile(source.parent / "config.json", out_dir / "config.json")
    out_path = write_checkpoint(Nvfp4Checkpoint(nvfp4, dense_f16, metadata), out_dir, "modelopt")
    # The written directory must pass the fail-closed loader, as ModelOpt's layout.
    if detect_layout(out_dir) != "modelopt":
        raise Refused(f"{out_dir}: written, but not detected as the ModelOpt layout")
    load_checkpoint(out_dir)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=REPO_ROOT / "model" / "model.safetensors")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "model" / "nvfp4")
    args = parser.parse_args(argv)
    try:
        out_path = derive(args.source, args.out)
    except Refused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    print(f"{out_path} {out_path.stat().st_size} bytes sha256 {sha256_file(out_path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
