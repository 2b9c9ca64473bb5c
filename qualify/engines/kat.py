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
and what this host runs (numpy, BLAS, kernel, threads, CPU).

vLLM and the torch engines on CUDA are not exact by construction (:data:`MEASURED_ENGINE_NAMES`):
their identities keep the pins that change their bits and carry a KAT too, measured on the hardware
class the identity covers and checked on top of those pins.

* vLLM: version, ISA class, threads, attention settings; its KAT measured on the CPU class the
  identity covers. Its prefill hands off whole blocks and keeps the prompt for a cold recompute, so
  its KAT digests both decode paths a lane uses: the cold recompute and the decode from the
  handed-off KV.
* ``transformers-torch`` (the GPU producer of the ``transformers`` lanes): its ABI names transformers,
  torch, CUDA, the GPU, the dtype, TF32 and the attention implementation; its KAT is measured on
  that GPU with that ABI (``tools/measure_known_answer.py``, pinned by ``tools/freeze_identity.py
  --producer-kat-evidence``), and the producer process checks it before it is ready. On the CPU
  the same engine has a KAT too (the same fixed input); no shipped identity runs it there.
* ``torch-llama`` (the compact engine of the ``torch-llama`` lanes, producer and consumer): its ABI
  names torch, CUDA, the GPU, the dtype, the LM head's float32 accumulation and whether the decode
  replays a CUDA graph; its weights are drawn from the seed the lane's model file names, on that GPU.
  Both sides' KATs are measured there (the same tool; pinned with ``--producer-kat-evidence`` and
  ``--consumer-kat-evidence``): the consumer checks its own at "identity sealed", the producer
  before it is ready (an in-process producer where its transport is made,
  ``bench/gpu_scale.py``). The KAT's seed and sizes are every engine's (its token ids drawn over
  the engine's own vocabulary), so the 8B-shaped engine runs it unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from qualify.core.errors import Refused
from qualify.core.kv import KVCache

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
"""Engines whose bits are exact by construction: their KAT holds on every host."""
MEASURED_ENGINE_NAMES = frozenset({"vllm", "transformers-torch", "torch-llama"})
"""Engines whose bits hold only where their pins hold (vLLM: version, ISA class, threads; transformers
on torch: transformers, torch, CUDA, the GPU, dtype, TF32, attention; the compact torch Llama: torch,
CUDA, the GPU, dtype, head accumulation, CUDA graphs): their KAT is measured on the class the
identity covers and checked on top of those pins."""
KAT_ENGINE_NAMES = EXACT_ENGINE_NAMES | MEASURED_ENGINE_NAMES
"""Every engine an identity must pin a known-answer digest for."""


def has_known_answer(engine: Any) -> bool:
    """Whether ``engine`` (or the engine a lane engine wraps) is one the KAT pins."""
    return getattr(engine, "name", None) in KAT_ENGINE_NAMES


def check_pinned(name: str, pinned: str | None, role: str, where: str) -> None:
    """Refuse an identity that pins no known-answer digest for a ``role`` engine that has one (absent
    evidence is failed evidence; the digest itself is checked where the engine runs)."""
    if name in KAT_ENGINE_NAMES and pinned is None:
        raise Refused(f"{where}: {role}_engine.kat_sha256: pinned none, expected the {name} engine's "
                      "known-answer digest (re-freeze the identity)")


def kat_tokens(vocab: int) -> np.ndarray:
    """The fixed KAT token ids for a vocabulary of ``vocab`` (prompt, then pending)."""
    rng = np.random.default_rng(KAT_SEED)
    return rng.integers(0, vocab, KAT_PROMPT_TOKENS + KAT_PENDING_TOKENS, dtype=np.int64)


KAT_EVIDENCE_SCHEMA = "trust-ladder.known-answer-evidence.v2"
"""The document a KAT measured where its engine runs is recorded in (``tools/measure_known_answer.py``
writes it; ``tools/freeze_identity.py --producer-kat-evidence``/``--consumer-kat-evidence`` pin from
it): per lane its KAT input and an entry per measured role (``producer``, ``consumer``)."""
KAT_EVIDENCE_SCHEMA_V1 = "trust-ladder.known-answer-evidence.v1"
"""The first such document, still read: one KAT input for the document and one producer entry per
lane (``bench/results/gpu-lanes/known-answers.json``)."""


def kat_input(vocab: int) -> dict[str, int | str]:
    """What the KAT feeds an engine of vocabulary ``vocab``: the sizes, the seed and the SHA-256 of
    the token ids (int64, little-endian), so a digest measured elsewhere can be shown to be of this
    input (another numpy drawing other ids would be another KAT)."""
    tokens = kat_tokens(vocab).astype("<i8")
    return {"seed": KAT_SEED, "vocab": vocab, "prompt_tokens": KAT_PROMPT_TOKENS,
            "pending_tokens": KAT_PENDING_TOKENS, "decode_steps": KAT_DECODE_STEPS,
            "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}


def _absorb(digest: Any, label: str, array: np.ndarray) -> None:
    """Frame one array (label, dtype, shape, then little-endian C-order bytes) into ``digest``."""
    array = np.ascontiguousarray(array)
    header = json.dumps([label, array.dtype.newbyteorder("<").str, list(array.shape)])
    digest.update(header.encode() + b"\n")
    digest.update(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


def digest_of(parts: Iterable[tuple[str, np.ndarray]]) -> str:
    """The KAT digest of labelled arrays, framed as :func:`known_answer_sha256` frames its own (an
    engine measured in its own process: ``qualify.engines.connector_session``)."""
    digest = hashlib.sha256(b"trust-ladder.kat.v1\n")
    for label, array in parts:
        _absorb(digest, label, array)
    return digest.hexdigest()


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
    source = getattr(kv, "source_tokens", None)
    if source is not None:  # a cold-recompute KV (vLLM): the decode from the handed-off blocks too
        handed = KVCache(list(kv.keys), list(kv.values))
        rest = np.concatenate([np.asarray(source)[handed.geometry.positions:], pending])
        loaded = inner.decode(handed, rest, KAT_DECODE_STEPS)
        _absorb(digest, "handed.tokens", np.asarray(loaded.tokens, dtype=np.int32))
        _absorb(digest, "handed.logits", np.asarray(loaded.logits, dtype=np.float32))
    if result.draft_trace is not None:
        digest.update(json.dumps([[list(p), a] for p, a in result.draft_trace]).encode() + b"\n")
    score_rows = getattr(inner, "score_rows", None)
    if score_rows is not None:  # the E2 controls' batched consumer path
        _absorb(digest, "score_rows", score_rows(prompt, kv))
    return digest.hexdigest()


def host_numerics() -> str:
    """What this host computes with, for a KAT refusal: numpy, BLAS, its kernel and threads, CPU;
    and torch, CUDA and the GPU where this process runs torch (a ``transformers`` or ``torch-llama``
    engine)."""
    from qualify.core.hostenv import blas_facts, cpu_model

    blas = blas_facts()
    facts = (f"numpy {np.__version__}, BLAS {blas['library']}, kernel {blas['kernel'] or 'unknown'}, "
             f"threads {blas['num_threads'] or 'unknown'}, CPU {os.cpu_count()} x {cpu_model()}")
    torch = sys.modules.get("torch")
    if torch is not None:  # only where an engine already imported it: a numpy run never pays for it
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        facts += f", torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, GPU {gpu}"
    return facts


def check_known_answer(engine: Any, expected: str | None, role: str, found: str | None = None) -> None:
    """Refuse (exit 2, one line) when ``engine``'s KAT is not the pinned ``expected`` digest; an
    engine without a KAT must pin none, and one with a KAT must pin one. ``found``: the digest the
    engine's own process measured (an engine that runs elsewhere), else it is computed here."""
    name = getattr(engine, "name", "?")
    if not has_known_answer(engine):
        if expected is not None:
            raise Refused(f"{role} engine {name}: known-answer digest: pinned {expected}, the engine has no "
                          "known-answer check")
        return
    if expected is None:
        raise Refused(f"{role} engine {name}: known-answer digest: pinned none, expected one "
                      "(re-freeze the identity)")
    inner = getattr(engine, "engine", engine)  # a LaneEngine's own engine
    if found is None and getattr(inner, "known_answer_in_engine_process", False):
        return  # its engine process measures it when it starts; the run compares it there
    if found is None:
        found = known_answer_sha256(engine)
    if found != expected:
        raise Refused(f"{role} engine {name} ({engine.abi}): known-answer digest: expected {expected}, found "
                      f"{found}: its arithmetic gives other bits here ({host_numerics()})")
