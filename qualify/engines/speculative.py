"""Speculative decode on the k-quant target with the EAGLE-1 draft (rung 3, lane
``kquant-exact-dflash``): the draft proposes, the target's greedy distribution disposes.

Every emitted token is the target's own greedy token and its logit row is the target's full row,
so speculative decode emits exactly plain greedy decode's tokens and, because the exact Q8_0
arithmetic makes every row independent of how many rows are fed together, the same logits bit for
bit. The draft only changes how many target rows are computed per forward.

One step (target has fed positions 0..L-1, ``last`` = the emitted token for position L):

1. draft catch-up: the rows the target accepted last step are fed to the draft with the target's
   true hidden states (one batched forward); its last row proposes d_1 for position L+1;
2. draft guesses: k-1 more single rows, each reading its own predicted hidden state (EAGLE-1),
   propose d_2..d_k; these guessed rows are dropped from the draft cache afterwards;
3. verify: the target scores [last, d_1..d_k] at positions L..L+k in one batched forward of k+1
   rows; a = the longest prefix with d_i == the target's greedy token; emit the target's tokens
   for positions L+1..L+a+1 (a accepted drafts plus the target's own next token) with their rows;
4. roll the target cache back to L+a+1 positions.

Draft context across the handoff (what ``KVCache.draft`` carries). Draft position t reads token
t+1 and the target hidden state h_t. The producer prefills ``prompt[:P]``: it knows tokens 0..P-1
and h_0..h_{P-1}, so it can compute draft positions 0..P-2 and no more. Position P-1 straddles the
seam: its token is the pending token (the consumer's) and its hidden state h_{P-1} is the
producer's, which the canonical KV does not carry. So the handed-off draft KV covers positions
0..P-2 (one fewer than the target's), and the consumer's draft context skips position P-1: the
draft's first decode row is position P (RoPE P) in cache slot P-1, and so on. The gap is the same
on the handoff and cold-recompute paths (both start from ``prefill``), so draft tokens and trace
are reproducible. It can only cost acceptance; measured against a gap-free context (draft KV of
0..P-1 computed with the pending token, a diagnostic only a producer that knew that token could
build), acceptance was identical at k = 1, 2, 3, 4 and 6 on all three held-out documents.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from qualify.contract.lanes import ProducerMode
from qualify.core import assets
from qualify.core.errors import Refused
from qualify.core.kv import KVCache, KVGeometry
from qualify.engines.base import ENGINE_VERSION, DecodeResult, check_decode_count, check_finite_logits, check_tokens
from qualify.engines.draft import EagleDraft
from qualify.engines.kquant import (
    DRAFT_GGUF_NAME,
    TARGET_GGUF_NAME,
    KQuantEngine,
    KQuantModel,
    build_kquant_engine,
    config_from_json,
    dequantized_weights,
    linear_factory,
    load_draft_gguf,
    load_kquant_model,
)
from qualify.engines.reference import DecodeCache

DEFAULT_PROPOSAL_TOKENS = 1
"""Draft tokens proposed per step (k). k = 1 measured best on this engine for both acceptance
(pooled 0.77 vs 0.53 at k = 3) and decode CPU time (``bench/speculative.py``): a target row costs
~45% of a one-row forward here, so deeper guesses (conditional acceptance ~0.3 on prose) lose."""
SPECULATIVE_ABI = "eagle1-spec-abi-1"

DraftTrace = list[tuple[tuple[int, ...], int]]


class SpeculativeEngine:
    """The ``kquant-exact-dflash`` producer and consumer (Engine protocol): k-quant target plus
    EAGLE-1 draft. ``prefill`` returns the target KV with the draft's own KV in ``draft``."""

    name = "kquant-eagle1-numpy"
    # Pure numpy, no thread pool or device: a forked child may run it (qualify.evidence.cold_ahead).
    fork_safe = True
    version = ENGINE_VERSION
    logit_units = "raw"

    def __init__(self, target: KQuantModel, draft: EagleDraft,
                 proposal_tokens: int = DEFAULT_PROPOSAL_TOKENS) -> None:
        if isinstance(proposal_tokens, bool) or not isinstance(proposal_tokens, int) or proposal_tokens < 1:
            raise Refused(f"speculative: proposal_tokens: found {proposal_tokens!r}, expected a positive int")
        self.target = target
        self.draft = draft
        self.proposal_tokens = proposal_tokens
        self.geometry = target.geometry
        self.abi = f"{SPECULATIVE_ABI}+{target.abi}+draft-{','.join(draft.linear_kinds)}"

    # ---- producer --------------------------------------------------------------------------

    def prefill(self, tokens: np.ndarray) -> KVCache:
        """Target KV of exactly ``tokens`` (P positions) plus ``draft``: the draft KV of
        positions 0..P-2 (see module docstring for why not P-1)."""
        began = time.perf_counter()
        tokens = check_tokens(tokens, self.geometry.vocab, "prefill tokens")
        kv, hidden = self.target.reference.prefill_with_hidden(tokens)  # hidden [P, hidden]
        # Draft row t: (embedding of token t+1, target hidden t) for t = 0..P-2.
        kv.draft = self.draft.prefill(self.target.embed(tokens[1:]), hidden[:-1])
        kv.meta["prefill_seconds"] = time.perf_counter() - began
        return kv

    def draft_kv_geometry(self, positions: int) -> KVGeometry:
        """The draft context a handoff of ``positions`` target positions carries: one draft
        layer over positions 0..P-2 (see :meth:`prefill`)."""
        first = self.draft.geometry if hasattr(self.draft, "geometry") else self.geometry
        return KVGeometry(1, first.kv_heads, first.head_dim, positions - 1, "float32")

    # ---- consumer --------------------------------------------------------------------------

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:
        """Install ``kv`` (target and draft context), feed ``pending``, then emit ``n`` greedy
        target tokens, k proposals verified per step; ``draft_trace`` = (proposals, accepted)."""
        began = time.perf_counter()
        n = check_decode_count(n)
        k = self.proposal_tokens
        pending = check_tokens(pending, self.geometry.vocab, "pending tokens")
        # Room for every row fed after the handoff, the k rows a last verify may feed included.
        cache = self.target.reference.new_cache(kv, extra_positions=pending.size + n + k)
        if kv.draft is None:
            raise Refused("kv: draft: missing; the speculative lane hands off the draft's KV with the target's")
        draft_cache = self.draft.new_cache(kv.draft, extra_positions=pending.size + n + k)
        handed_off = cache.length
        if draft_cache.length != handed_off - 1:
            raise Refused(f"kv: draft: {draft_cache.length} positions, expected {handed_off - 1} "
                          f"(one fewer than the target's {handed_off})")

        out = self.target.forward_rows(cache, pending)  # positions P..P+m-1
        emitted_tokens = [int(np.argmax(out.logits[-1]))]
        emitted_logits = [out.logits[-1]]
        # Draft rows owed (true inputs): positions, the token after each, the target hidden at each.
        owed_positions = np.arange(handed_off, handed_off + pending.size)
        owed_next = np.append(pending[1:], emitted_tokens[0])
        owed_hidden = out.hidden
        trace: DraftTrace = []
        draft_seconds = verify_seconds = 0.0

        while len(emitted_tokens) < n:
            proposals_wanted = min(k, n - len(emitted_tokens) - 1)
            last = emitted_tokens[-1]
            proposals: list[int] = []
            if proposals_wanted > 0:
                draft_began = time.perf_counter()
                proposals = self._propose(draft_cache, owed_positions, owed_next, owed_hidden, proposals_wanted)
                draft_seconds += time.perf_counter() - draft_began
            verify_began = time.perf_counter()
            fed_from = cache.length
            out = self.target.forward_rows(cache, np.array([last, *proposals], dtype=np.int64))
            greedy = np.argmax(out.logits, axis=1)  # the target's token after each fed row
            accepted = 0
            while accepted < len(proposals) and proposals[accepted] == int(greedy[accepted]):
                accepted += 1
            cache.truncate(fed_from + accepted + 1)  # keep last and the accepted proposals
            verify_seconds += time.perf_counter() - verify_began
            emitted_tokens.extend(int(token) for token in greedy[:accepted + 1])
            emitted_logits.extend(out.logits[:accepted + 1])
            trace.append((tuple(proposals), accepted))
            if proposals_wanted == 0:
                continue  # a target-only step (no room left for proposals); the draft is not fed
            owed_positions = np.arange(fed_from, fed_from + accepted + 1)
            owed_next = greedy[:accepted + 1]
            owed_hidden = out.hidden[:accepted + 1]

        logits = np.stack(emitted_logits).astype(np.float32, copy=False)
        check_finite_logits(self.name, logits)
        proposed = sum(len(step[0]) for step in trace)
        accepted_total = sum(step[1] for step in trace)
        return DecodeResult(
            tokens=np.asarray(emitted_tokens, dtype=np.int32), logits=logits, draft_trace=trace,
            seconds=time.perf_counter() - began,
            meta={"handed_off_positions": float(handed_off), "pending_tokens": float(pending.size),
                  "draft_positions": float(handed_off - 1),
                  "proposal_tokens": float(k), "proposed": float(proposed),
                  "accepted": float(accepted_total), "steps": float(len(trace)),
                  "draft_seconds": draft_seconds, "verify_seconds": verify_seconds})

    def _propose(self, draft_cache: DecodeCache, owed_positions: np.ndarray, owed_next: np.ndarray,
                 owed_hidden: np.ndarray, count: int) -> list[int]:
        """Feed the owed true-input rows (kept), then guess ``count`` tokens; guessed rows are
        dropped from the draft cache before returning."""
        predicted = self.draft.forward_rows(draft_cache, self.target.embed(owed_next), owed_hidden,
                                            owed_positions)
        kept = draft_cache.length
        guess_hidden = predicted[-1:]  # ĥ for the position after the last owed one, [1, hidden]
        position = int(owed_positions[-1]) + 1  # the position the next guessed row sits at
        proposals = [int(np.argmax(self.target.logits(guess_hidden)[0]))]
        while len(proposals) < count:
            # EAGLE-1 feature feedback: the guessed hidden state stands in for the target's.
            guess_hidden = self.draft.forward_rows(
                draft_cache, self.target.embed(np.array(proposals[-1:])), guess_hidden, np.array([position]))
            proposals.append(int(np.argmax(self.target.logits(guess_hidden)[0])))
            position += 1
        draft_cache.truncate(kept)  # guessed rows never stay in the draft's context
        return proposals

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:
        """Logits [len(forced), vocab]: row i scores the position after pending + forced[:i]
        (target only: one batched forward of pending + forced[:-1])."""
        reference = self.target.reference
        pending = check_tokens(pending, self.geometry.vocab, "pending tokens")
        forced = check_tokens(forced, self.geometry.vocab, "forced tokens")
        cache = reference.new_cache(kv, extra_positions=pending.size + forced.size - 1)
        logits = self.target.forward_rows(cache, np.concatenate([pending, forced[:-1]])).logits
        logits = np.ascontiguousarray(logits[pending.size - 1:])
        check_finite_logits(self.name, logits)
        return logits


def load_kquant_draft(target: KQuantModel, model_dir: Path = assets.MODEL_DIR) -> EagleDraft:
    """The draft from ``model_dir/gguf/eagle1-draft-q8_0.gguf`` in the target's arithmetic."""
    config = config_from_json(Path(model_dir) / "config.json")
    weights = load_draft_gguf(Path(model_dir) / "gguf" / DRAFT_GGUF_NAME, config)
    return EagleDraft(dequantized_weights(weights), target.geometry, config.rms_norm_eps,
                      target.reference.rope, make_linear=linear_factory(weights.matrices, target.mode))


def build_speculative_engine(proposal_tokens: int = DEFAULT_PROPOSAL_TOKENS,
                             mode: ProducerMode = ProducerMode.EXACT,
                             model_dir: Path = assets.MODEL_DIR) -> SpeculativeEngine:
    """The lane ``kquant-exact-dflash`` engine (producer and consumer are both this). ``mode=
    NATIVE`` exists only to fabricate other-mode cache entries (target and draft KV) for fault
    tests; a native lane never declares a draft (``qualify.contract.lanes.check_speculative_draft``)."""
    target = load_kquant_model(mode, model_dir)
    return SpeculativeEngine(target, load_kquant_draft(target, model_dir), proposal_tokens)


def checkpoint_paths(model_dir: Path = assets.MODEL_DIR) -> tuple[Path, Path]:
    """The GGUF files the kquant lane's engines read: (target, draft). ``config.json`` is read too."""
    return (Path(model_dir) / "gguf" / TARGET_GGUF_NAME, Path(model_dir) / "gguf" / DRAFT_GGUF_NAME)


def build_engine(mode: ProducerMode, model_dir: Path = assets.MODEL_DIR,
                 proposal_tokens: int = DEFAULT_PROPOSAL_TOKENS) -> SpeculativeEngine | KQuantEngine:
    """The kquant lane engine for ``mode``: ``EXACT`` -> the ``kquant-exact-dflash`` speculative
    engine (producer and consumer; ``proposal_tokens`` must be the identity's sealed k);
    ``NATIVE`` -> the ``kquant-native`` producer, plain k-quant with float accumulation and no
    draft (a native lane never carries draft context)."""
    if mode is ProducerMode.EXACT:
        return build_speculative_engine(proposal_tokens, ProducerMode.EXACT, model_dir)
    if mode is ProducerMode.NATIVE:
        return build_kquant_engine(ProducerMode.NATIVE, model_dir)
    raise Refused(f"kquant: producer mode: found {mode!r}, expected exact or native")
