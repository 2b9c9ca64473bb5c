"""Known-answer checks (KATs): an engine's arithmetic pinned by its output bits, not by versions.

A numpy engine's bits are exact by construction (``qualify.core.numerics``), so an identity pins
what it computes, not which numpy, BLAS or source bytes computed it: :func:`known_answer_sha256`
is the SHA-256 of the engine's KV and logit bits on a small fixed input (:data:`KAT_PROMPT_TOKENS`
tokens, so several prefill query blocks and a partial one; a multi-token pending feed; a few
greedy decode steps, the draft's proposals and its KV where the engine drafts; the batched
``score_rows`` path where the engine has one). Any change to a contraction, a rounding, a
reduction shape or a block size that moves one bit moves the digest.

The consumer checks its own KAT when its identity is sealed; the producer process checks its own
before it announces itself ready. A mismatch refuses in one line naming the engine, both digests
and what this host runs (numpy, BLAS, kernel, threads, CPU). Engines that are not exact by
construction (vLLM, torch/CUDA) have no KAT here; their identities keep the pins that change
their bits (versions, ISA class, threads, attention and device settings).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from qualify.core.errors import Refused

KAT_SEED = 35
"""Seed of the fixed KAT token ids (drawn uniformly over the model's vocabulary)."""
KAT_PROMPT_TOKENS = 259
"""Prefilled positions: two whole prefill query blocks of 128 and a partial one; attention over
more keys than one fixed-point reduction chunk (256 terms, ``qualify.core.numerics``) holds."""
KAT_PENDING_TOKENS = 2
"""Tokens fed after the KV before decoding (a multi-row pending feed)."""
KAT_DECODE_STEPS = 4
"""Greedy decode steps (a speculative engine proposes and verifies drafts over them)."""

EXACT_ENGINE_NAMES = frozenset({"reference-numpy", "kquant-numpy", "kquant-eagle1-numpy"})
"""Engines whose bits are exact by construction and so carry a KAT."""


def has_known_answer(engine: Any) -> bool:
    """Whether ``engine`` (or the engine a lane engine wraps) is one the KAT pins."""
    return getattr(engine, "name", None) in EXACT_ENGINE_NAMES


def kat_tokens(vocab: int) -> np.ndarray:
    """The fixed KAT token ids for a vocabulary of ``vocab`` (prompt, then pending)."""
    rng = np.random.default_rng(KAT_SEED)
    return rng.integers(0, vocab, KAT_PROMPT_TOKENS + KAT_PENDING_TOKENS, dtype=np.int64)


def _absorb(digest: Any, label: str, array: np.ndarray) -> None:
    """Frame one array (label, dtype, shape, then little-endian C-order bytes) into ``digest``."""
    array = np.ascontiguousarray(array)
    header = json.dumps([label, array.dtype.newbyteorder("<").str, list(array.shape)])
    digest.update(header.encode() + b"\n")
    digest.update(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


def _absorb_kv(digest: Any, label: str, kv: Any) -> None:
    for layer, (keys, values) in enumerate(zip(kv.keys, kv.values, strict=True)):
        _absorb(digest, f"{label}.{layer}.k", keys)
        _absorb(digest, f"{label}.{layer}.v", values)
    draft = getattr(kv, "draft", None)
    if draft is not None:
        _absorb_kv(digest, f"{label}.draft", draft)


def known_answer_sha256(engine: Any) -> str:
    """The SHA-256 of ``engine``'s KV and logit bits on the fixed KAT input (module docstring)."""
    inner = getattr(engine, "engine", engine)  # a LaneEngine's own engine: no block trimming
    tokens = kat_tokens(inner.geometry.vocab)
    prompt, pending = tokens[:KAT_PROMPT_TOKENS], tokens[KAT_PROMPT_TOKENS:]
    digest = hashlib.sha256(b"trust-ladder.kat.v1\n")
    kv = inner.prefill(prompt)
    _absorb_kv(digest, "prefill", kv)
    result = inner.decode(kv, pending, KAT_DECODE_STEPS)
    _absorb(digest, "decode.tokens", np.asarray(result.tokens, dtype=np.int32))
    _absorb(digest, "decode.logits", np.asarray(result.logits, dtype=np.float32))
    if result.draft_trace is not None:
        digest.update(json.dumps([[list(p), a] for p, a in result.draft_trace]).encode() + b"\n")
    score_rows = getattr(inner, "score_rows", None)
    if score_rows is not None:  # the E2 controls' batched consumer path
        _absorb(digest, "score_rows", score_rows(prompt, kv))
    return digest.hexdigest()


def host_numerics() -> str:
    """What this host computes with, for a KAT refusal: numpy, BLAS, its kernel and threads, CPU."""
    from qualify.core.hostenv import blas_facts, cpu_model

    blas = blas_facts()
    return (f"numpy {np.__version__}, BLAS {blas['library']}, kernel {blas['kernel'] or 'unknown'}, "
            f"threads {blas['num_threads'] or 'unknown'}, CPU {os.cpu_count()} x {cpu_model()}")


def check_known_answer(engine: Any, expected: str | None, role: str) -> None:
    """Refuse (exit 2, one line) when ``engine``'s KAT is not the pinned ``expected`` digest; an
    engine without a KAT must pin none, and one with a KAT must pin one."""
    name = getattr(engine, "name", "?")
    if not has_known_answer(engine):
        if expected is not None:
            raise Refused(f"{role} engine {name}: known-answer digest: pinned {expected}, the engine has no "
                          "known-answer check")
        return
    if expected is None:
        raise Refused(f"{role} engine {name}: known-answer digest: pinned none, expected one "
                      "(re-freeze the identity)")
    found = known_answer_sha256(engine)
    if found != expected:
        raise Refused(f"{role} engine {name} ({engine.abi}): known-answer digest: expected {expected}, found "
                      f"{found}: its arithmetic gives other bits here ({host_numerics()})")
