"""Measure every native lane of a kind against its consumer on every held-out document.

``--kind nvfp4`` (default): every NVFP4 native variant against the exact consumer.
``--kind transformers`` (on the GPU machine): the CUDA fp32/TF32/bf16 producers against the CPU
reference consumer.

For each (lane, document): the producer prefills ``prompt[:2047]``, the consumer
decodes 256 greedy tokens from that KV and from its own cold prefill. Reports per-layer K and V
max abs deltas, 256-token agreement and the first divergence, the cold run's top-1/top-2 margin
there, and teacher-forced logit drift (max and mean). In-process, no transport: this measures
numerics only. Writes the table as JSON to ``--out`` when given.

Usage: python bench/native_lanes.py [--kind nvfp4|transformers] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

from qualify.contract.lanes import LANES, LaneKind, ProducerMode, lane_spec
from qualify.core import assets
from qualify.engines.factory import build_consumer, build_producer
from qualify.evidence.compare import compare_branches
from qualify.run.run_contract import comparison_bounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the measurements as JSON here")
    parser.add_argument("--kind", choices=["nvfp4", "transformers"], default="nvfp4")
    args = parser.parse_args()
    kind = LaneKind(args.kind)
    lanes = [spec.name for spec in LANES.values() if spec.kind is kind and spec.mode is ProducerMode.NATIVE]
    consumer = build_consumer(lane_spec(lanes[0]))
    rows = []
    for document in assets.PROMPT_NAMES:
        prompt = assets.load_prompt(document)
        prefix, pending = prompt[:-1], prompt[-1:]
        cold_kv = consumer.prefill(prefix)
        cold = consumer.decode(cold_kv, pending, 256)
        for lane in lanes:
            producer = build_producer(lane, "native")
            started = time.perf_counter()
            kv = producer.prefill(prefix)
            handoff = consumer.decode(kv, pending, 256)
            forced = consumer.teacher_forced(kv, pending, cold.tokens)
            unbounded, _ = comparison_bounds(None)
            comparison = compare_branches(handoff, cold, "raw", maximum_absolute=unbounded,
                                          maximum_mean_absolute=unbounded, teacher_forced_logits=forced,
                                          handoff_kv=(kv.keys, kv.values),
                                          own_kv=(cold_kv.keys, cold_kv.values))
            row = {
                "document": document, "lane": lane,
                "tokens_agreed": int(round(comparison.token_agreement_rate * 256)),
                "first_divergence": comparison.first_divergence,
                "cold_margin_at_divergence": comparison.cold_margin_at_divergence,
                "divergence_class": comparison.divergence_class,
                "teacher_forced_max_abs": comparison.teacher_forced.max_abs,
                "teacher_forced_mean_abs": comparison.teacher_forced.mean_abs,
                "teacher_forced_top1_flips": comparison.teacher_forced.top1_flips,
                "kv_max_abs": [(item.layer, item.k, item.v) for item in comparison.kv.layers],
                "seconds": round(time.perf_counter() - started, 2),
            }
            rows.append(row)
            kv_text = " ".join(f"L{layer}:{k:.4g}/{v:.4g}" for layer, k, v in row["kv_max_abs"])
            margin = row["cold_margin_at_divergence"]
            print(f"{document:26s} {lane:24s} tokens {row['tokens_agreed']:3d}/256 "
                  f"first-div {row['first_divergence']} margin {margin if margin is None else round(margin, 4)} "
                  f"({row['divergence_class']}) tf max {row['teacher_forced_max_abs']:.4g} "
                  f"mean {row['teacher_forced_mean_abs']:.4g} flips {row['teacher_forced_top1_flips']} "
                  f"KV(K/V) {kv_text}", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)
    exact = sum(1 for row in rows if row["tokens_agreed"] == 256)
    headline = "native_variant_documents_exact" if kind is LaneKind.NVFP4 else "transformers_lane_documents_exact"
    print(f"{headline}: {exact}/{len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
