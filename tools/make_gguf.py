"""Write the k-quant lane's checkpoint: the shipped model and its EAGLE-1 draft as Q8_0 GGUF files.

Rung 3 (``kquant-target-plus-dflash``) runs integer-exact k-quant arithmetic, so its weights are
an integer quantization written by ``gguf`` itself (``gguf.GGUFWriter`` + ``gguf.quants.quantize``):

* ``model/gguf/target-q8_0.gguf``: llama.cpp's ``llama`` layout. Every projection and the tied
  token embedding / LM head (``token_embd.weight``) are Q8_0; norms are F32 (exact copies of the
  float16 weights). Its tokenizer is in the ``tokenizer.ggml.*`` keys (byte-level BPE: tokens,
  types, merges), as llama.cpp needs to load it and ``qualify --model`` reads it back. Q and K
  rows are permuted the way ``convert_hf_to_gguf.py`` does, so the file
  means what its ``llama`` architecture key says; the loader undoes the permutation exactly.
* ``model/gguf/eagle1-draft-q8_0.gguf``: the draft head (``fc`` + one decoder layer) in the same
  tensor naming and Q/K layout, under the custom architecture ``trust-ladder-eagle1``.

Q8_0 (not Q4_0) because the lane's point is exactness, not size: Q8_0 keeps the target's greedy
text and the draft's acceptance close to the float16 model. Output is deterministic: the same
source bytes give the same file bytes (no timestamps; tensors and keys in a fixed order).

Usage: python tools/make_gguf.py [--model-dir model] [--out-dir model/gguf]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qualify.core.digests import sha256_file
from qualify.engines.checkpoint import LlamaConfig, load_config, load_weights
from qualify.engines.draft import DRAFT_FILE, load_draft_safetensors
from qualify.engines.kquant import (
    DRAFT_ARCH,
    DRAFT_GGUF_NAME,
    QUANT_TYPE,
    TARGET_GGUF_NAME,
    permute_qk_rows_to_gguf,
)
from qualify.engines.model_source import add_gguf_tokenizer

# Hugging Face suffix inside one decoder layer -> llama.cpp tensor suffix inside ``blk.{i}``.
LAYER_TENSORS: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def add_weight(writer: gguf.GGUFWriter, name: str, weight_f32: np.ndarray) -> None:
    """A 2-D projection/embedding goes in as Q8_0 bytes; a 1-D norm weight as F32."""
    if weight_f32.ndim == 1:
        writer.add_tensor(name, np.ascontiguousarray(weight_f32, dtype=np.float32))
        return
    quantized = gguf.quants.quantize(np.ascontiguousarray(weight_f32), QUANT_TYPE)
    writer.add_tensor(name, quantized, raw_dtype=QUANT_TYPE)  # shape from the byte shape


def add_layer(writer: gguf.GGUFWriter, block: str, hf_layer: dict[str, np.ndarray],
              heads: int, kv_heads: int) -> None:
    """One decoder layer's tensors under ``{block}.*`` in llama.cpp naming and Q/K layout."""
    for hf_suffix, gguf_suffix in LAYER_TENSORS.items():
        weight = hf_layer[hf_suffix]
        if hf_suffix == "self_attn.q_proj.weight":
            weight = permute_qk_rows_to_gguf(weight, heads)
        elif hf_suffix == "self_attn.k_proj.weight":
            weight = permute_qk_rows_to_gguf(weight, kv_heads)
        add_weight(writer, f"{block}.{gguf_suffix}", weight)


def add_hparams(writer: gguf.GGUFWriter, config: LlamaConfig, source_sha256: str) -> None:
    geometry = config.geometry
    writer.add_name("trust-ladder shipped model" if writer.arch == "llama" else "trust-ladder EAGLE-1 draft")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(geometry.max_positions)
    writer.add_embedding_length(geometry.hidden)
    writer.add_feed_forward_length(config.intermediate)
    writer.add_head_count(geometry.heads)
    writer.add_head_count_kv(geometry.kv_heads)
    writer.add_key_length(geometry.head_dim)
    writer.add_value_length(geometry.head_dim)
    writer.add_rope_dimension_count(geometry.head_dim)
    writer.add_rope_freq_base(geometry.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(geometry.vocab)
    writer.add_string("trust_ladder.source_sha256", source_sha256)


def write_target(model_dir: Path, out: Path) -> None:
    """The shipped model (checked by the reference engine's fail-closed loader) as Q8_0 GGUF."""
    config = load_config(model_dir)
    tensors = load_weights(model_dir, config)  # float32, exact widening of float16
    geometry = config.geometry
    writer = gguf.GGUFWriter(out, "llama")
    add_hparams(writer, config, sha256_file(model_dir / "model.safetensors"))
    writer.add_block_count(geometry.layers)
    add_gguf_tokenizer(writer, model_dir / "tokenizer.json")
    add_weight(writer, "token_embd.weight", tensors["model.embed_tokens.weight"])
    for index in range(geometry.layers):
        prefix = f"model.layers.{index}."
        layer = {name[len(prefix):]: value for name, value in tensors.items() if name.startswith(prefix)}
        add_layer(writer, f"blk.{index}", layer, geometry.heads, geometry.kv_heads)
    add_weight(writer, "output_norm.weight", tensors["model.norm.weight"])
    finish(writer)


def write_draft(model_dir: Path, out: Path) -> None:
    """The EAGLE-1 draft (checked by its fail-closed loader) as Q8_0 GGUF."""
    config = load_config(model_dir)
    source = model_dir / DRAFT_FILE
    tensors = load_draft_safetensors(source, config.geometry, config.intermediate)
    writer = gguf.GGUFWriter(out, DRAFT_ARCH)
    add_hparams(writer, config, sha256_file(source))
    writer.add_block_count(1)
    writer.add_string("trust_ladder.draft_kind", "eagle-1")
    add_weight(writer, "fc.weight", tensors["fc.weight"])
    layer = {name[len("layer."):]: value for name, value in tensors.items() if name.startswith("layer.")}
    add_layer(writer, "blk.0", layer, config.geometry.heads, config.geometry.kv_heads)
    finish(writer)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=ROOT / "model")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "model" / "gguf")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, write in ((TARGET_GGUF_NAME, write_target), (DRAFT_GGUF_NAME, write_draft)):
        path = args.out_dir / name
        write(args.model_dir, path)
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
              f"{path.stat().st_size} bytes sha256 {sha256_file(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
