"""Train the shipped model: a small Llama (Hugging Face format) and its EAGLE-style draft head.

Stage 1 trains the target on the stdlib corpus built by ``tools/build_corpus.py``: short
sequences first, then 2304-token sequences so every position a 2048/256 qualification touches
has been trained. Stage 2 freezes the target and trains the draft: one decoder layer that reads
the target's last hidden state at position t and the embedding of token t+1, predicts the hidden
state at t+1, and scores token t+2 through the target's own final norm and (tied) LM head.

Writes ``model/config.json``, ``model/model.safetensors`` (float16, tied embeddings),
``model/draft_config.json``, ``model/draft.safetensors`` and ``model/training-log.json``.
Measured on one H200: see ``model/training-log.json`` (``seconds``). ``--device cpu`` works with
smaller ``--steps`` for a smoke run.

Usage: python tools/train_model.py [--device cuda] [--out model] [--steps 900]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "float16",
}
DRAFT_CONFIG = {"kind": "eagle-1", "layers": 1, "reads": "target last hidden state (pre-norm)",
                "input": "fc([embed(token t+1), hidden t]) -> decoder layer -> predicted hidden t+1"}


def rope_tables(positions: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim], Hugging Face's rotate_half layout
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Block(nn.Module):
    """One Llama decoder layer; parameter names follow Hugging Face's LlamaDecoderLayer."""

    def __init__(self, c: dict):
        super().__init__()
        d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.heads, self.kv_heads, self.head_dim = h, kv, hd
        self.input_layernorm = RMSNorm(d, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(d, c["rms_norm_eps"])
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, h * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(h * hd, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.mlp.up_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.mlp.down_proj = nn.Linear(c["intermediate_size"], d, bias=False)

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        a = self.input_layernorm(x)
        q = self.self_attn.q_proj(a).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.self_attn.k_proj(a).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.self_attn.v_proj(a).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.self_attn.o_proj(o.transpose(1, 2).reshape(batch, seq, -1))
        m = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


class Llama(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.data /= math.sqrt(2 * c["num_hidden_layers"])

    def hidden(self, tokens):
        cos, sin = rope_tables(tokens.shape[1], self.c["head_dim"], self.c["rope_theta"], tokens.device)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x  # last hidden state before the final norm

    def logits(self, hidden):
        return self.norm(hidden) @ self.embed_tokens.weight.T


class Draft(nn.Module):
    """EAGLE-1 draft: position t sees (embed(token t+1), target hidden t), predicts hidden t+1."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.fc = nn.Linear(2 * c["hidden_size"], c["hidden_size"], bias=False)
        self.layer = Block(c)
        nn.init.normal_(self.fc.weight, std=0.02)

    def forward(self, next_embeddings, hidden):
        cos, sin = rope_tables(hidden.shape[1], self.c["head_dim"], self.c["rope_theta"], hidden.device)
        return self.layer(self.fc(torch.cat([next_embeddings, hidden], dim=-1)), cos, sin)


def batches(tokens: np.ndarray, seq: int, batch: int, rng: np.random.Generator, device):
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    chunk = np.stack([tokens[s: s + seq + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(chunk).to(device, non_blocking=True)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_loss(model: Llama, device) -> dict[str, float]:
    losses = {}
    for path in sorted((ROOT / "model" / "prompts").glob("*.json")):
        ids = torch.tensor(json.loads(path.read_text())["token_ids"], device=device)[None]
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model.logits(model.hidden(ids[:, :-1])).float()
        losses[path.stem] = F.cross_entropy(logits[0], ids[0, 1:]).item()
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "model")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--draft-steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--draft-only", action="store_true",
                        help="keep the shipped target (model/model.safetensors) and train only the draft")
    parser.add_argument("--distill", action="store_true",
                        help="draft token targets are the target's own greedy choices (self-distillation)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tokens = np.fromfile(ROOT / ".cache" / "corpus.u16", dtype=np.uint16)
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    began = time.perf_counter()
    log: dict = {"config": CONFIG, "corpus_tokens": int(len(tokens)), "device": str(device), "stages": []}

    model = Llama(CONFIG).to(device)
    if args.draft_only:
        from safetensors.torch import load_file

        shipped = load_file(str(ROOT / "model" / "model.safetensors"))
        model.load_state_dict({k.removeprefix("model."): v.float() for k, v in shipped.items()})
        args.steps = 0
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    short_steps = int(args.steps * 0.7)
    for step in range(args.steps):
        seq, batch = (512, 128) if step < short_steps else (2304, 32)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, 3e-3, 50)
        chunk = batches(tokens, seq, batch, rng, device)
        with torch.autocast(**autocast):
            logits = model.logits(model.hidden(chunk[:, :-1]))
            loss = F.cross_entropy(logits.float().reshape(-1, CONFIG["vocab_size"]), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"target step {step} seq {seq} loss {loss.item():.4f}", flush=True)
            log["stages"].append({"stage": "target", "step": step, "loss": loss.item()})
    model.eval()
    log["draft_only"], log["distill"] = args.draft_only, args.distill
    log["held_out_loss"] = held_out_loss(model, device)
    print("held-out loss", log["held_out_loss"], flush=True)

    for p in model.parameters():
        p.requires_grad_(False)
    draft = Draft(CONFIG).to(device)
    dopt = torch.optim.AdamW(draft.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(args.draft_steps):
        for group in dopt.param_groups:
            group["lr"] = lr_at(step, args.draft_steps, 2e-3, 30)
        chunk = batches(tokens, 1024, 64, rng, device)
        with torch.no_grad(), torch.autocast(**autocast):
            hidden = model.hidden(chunk[:, :-1]).float()
            # Self-distillation: the draft must predict what the target will emit, not the data.
            greedy = model.logits(hidden).float().argmax(-1) if args.distill else None
        with torch.autocast(**autocast):
            # position t: (embed(token t+1), hidden t) -> predicted hidden t+1, scored on token t+2
            predicted = draft(model.embed_tokens(chunk[:, 1:-1]), hidden[:, :-1]).float()
            feature_loss = F.smooth_l1_loss(predicted, hidden[:, 1:])
            logits = model.logits(predicted).float()
            token_targets = greedy[:, 1:] if args.distill else chunk[:, 2:]
            token_loss = F.cross_entropy(logits.reshape(-1, CONFIG["vocab_size"]), token_targets.reshape(-1))
            loss = feature_loss + (1.0 if args.distill else 0.1) * token_loss
        dopt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        dopt.step()
        if step % 100 == 0 or step == args.draft_steps - 1:
            print(f"draft step {step} feature {feature_loss.item():.4f} token {token_loss.item():.4f}", flush=True)
            log["stages"].append({"stage": "draft", "step": step, "feature_loss": feature_loss.item(),
                                  "token_loss": token_loss.item()})
    log["seconds"] = round(time.perf_counter() - began, 1)

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.draft_only:
        state = {f"model.{k}": v.detach().to(torch.float16).cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    draft_state = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(draft_state, str(args.out / "draft.safetensors"), metadata={"format": "pt"})
    if not args.draft_only:
        (args.out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (args.out / "draft_config.json").write_text(json.dumps(DRAFT_CONFIG, indent=2) + "\n")
    log_name = "draft-training-log.json" if args.draft_only else "training-log.json"
    (args.out / log_name).write_text(json.dumps(log, indent=1) + "\n")
    print(f"trained in {log['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
