"""Derive the NVFP4 checkpoint model/nvfp4/ from the shipped float16 model (deterministic).

Quantizes every attention and MLP projection (``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``) with the standard NVFP4 recipe; embeddings
(the tied LM head) and norms stay float16. Weight-only (W4A16): no input_scale_inv tensors.

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
    Nvfp4Tensor,
    load_nvfp4_checkpoint,
    quantize_nvfp4,
    read_safetensors,
    write_nvfp4_checkpoint,
)

QUANTIZED_NAME = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
RECIPE = "nvfp4-modelopt-w4a16-v1"  # scale2 = amax/2688; E4M3FN(block amax/(6*scale2)); RNE E2M1


def derive(source: Path, out_dir: Path) -> Path:
    """Quantize ``source`` into ``out_dir/model.safetensors`` and copy config.json beside it."""
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
    out_path = out_dir / "model.safetensors"
    metadata = {"quantization_recipe": RECIPE, "source_sha256": sha256_file(source)}
    write_nvfp4_checkpoint(out_path, nvfp4, dense_f16, metadata)
    shutil.copyfile(source.parent / "config.json", out_dir / "config.json")
    load_nvfp4_checkpoint(out_path)  # the written file must pass the fail-closed loader
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
