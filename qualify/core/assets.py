"""Where the shipped model, tokenizer and held-out prompts live, and the prompt digest rule.

The harness runs from a checkout (``pip install -e .``): assets sit beside the package under
``model/``. A prompt's canonical byte form is its token ids as little-endian uint32, concatenated;
``prompt_sha256`` is the SHA-256 of those bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from qualify.core.digests import sha256_bytes
from qualify.core.errors import Refused

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / "model"
PROMPTS_DIR = MODEL_DIR / "prompts"
CONTRACTS_DIR = REPO_ROOT / "contracts"
MAIN_PROMPT = "python-textwrap"
PROMPT_NAMES = ("python-textwrap", "prose-email-architecture", "config-idle-keys")


def prompt_bytes(tokens: np.ndarray) -> bytes:
    """The canonical byte form: token ids as little-endian uint32."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def prompt_sha256(tokens: np.ndarray) -> str:
    return sha256_bytes(prompt_bytes(tokens))


def load_prompt(name: str = MAIN_PROMPT) -> np.ndarray:
    """Token ids (int64 [2048]) of a held-out document, refusing unknown names."""
    if name not in PROMPT_NAMES:
        raise Refused(f"prompt: unknown name {name!r}; expected one of {', '.join(PROMPT_NAMES)}")
    path = PROMPTS_DIR / f"{name}.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        return np.asarray(document["token_ids"], dtype=np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise Refused(f"{path}: cannot read prompt token ids ({type(exc).__name__})") from None
