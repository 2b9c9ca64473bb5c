"""Long-context E2 controls at the 8B shape on one GPU: 3 documents x nested lengths 2048..32768, 256
decoded tokens per cell; prints every cell and the wall time of the whole grid.

Lane and reference are those of ``llama3-8b-shape-pd`` (``contracts/llama3-8b-shape-pd-identity-v1.json``):
the producer is the torch-llama engine in eager mode, the consumer the same engine with its
CUDA-graph decode, on the random bf16 weights of Llama-3 8B's shape that
``model/llama3-8b-shape/config.json`` draws on the GPU from its seed (the pd lane's weights; only
``max_position_embeddings`` is raised to the longest length plus the decode; RoPE stays theta
500000 unscaled, Llama 3.1's long-context scaling is not modelled). Per document, one pass per KV
source serves every length (the criteria's nesting rule, ``contracts/e2-controls-v2.json``):

* lane: the producer prefills the document's first max(lengths) tokens; that KV is the handoff;
* reference: an engine identical to the consumer prefills the same tokens (its own cold KV);
* rows: the consumer scores every row teacher-forced from each KV
  (:mod:`qualify.evidence.controls_device`); a cell of length L counts the rows 0..L-1 whose top
  tokens differ (:func:`qualify.evidence.controls_measure.disagreement_cells`);
* decode: per cell the consumer decodes ``--decode`` tokens after the first L tokens (positions
  0..L-2 handed off, token L-1 pending): greedily from the reference KV, teacher-forced on those
  tokens from the lane's KV; a step disagrees where the two top tokens differ.

No E1 yardstick exists at this shape (no second quantization of these weights), so the cells are
figures, not gated. Documents: ``bench/documents`` (``tools/build_long_documents.py``), token
digests checked. ``--fault kv-layer`` scales the V of the producer's middle layer by 1.25 in the
handoff: the measure must then disagree. Timing: the grid wall runs from the first pass to the
last cell, device synchronized; setup (CUDA context, weights, warm-up, graph capture) is printed
beside it. Writes ``<out>/e2-grid.json``. Last line: ``e2_grid_wall_s: <seconds>``.

Usage: python bench/gpu_e2_grid.py [--out DIR] [--lengths 2048,...] [--decode 256] [--chunk 2048]
       [--profile-window 2048] [--fault kv-layer] [--model-file FILE] [--documents DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np

from qualify.core.assets import prompt_sha256
from qualify.core.errors import Refused, one_line

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "e2-grid"
DEFAULT_MODEL = REPO_ROOT / "model" / "llama3-8b-shape" / "config.json"
DEFAULT_DOCUMENTS = REPO_ROOT / "bench" / "documents"
DOCUMENT_NAMES = ("python-test-descr", "c-test-clinic", "data-decimal-squareroot")
DEFAULT_LENGTHS = (2048, 4096, 8192, 16384, 32768)
FAULTS = ("kv-layer",)
FAULT_V_SCALE = 1.25
MEMORY_MARGIN_BYTES = 4 << 30
RECORD_SCHEMA = "trust-ladder.e2-grid-record.v1"


# --------------------------------------------------------------------------- inputs


def load_documents(directory: Path, rows: int) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
    """Each long control document's first ``rows`` token ids (int64) and its file's description,
    refused unless the file's ids hash to its ``token_sha256`` and cover ``rows``."""
    documents = {}
    for name in DOCUMENT_NAMES:
        path = directory / f"{name}.json"
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
            ids = np.asarray(document["token_ids"], dtype=np.int64)
        except (OSError, ValueError, KeyError) as exc:
            raise Refused(f"document {path}: cannot read its token ids ({type(exc).__name__})") from None
        if prompt_sha256(ids) != document.get("token_sha256"):
            raise Refused(f"document {path}: ids hash to {prompt_sha256(ids)}, the file states {document.get('token_sha256')}")
        if ids.size < rows:
            raise Refused(f"document {name}: {ids.size} tokens, expected at least the longest length {rows}")
        description = {key: document[key] for key in ("name", "kind", "source", "source_sha256", "rule", "token_sha256")}
        documents[name] = (ids[:rows], description)
    return documents


def parse_lengths(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise Refused(f"--lengths: found {text!r}, expected comma-separated whole numbers") from None


# --------------------------------------------------------------------------- engines


@dataclasses.dataclass
class GridEngines:
    """The lane's producer (eager), its consumer (CUDA-graph decode; scores rows), the reference
    source (an engine identical to the consumer, with its own cache), and per cell length a decoder:
    the consumer's engine with a cache of that length plus the decode. The decode step attends over
    every cache slot (masked past its position, so the graph is capturable once), so a 2048-token
    cell decoded in a 33k-slot cache would pay for 33k slots a step."""

    producer: Any
    consumer: Any
    reference: Any
    decoders: dict[int, Any]
    model: dict[str, Any]


def required_bytes(shape: Any, element: int, cache_positions: int, rows: int, chunk: int,
                   decoder_positions: int = 0) -> int:
    """What the grid holds on the device at its peak: the weights, three KV caches and the cell
    decoders' (``decoder_positions`` slots in all), a prefill's
    activations over ``rows`` (float32 RoPE temporaries, the MLP's gate|up) and a scored chunk's
    float32 logits and expanded keys."""
    layer = shape.qkv_width * shape.hidden + shape.hidden * shape.heads * shape.head_dim + 3 * shape.intermediate * shape.hidden
    weights = (shape.layers * layer + (1 if shape.tied_embeddings else 2) * shape.vocab * shape.hidden) * element
    slot = shape.layers * 2 * shape.kv_heads * shape.head_dim * element
    cache = (cache_positions + 2) * slot
    prefill = rows * (3 * shape.intermediate * element + 4 * shape.qkv_width * 4)
    scoring = 2 * chunk * shape.vocab * 4 + 4 * shape.heads * (rows + chunk) * shape.head_dim * element
    return int(weights + 3 * cache + decoder_positions * slot + prefill + scoring)


def build_engines(model_file: Path, lengths: Sequence[int], decode: int, chunk: int) -> GridEngines:
    """The engines on the random weights ``model_file`` names, with room for the longest length
    plus ``decode``; refused in one line when the device is absent or short of memory."""
    import torch

    from qualify.engines.torch_llama import TorchLlama, check_dtype_device, random_model, random_weights

    shape, seed, dtype, device = random_model(model_file)
    torch_dtype = check_dtype_device(dtype, device)
    max_length = max(lengths)
    cache_positions = max_length + decode
    shape = dataclasses.replace(shape, max_positions=max(shape.max_positions, cache_positions))
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        need = required_bytes(shape, torch.empty((), dtype=torch_dtype).element_size(), cache_positions,
                              max_length, chunk, sum(length + decode for length in lengths) if decode else 0
                              ) + MEMORY_MARGIN_BYTES
        if need > free:
            raise Refused(f"device memory: the grid needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB "
                          f"of {total / 2**30:.1f} GiB free; use shorter --lengths or a smaller --chunk")
    weights = random_weights(shape, seed=seed, dtype=dtype, device=device)
    producer = TorchLlama(weights, cache_positions=cache_positions, max_decode_steps=max(decode, 1), cuda_graph=False)
    consumer = producer.sharing_weights(cuda_graph=True)
    reference = producer.sharing_weights(cuda_graph=True)
    decoders = {length: producer.sharing_weights(cuda_graph=True, cache_positions=length + decode)
                for length in lengths} if decode else {}
    resolved = model_file.resolve()
    named = resolved.relative_to(REPO_ROOT).as_posix() if resolved.is_relative_to(REPO_ROOT) else model_file.name
    model = {"file": named, "file_sha256": hashlib.sha256(model_file.read_bytes()).hexdigest(), "seed": seed,
             "dtype": dtype, "device": device, "shape": dataclasses.asdict(shape),
             "weights_fingerprint": weights.fingerprint()}
    return GridEngines(producer, consumer, reference, decoders, model)


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(engines: GridEngines, decode: int, chunk: int) -> None:
    """First calls outside the wall: each engine's prefill kernels, the scorer's, the decode graph."""
    import torch

    from qualify.evidence.controls_device import decode_cell, score_top_tokens

    device, vocab = engines.consumer.device, engines.consumer.shape.vocab
    ids = torch.arange(min(2 * chunk, 256, engines.consumer.cache_positions - decode), device=device) % vocab
    for engine in (engines.producer, engines.reference):
        engine.prefill_device(ids)
    score_top_tokens(engines.consumer, ids, engines.reference.kv_device(), chunk)
    for length, decoder in engines.decoders.items():
        decoder.warm_up()
        decode_cell(decoder, ids, min(ids.shape[0], length), min(decode, 2), engines.reference.kv_device(),
                    engines.producer.kv_device())
    synchronize(device)


def apply_fault(name: str, kv: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
    """The handoff with fault ``name``: ``kv-layer`` scales the middle layer's V by FAULT_V_SCALE
    (a copy; the producer's cache is untouched)."""
    if name != "kv-layer":
        raise Refused(f"--fault: found {name!r}, expected one of {', '.join(FAULTS)}")
    keys, values = list(kv[0]), list(kv[1])
    middle = len(values) // 2
    values[middle] = values[middle] * FAULT_V_SCALE
    return keys, values


# --------------------------------------------------------------------------- the grid


class Stopwatch:
    """Seconds per labelled piece of work, the device synchronized after each."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def __call__(self, label: str, work: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = work()
        synchronize(self.device)
        self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started
        return result


def measure_document(engines: GridEngines, name: str, ids: np.ndarray, lengths: Sequence[int], decode: int, chunk: int,
                     profile_window: int, fault: str | None) -> tuple[dict[str, Any], dict[str, float]]:
    """One document's two passes (lane, reference), its cells and their decodes, and its seconds."""
    import torch

    from qualify.evidence.controls_device import decode_cell, kv_equal, score_top_tokens
    from qualify.evidence.controls_measure import TopTokens, disagreement_cells

    consumer, watch = engines.consumer, Stopwatch(engines.consumer.device)
    tokens = torch.from_numpy(ids).to(consumer.device)
    watch("lane_prefill", lambda: engines.producer.prefill_device(tokens))
    watch("reference_prefill", lambda: engines.reference.prefill_device(tokens))
    lane_kv, reference_kv = engines.producer.kv_device(), engines.reference.kv_device()
    if fault is not None:
        lane_kv = apply_fault(fault, lane_kv)
    reference_top = watch("reference_scoring", lambda: score_top_tokens(consumer, tokens, reference_kv, chunk))
    lane_top = watch("lane_scoring", lambda: score_top_tokens(consumer, tokens, lane_kv, chunk))
    seconds = watch.seconds
    reference = TopTokens(reference_top.cpu().numpy().astype(np.int32), seconds["reference_prefill"],
                          seconds["reference_scoring"])
    lane = TopTokens(lane_top.cpu().numpy().astype(np.int32), seconds["lane_prefill"], seconds["lane_scoring"])
    counted, profile = disagreement_cells({"lane": lane.tokens != reference.tokens}, lengths, profile_window)
    cells: list[dict[str, Any]] = [dict(cell) for cell in counted]
    for cell in cells:
        cell["rate"] = cell["lane_disagreeing"] / cell["rows"]
        if decode:
            run = watch("decode", functools.partial(decode_cell, engines.decoders[cell["length"]], tokens,
                                                    cell["length"], decode, reference_kv, lane_kv))
            cell["decode"] = {"steps": decode, "disagreeing": run.disagreeing, "first_divergence": run.first_divergence,
                              "reference_tokens_sha256": prompt_sha256(run.reference_tokens)}
    record = {"document": name, "token_sha256": prompt_sha256(ids), "rows": int(ids.size),
              "kv_equal": kv_equal(lane_kv, reference_kv), "cells": cells, "profile": profile,
              "top_tokens_sha256": {"reference": reference.sha256, "lane": lane.sha256}}
    return record, {"decode": 0.0, **seconds}


def run_grid(engines: GridEngines, documents: dict[str, tuple[np.ndarray, dict[str, Any]]], lengths: Sequence[int],
             decode: int, chunk: int, profile_window: int, fault: str | None,
             progress: Callable[[str], None]) -> dict[str, Any]:
    """Every document's passes and cells (module docstring); seconds are device-synchronized."""
    from qualify.evidence.controls_measure import check_layout, checked_documents

    checked = checked_documents({name: ids for name, (ids, _) in documents.items()}, engines.consumer.shape.vocab)
    check_layout(lengths, profile_window, {name: ids.size for name, ids in checked.items()})
    records = []
    totals = {"prefill": 0.0, "scoring": 0.0, "decode": 0.0}
    began = time.perf_counter()
    for name, ids in checked.items():
        record, seconds = measure_document(engines, name, ids, lengths, decode, chunk, profile_window, fault)
        totals["prefill"] += seconds["lane_prefill"] + seconds["reference_prefill"]
        totals["scoring"] += seconds["lane_scoring"] + seconds["reference_scoring"]
        totals["decode"] += seconds["decode"]
        progress(f"{name}: prefill {seconds['lane_prefill']:.2f} + {seconds['reference_prefill']:.2f} s, scoring "
                 f"{seconds['lane_scoring']:.2f} + {seconds['reference_scoring']:.2f} s, decode {seconds['decode']:.2f} s "
                 f"({len(lengths)} cells x 2 x {decode} steps); lane KV "
                 f"{'equals' if record['kv_equal'] else 'differs from'} the reference's")
        description = documents[name][1]
        records.append({**description, **record, "file_token_sha256": description["token_sha256"],
                        "seconds": {label: round(value, 4) for label, value in seconds.items()}})
    wall = time.perf_counter() - began
    return {"documents": records, "seconds": {**{k: round(v, 3) for k, v in totals.items()}, "grid_wall": wall}}


def versions(engines: GridEngines) -> dict[str, Any]:
    import torch

    device = engines.consumer.device
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


# --------------------------------------------------------------------------- output


def print_table(record: dict[str, Any]) -> None:
    """One row per cell: document, length, disagreeing rows k/L and rate, decode steps k/n and
    the first divergence."""
    print(f"{'document':24s} {'length':>6s} {'rows disagreeing':>17s} {'rate':>8s} {'decode':>9s} {'first':>6s}")
    for document in record["documents"]:
        for cell in document["cells"]:
            decoded = cell.get("decode")
            decode_text = f"{decoded['disagreeing']}/{decoded['steps']}" if decoded else "-"
            first = decoded["first_divergence"] if decoded and decoded["first_divergence"] is not None else "-"
            print(f"{document['document']:24s} {cell['length']:6d} {cell['lane_disagreeing']:>9d}/{cell['rows']:<7d} "
                  f"{cell['rate']:8.4f} {decode_text:>9s} {first!s:>6s}")


def run(options: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    lengths = parse_lengths(options.lengths)
    if options.decode < 0:
        raise Refused(f"--decode: found {options.decode}, expected 0 or more tokens")
    if not lengths or min(lengths) < 2:
        raise Refused(f"--lengths: found {options.lengths!r}, expected lengths of at least 2")
    documents = load_documents(options.documents, max(lengths))
    from qualify.evidence.controls_measure import check_layout

    check_layout(lengths, options.profile_window, {name: ids.size for name, (ids, _) in documents.items()})
    if options.fault is not None and options.fault not in FAULTS:
        raise Refused(f"--fault: found {options.fault!r}, expected one of {', '.join(FAULTS)}")
    engines = build_engines(options.model_file, lengths, options.decode, options.chunk)
    synchronize(engines.consumer.device)
    weights_s = time.perf_counter() - began
    warm_began = time.perf_counter()
    warm_up(engines, options.decode, options.chunk)
    warm_s = time.perf_counter() - warm_began
    model = engines.model
    print(f"model {model['file']} seed {model['seed']} {model['dtype']} on {versions(engines)['gpu'] or model['device']}; "
          f"weights fingerprint {model['weights_fingerprint'][:16]}", flush=True)
    print(f"lane: producer {engines.producer.abi} -> consumer {engines.consumer.abi}", flush=True)
    grid = run_grid(engines, documents, lengths, options.decode, options.chunk, options.profile_window, options.fault,
                    lambda line: print(f"  {line}", flush=True))
    return {
        "schema": RECORD_SCHEMA,
        "measure": {"rows": "row r scored by the consumer from the source's KV of positions 0..r-1 and its own computation "
                            "at r (teacher-forced, batched: qualify.evidence.controls_device); a cell of length L counts "
                            "rows 0..L-1 whose top tokens (first index of the maximum) differ between the lane's KV and "
                            "the reference's",
                    "decode": "positions 0..L-2 handed off, token L-1 pending; the reference decodes greedily from its own "
                              "KV, the lane is teacher-forced on those tokens; a step disagrees where the top tokens differ",
                    "lane": "llama3-8b-shape-pd: torch-llama producer (eager) -> torch-llama consumer (CUDA-graph decode)",
                    "reference": "an engine identical to the consumer, prefilling the same tokens itself"},
        "model": engines.model,
        "engines": {"producer": engines.producer.abi, "consumer": engines.consumer.abi,
                    "reference": engines.reference.abi, "scorer_chunk_rows": options.chunk},
        "versions": versions(engines),
        "lengths": lengths, "decode_steps": options.decode, "profile_window": options.profile_window,
        "fault": options.fault, "documents": grid["documents"],
        "seconds": {**grid["seconds"], "setup_weights": weights_s, "setup_warm_up": warm_s,
                    "total": time.perf_counter() - began},
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for e2-grid.json")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="nested cell lengths")
    parser.add_argument("--decode", type=int, default=256, help="tokens decoded per cell (0: none)")
    parser.add_argument("--chunk", type=int, default=2048, help="rows scored at once")
    parser.add_argument("--profile-window", type=int, default=2048, help="rows per profile window")
    parser.add_argument("--fault", choices=FAULTS, help="corrupt the handoff (the measure must disagree)")
    parser.add_argument("--model-file", type=Path, default=DEFAULT_MODEL, help="random-model file (shape, seed, dtype, device)")
    parser.add_argument("--documents", type=Path, default=DEFAULT_DOCUMENTS, help="folder of the long documents")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    try:
        record = run(options)
    except Refused as exc:
        print(f"gpu_e2_grid: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:  # a GPU error, out of memory...: one line, no traceback
        print(f"gpu_e2_grid: failed: {type(exc).__name__}: {one_line(str(exc))}", file=sys.stderr)
        return 1
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / "e2-grid.json"
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print_table(record)
    seconds = record["seconds"]
    print(f"wrote {path}")
    print(f"grid: prefill {seconds['prefill']:.1f} s, row scoring {seconds['scoring']:.1f} s, decode {seconds['decode']:.1f} s; "
          f"setup outside the wall: weights {seconds['setup_weights']:.1f} s, warm-up {seconds['setup_warm_up']:.1f} s; "
          f"total {seconds['total']:.1f} s")
    if record["fault"] is not None:
        print(f"fault {record['fault']}: V of layer {record['model']['shape']['layers'] // 2} x {FAULT_V_SCALE} in the handoff")
    print(f"e2_grid_wall_s: {seconds['grid_wall']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
