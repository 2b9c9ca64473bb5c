"""Measure the EAGLE-1 draft's acceptance on the k-quant lane: the basis for the sealed floor.

For each held-out document, exactly the qualification flow: the producer prefills
``prompt[:2047]`` (target KV + draft KV), the consumer feeds the pending ``prompt[2047:]`` and
speculatively decodes 256 tokens. Reported per document and overall:

* ``acceptance_rate`` = accepted drafted tokens / proposed drafted tokens (the floor's quantity);
* ``mean_accepted_per_step`` = accepted drafted tokens per verify step;
* ``tokens_per_target_forward`` = emitted tokens / target forwards after the pending feed;
* digests of the generated tokens and of the draft trace (canonical JSON), so the archived
  numbers can be re-derived bit for bit.

``--sweep 1,2,3,4,6`` adds the same numbers for other proposal counts k (diagnostic; the lane's
k is ``--proposal-tokens``). The report is one JSON document (canonical key order), written to
``--out`` or else printed; ``--receipts DIR`` archives it as a receipt judged by
:func:`qualify.judge.judge_draft_acceptance`. Never tune a floor to this output after the fact:
the floor is sealed from it. The last line is ``draft_acceptance_rate: <pooled rate at k>``.

Usage: python bench/measure_draft.py [--proposal-tokens K] [--sweep K,K,...] [--out FILE] [--receipts DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qualify.core import assets
from qualify.core.digests import canonical_sha256, sha256_bytes, sha256_file
from qualify.core.kv import KVCache
from qualify.engines.base import DecodeResult
from qualify.engines.kquant import DRAFT_GGUF_NAME, TARGET_GGUF_NAME
from qualify.engines.speculative import (
    DEFAULT_PROPOSAL_TOKENS,
    SpeculativeEngine,
    build_speculative_engine,
)

HANDOFF = 2047
OUTPUT_TOKENS = 256


def rate_text(rate: float | None) -> str:
    """A rate as reported: six decimals, or ``none`` when nothing was proposed."""
    return "none" if rate is None else f"{rate:.6f}"


def trace_document(result: DecodeResult) -> list[list[Any]]:
    """The draft trace as JSON: [[proposed token ids...], accepted count] per step."""
    assert result.draft_trace is not None
    return [[list(proposed), accepted] for proposed, accepted in result.draft_trace]


def acceptance_numbers(result: DecodeResult) -> dict[str, Any]:
    """Acceptance counts and rates of one speculative decode, from its draft trace."""
    trace = result.draft_trace or []
    proposed = sum(len(step[0]) for step in trace)
    accepted = sum(step[1] for step in trace)
    drafting_steps = sum(1 for step in trace if step[0])
    return {
        "steps": len(trace),
        "drafting_steps": drafting_steps,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_per_step": accepted / drafting_steps if drafting_steps else None,
        "tokens_per_target_forward": (len(result.tokens) - 1) / len(trace) if trace else None,
        "generated_tokens_sha256": sha256_bytes(np.asarray(result.tokens, dtype="<u4").tobytes()),
        "draft_trace_sha256": canonical_sha256(trace_document(result)),
    }


def measure(engine: SpeculativeEngine, kvs: dict[str, KVCache], k: int) -> dict[str, Any]:
    """Speculative decode of every document at ``k`` proposals per step; per-document numbers
    and the pooled totals (sum accepted / sum proposed)."""
    engine.proposal_tokens = k
    documents: dict[str, Any] = {}
    for name, kv in kvs.items():
        prompt = assets.load_prompt(name)
        result = engine.decode(kv, prompt[HANDOFF:], OUTPUT_TOKENS)
        documents[name] = acceptance_numbers(result) | {"decode_seconds": round(result.seconds, 3)}
    proposed = sum(doc["proposed"] for doc in documents.values())
    accepted = sum(doc["accepted"] for doc in documents.values())
    steps = sum(doc["drafting_steps"] for doc in documents.values())
    return {
        "proposal_tokens": k,
        "documents": documents,
        "pooled": {
            "proposed": proposed,
            "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_per_step": accepted / steps if steps else None,
            "minimum_document_acceptance_rate": min(
                (doc["acceptance_rate"] for doc in documents.values() if doc["acceptance_rate"] is not None),
                default=None),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposal-tokens", type=int, default=DEFAULT_PROPOSAL_TOKENS)
    parser.add_argument("--sweep", default="", help="comma-separated extra k values (diagnostic)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--receipts", type=Path, default=None,
                        help="archive the measurement as a receipt here (the acceptance floor's basis)")
    args = parser.parse_args()
    sweep = [int(k) for k in args.sweep.split(",") if k.strip()]

    began = time.perf_counter()
    engine = build_speculative_engine(proposal_tokens=args.proposal_tokens)
    kvs: dict[str, KVCache] = {}
    prompts: dict[str, str] = {}
    for name in assets.PROMPT_NAMES:
        prompt = assets.load_prompt(name)
        prompts[name] = assets.prompt_sha256(prompt)
        kvs[name] = engine.prefill(prompt[:HANDOFF])
        print(f"prefilled {name} ({HANDOFF} positions)", file=sys.stderr, flush=True)

    lane = measure(engine, kvs, args.proposal_tokens)
    report: dict[str, Any] = {
        "schema": "trust-ladder.draft-acceptance.v1",
        "command": " ".join(["python", "bench/measure_draft.py", *sys.argv[1:]]),
        "engine": {"name": engine.name, "version": engine.version, "abi": engine.abi},
        "checkpoint_sha256": {
            f"model/gguf/{TARGET_GGUF_NAME}": sha256_file(assets.MODEL_DIR / "gguf" / TARGET_GGUF_NAME),
            f"model/gguf/{DRAFT_GGUF_NAME}": sha256_file(assets.MODEL_DIR / "gguf" / DRAFT_GGUF_NAME),
        },
        "prompt_sha256": prompts,
        "split": {"prefill_tokens": HANDOFF, "pending_tokens": 1, "output_tokens": OUTPUT_TOKENS,
                  "draft_context_positions": HANDOFF - 1},
        "definitions": {
            "acceptance_rate": "accepted drafted tokens / proposed drafted tokens",
            "mean_accepted_per_step": "accepted drafted tokens / steps that proposed at least one token",
            "tokens_per_target_forward":
                "(emitted tokens - 1) / verify steps (the first token comes from the pending feed)",
        },
        "lane": lane,
        "sweep": [measure(engine, kvs, k) for k in sweep if k != args.proposal_tokens],
        "host": {"python": platform.python_version(), "numpy": np.__version__,
                 "machine": platform.machine(), "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS")},
        "seconds": round(time.perf_counter() - began, 1),
    }
    text = json.dumps(report, indent=1, sort_keys=True) + "\n"
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    if args.receipts is not None:
        print(f"receipt: {archive_receipt(report, args.receipts)}", file=sys.stderr)
    print(f"draft_acceptance_rate: {rate_text(lane['pooled']['acceptance_rate'])}")
    return 0


def archive_receipt(report: dict[str, Any], archive: Path) -> Path:
    """Write the measurement as a receipt: the measured lane facts stand in the identity's place,
    one sample per document, and the summary states the pooled acceptance it measured."""
    from qualify.archive.writer import ReceiptWriter
    from qualify.judge import judge_draft_acceptance

    lane = report["lane"]
    facts = {key: report[key] for key in ("schema", "engine", "checkpoint_sha256", "prompt_sha256", "split")}
    facts["proposal_tokens"] = lane["proposal_tokens"]
    writer = ReceiptWriter(archive, command_line=report["command"].split(), identity=facts,
                           recipe="kquant-target-plus-dflash", lane="kquant-exact-dflash",
                           versions={"engine": report["engine"], "host": report["host"]})
    for name, document in sorted(lane["documents"].items()):
        writer.add_sample({"document": name, **document})
        writer.log(f"{name}: acceptance {rate_text(document['acceptance_rate'])}")
    for block in report["sweep"]:
        writer.log(f"sweep k={block['proposal_tokens']}: pooled acceptance "
                   f"{rate_text(block['pooled']['acceptance_rate'])}")
    return writer.finalize(judge_draft_acceptance(lane["documents"], proposal_tokens=lane["proposal_tokens"]))


if __name__ == "__main__":
    raise SystemExit(main())
