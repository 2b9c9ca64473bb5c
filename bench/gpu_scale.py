"""Qualification at scale: the native-text recipe on a Llama-3-8B-shaped model on one GPU, through
the harness's one orchestrator (:class:`qualify.run.qualification.QualificationRun`).

The lane is ``llama3-8b-shape-pd`` (``qualify.contract.lanes``): random bf16 weights of Llama-3 8B's
shape (``model/llama3-8b-shape/config.json``: 32 layers, hidden 4096, 32/8 heads, vocab 128256,
seed-drawn on the GPU), a prefill/decode split of the compact CUDA-graph engine
(:mod:`qualify.engines.torch_llama`), sealed in ``contracts/llama3-8b-shape-pd-identity-v1.json``
with its basis receipt like every other lane. This script only plugs two things into the run:

* an in-process **transport**: the producer engine prefills on the GPU; its 64 K/V tensors are
  gathered into a device staging buffer laid out by :func:`qualify.handoff.wire.payload_layout`,
  copied once into a pinned host buffer that is the safetensors payload, and sealed there in place
  (:func:`qualify.handoff.wire.seal_handoff_parts`, 16 hashing threads). Before it is made the
  producer engine's known-answer digest is checked against the identity's, as a producer process
  checks its own before it is ready (the consumer's is checked at 'identity sealed', by the run);
* the **device comparer** (:class:`qualify.evidence.comparers.DeviceComparer`): the consumer
  installs the verified bytes, decodes on the GPU and compares every full logit row there.

Everything else (contract, handoff verification, records, judge, receipt) is the run's. Timing,
all in the same run: engine time is every engine call timed with CUDA events (producer prefills,
consumer decodes, the reference prefill and decode, teacher-forced decodes); the qualification
wall runs from the first step to the receipt written, excluding CUDA context, weights and warm-up
(reported beside it); the overhead ratio is wall / engine.

    python bench/gpu_scale.py [--receipts DIR] [--json PATH]      # a qualification (GPU)
    python bench/gpu_scale.py --calibrate                         # the lane's basis receipt
    python bench/gpu_scale.py --fault kv-ulp|block-order          # must fail, localised

Last line: ``gpu_scale_overhead_ratio: <wall / engine>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np

# The modules the run loads lazily (identity model and schema, receipt writer, device comparison)
# are loaded here, with the script: module loading is setup, like the CUDA context, not the run.
import qualify.archive.reader
import qualify.archive.writer
import qualify.contract.identity
import qualify.engines.torch_llama
import qualify.evidence.compare_device  # noqa: F401
from qualify.contract.lanes import LLAMA3_8B_SHAPE_LANE, Recipe, lane_spec
from qualify.core.assets import prompt_sha256
from qualify.core.errors import Refused, one_line
from qualify.evidence.compare_device import DeviceClock
from qualify.evidence.comparers import ComparerSetup, DeviceComparer
from qualify.handoff.setup import TransportSetup
from qualify.handoff.transport import InProcessTransport
from qualify.run.calibrate import calibrate
from qualify.run.qualification import QualificationRun, RunOptions
from qualify.run.run_contract import identity_path_for_lane

KV_HASH_THREADS = max(2, min(16, os.cpu_count() or 2))
COPY_BYTES = 2 << 30  # device-to-device copy bandwidth probe


# --------------------------------------------------------------------------- the transport


class DeviceProducer:
    """The lane's producer engine on the GPU, as an in-process producer
    (:class:`qualify.handoff.transport.InProcessProducer`): it prefills, gathers its 64 K/V tensors
    into a device staging buffer laid out like the payload and copies that once into a pinned host
    buffer whose tensors the transport then seals in place. Buffers are allocated once."""

    def __init__(self, producer: Any, fault: str | None, positions: int) -> None:
        self.producer, self.fault = producer, fault
        self.clock = DeviceClock("cuda")
        self.prefill_seconds: list[float] = []
        self.gather_seconds: list[float] = []
        self._buffers: tuple[Any, ...] | None = None
        # Pinning the payload's host memory takes a noticeable fraction of a second: it runs on a
        # thread while the consumer's reference decode occupies the GPU, and the first handoff
        # waits for it.
        self._allocation = ThreadPoolExecutor(1).submit(self._allocate, positions)

    def _allocate(self, positions: int) -> tuple[Any, ...]:
        import torch

        from qualify.core.kv import KVCache
        from qualify.handoff.wire import payload_layout

        geometry = self.producer.geometry.kv_geometry(positions, "bfloat16")
        layout = payload_layout(geometry)
        payload_tensor = torch.empty(layout.size, dtype=torch.uint8, pin_memory=True)
        payload = payload_tensor.numpy()
        payload[:len(layout.prefix)] = np.frombuffer(layout.prefix, dtype=np.uint8)
        start = len(layout.prefix)
        shape = (geometry.kv_heads, positions, geometry.head_dim)
        # The producer's KV as the wire sees it: views of the pinned payload (sealed in place).
        host = {name: payload[begin:end].view(np.dtype("bfloat16")).reshape(shape)
                for name, (begin, end) in layout.offsets.items()}
        host_kv = KVCache([host[f"layers.{i}.k"] for i in range(geometry.layers)],
                          [host[f"layers.{i}.v"] for i in range(geometry.layers)])
        staging = torch.empty(layout.size - start, dtype=torch.uint8, device="cuda")
        staged = {name: staging[begin - start:end - start].view(torch.bfloat16).view(shape)
                  for name, (begin, end) in layout.offsets.items()}
        return payload, payload_tensor[start:], host_kv, staging, staged

    def produce(self, prompt: np.ndarray, request_id: str) -> Any:
        import torch

        from qualify.handoff.transport import ProducedKV

        if self._buffers is None:
            self._buffers = self._allocation.result()
        payload, payload_data, host_kv, staging, staged = self._buffers
        engine = self.producer.engine
        started = self.clock.start()
        engine.prefill_device(torch.from_numpy(np.ascontiguousarray(prompt)).to("cuda"))
        compute_s = self.clock.stop(started)()  # waits for the prefill: the copy times only itself
        self.prefill_seconds.append(compute_s)
        keys, values = engine.kv_device()
        if self.fault is not None:
            keys, values, _ = apply_fault(self.fault, keys, values)
        began = time.perf_counter()
        for index in range(len(keys)):
            staged[f"layers.{index}.k"].copy_(keys[index])
            staged[f"layers.{index}.v"].copy_(values[index])
        payload_data.copy_(staging, non_blocking=True)
        torch.cuda.synchronize()
        transfer_s = time.perf_counter() - began
        self.gather_seconds.append(transfer_s)
        return ProducedKV(host_kv, payload, compute_s, transfer_s)


def warm_up(consumer: Any, producer: Any) -> None:
    """First calls outside the wall, as any engine's warm-up: both engines' kernels, the decode
    graph, the comparison's kernels (lazy CUDA module loading), and the wire's schemas."""
    import torch

    from qualify.contract.lanes import ProducerMode
    from qualify.core.kv import KVCache, KVGeometry
    from qualify.evidence.compare_device import DeviceBranch, compare_branches_device
    from qualify.handoff.transport import InProcessTransport, PrefillProducer
    from qualify.handoff.wire import HandoffExpectation, mint_run_key, open_handoff

    device_consumer = consumer.engine
    warm = torch.arange(2048, device="cuda") % device_consumer.shape.vocab
    producer.engine.prefill_device(warm[:2047])
    device_consumer.prefill_device(warm[:2047])
    device_consumer.warm_up()
    run = device_consumer.decode_device(warm[2047:], 4)
    branch = DeviceBranch(run.tokens.clone(), run.logits.clone())
    kv = device_consumer.kv_device()
    compare_branches_device(branch, branch, "raw", maximum_absolute=1.0, maximum_mean_absolute=1.0,
                            teacher_forced_logits=branch.logits, handoff_kv=kv, own_kv=kv)

    class Tiny:
        def prefill(self, tokens: np.ndarray) -> KVCache:
            return KVCache([np.zeros((1, len(tokens), 2), np.float32)], [np.zeros((1, len(tokens), 2), np.float32)])

    key, digest = mint_run_key(), "a" * 64
    with InProcessTransport(PrefillProducer(Tiny()), key=key, identity_sha256=digest, cache_identity=digest,
                            mode=ProducerMode.NATIVE, lane="warm-up", run_id="warm-up") as transport:
        handoff = transport.request_prefill(np.arange(3), "warm-up")
    open_handoff(handoff, key, HandoffExpectation(digest, digest, KVGeometry(1, 1, 2, 3, "float32"),
                                                  prompt_sha256(np.arange(3)), "warm-up", "warm-up",
                                                  lane="warm-up", producer_mode=ProducerMode.NATIVE))
    torch.cuda.synchronize()


# --------------------------------------------------------------------------- producer faults

SCALE_FAULTS = ("kv-ulp", "block-order")
"""Producer-side faults (``--fault``), as in :mod:`qualify.engines.faults`, applied to the producer's KV on
the device after its prefill and before sealing: the MAC verifies, so only the comparison can
catch them."""


def fault_site(layers: int, positions: int) -> tuple[int, int, int, int]:
    """(layer, head, position, dim) of the single-element fault: qualify.engines.faults' site, clamped."""
    from qualify.engines.faults import FAULT_DIM, FAULT_HEAD, FAULT_LAYER, FAULT_POSITION

    return min(FAULT_LAYER, layers - 1), FAULT_HEAD, min(FAULT_POSITION, positions - 1), FAULT_DIM


def apply_fault(name: str, keys: list[Any], values: list[Any]) -> tuple[list[Any], list[Any], str]:
    """The producer's KV with fault ``name`` applied (copies of the touched tensors), and where."""
    import torch

    from qualify.engines.faults import BLOCK_POSITIONS, SWAPPED_BLOCKS

    keys = list(keys)
    if name == "kv-ulp":
        layer, head, position, dim = fault_site(len(keys), keys[0].shape[1])
        keys[layer] = keys[layer].clone()
        bits = keys[layer].view({2: torch.int16, 4: torch.int32}[keys[layer].element_size()])
        bits[head, position, dim] += 1  # the next representable magnitude: one ULP
        return keys, values, f"layer {layer} K head {head} position {position} dim {dim} moved by one ULP"
    if name == "block-order":
        first, second = (block * BLOCK_POSITIONS for block in SWAPPED_BLOCKS)
        if keys[0].shape[1] < second + BLOCK_POSITIONS:
            raise Refused(f"--fault block-order: needs {second + BLOCK_POSITIONS} handed-off positions")
        for index, key in enumerate(keys):
            swapped = key.clone()
            swapped[:, first:first + BLOCK_POSITIONS] = key[:, second:second + BLOCK_POSITIONS]
            swapped[:, second:second + BLOCK_POSITIONS] = key[:, first:first + BLOCK_POSITIONS]
            keys[index] = swapped
        return keys, values, f"K positions {first}..{second + BLOCK_POSITIONS - 1}: blocks {SWAPPED_BLOCKS} swapped, V kept"
    raise Refused(f"--fault: found {name!r}, expected one of {', '.join(SCALE_FAULTS)}")



def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device-to-device copy GB/s, counting bytes read plus bytes written (best of 10)."""
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    clock, best = DeviceClock(device), math.inf
    for _ in range(11):  # the first is a warm-up
        started = clock.start()
        target.copy_(source)
        best = min(best, clock.stop(started)())
    return 2 * nbytes / best / 1e9


def sha256_rate(data: np.ndarray) -> float:
    """Single-thread hashlib.sha256 GB/s over ``data`` (best of 3)."""
    best = math.inf
    for _ in range(3):
        began = time.perf_counter()
        hashlib.sha256(memoryview(data)).digest()
        best = min(best, time.perf_counter() - began)
    return data.nbytes / best / 1e9



def prefill_differences(consumer: Any, producer: Any) -> list[dict[str, Any]]:
    """Prefill the recipe prompt's 2047 positions on both engines and compare their K/V bit for
    bit: per layer and tensor that differ, the first and last differing position and how many."""
    import torch

    from qualify.core.assets import load_prompt

    prompt = torch.from_numpy(load_prompt()[:2047]).to("cuda")
    producer.engine.prefill_device(prompt)
    consumer.engine.prefill_device(prompt)
    (produced_keys, produced_values), (own_keys, own_values) = producer.engine.kv_device(), consumer.engine.kv_device()
    differing = []
    for layer in range(len(own_keys)):
        for name, mine, theirs in (("K", produced_keys[layer], own_keys[layer]),
                                   ("V", produced_values[layer], own_values[layer])):
            positions = (mine != theirs).any(dim=2).any(dim=0).nonzero().flatten().tolist()
            if positions:
                differing.append({"layer": layer, "tensor": name, "positions": [positions[0], positions[-1]],
                                  "count": len(positions)})
    return differing


# --------------------------------------------------------------------------- the run


def run(options: argparse.Namespace) -> dict[str, Any]:
    import torch

    from qualify.engines.factory import build_consumer, build_producer
    from qualify.engines.kat import check_known_answer

    if options.calibrate and options.fault is not None:
        raise Refused("--fault: a calibration measures a lane as it is; run the fault without --calibrate")
    if not torch.cuda.is_available():
        raise Refused(f"lane {LLAMA3_8B_SHAPE_LANE}: torch sees no CUDA device (the lane runs on one GPU)")
    total_began = time.perf_counter()
    # ---- one-time setup, outside the qualification wall (reported beside it) ----------------
    began = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context
    cuda_init_s = time.perf_counter() - began
    began = time.perf_counter()
    consumer = build_consumer(lane_spec(LLAMA3_8B_SHAPE_LANE))  # draws the weights (shared with the producer)
    producer = build_producer(LLAMA3_8B_SHAPE_LANE, consumer.spec.mode)
    torch.cuda.synchronize()
    weights_s = time.perf_counter() - began
    began = time.perf_counter()
    device_consumer = consumer.engine
    warm_up(consumer, producer)
    warmup_s = time.perf_counter() - began

    producers: list[DeviceProducer] = []
    comparers: list[DeviceComparer] = []

    def transport(setup: TransportSetup) -> InProcessTransport:
        if setup.expectation.engine_kat_sha256 is not None:
            # Before the producer is ready, as the producer process checks its own
            # (qualify.handoff.service.serve): the honest engine's known answer on this GPU (a
            # --fault is injected into its handoffs, not its arithmetic); exit 2 at 'producer ready'.
            check_known_answer(producer, setup.expectation.engine_kat_sha256, "producer")
        producers.append(DeviceProducer(producer, options.fault, setup.handed_off_positions))
        return InProcessTransport(
            producers[-1], key=setup.key, identity_sha256=setup.expectation.identity_sha256,
            cache_identity=producer.target_cache_identity_sha256, mode=producer.mode, lane=setup.lane,
            run_id=setup.run_id, digest_threads=KV_HASH_THREADS)

    def comparer(setup: ComparerSetup) -> DeviceComparer:
        comparers.append(DeviceComparer(setup, device_consumer, "cuda"))
        return comparers[-1]

    archive = Path(options.receipts) if options.receipts else Path(tempfile.mkdtemp(prefix="gpu-scale-receipts-"))
    run_options = RunOptions(
        recipe=Recipe.NATIVE_TEXT.value, identity=identity_path_for_lane(LLAMA3_8B_SHAPE_LANE),
        receipts=archive, reference_once=True, drift_graded=True,
        command_line=["python", "bench/gpu_scale.py", *sys.argv[1:]], digest_threads=KV_HASH_THREADS)
    # ---- the qualification wall: from the first step to the receipt written -------------------
    wall_began = time.perf_counter()
    if options.calibrate:
        calibration = calibrate(lane_spec(LLAMA3_8B_SHAPE_LANE), Recipe.NATIVE_TEXT.value, run_options,
                                transport=transport, comparer=comparer, environments=[{}], consumer=consumer)
        passed, headline, receipt_path = calibration.passed, calibration.headline, calibration.receipt_path
        records = calibration.records
        proposed = [calibration.proposed_maximum_absolute, calibration.proposed_maximum_mean_absolute]
    else:
        qualification = QualificationRun(run_options, transport=transport, comparer=comparer, consumer=consumer)
        try:
            outcomes = qualification.run_all()
        finally:
            qualification.close()
        if qualification.refused:
            raise Refused(next(f"{o.label}: {o.message}" for o in outcomes if o.refused))
        verdict = qualification.verdict
        passed, headline = (verdict.passed, verdict.headline) if verdict is not None else (False, "no verdict")
        receipt_path, records = qualification.receipt_path, qualification.records
        proposed = [None, None]
    wall_end = time.perf_counter()
    prefill_recheck = prefill_differences(consumer, producer) if options.recheck_prefill else None

    # ---- baselines measured in the same run, after the wall -----------------------------------
    d2d_gbs = copy_bandwidth("cuda", COPY_BYTES)
    payload_bytes = next((r["payload_bytes"] for r in records if r.get("payload_bytes")), 0)
    sha_gbs = sha256_rate(np.zeros(max(payload_bytes, 1 << 20), dtype=np.uint8))
    engine: dict[str, list[float]] = {"producer prefill": [s for p in producers for s in p.prefill_seconds]}
    for device_comparer in comparers:
        for name, values in device_comparer.engine_seconds.items():
            engine.setdefault(name, []).extend(values)
    measured = [record for record in records if not record.get("error")]
    harness: dict[str, list[float]] = {
        "transport (gather, device to pinned host)": [s for p in producers for s in p.gather_seconds],
        "seal (hash, tree, manifest, MAC)": [record["serialize_s"] for record in measured],
        "verify (MAC, manifest, re-hash)": [record["verify_s"] for record in measured],
        "install (host to device, into the cache, finiteness)": [record["install_s"] for record in measured],
    }
    engine_s = sum(sum(values) for values in engine.values())
    wall_s = wall_end - wall_began
    return {
        "lane": LLAMA3_8B_SHAPE_LANE, "device": torch.cuda.get_device_name(0),
        "producer": {"name": producer.name, "abi": producer.abi}, "consumer": {"name": consumer.name, "abi": consumer.abi},
        "mode": "calibration" if options.calibrate else "qualification", "fault": options.fault,
        "engine_seconds": {name: values for name, values in engine.items() if values}, "engine_total_s": engine_s,
        "harness_seconds": harness, "setup_cuda_init_s": cuda_init_s, "setup_weights_s": weights_s,
        "setup_warmup_s": warmup_s, "qualification_wall_s": wall_s, "total_wall_s": wall_end - total_began,
        "overhead_ratio": wall_s / engine_s if engine_s > 0 else math.nan,
        "overhead_ratio_with_setup": (wall_end - total_began) / engine_s if engine_s > 0 else math.nan,
        "d2d_copy_gbs_read_plus_write": d2d_gbs, "kv_payload_bytes": payload_bytes,
        "kv_seal_gbs": [payload_bytes / s / 1e9 if s > 0 else math.nan
                        for s in harness.get("seal (hash, tree, manifest, MAC)", [])],
        "sha256_single_thread_gbs": sha_gbs, "kv_hash_threads": KV_HASH_THREADS,
        "compare_gbs_logit_bytes_read": [
            c.last_timings.get("logit_pass_bytes", 0.0) / max(c.last_timings.get("logit_pass_s", 1e-9), 1e-9) / 1e9
            for c in comparers],
        "verdict": {"passed": passed, "headline": headline},
        "calibration_proposed_bounds": proposed,
        "prefill_recheck": prefill_recheck,
        "samples": [{key: record.get(key) for key in ("repetition", "token_agreement_rate", "max_abs", "mean_abs",
                                                       "payload_sha256", "error", "localisation")} for record in records],
        "receipt": str(receipt_path),
    }


# --------------------------------------------------------------------------- output


def print_report(values: dict[str, Any]) -> None:
    print(f"gpu_scale: lane {values['lane']} on {values['device']}, {values['mode']}; producer "
          f"{values['producer']['abi']}, consumer {values['consumer']['abi']}")
    if values["fault"] is not None:
        print(f"producer fault: {values['fault']} (the run must fail, localised)")
    print(f"{'engine (CUDA events around the engine call)':58s} {'total s':>9s}  per call")
    for name, seconds in values["engine_seconds"].items():
        print(f"  {name:56s} {sum(seconds):9.3f}  {' '.join(f'{s:.3f}' for s in seconds)}")
    print(f"  {'engine total':56s} {values['engine_total_s']:9.3f}")
    for name, seconds in values["harness_seconds"].items():
        print(f"  {name:56s} {sum(seconds):9.3f}  {' '.join(f'{s:.4f}' for s in seconds)}")
    print(f"one-time setup outside the wall: CUDA context {values['setup_cuda_init_s']:.3f} s, weights "
          f"{values['setup_weights_s']:.3f} s, warm-up {values['setup_warmup_s']:.3f} s")
    print(f"qualification wall (first step to receipt written): {values['qualification_wall_s']:.3f} s; "
          f"with setup {values['total_wall_s']:.3f} s")
    print(f"device-to-device copy {values['d2d_copy_gbs_read_plus_write']:.1f} GB/s (read + write); full-logit "
          f"compare {' '.join(f'{r:.1f}' for r in values['compare_gbs_logit_bytes_read'])} GB/s of logit bytes read")
    print(f"KV payload {values['kv_payload_bytes']} bytes: seal {' '.join(f'{r:.2f}' for r in values['kv_seal_gbs'])}"
          f" GB/s on {values['kv_hash_threads']} threads; single-thread sha256 {values['sha256_single_thread_gbs']:.2f} GB/s")
    for sample in values["samples"]:
        print(f"  sample {sample['repetition']}: " + (f"FAILED {sample['error']}" if sample.get("error") else
              f"tokens agreed {sample['token_agreement_rate']}, max abs {sample['max_abs']!r}, "
              f"mean abs {sample['mean_abs']!r}, payload {str(sample['payload_sha256'])[:16]}"))
        over = (sample.get("localisation") or {}).get("kv_over_envelope") or []
        if over:
            print("    KV above envelope: " + ", ".join(f"layer {item['layer']} {item['tensor']} position "
                                                     f"{item.get('position')}" for item in over[:3]))
    if values["prefill_recheck"] is not None:
        print("prefill recheck after the run: " + ("producer and consumer prefill KV equal"
              if not values["prefill_recheck"] else f"differ: {values['prefill_recheck'][:4]}"))
    print(f"verdict: {values['verdict']['headline']}")
    print(f"receipt: {values['receipt']}")
    print(f"overhead ratio wall / engine: {values['overhead_ratio']:.3f} (with setup {values['overhead_ratio_with_setup']:.3f})")
    print(f"gpu_scale_overhead_ratio: {values['overhead_ratio']:.3f}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receipts", type=Path, default=None, help="receipt archive (default: a new temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here as JSON")
    parser.add_argument("--calibrate", action="store_true", help="measure the lane: its basis receipt")
    parser.add_argument("--fault", choices=SCALE_FAULTS,
                        help="corrupt the producer's KV before sealing (the run must fail, localised)")
    parser.add_argument("--recheck-prefill", action="store_true",
                        help="after the run, prefill the prompt on both engines again and compare their KV bit for bit")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    try:
        values = run(options)
    except Refused as exc:
        print(f"gpu_scale: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:  # a GPU error, out of memory...: one line, no traceback
        print(f"gpu_scale: failed: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return 1
    if options.json is not None:
        options.json.write_text(json.dumps(values, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    print_report(values)
    return 0 if values["verdict"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
