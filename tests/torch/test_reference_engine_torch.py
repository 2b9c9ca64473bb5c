"""The numpy reference engine against Hugging Face transformers on the shipped model: same tokens, logits and KV to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from qualify.core import assets
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult
from tests.unit.engines import test_reference_engine
from tests.unit.engines.test_reference_engine import DECODE, HANDOFF

# The reference engine module's fixtures, bound here by assignment (an import of a fixture only a
# parameter uses reads as unused to the linter, which would drop it).
engine = test_reference_engine.engine
prompt = test_reference_engine.prompt
handoff_kv = test_reference_engine.handoff_kv
main_decode = test_reference_engine.main_decode

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def test_agrees_with_transformers(prompt: np.ndarray, handoff_kv: KVCache, main_decode: DecodeResult) -> None:
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as exc:
        pytest.skip(f"torch extra not installed (pip install -e '.[torch]'): {exc}")
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(str(assets.MODEL_DIR), dtype=torch.float32).eval()
    rows, tokens = [], []
    with torch.no_grad():
        out = model(torch.tensor(prompt[None, :HANDOFF]), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        next_input = torch.tensor(prompt[None, HANDOFF:])
        for _ in range(DECODE):
            out = model(next_input, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            row = out.logits[0, -1].float().numpy()
            rows.append(row)
            tokens.append(int(row.argmax()))
            next_input = torch.tensor([[tokens[-1]]])
    # Hugging Face caches K post-RoPE as [batch, kv_heads, positions, head_dim], like ours.
    hf_keys = cache.layers[0].keys[0, :, :HANDOFF].numpy()
    max_abs_key_delta = float(np.abs(hf_keys - handoff_kv.keys[0]).max())
    matching = int((np.array(tokens) == main_decode.tokens).sum())
    max_abs_logit_delta = float(np.abs(np.stack(rows) - main_decode.logits).max())
    print(f"transformers vs reference: tokens {matching}/{DECODE}, max abs logit delta "
          f"{max_abs_logit_delta:.3e}, layer-0 max abs K delta {max_abs_key_delta:.3e}")
    assert matching == DECODE
    assert max_abs_logit_delta < 1e-3
    assert max_abs_key_delta < 1e-3
