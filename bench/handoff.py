"""Handoff path benchmark: >= 256 MB of float32 KV sealed, sent, verified and installed.

A real producer process (``qualify.handoff.service``, started as
``qualify.interfaces.producer_command``, with this module's bench engine) seals a random KV of a
plausible geometry (default 16 layers x 8 KV heads x 2048 positions x 128 dims, float32:
256 MiB), sends it over the Unix socket, and this process verifies and installs it. In
the same run it times one ``hashlib.sha256`` pass and a plain memory copy over the same payload
bytes, right after each repeat (paired, so noise from a shared machine hits both), and prints
the per-phase breakdown and ratios. Last line: ``handoff_path_over_sha256: <median ratio>``.

    .venv/bin/python bench/handoff.py [--layers 16 --kv-heads 8 --head-dim 128 --positions 2048]

The path is everything but the engine's compute: producer serialize + digests + MAC, frame
wait, transfer, consumer MAC + manifest + digests + checks + install. Each side hashes each
payload byte once (one SHA-256 per tensor, over two threads, then the payload tree digest over
the header and the 32-byte tensor digests; see ``qualify.handoff.wire.payload_tree_sha256``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from qualify.contract.lanes import ProducerMode
from qualify.core.assets import prompt_sha256
from qualify.core.kv import KVCache, KVGeometry
from qualify.engines.base import DecodeResult, ModelGeometry
from qualify.handoff.wire import Handoff, OpenedHandoff

GEOMETRY_ENV = "BENCH_HANDOFF_GEOMETRY"
TARGET_RATIO = 1.5  # whole path / one SHA-256 pass
BENCH_CACHE_IDENTITY = hashlib.sha256(b"bench cache identity").hexdigest()
BENCH_IDENTITY = hashlib.sha256(b"bench identity").hexdigest()
BENCH_DIGESTS = {"bench.safetensors": hashlib.sha256(b"bench checkpoint").hexdigest()}


def bench_model_geometry(layers: int, kv_heads: int, head_dim: int, positions: int) -> ModelGeometry:
    """A Llama-like model geometry around the benchmarked KV shape (GQA 4:1)."""
    return ModelGeometry(layers=layers, hidden=kv_heads * 4 * head_dim, heads=kv_heads * 4,
                         kv_heads=kv_heads, head_dim=head_dim, vocab=32000,
                         max_positions=max(positions, 4096), rope_theta=500000.0)


class BenchEngine:
    """A producer engine whose prefill returns a pre-generated random KV (compute excluded)."""

    name = "bench-random-kv"
    version = "bench-1"
    abi = "bench-abi-1"
    logit_units = "raw"
    digests = BENCH_DIGESTS
    target_cache_identity_sha256 = BENCH_CACHE_IDENTITY

    def __init__(self, layers: int, kv_heads: int, head_dim: int, positions: int, mode: ProducerMode) -> None:
        self.geometry = bench_model_geometry(layers, kv_heads, head_dim, positions)
        self.producer_mode = mode
        self.positions = positions
        rng = np.random.default_rng(20251129)
        shape = (kv_heads, positions, head_dim)
        self.kv = KVCache(
            [rng.standard_normal(shape, dtype=np.float32) for _ in range(layers)],
            [rng.standard_normal(shape, dtype=np.float32) for _ in range(layers)],
        )

    def prefill(self, tokens: np.ndarray) -> KVCache:
        if len(tokens) == self.positions:
            return self.kv
        count = len(tokens)
        return KVCache([np.ascontiguousarray(k[:, :count]) for k in self.kv.keys],
                       [np.ascontiguousarray(v[:, :count]) for v in self.kv.values])

    def decode(self, kv: KVCache, pending: np.ndarray, n: int) -> DecodeResult:  # pragma: no cover
        raise NotImplementedError

    def teacher_forced(self, kv: KVCache, pending: np.ndarray, forced: np.ndarray) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError


def build_bench_engine(lane: str, mode: ProducerMode) -> BenchEngine:
    """Engine factory for the producer process; the geometry travels in the environment."""
    layers, kv_heads, head_dim, positions = (int(x) for x in os.environ[GEOMETRY_ENV].split(","))
    return BenchEngine(layers, kv_heads, head_dim, positions, mode)


def hash_split_over_two_threads(views: list[memoryview]) -> None:
    """SHA-256 of every tensor, the tensors shared between two threads (GIL released).

    A plain reference for what one side's digest phase costs at best, next to the measured one.
    """
    halves = (views[0::2], views[1::2])
    helper = threading.Thread(target=lambda: [hashlib.sha256(v).digest() for v in halves[1]])
    helper.start()
    for view in halves[0]:
        hashlib.sha256(view).digest()
    helper.join()


def best_of(repeats: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def measure_repeat(handoff: Handoff, opened: OpenedHandoff) -> dict[str, Any]:
    """Phases of one handoff, then the baselines over the same payload bytes (paired)."""
    transport, manifest, verify = handoff.transport, opened.manifest, opened.timings
    assert transport is not None
    payload = memoryview(handoff.payload_bytes)
    sha_s = best_of(2, lambda: hashlib.sha256(payload).digest())
    fresh_copy_s = best_of(2, lambda: bytearray(payload))
    target = np.empty(payload.nbytes, dtype=np.uint8)
    source = np.frombuffer(payload, dtype=np.uint8)
    warm_copy_s = best_of(2, lambda: np.copyto(target, source))
    layer_views = [a.reshape(-1).view(np.uint8).data
                   for a in opened.kv.keys + opened.kv.values]
    seam_split_s = best_of(2, lambda: hash_split_over_two_threads(layer_views))
    seal_s = transport.producer_seal_s or (manifest.serialize_s + manifest.digest_s)
    compute_s = transport.producer_compute_s or manifest.compute_s
    wait_s = max(transport.request_s - compute_s - seal_s - transport.transfer_s, 0.0)
    phases = {
        "producer serialize (header, zero-copy)": manifest.serialize_s,
        "producer digests (tensor SHA-256s, 2 threads; tree)": manifest.digest_s,
        "producer schema + MAC": max(seal_s - manifest.serialize_s - manifest.digest_s, 0.0),
        "request + frame latency": wait_s,
        "transfer (Unix socket, into one buffer)": transport.transfer_s,
        "consumer MAC": verify.mac_s,
        "consumer manifest (canonical + schema)": verify.manifest_s,
        "consumer digests (tensor SHA-256s, 2 threads; tree)": verify.digest_s,
        "consumer checks": verify.checks_s,
        "consumer install (zero-copy views)": verify.install_s,
    }
    path_s = sum(phases.values())
    return dict(phases=phases, path_s=path_s, sha_s=sha_s, fresh_copy_s=fresh_copy_s,
                warm_copy_s=warm_copy_s, bytes=payload.nbytes, gbit=transport.gbit_per_s,
                ratio=path_s / sha_s, split_s=seam_split_s,
                floor_s=2 * seam_split_s + transport.transfer_s)


def main(argv: list[str] | None = None) -> int:
    from qualify.handoff.client import ProducerProcess
    from qualify.handoff.protocol import ProducerExpectation
    from qualify.handoff.wire import HandoffExpectation, mint_run_key, open_handoff

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    model = bench_model_geometry(args.layers, args.kv_heads, args.head_dim, args.positions)
    kv_geometry = KVGeometry(args.layers, args.kv_heads, args.head_dim, args.positions, "float32")
    payload_mb = 2 * args.layers * args.kv_heads * args.positions * args.head_dim * 4 / 1e6
    if payload_mb < 256:
        print(f"note: payload {payload_mb:.0f} MB is below the 256 MB the benchmark is specified for")
    key = mint_run_key()
    tokens = np.arange(args.positions, dtype=np.int64) % model.vocab
    expectation = ProducerExpectation(engine_version="bench-1", geometry=model,
                                      identity_sha256=BENCH_IDENTITY, digests=BENCH_DIGESTS)
    env = {GEOMETRY_ENV: f"{args.layers},{args.kv_heads},{args.head_dim},{args.positions}"}
    print(f"handoff bench: KV {args.layers} layers x {args.kv_heads} kv heads x {args.positions} "
          f"positions x {args.head_dim} dims float32, {len(os.sched_getaffinity(0))} CPUs usable")
    rows = []
    with ProducerProcess(lane="bench", mode=ProducerMode.EXACT, key=key, run_id="bench",
                         expectation=expectation, engine_factory="bench.handoff:build_bench_engine",
                         env=env, watchdog_s=300.0) as producer:
        for repeat in range(args.repeats):
            request_id = f"bench-{repeat}"
            handoff = producer.request_prefill(tokens, request_id)
            opened = open_handoff(handoff, key=key, expectation=HandoffExpectation(
                identity_sha256=BENCH_IDENTITY, cache_identity=BENCH_CACHE_IDENTITY, geometry=kv_geometry,
                prompt_sha256=prompt_sha256(tokens), run_id="bench", request_id=request_id,
                lane="bench", producer_mode=ProducerMode.EXACT,
            ))
            rows.append(measure_repeat(handoff, opened))
            row = rows[-1]
            print(f"  repeat {repeat}: path {row['path_s']:.3f} s, sha256 {row['sha_s']:.3f} s, "
                  f"ratio {row['ratio']:.2f}, transfer {row['gbit']:.1f} Gbit/s")
            del handoff, opened
            gc.collect()

    median = sorted(rows, key=lambda row: row["ratio"])[len(rows) // 2]
    size = median["bytes"]
    sha_s = median["sha_s"]
    print(f"\npayload {size / 1e6:.1f} MB ({size / 2**20:.1f} MiB); median repeat by ratio:")
    print(f"  {'phase':<50} {'seconds':>9} {'x sha256':>9}")
    for name, seconds in median["phases"].items():
        print(f"  {name:<50} {seconds:9.4f} {seconds / sha_s:9.2f}")
    print(f"  {'whole path':<50} {median['path_s']:9.4f} {median['path_s'] / sha_s:9.2f}")
    print("baselines over the same bytes:")
    print(f"  one hashlib.sha256 pass        {sha_s:.4f} s  ({size / sha_s / 1e9:.2f} GB/s)")
    print(f"  memory copy into a new buffer  {median['fresh_copy_s']:.4f} s  "
          f"({size / median['fresh_copy_s'] / 1e9:.2f} GB/s)")
    print(f"  memory copy into a warm buffer {median['warm_copy_s']:.4f} s  "
          f"({size / median['warm_copy_s'] / 1e9:.2f} GB/s)")
    print("ratios:")
    all_ratios = ", ".join(f"{row['ratio']:.2f}" for row in rows)
    print(f"  path / sha256           {median['path_s'] / sha_s:.2f}  (all repeats: {all_ratios})")
    print(f"  path / copy (new)       {median['path_s'] / median['fresh_copy_s']:.2f}")
    print(f"  transfer rate           {median['gbit']:.1f} Gbit/s")
    print(f"  tensor SHA-256s over 2 threads {median['split_s']:.4f} s  "
          f"({median['split_s'] / sha_s:.2f} x one pass)")
    print("floor: the contract hashes every byte once on each side (tensor SHA-256s, the tree "
          "over their digests), 2 SHA passes of CPU; split over 2 threads per side, plus the "
          f"transfer: ~ {median['floor_s']:.3f} s = {median['floor_s'] / sha_s:.2f} x sha256")
    ratio = statistics.median(row["ratio"] for row in rows)
    print(f"target: path / sha256 <= {TARGET_RATIO:.2f}: "
          f"{'met' if ratio <= TARGET_RATIO else 'NOT met'}")
    print(f"handoff_path_over_sha256: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
