#!/usr/bin/env python3
"""Measure a lane producer's known-answer digest (KAT) where it runs, and write the evidence.

An engine that is not exact by construction (``qualify.engines.kat.MEASURED_ENGINE_NAMES``) has
its KAT measured on the hardware its identity pins: the ``transformers`` lanes' producer on their
GPU. This tool builds each lane's producer as the producer process does
(``qualify.engines.factory.build_producer``), measures its KAT three times (twice on one build, once
on a second build: a digest that moves between them is no known answer, exit 2) and writes one JSON
document (schema ``trust-ladder.known-answer-evidence.v1``): the KAT input, this host's torch, CUDA,
GPU and numpy, and per lane the engine's name, version and ABI, the digests, and whether the
engine's version and ABI are what the lane's shipped identity pins (``pins_hold``).

``tools/freeze_identity.py --refreeze IDENTITY --producer-kat-evidence FILE`` pins a lane's digest
from that document only where its engine is the identity's producer engine (name, version and ABI
equal): a KAT measured under other pins is never pinned. Run it on the GPU machine, from the repo
root (only numpy, rfc8785, torch and transformers are needed there)::

    python3 tools/measure_known_answer.py --out "$OUT/known-answers.json"

Exit 0 when every lane's digests agree, 2 when one does not (the document is written either way),
or when a lane's producer cannot be built here (one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from qualify.contract.lanes import TRANSFORMERS_LANE_SETTINGS, lane_spec
from qualify.core import assets
from qualify.core.errors import Refused, one_line
from qualify.engines.kat import KAT_EVIDENCE_SCHEMA, MEASURED_ENGINE_NAMES, kat_input, known_answer_sha256

BUILDS = 2
"""Builds per lane: the KAT is measured twice on the first and once on the second."""


def host_facts() -> dict[str, Any]:
    """What the measuring host runs: python, numpy, torch, CUDA, cuDNN, transformers, the GPU and
    its driver (``nvidia-smi``, where there is one), the CPU."""
    import numpy as np
    import torch
    import transformers

    facts: dict[str, Any] = {
        "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call]
        "transformers": transformers.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
        "driver": None,
    }
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=False)
        facts["driver"] = smi.stdout.strip() or None
    except OSError:
        pass
    return facts


def identity_pins(lane: str) -> dict[str, Any] | None:
    """The producer engine the lane's shipped identity pins (read as JSON: this tool needs none of
    the identity model's dependencies), or None where no identity is shipped."""
    path = assets.CONTRACTS_DIR / f"{lane}-identity-v1.json"
    if not path.is_file():
        return None
    pinned = json.loads(path.read_bytes())["producer_engine"]
    return {key: pinned[key] for key in ("name", "version", "abi", "kat_sha256")}


def measure(lane: str) -> dict[str, Any]:
    """The lane producer's KAT, measured ``BUILDS`` builds over (see the module docstring)."""
    from qualify.engines.factory import build_producer

    spec = lane_spec(lane)
    digests: list[str] = []
    seconds: list[float] = []
    engine: Any = None
    for build in range(BUILDS):
        engine = build_producer(lane, spec.mode)
        for _ in range(2 if build == 0 else 1):
            began = time.perf_counter()
            digests.append(known_answer_sha256(engine))
            seconds.append(round(time.perf_counter() - began, 4))
        if build + 1 < BUILDS:
            del engine
    assert engine is not None
    if engine.name not in MEASURED_ENGINE_NAMES:
        raise Refused(f"lane {lane}: producer engine {engine.name} is not measured where it runs "
                      f"(qualify.engines.kat.MEASURED_ENGINE_NAMES); its KAT is computed by the freeze")
    found = {"name": engine.name, "version": engine.version, "abi": engine.abi}
    pinned = identity_pins(lane)
    return {
        "role": "producer",
        "engine": found,
        "kat_sha256": digests[0],
        "measurements": digests,
        "deterministic": len(set(digests)) == 1,
        "kat_seconds": seconds,
        "vocab": engine.geometry.vocab,
        "identity_pins": pinned,
        "pins_hold": pinned is not None and all(pinned[key] == found[key] for key in found),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="measure_known_answer",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--lane", action="append", choices=sorted(TRANSFORMERS_LANE_SETTINGS),
                        help="a lane to measure (repeatable; default every transformers lane)")
    parser.add_argument("--out", required=True, type=Path, help="the evidence JSON to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lanes = args.lane or sorted(TRANSFORMERS_LANE_SETTINGS)
    try:
        measured = {lane: measure(lane) for lane in lanes}
        vocabularies = {entry.pop("vocab") for entry in measured.values()}
        if len(vocabularies) != 1:
            raise Refused(f"lanes {', '.join(lanes)}: producers of different vocabularies {sorted(vocabularies)}")
        document = {
            "schema": KAT_EVIDENCE_SCHEMA,
            "measured_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tool": "tools/measure_known_answer.py",
            "kat_input": kat_input(vocabularies.pop()),
            "host": host_facts(),
            "lanes": measured,
        }
    except Refused as exc:
        print(f"measure_known_answer: refused: {one_line(str(exc))}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    status = 0
    for lane, entry in measured.items():
        pinned = entry["identity_pins"] or {}
        print(f"{lane}: KAT {entry['kat_sha256']} ({'deterministic' if entry['deterministic'] else 'NOT deterministic: '}"
              f"{'' if entry['deterministic'] else ' '.join(entry['measurements'])}); abi {entry['engine']['abi']}; "
              f"identity pins {'hold' if entry['pins_hold'] else 'DIFFER'} (pinned abi {pinned.get('abi')}, "
              f"version {pinned.get('version')})")
        if not entry["deterministic"]:
            status = 2
    print(f"# wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
